"""What the user will get at the serving profile: the served target distribution, the
acceptance it predicts offline, and a test that speculation left the output distribution
unchanged.

Served distribution (as vLLM's rejection sampler builds the TARGET's probabilities):
    logits / temperature -> top-k -> top-p (sort ascending, drop the tail whose cumulative
    probability is <= 1 - top_p, always keep the top token) -> softmax -> min-p (drop tokens
    below min_p * max prob, renormalise).
The drafter's probabilities under probabilistic drafting are softmax(draft logits /
temperature) over the draft vocab only: vLLM applies the temperature and nothing else to
them (`compute_probs_and_sample_next_token`).

Expected acceptance offline, exactly as vLLM drafts (per draft column t, TTT step j, target
row t+1+j; the drafter's token inputs are the store's continuation y, sampled at the serving
profile):
    the drafter's rate     a_j = p_j(argmax q_j)              (greedy drafting: one-hot draft)
                           a_j = sum_v min(p_j(v), q_j(v))    (probabilistic: rejection rate)
    given the output y_j   w_j = 1[argmax q_j == y_j]         (greedy drafting)
                           w_j = min(1, q_j(y_j) / p_j(y_j))  (probabilistic)
Speculation is lossless, so online outputs are distributed as the store's continuations, and
given output y_j the chance that step j was an accepted draft (not a rejection's recovered
token) is min(p, q)(y_j) / p(y_j) = w_j; an accepted step feeds the drafter exactly y_j, the
token the offline unroll feeds. So along a stored continuation:
    P(steps 0..j of the draft at t accepted) = prod_{i<j} w_i * a_j       (E over y_j of w_j is a_j)
and vLLM's drafts start where the previous one ended: a draft at t that accepts n tokens
(chance prod_{i<n} w_i * (1 - w_n)) is followed by the draft at t + n + 1. `walk_drafts`
carries that chance forward from the first generated token, so the pooled figure counts the
positions vLLM drafts from, not every position (drafts start after hard tokens more often).
Both corrections matter: feeding the continuation as if every draft were accepted
(prod_j a_j) under-counts greedy drafting (a draft that is accepted is the drafter's likely
token, and its next step is easier than after a sampled one), and a mean over all positions
over-counts easy stretches. The result equals the online figure in expectation when the
store was regenerated at the serving profile; a keep-logged store or one sampled otherwise
gives no exact expectation (`offline_acceptance` says so and nothing is judged).

Distribution test (`distribution_test`): does a speculative run produce the same output
distribution as the plain run at the same sampling? Statistic: total-variation distance
between the two runs' output-token (unigram) frequencies, pooled over prompts and seeds.
Null distribution: a stratified permutation test; within each prompt, the plain and the
speculative completions (one per seed each) are exchangeable under the null, so their labels
are shuffled within the prompt. Whole completions move together, so the dependence between
tokens of one completion does not make the test over-confident. p = (1 + #{T_perm >= T}) /
(1 + permutations); a run fails when p < alpha / (number of runs tested) (Bonferroni).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

# Rows of [rows, V] fp32 target logits computed at once (~512 MB).
_ROW_BUDGET = 1 << 27


def served_probs(logits: torch.Tensor, sampling: Mapping[str, Any]) -> torch.Tensor:
    """[n, V] logits -> [n, V] probabilities of the target as vLLM verifies drafts at
    `sampling` (temperature > 0; top_p/top_k/min_p None or neutral = off)."""
    t = float(sampling["temperature"])
    if t <= 0:
        raise ValueError("served_probs needs temperature > 0 (greedy has no distribution)")
    x = logits.float() / t
    top_k = sampling.get("top_k")
    if top_k is not None and 0 < int(top_k) < x.shape[-1]:
        kth = x.topk(int(top_k), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    top_p = sampling.get("top_p")
    if top_p is not None and float(top_p) < 1.0:
        srt, order = x.sort(dim=-1)  # ascending
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= 1 - float(top_p)
        drop[..., -1] = False
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    p = x.softmax(-1)
    min_p = sampling.get("min_p")
    if min_p is not None and float(min_p) > 0:
        p = p.masked_fill(p < float(min_p) * p.amax(-1, keepdim=True), 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


@torch.no_grad()
def served_step_rates(final_rows: torch.Tensor, draft_logits: torch.Tensor, lm_head: torch.Tensor,
                      draft_ids: torch.Tensor, sampling: Mapping[str, Any],
                      next_ids: torch.Tensor) -> torch.Tensor:
    """Acceptance chances of one drafting step at n positions (module docstring): [4, n] =
    (a greedy drafting, a probabilistic, w greedy drafting, w probabilistic). final_rows
    [n, H] are the target's final hidden states of the rows being predicted, draft_logits
    [n, N] the drafter's logits over the draft vocab, next_ids [n] the tokens the
    continuation holds at those rows."""
    n = final_rows.shape[0]
    out = torch.zeros(4, n)
    rows = max(1, _ROW_BUDGET // lm_head.shape[0])
    t = float(sampling["temperature"])
    draft_ids = draft_ids.to(torch.long)
    for lo in range(0, n, rows):
        sl = slice(lo, lo + rows)
        f = final_rows[sl].to(lm_head.dtype)
        p = served_probs(f @ lm_head.T, sampling)                          # [c, V]
        dl = draft_logits[sl].float()
        d = draft_ids[dl.argmax(-1)]                                       # greedy draft, target ids
        q = torch.zeros_like(p)
        q[:, draft_ids] = (dl / t).softmax(-1)                             # draft probs, target vocab
        y = next_ids[sl].to(torch.long)[:, None]
        p_y, q_y = p.gather(1, y)[:, 0], q.gather(1, y)[:, 0]
        out[0, sl] = p.gather(1, d[:, None])[:, 0]
        out[1, sl] = torch.minimum(p, q).sum(-1)
        out[2, sl] = (d == y[:, 0]).float()
        # p(y) = 0 only for a continuation not sampled at this profile: never an accepted draft.
        out[3, sl] = torch.where(p_y > 0, (q_y / p_y.clamp(min=1e-30)).clamp(max=1.0), 0.0)
    return out


def walk_drafts(rates: torch.Tensor, keep: torch.Tensor, start: int) -> tuple[float, list[float]]:
    """Expected (drafts, accepted through step j for each j) of vLLM's chain drafting along
    one stored continuation: rates [2, k, T] = (a, w) per step and draft column (0 where the
    step is not valid), keep [T] whether a draft may start at that column (its step 0 is
    valid), `start` the column of the first draft (the last prompt position: the first
    generated token comes from the prefill). Module docstring."""
    a, w = rates[0].tolist(), rates[1].tolist()
    k, T = len(a), len(a[0])
    keep = keep.tolist()
    reach = [0.0] * (T + k + 2)  # chance that a draft starts at column t
    reach[start] = 1.0
    drafts, accepted = 0.0, [0.0] * k
    for t in range(start, T):
        r = reach[t]
        if r == 0.0 or not keep[t]:
            continue
        drafts += r
        for j in range(k):
            accepted[j] += r * a[j][t]
            reach[t + j + 1] += r * (1.0 - w[j][t])  # step j rejected: next draft after its token
            r *= w[j][t]
        reach[t + k + 1] += r  # all k accepted: the bonus token, then the next draft
    return drafts, accepted


def distribution_test(plain: Sequence[Sequence[Sequence[int]]], spec: Sequence[Sequence[Sequence[int]]],
                      *, permutations: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Stratified permutation test of equal output-token distributions (module docstring).
    plain[s][i], spec[s][i]: token ids of prompt i at seed s (same prompts, same count of seeds)."""
    if len(plain) != len(spec) or any(len(a) != len(b) for a, b in zip(plain, spec)):
        raise ValueError("distribution_test: both runs need the same prompts and seeds")
    S, P = len(plain), len(plain[0]) if plain else 0
    seqs = [plain[s][i] for i in range(P) for s in range(S)] + [spec[s][i] for i in range(P) for s in range(S)]
    vocab = sorted({t for q in seqs for t in q})
    col = {t: c for c, t in enumerate(vocab)}
    C = torch.zeros(len(seqs), max(1, len(vocab)), dtype=torch.float64)
    for r, q in enumerate(seqs):
        for t in q:
            C[r, col[t]] += 1
    # Plain rows i*S + s, speculative rows n + i*S + s: prompt i's stratum is groups[i].
    n = P * S
    groups = torch.stack([torch.cat([torch.arange(S) + i * S, n + torch.arange(S) + i * S])
                          for i in range(P)]) if P else torch.zeros(0, 2 * S, dtype=torch.long)

    def tv(labels: torch.Tensor) -> torch.Tensor:  # labels [m, 2n] in {0, 1}: 1 = speculative
        a, b = (1 - labels) @ C, labels @ C
        a = a / a.sum(-1, keepdim=True).clamp(min=1)
        b = b / b.sum(-1, keepdim=True).clamp(min=1)
        return 0.5 * (a - b).abs().sum(-1)

    observed = torch.cat([torch.zeros(n), torch.ones(n)]).double()
    t_obs = float(tv(observed[None])[0])
    g = torch.Generator().manual_seed(seed)
    half = (torch.arange(2 * S) >= S).double()            # within a stratum: S plain, S speculative
    t_perm = []
    for lo in range(0, permutations, 256):
        m = min(256, permutations - lo)
        order = torch.rand(m, P, 2 * S, generator=g).argsort(-1)  # a random relabelling per stratum
        labels = torch.zeros(m, 2 * n, dtype=torch.float64)
        labels.scatter_(1, groups[None].expand(m, -1, -1).gather(2, order).reshape(m, -1),
                        half.repeat(P)[None].expand(m, -1).contiguous())
        t_perm.append(tv(labels))
    t_perm = torch.cat(t_perm)
    p = (1 + int((t_perm >= t_obs - 1e-12).sum())) / (1 + permutations)
    return {"statistic": "total-variation distance of output-token frequencies",
            "tv_distance": t_obs, "tv_null_median": float(t_perm.median()), "p_value": p,
            "prompts": P, "seeds": S, "tokens": [int(C[:n].sum()), int(C[n:].sum())],
            "permutations": permutations}


