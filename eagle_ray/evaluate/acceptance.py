"""Acceptance evaluation of a drafter: offline (simulated on held-out store samples) and
online (real vLLM speculative decoding, read from vLLM's own counters).

Metric, pooled the way vLLM pools it:
    mean acceptance length = 1 + (accepted draft tokens) / (drafts)
    per-position acceptance[j] = (drafts whose first j+1 tokens were all accepted) / (drafts)
where a draft is one proposal of k tokens. Pooling weights every draft equally; a
per-request mean would weight every request equally, so short requests (few drafts) would
count as much as long ones. We report the pooled number only, as vLLM does.

Offline simulation (greedy chain drafting): every held-out position t with a valid step-0
target is one draft. TTT step j at column t feeds the ground-truth token x_{t+1+j}; as long
as steps 0..j-1 were accepted that token IS the drafter's own previous guess, so the leading
run of correct steps equals what chain drafting from t would get accepted against the
target's greedy choice (the teacher argmax). Online, vLLM drafts only from positions it
actually reaches, so the two differ by sampling of positions, not by definition.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch


def pooled(num_drafts: int, accepted_per_pos: list[int]) -> dict[str, Any]:
    d = max(1, num_drafts)
    return {"num_drafts": num_drafts, "accepted_per_pos": accepted_per_pos,
            "per_position_acceptance": [a / d for a in accepted_per_pos],
            "mean_acceptance_length": 1 + sum(accepted_per_pos) / d}


class _Tally:
    """Drafts and (expected) accepted counts per position, pooled and per source, and the
    standard error of the pooled mean acceptance length over samples (each sample's drafts
    and accepted tokens: the delta method for a ratio of sums)."""

    def __init__(self, k: int) -> None:
        self.k, self.drafts, self.acc, self.samples = k, {}, {}, []

    def add(self, source: str, drafts: float, accepted: list[float]) -> None:
        self.samples.append((drafts, sum(accepted)))
        for key in ("all", source):
            self.drafts[key] = self.drafts.get(key, 0) + drafts
            prev = self.acc.setdefault(key, [0.0] * self.k)
            for j, a in enumerate(accepted):
                prev[j] += a

    def standard_error(self) -> float | None:
        n = len(self.samples)
        d = sum(x for x, _ in self.samples)
        if n < 2 or d <= 0:
            return None
        r = sum(a for _, a in self.samples) / d
        resid = [a - r * x for x, a in self.samples]
        return (n / (n - 1) * sum(e * e for e in resid)) ** 0.5 / d

    def result(self) -> dict[str, Any]:
        out = pooled(self.drafts.get("all", 0), self.acc.get("all", [0.0] * self.k))
        out["per_source"] = {s: pooled(self.drafts[s], self.acc[s]) for s in sorted(self.drafts)
                             if s != "all"}
        out["standard_error"] = self.standard_error()
        out["samples_counted"] = len(self.samples)
        return out


# Where a target's template writes an assistant's tool calls, by the vLLM tool parser the
# recipe names (serve.tool_call_parser): the text from the first marker to the second.
TOOL_CALL_MARKERS = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
}
TURN_KINDS = ("tool_call", "text")


def tool_call_tokens(tokenizer, ids: list[int], markers: tuple[str, str]) -> list[bool]:
    """Per token of `ids`: inside a tool-call section (markers included). Each token is decoded
    on its own and the pieces laid end to end, so a marker is found where the template wrote
    it whatever the tokenizer made of it; a section left open runs to the end."""
    begin, end = markers
    pieces = [tokenizer.decode([i]) for i in ids]
    text = "".join(pieces)
    spans, pos = [], 0
    while (b := text.find(begin, pos)) >= 0:
        e = text.find(end, b + len(begin))
        stop = len(text) if e < 0 else e + len(end)
        spans.append((b, stop))
        pos = stop
    out, at, si = [], 0, 0
    for piece in pieces:
        lo, hi = at, at + len(piece)
        while si < len(spans) and spans[si][1] <= lo:
            si += 1
        out.append(si < len(spans) and spans[si][0] < max(hi, lo + 1) and lo < spans[si][1])
        at = hi
    return out


def _neutral(s: dict) -> dict:
    """Sampling fields with every 'off' spelling as one value (top_k None/0/-1, ...)."""
    top_k = int(s.get("top_k") or 0)
    return {"temperature": float(s.get("temperature") or 0), "top_p": float(s.get("top_p") or 1.0),
            "top_k": top_k if top_k > 0 else 0, "min_p": float(s.get("min_p") or 0)}


def sampled_as(manifest: dict, sampling: dict) -> str | None:
    """None when the store's completions were sampled at `sampling` (the offline expectation
    as served is then exact, `eagle_ray.evaluate.served`), else why not."""
    gen = manifest.get("generation") or {}
    got = gen.get("sampling")
    if gen.get("mode") != "regenerate" or not got:
        return (f"the store holds {gen.get('mode') or 'logged'} completions, not the target's own "
                "samples at the serving profile")
    if _neutral(got) != _neutral(sampling):
        return (f"the store was sampled at {_neutral(got)}, evaluation serves at {_neutral(sampling)}")
    return None


@torch.no_grad()
def offline_acceptance(run_info: dict, drafter_state: dict | None, k: int,
                       max_samples: int = 256, sampling: dict | None = None,
                       tool_call_mask: Callable[[list[int]], list[bool]] | None = None
                       ) -> dict[str, Any]:
    """Simulated acceptance on the run's held-out split (drafter_state None = untrained),
    pooled and per source: greedy (the chain of exact argmax matches), and with `sampling`
    (temperature > 0) the acceptance expected at that serving profile for greedy and for
    probabilistic drafting, walking the drafts as vLLM places them
    (`eagle_ray.evaluate.served`); `as_served["exact"]` says whether that expectation is
    exact (the store sampled at `sampling`) and `as_served["inexact_because"]` why not.
    With `tool_call_mask` (token ids -> inside a tool call, per token: `tool_call_tokens`),
    greedy acceptance also by the kind of the first drafted token, inside a tool call or text
    (`per_turn_kind`, present when the validation samples hold any tool-call tokens)."""
    from eagle_ray.evaluate.served import served_step_rates, walk_drafts
    from eagle_ray.export.drafter import build_drafter
    from eagle_ray.store.reader import HiddenStateStore
    from eagle_ray.store.batch import collate
    from eagle_ray.targets.load import load_embed_and_lm_head

    model = build_drafter(run_info, drafter_state).eval()
    embed, head = load_embed_and_lm_head(run_info["target_dir"])
    model.set_target_weights(embed.float(), head.float())
    store = HiddenStateStore(run_info["store"])
    index = store.index_table()
    source_of = dict(zip(index.column("sample_id").to_pylist(), index.column("source").to_pylist()))
    ids = run_info["val_ids"][:max_samples]
    served = sampling is not None and float(sampling.get("temperature") or 0) > 0
    greedy, as_greedy, as_prob = _Tally(k), _Tally(k), _Tally(k)
    by_kind = {kind: _Tally(k) for kind in TURN_KINDS}
    shift = model.shift
    for lo in range(0, len(ids), 16):
        chunk = ids[lo:lo + 16]
        batch = collate(store, chunk)
        out = model.ttt_outputs(batch, ttt_steps=k)
        run = torch.ones_like(out.valid[0])
        hits, runs = [], []
        for j in range(k):
            run = run & out.correct[j]  # correct implies valid
            runs.append(run)
            hits.append(run.sum(-1))
        tool = None
        if tool_call_mask is not None:  # column t drafts token t+2 first (as `served_step_rates`)
            tool = torch.zeros_like(out.valid[0])
            for b, row in enumerate(batch["input_ids"].tolist()):
                t = torch.tensor(tool_call_mask(row))
                tool[b] = shift(t[None], 2, False)[0]
        rates = None
        if served:  # (a, w) per drafting method (greedy, probabilistic), step, column [2, 2, k, B, T]
            rates = torch.zeros(2, 2, k, *out.valid[0].shape)
            for j in range(k):
                v = out.valid[j]
                r = served_step_rates(shift(batch["final"], 1 + j)[v],           # target row t+1+j
                                      out.logits[j].detach()[v], model.target_lm_head_weight,
                                      model.draft_ids, sampling,
                                      shift(batch["input_ids"], 2 + j)[v])       # its token y
                for m in range(2):
                    rates[m, 0, j][v], rates[m, 1, j][v] = r[m], r[2 + m]
        for b, sid in enumerate(chunk):
            src = source_of.get(sid, "?")
            n = int(out.valid[0][b].sum())
            greedy.add(src, n, [float(h[b]) for h in hits])
            if tool is not None:
                for kind, m in (("tool_call", tool[b]), ("text", ~tool[b])):
                    by_kind[kind].add(kind, int((out.valid[0][b] & m).sum()),
                                      [float((r[b] & m).sum()) for r in runs])
            if rates is not None and n:
                keep = out.valid[0][b]
                start = int(keep.nonzero()[0]) + 1  # the first draft: after the prefill's token
                for tally, rr in zip((as_greedy, as_prob), rates[:, :, :, b]):
                    tally.add(src, *walk_drafts(rr, keep, start))
    res = greedy.result() | {"samples": len(ids), "k": k}
    if tool_call_mask is not None and by_kind["tool_call"].drafts.get("all", 0) > 0:
        res["per_turn_kind"] = {kind: t.result() for kind, t in by_kind.items()}
    if served:
        why = sampled_as(run_info.get("store_manifest") or {}, sampling)
        res["as_served"] = {"sampling": dict(sampling), "greedy_drafting": as_greedy.result(),
                            "probabilistic_drafting": as_prob.result(),
                            "exact": why is None, "inexact_because": why}
    return res


def _spec_counters(llm) -> tuple[int, list[int]]:
    m = {x.name: x for x in llm.get_metrics()}
    drafts = int(getattr(m.get("vllm:spec_decode_num_drafts"), "value", 0) or 0)
    per_pos = getattr(m.get("vllm:spec_decode_num_accepted_tokens_per_pos"), "values", None) or []
    return drafts, [int(v) for v in per_pos]


def online_run(engine_kwargs: dict, prompts: list[list[int]], max_tokens: int,
               speculative_config: dict | None, sampled: dict | None = None,
               sources: list[str] | None = None) -> dict[str, Any]:
    """Generation in vLLM (optionally speculative): greedy first (tokens/s, outputs, vLLM's
    spec counters), then, with `sampled` = {"sampling": {temperature, top_p, top_k, min_p},
    "seeds": [...]}, the same prompts once per seed at that sampling (per-request seeds,
    counters read per seed) in the same engine: result["sampled"] = [one result per seed].
    With `sources` (one label per prompt) each source's prompts run as their own batch, so
    vLLM's counters give acceptance per source too (result["per_source"])."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_ray.data.ids import sample_seed
    from eagle_ray.targets.serving import sampling_kwargs

    llm = LLM(**engine_kwargs, speculative_config=speculative_config, disable_log_stats=False)
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    labels = sources or ["all"] * len(reqs)
    groups: dict[str, list[int]] = {}
    for i, lab in enumerate(labels):
        groups.setdefault(lab, []).append(i)

    def phase(llm, sps) -> dict[str, Any]:
        tokens: list[list[int]] = [[] for _ in reqs]
        dt, per_source = 0.0, {}
        for lab, idx in groups.items():
            d0, p0 = _spec_counters(llm) if speculative_config is not None else (0, [])
            t0 = time.perf_counter()
            outs = llm.generate([reqs[i] for i in idx], [sps[i] for i in idx], use_tqdm=False)
            dt += time.perf_counter() - t0
            for i, o in zip(idx, outs):
                tokens[i] = list(o.outputs[0].token_ids)
            if speculative_config is not None:
                d1, p1 = _spec_counters(llm)
                p0 = p0 + [0] * (len(p1) - len(p0))
                per_source[lab] = pooled(d1 - d0, [b - a for a, b in zip(p0, p1)])
        r: dict[str, Any] = {"seconds": dt, "output_tokens": sum(map(len, tokens)),
                             "tokens_per_s": sum(map(len, tokens)) / dt, "outputs": tokens}
        if speculative_config is not None:
            drafts = sum(v["num_drafts"] for v in per_source.values())
            k = max((len(v["accepted_per_pos"]) for v in per_source.values()), default=0)
            acc = [sum((v["accepted_per_pos"] + [0] * k)[j] for v in per_source.values()) for j in range(k)]
            r |= pooled(drafts, acc)
            if sources:
                r["per_source"] = dict(sorted(per_source.items()))
        return r

    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, skip_special_tokens=False)
        result = phase(llm, [greedy] * len(reqs))
        if sampled:
            kw = sampling_kwargs(sampled["sampling"])
            result["sampled"] = []
            for seed in sampled["seeds"]:
                sps = [SamplingParams(**kw, max_tokens=max_tokens, skip_special_tokens=False,
                                      seed=sample_seed(seed, str(i))) for i in range(len(reqs))]
                result["sampled"].append(phase(llm, sps) | {"seed": seed})
        return result
    finally:
        del llm
        gc.collect()


