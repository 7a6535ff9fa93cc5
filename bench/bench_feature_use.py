"""How much of a trained drafter's first draft comes from the target's features?

On a training run's held-out split (the run's own, split by conversation), the step-0
accuracy (the drafter's argmax equals the target's greedy next token, column t drafting
x_{t+2}; eagle_ray/model/drafter.py has the alignment) of:

    the store's token   how often the token the store sampled (at the serving profile) is
                     the target's greedy one: how broad the target's distribution is
    unigram          the training split's most common greedy target token, everywhere
    bigram           the greedy target token most often seen after the token input x_{t+1}
                     in the training split (what a drafter that ignores the features can
                     hope for from its token input alone, roughly)
    drafter, zeroed     the trained drafter with its aux features set to zero
    drafter, shuffled   ... with each position's features taken from a random other position
    drafter             ... with the features as captured

If the drafter is barely above the bigram, it has not yet learned much from the features
(or the features are misaligned); if zeroing them costs most of its accuracy, it does use
them. Forward passes only, one thread; the teacher's full-vocabulary logits dominate.

    .venv/bin/python bench/bench_feature_use.py --run out/curve/curve/frac-1 [--samples 64]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch


def _columns(store, sid: str, head: torch.Tensor):
    """(token input x_{t+1}, greedy target token of position t+1, the store's token x_{t+2})
    at the valid columns t."""
    s = store.get(sid)
    x, mask, final = s["input_ids"].long(), s["loss_mask"].bool(), s["final"].float()
    t = torch.arange(len(x) - 2)
    t = t[mask[t + 2]]  # column t is valid iff x_{t+2} is a loss token
    return x[t + 1], (final[t + 1] @ head.T).argmax(-1), x[t + 2]


def ngram_rows(store, train_ids: list[str], val_ids: list[str], head: torch.Tensor) -> list[tuple[str, float, int]]:
    counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    uni: collections.Counter = collections.Counter()
    for sid in train_ids:
        a, b, _ = _columns(store, sid, head)
        for i, j in zip(a.tolist(), b.tolist()):
            counts[i][j] += 1
            uni[j] += 1
    top = uni.most_common(1)[0][0]
    best = {i: c.most_common(1)[0][0] for i, c in counts.items()}
    n = hit_bi = hit_uni = hit_sampled = 0
    for sid in val_ids:
        a, b, y = _columns(store, sid, head)
        for i, j, k in zip(a.tolist(), b.tolist(), y.tolist()):
            n += 1
            hit_bi += best.get(i, top) == j
            hit_uni += top == j
            hit_sampled += k == j
    # How broad the target is where the store sampled it: its own token is its greedy one.
    return [("the store's (sampled) token", hit_sampled / max(1, n), n), ("unigram", hit_uni / max(1, n), n),
            ("bigram (token input only)", hit_bi / max(1, n), n)]


@torch.no_grad()
def drafter_rows(info: dict, state: dict, store, val_ids: list[str], embed, head) -> list[tuple[str, float, int]]:
    from eagle_ray.export.drafter import build_drafter
    from eagle_ray.store.batch import collate

    model = build_drafter(info, state).eval()
    model.set_target_weights(embed, head)
    gen = torch.Generator().manual_seed(0)
    tally = {"drafter, features zeroed": [0, 0], "drafter, features shuffled": [0, 0],
             "drafter, features as captured": [0, 0]}
    for lo in range(0, len(val_ids), 8):
        batch = collate(store, val_ids[lo:lo + 8])
        for name, t in tally.items():
            b = dict(batch)
            if "zeroed" in name:
                b["aux"] = torch.zeros_like(b["aux"])
            elif "shuffled" in name:
                flat = b["aux"].reshape(-1, b["aux"].shape[-1])
                b["aux"] = flat[torch.randperm(flat.shape[0], generator=gen)].reshape(b["aux"].shape)
            out = model.ttt_outputs(b, ttt_steps=1)
            t[0] += int(out.correct[0].sum())
            t[1] += int(out.valid[0].sum())
    return [(name, c / max(1, n), n) for name, (c, n) in tally.items()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a training run directory (run.json, checkpoints/)")
    p.add_argument("--checkpoint", default=None, help="default: the run's newest loadable")
    p.add_argument("--samples", type=int, default=64, help="held-out samples judged")
    p.add_argument("--train-samples", type=int, default=None, help="training samples the n-grams count (default all)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from safetensors.torch import load_file

    from eagle_ray.store.reader import HiddenStateStore
    from eagle_ray.targets.load import load_embed_and_lm_head
    from eagle_ray.train.checkpoint import newest_loadable

    run = Path(args.run)
    info = json.loads((run / "run.json").read_text())
    ck = Path(args.checkpoint) if args.checkpoint else newest_loadable(run)
    store = HiddenStateStore(info["store"])
    embed, head = load_embed_and_lm_head(info["target_dir"])
    embed, head = embed.float(), head.float()
    val = info["val_ids"][:args.samples]
    train = info["train_ids"][:args.train_samples] if args.train_samples else info["train_ids"]
    t0 = time.time()
    rows = ngram_rows(store, train, val, head)
    rows += drafter_rows(info, load_file(str(ck / "model.safetensors")), store, val, embed, head)
    print(f"run {run} (checkpoint {ck.name}); {len(val)} held-out samples, n-grams from {len(train)} "
          f"training samples; {time.time() - t0:,.0f} s\n")
    print("| predictor | held-out step-0 accuracy | columns |\n|---|---|---|")
    for name, acc, n in rows:
        print(f"| {name} | {acc:.3f} | {n:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
