"""Where a drafter training step's time goes, at a real target's shapes (default: SmolLM2-135M,
recipe smollm2_cpu): the teacher's full-vocabulary logits, the TTT forward, the backward.

    .venv/bin/python bench/bench_drafter_step.py [--vocab 32000,8192,4096] [--ttt 7,3,1]
                                                [--tokens 2048] [--threads 1]

One process, one thread by default (a Ray Train worker with train.cpus_per_worker <= 1 gets
one), random features and weights of the target's shapes (the cost does not depend on their
values), half of the positions in the loss mask. Prints one row per (draft vocabulary, TTT
steps): seconds for the teacher, the forward (teacher included), the backward, and tokens/s.
"""

from __future__ import annotations

import argparse
import time


def step_seconds(arch_kw: dict, vocab: int, draft_vocab: int, ttt: int, tokens: int, seq: int) -> tuple:
    import torch

    from eagle_ray.model.drafter import Eagle3Drafter, drafter_arch_from
    from eagle_ray.model.vocab import build_draft_vocab

    g = torch.Generator().manual_seed(0)
    H = arch_kw["hidden_size"]
    d2t, t2d = build_draft_vocab(torch.randint(0, 100, (vocab,), generator=g), draft_vocab)
    arch = drafter_arch_from(H, arch_kw["heads"], arch_kw["kv_heads"], arch_kw["head_dim"],
                             arch_kw["intermediate"], vocab, draft_vocab, ttt_steps=ttt)
    model = Eagle3Drafter(arch, embed_weight=0.02 * torch.randn(vocab, H, generator=g),
                          target_lm_head_weight=0.02 * torch.randn(vocab, H, generator=g), d2t=d2t, t2d=t2d)
    B, T = max(1, tokens // seq), seq
    batch = {"input_ids": torch.randint(0, vocab, (B, T), generator=g),
             "loss_mask": torch.rand(B, T, generator=g) < 0.5,
             "aux": torch.randn(B, T, 3 * H, generator=g), "final": torch.randn(B, T, H, generator=g),
             "attention_mask": torch.ones(B, T, dtype=torch.bool)}
    t0 = time.perf_counter()
    with torch.no_grad():
        model.teacher(batch)
    t1 = time.perf_counter()
    loss, _ = model(batch)
    t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, B * T / (t3 - t1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", default="32000,8192,4096", help="draft vocabulary sizes")
    p.add_argument("--ttt", default="7,3,1", help="TTT lengths")
    p.add_argument("--tokens", type=int, default=2048, help="tokens a step (train.tokens_per_batch)")
    p.add_argument("--seq", type=int, default=1024, help="sequence length (data.max_seq_len)")
    p.add_argument("--threads", type=int, default=1)
    # SmolLM2-135M-Instruct (targets/smollm2.py)
    p.add_argument("--target-vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=1536)
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    arch = {"hidden_size": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
            "intermediate": a.intermediate}
    print(f"target vocab {a.target_vocab:,}, hidden {a.hidden}; {a.tokens:,} tokens a step "
          f"(sequences of {a.seq}); {a.threads} thread(s)")
    step_seconds(arch, a.target_vocab, 1024, 1, 128, 64)  # warm-up: the first step pays one-time costs
    print(f"{'draft vocab':>11} {'TTT':>4} {'teacher s':>10} {'forward s':>10} {'backward s':>11} {'tokens/s':>9}")
    for n in (int(x) for x in a.vocab.split(",")):
        for ttt in (int(x) for x in a.ttt.split(",")):
            t, f, b, tps = step_seconds(arch, a.target_vocab, n, ttt, a.tokens, a.seq)
            print(f"{n:>11,} {ttt:>4} {t:>10.1f} {f:>10.1f} {b:>11.1f} {tps:>9.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