def online_runs_isolated(engine_kwargs: dict, prompts: list[list[int]], max_tokens: int,
                         specs: dict[str, dict | None], sampled: dict | None = None,
                         sources: list[str] | None = None,
                         on_start=None) -> dict[str, dict[str, Any]]:
    """`online_run` of each named speculative config, one engine after another in ONE child
    process: {name: result}. A child, not this process: the caller may be a Ray driver or a
    test holding other engines, and a crash of vLLM must not take it down. One child for all
    of them: each child pays ~5 s of Python and vLLM imports before its engine starts
    (evaluate runs 4-6 engines). The n-gram proposer imports numba, which breaks vLLM 0.32's
    CPU kernel-override scan for any later engine in the process unless our plugin's
    tolerant scan is installed (eagle_ray/vllm/plugin.py); n-gram configs run last anyway.
    `on_start(i, name)` is called as the child starts the i-th engine (progress)."""
    import os
    import subprocess
    import sys
    import tempfile

    order = sorted(specs, key=lambda n: (specs[n] or {}).get("method") == "ngram")
    with tempfile.TemporaryDirectory(prefix="eagle_ray_online_") as d:
        req, res = Path(d) / "request.json", Path(d) / "result.json"
        req.write_text(json.dumps({"engine_kwargs": engine_kwargs, "prompts": prompts,
                                   "max_tokens": max_tokens,
                                   "specs": [[n, specs[n]] for n in order],
                                   "sampled": sampled, "sources": sources}))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        proc = subprocess.Popen([sys.executable, "-m", "eagle_ray.evaluate.acceptance", str(req),
                                 str(res)], env=env, stdout=subprocess.PIPE, text=True)
        try:
            for line in proc.stdout:  # the child names each engine as it starts it
                if not line.startswith(_STARTING):
                    sys.stdout.write(line)  # anything else the child prints, as before
                elif on_start is not None:
                    i, name = line[len(_STARTING):].rstrip("\n").split(" ", 1)
                    on_start(int(i), name)
        except BaseException:  # a stop of this process (signal, Ctrl-C) ends the child too
            proc.kill()
            proc.wait()
            raise
        if proc.wait() != 0:
            raise subprocess.CalledProcessError(proc.returncode, proc.args)
        out = json.loads(res.read_text())
    return {n: out[n] for n in specs}


