"""vLLM's async engine (AsyncLLM, engine core in its own process) vs our hand loop
(EngineLoop stepping an in-process `vllm.LLM`), on the tiny target, same prompts.

    .venv/bin/python bench/bench_engine.py [--prompts 512] [--max-tokens 64] [--repeat 1]

Each engine runs in a fresh interpreter (the in-process engine needs
VLLM_ENABLE_V1_MULTIPROCESSING=0, AsyncLLM needs it on). Requests are submitted in waves of
--wave (as a replica with several Ray Data batches in flight sees them). Greedy: the two
engines must produce the same tokens (checked). Prints a table: start-up s, generation s,
completion tokens/s, and the process tree's peak RSS.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _prompts(n: int, model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from eagle_ray.targets.tiny import corpus

    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for conv in corpus.conversations(n, seed=11):
        msgs = conv[:-1] if conv[-1]["role"] == "assistant" else conv
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out



class EngineLoop:
    """The hand loop eagle_ray used before AsyncLLM (kept here as the baseline). Continuous batching across Ray Data batches for a synchronous `vllm.LLM`.

    `LLM.generate` returns only when its whole batch is done, so the engine idles on the
    batch's tail and between batches. The stage UDF is async and the actor runs several
    batches at once (`max_concurrency`): each submits its requests here and awaits their
    futures while one thread steps the engine over everything in flight. (A sync UDF would
    not do: Ray Data runs sync callables on a single thread whatever max_concurrency says.)
    """

    def __init__(self, llm):
        self.engine = llm.llm_engine
        self.cv = threading.Condition()
        self.pending: dict[str, Future] = {}
        self.fatal: BaseException | None = None
        self._seq = 0
        threading.Thread(target=self._run, name="eagle-ray-engine-loop", daemon=True).start()

    def submit(self, prompt, params) -> Future:
        """Queue one request; raises at once for a request the engine refuses (validation)."""
        fut: Future = Future()
        with self.cv:
            if self.fatal is not None:
                raise RuntimeError(f"engine is dead: {self.fatal!r}")
            self._seq += 1
            rid = f"er-{self._seq}"  # outputs carry this id (add_request returns it suffixed)
            self.engine.add_request(rid, prompt, params)
            self.pending[rid] = fut
            self.cv.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.pending:
                    self.cv.wait()
                try:
                    outputs = self.engine.step()
                except BaseException as e:  # the engine cannot continue: fail every waiter
                    self.fatal = e
                    for fut in self.pending.values():
                        fut.set_exception(e)
                    self.pending.clear()
                    return
                for out in outputs:
                    if out.finished:
                        self.pending.pop(out.request_id).set_result(out)




def _peak_rss_mib() -> float:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + kids) / 1024


def child(mode: str, n: int, max_tokens: int, wave: int) -> dict:
    from vllm import SamplingParams

    from eagle_ray.recipes import load_recipe
    from eagle_ray.targets.resolve import resolve_target_path
    from eagle_ray.vllm.engine import engine_kwargs

    recipe = load_recipe("tiny_cpu")
    model = str(resolve_target_path(recipe.target))
    prompts = _prompts(n, model)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0)
    kw = engine_kwargs(recipe, model)
    t0 = time.perf_counter()
    if mode == "loop":
        from vllm import LLM

        loop = EngineLoop(LLM(**kw))
        t1 = time.perf_counter()
        outs = []
        for i in range(0, n, wave):
            futs = [loop.submit({"prompt_token_ids": p}, params) for p in prompts[i:i + wave]]
            outs += [f.result() for f in futs]
        t2 = time.perf_counter()
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    else:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        t1 = time.perf_counter()

        async def one(i, p):
            last = None
            async for out in engine.generate({"prompt_token_ids": p}, params, f"r{i}"):
                last = out
            return list(last.outputs[0].token_ids)

        async def run():
            res = []
            for i in range(0, n, wave):
                res += await asyncio.gather(*(one(i + j, p) for j, p in enumerate(prompts[i:i + wave])))
            return res

        tokens = asyncio.run(run())
        t2 = time.perf_counter()
        engine.shutdown()
    ntok = sum(len(t) for t in tokens)
    return {"mode": mode, "startup_s": t1 - t0, "generate_s": t2 - t1, "tokens": ntok,
            "tokens_per_s": ntok / (t2 - t1), "peak_rss_mib": _peak_rss_mib(),
            "digest": hash(json.dumps(tokens))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--wave", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.prompts, args.max_tokens, args.wave)))
        return 0
    rows = []
    for _ in range(args.repeat):
        for mode, mp in (("loop", "0"), ("async", "1")):
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=mp, PYTHONHASHSEED="0")
            p = subprocess.run([sys.executable, __file__, "--child", mode, "--prompts",
                                str(args.prompts), "--max-tokens", str(args.max_tokens),
                                "--wave", str(args.wave)], env=env, capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                print(p.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{mode} failed (exit {p.returncode})")
            rows.append(json.loads(line[0][7:]))
    print(f"\n{args.prompts} prompts, max_tokens {args.max_tokens}, waves of {args.wave}, greedy\n")
    print("| engine | start-up s | generation s | completion tokens | tokens/s | peak RSS MiB (tree) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        name = "EngineLoop (in-process LLM)" if r["mode"] == "loop" else "AsyncLLM (engine-core process)"
        print(f"| {name} | {r['startup_s']:.1f} | {r['generate_s']:.1f} | {r['tokens']:,} | "
              f"{r['tokens_per_s']:,.0f} | {r['peak_rss_mib']:,.0f} |")
    same = len({r["digest"] for r in rows}) == 1
    print(f"\nsame tokens from both engines: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
