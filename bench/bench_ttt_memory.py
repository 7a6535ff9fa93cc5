"""TTT attention memory: peak memory and time of one training step (forward + backward over a
full TTT unroll) at T = 1K, 2K, 4K, 8K, for the eager attention (keeps [B,h,T,T] fp32 scores
per TTT step for backward) and the chunked one (linear in T; the default).

    .venv/bin/python bench/bench_ttt_memory.py                # heads=2, ttt_steps=7, B=1
    .venv/bin/python bench/bench_ttt_memory.py --T 1024 2048 --impls chunked

Each (impl, T) runs in a fresh subprocess; "peak" is the child's peak RSS minus its RSS just
before the step (model, batch and frozen target tensors already allocated), so it is the
step's activation + gradient memory. Shapes are scaled down (CPU, 24 GiB): hidden 256,
`--heads` heads of 64, draft vocab 1024. Then the script extrapolates to the Kimi-K2.5 drafter
(64 heads of 128, H 7168, MLP 18432, draft vocab 32000, 7 steps, T 8192) from the measured
coefficients, printing the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch
from eagle_ray.model.drafter import Eagle3Drafter, drafter_arch_from
impl, T, heads, steps, H, N, V, I = sys.argv[1], *map(int, sys.argv[2:9])
torch.manual_seed(0); torch.set_num_threads(2)
arch = drafter_arch_from(H, heads, heads, 64, I, V, N, ttt_steps=steps, max_position_embeddings=T + 16)
m = Eagle3Drafter(arch, embed_weight=torch.randn(V, H), target_lm_head_weight=torch.randn(V, H) * 0.05,
                  d2t=torch.zeros(N, dtype=torch.long), attn_impl=impl)
batch = {"input_ids": torch.randint(0, V, (1, T)), "loss_mask": torch.ones(1, T, dtype=torch.bool),
         "aux": torch.randn(1, T, 3 * H), "final": torch.randn(1, T, H),
         "attention_mask": torch.ones(1, T, dtype=torch.bool)}
def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1])
# warm-up at a small T so allocator/threads are set up, then measure
m(dict((k, v[:, :64]) for k, v in batch.items()))[0].backward(); m.zero_grad(set_to_none=False)
base = rss_kb()
t0 = time.perf_counter()
loss, _ = m(batch)
loss.backward()
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"impl": impl, "T": T, "peak_mib": (peak - base) / 1024, "seconds": dt}))
"""


def run(impl: str, T: int, a) -> dict | None:
    args = [sys.executable, "-c", CHILD, impl, str(T), str(a.heads), str(a.steps), str(a.hidden),
            str(a.draft_vocab), str(a.vocab), str(a.mlp)]
    p = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        return {"impl": impl, "T": T, "error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--impls", nargs="+", default=["eager", "chunked"])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--mlp", type=int, default=512)
    ap.add_argument("--draft-vocab", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--max-eager-gib", type=float, default=12.0,
                    help="skip an eager run whose predicted peak exceeds this (machine safety)")
    a = ap.parse_args()
    rows: list[dict] = []
    print(f"shapes: hidden {a.hidden}, {a.heads} heads x 64, MLP {a.mlp}, draft vocab "
          f"{a.draft_vocab}, ttt_steps {a.steps}, batch 1 (fp32, CPU)")
    print("| impl | T | peak step memory (MiB) | peak / T (KiB per token) | fwd+bwd s |")
    print("|---|---|---|---|---|")
    for impl in a.impls:
        for T in a.T:
            if impl == "eager":
                # ~3 fp32 [h,T,T] tensors per TTT step live at the end of the forward
                pred = 3 * 4 * a.heads * T * T * a.steps / 2**30
                if pred > a.max_eager_gib:
                    print(f"| {impl} | {T} | skipped: predicted {pred:.1f} GiB > --max-eager-gib | | |")
                    continue
            r = run(impl, T, a)
            rows.append(r)
            if "error" in r:
                print(f"| {impl} | {T} | failed: {r['error']} | | |")
            else:
                print(f"| {impl} | {T} | {r['peak_mib']:,.0f} | {r['peak_mib'] * 1024 / T:,.1f} | "
                      f"{r['seconds']:.2f} |", flush=True)
    extrapolate(rows, a)