def distribution_tests(plain: Sequence[Sequence[Sequence[int]]], runs: Mapping[str, Sequence],
                       *, alpha: float = 0.01, permutations: int = 2000) -> dict[str, Any]:
    """`distribution_test` of every speculative run against the plain one, Bonferroni over runs."""
    level = alpha / max(1, len(runs))
    out = {name: distribution_test(plain, outs, permutations=permutations) for name, outs in runs.items()}
    for r in out.values():
        r["passed"] = r["p_value"] >= level
    return {"test": "stratified permutation test (completions shuffled within their prompt) of the "
                    "total-variation distance between output-token frequencies, vs no speculation",
            "alpha": alpha, "level": level, "runs": out,
            "passed": all(r["passed"] for r in out.values())}


def distribution_lines(result: Mapping[str, Any] | None) -> list[str]:
    """The report's words for a `distribution_tests` result."""
    if not result:
        return []
    lines = [f"Output distribution unchanged by speculation ({result['test']}; alpha "
             f"{result['alpha']} over {len(result['runs'])} run(s), so each run needs p >= "
             f"{result['level']:.4f}): " + ("PASSED" if result["passed"] else "FAILED") + "."]
    for name, r in result["runs"].items():
        lines.append(f"- {name}: TV {r['tv_distance']:.4f} (null median {r['tv_null_median']:.4f}), "
                     f"p = {r['p_value']:.4f}: " + ("same distribution" if r["passed"] else
                     "DIFFERENT distribution: speculation changed what the user gets; the "
                     "sampler is broken or the runs were not sampled alike"))
    return lines