def online_run_isolated(engine_kwargs: dict, prompts: list[list[int]], max_tokens: int,
                        speculative_config: dict | None, sampled: dict | None = None,
                        sources: list[str] | None = None) -> dict[str, Any]:
    """`online_run` of one speculative config in a child process (`online_runs_isolated`)."""
    return online_runs_isolated(engine_kwargs, prompts, max_tokens, {"run": speculative_config},
                                sampled, sources)["run"]


_STARTING = "eagle_ray-online-run "


def prompts_from_ingest(prompts_dir: str | Path, tokenizer, limit: int,
                        exclude_ids: set[str] | None = None, *,
                        with_sources: bool = False, max_prompt_tokens: int | None = None,
                        skipped: dict | None = None) -> list[list[int]] | tuple[list[list[int]], list[str]]:
    """Token ids of up to `limit` ingest prompts, skipping every prompt any of whose samples
    is in exclude_ids (sample ids `<prompt>#<j>` exclude their prompt); `with_sources`: also
    each prompt's source label. A prompt longer than `max_prompt_tokens` (the engine's
    context less the tokens each run generates) is skipped and counted in
    `skipped["too_long"]`: vLLM refuses it, which used to end the whole evaluation."""
    from eagle_ray.common.tables import read_stage_table
    from eagle_ray.data.ids import prompt_id

    exclude_ids = {prompt_id(s) for s in exclude_ids} if exclude_ids else None

    from eagle_ray.data.chat import load_tools, render

    cols = ["sample_id", "source", "messages", "tools"]
    _, table = read_stage_table(prompts_dir, "prompts.parquet", cols, "ingest", columns=cols)
    out, labels = [], []
    for sid, src, m, tools in zip(*(table.column(c).to_pylist() for c in cols)):
        if exclude_ids and sid in exclude_ids:
            continue
        # Rendered as served: with the request's tools.
        text = render(tokenizer, [json.loads(m)], [load_tools(tools)], add_generation_prompt=True)[0]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            if skipped is not None:
                skipped["too_long"] = skipped.get("too_long", 0) + 1
            continue
        out.append(ids)
        labels.append(src)
        if len(out) >= limit:
            break
    return (out, labels) if with_sources else out


if __name__ == "__main__":  # child process of online_runs_isolated
    import sys

    a = json.loads(Path(sys.argv[1]).read_text())
    results = {}
    for i, (name, spec) in enumerate(a["specs"]):
        print(f"{_STARTING}{i} {name}", flush=True)
        results[name] = online_run(a["engine_kwargs"], a["prompts"], a["max_tokens"], spec,
                                   a.get("sampled"), a.get("sources"))
    Path(sys.argv[2]).write_text(json.dumps(results))