def extrapolate(rows: list[dict], a) -> None:
    """Kimi-K2.5 drafter at T=8192 from the measured numbers.

    chunked: the peak is linear in T; its per-token cost is dominated by activations kept for
    backward per TTT step, which scale with the widths (H, MLP, draft vocab, heads x head_dim).
    We count the kept floats per token per step for the bench shape and for Kimi's shapes with
    one formula, scale the MEASURED per-token bytes by their ratio, and add the fixed costs.
    eager: on top of that, a [h, T, T] term per step; its bytes per (head x T^2 x step) is
    fitted from the measured eager-minus-chunked difference at the largest T measured."""
    ok = [r for r in rows if "error" not in r]
    ch = sorted((r for r in ok if r["impl"] == "chunked"), key=lambda r: r["T"])
    ea = {r["T"]: r for r in ok if r["impl"] == "eager"}
    if not ch:
        return

    def kept_floats_per_token_step(H, hD, kvD, I, N):
        # x=[emb;hid] 2H, norms ~4H, q/k/v (+ pre-rope) 2hD+4kvD, attn out hD, o_proj/residual
        # ~2H, post-attn norm ~2H, MLP gate/up/silu/product 4I, down/residual ~2H, final norm
        # ~2H, logits + log_softmax + teacher probs 3N
        return 14 * H + 3 * hD + 4 * kvD + 4 * I + 3 * N

    bench = kept_floats_per_token_step(a.hidden, a.heads * 64, a.heads * 64, a.mlp, a.draft_vocab)
    kimi = kept_floats_per_token_step(7168, 64 * 128, 8 * 128, 18432, 32000)
    big = ch[-1]
    per_tok_step = big["peak_mib"] * 2**20 / big["T"] / a.steps            # measured bytes
    kimi_tok_step = per_tok_step * kimi / bench
    T, steps = 8192, 7
    act = kimi_tok_step * T * steps
    params = 3 * 7168 * 7168 + 2 * 7168 * 8192 + 2 * 2 * 7168 * 1024 + 8192 * 7168 \
        + 3 * 7168 * 18432 + 7168 * 32000
    states = params * 16  # fp32 weights + grads + AdamW m, v
    frozen = 2 * 163840 * 7168 * 4  # target embedding + lm_head kept fp32 by the trainer
    print("\nKimi-K2.5 drafter, T=8192, 7 TTT steps, batch 1 sequence (fp32 activations; bf16 "
          "autocast on GPU keeps less):")
    print(f"  measured chunked step memory at T={big['T']}: {big['peak_mib']:,.0f} MiB = "
          f"{per_tok_step:,.0f} B per token per TTT step; kept floats/token/step "
          f"bench {bench:,} vs Kimi {kimi:,} (x{kimi / bench:.1f})")
    print(f"  chunked activations: {kimi_tok_step:,.0f} B x {T} tokens x {steps} steps = "
          f"{act / 1e9:,.1f} GB")
    print(f"  drafter {params / 1e9:.2f} B params x 16 B (weights, grads, AdamW) = {states / 1e9:,.1f} GB;"
          f" frozen target embedding + lm_head fp32 = {frozen / 1e9:,.1f} GB")
    total = act + states + frozen
    print(f"  chunked total ~= {total / 1e9:,.1f} GB  (H200: 141 GB -> "
          f"{'fits' if total < 141e9 else 'does NOT fit'}; attention transient per chunk "
          f"64 x 512 x 8192 x 4 B x ~3 = {64 * 512 * 8192 * 4 * 3 / 1e9:.1f} GB)")
    if big["T"] in ea:
        extra = (ea[big["T"]]["peak_mib"] - big["peak_mib"]) * 2**20
        per = extra / (a.heads * big["T"] ** 2 * a.steps)
        eager_attn = per * 64 * T * T * steps
        print(f"  eager: measured (eager - chunked) at T={big['T']} = {extra / 2**20:,.0f} MiB = "
              f"{per:.1f} B per (head x T^2 x step); at 64 heads, T=8192, 7 steps: "
              f"{eager_attn / 1e9:,.0f} GB more -> total {(total + eager_attn) / 1e9:,.0f} GB "
              f"({'fits' if total + eager_attn < 141e9 else 'does NOT fit'} in 141 GB)")


if __name__ == "__main__":
    main()
