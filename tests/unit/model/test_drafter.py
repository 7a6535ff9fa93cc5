"""EAGLE-3 drafter: TTT alignment, masks, loss, padding, draft vocab, vLLM export names."""

from __future__ import annotations

import math

import pytest
import torch

from eagle_ray.export.vllm_layout import export_param_names, state_dict_for_export, vllm_config
from eagle_ray.model import (Eagle3Drafter, build_draft_vocab, draft_target_ids, draft_to_target,
                             drafter_arch_from, drafter_arch_from_target_config,
                             target_to_draft_map, ttt_attention_mask)
from eagle_ray.model import drafter as drafter_mod

H, HEADS, KV_HEADS, HEAD_DIM, INTER, V, N = 32, 2, 1, 16, 64, 50, 20


def make_model(steps: int = 3, seed: int = 0, dtype=torch.float32, **kw) -> Eagle3Drafter:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 100, (V,), generator=g)
    d2t, t2d = build_draft_vocab(counts, N)
    arch = drafter_arch_from(H, HEADS, KV_HEADS, HEAD_DIM, INTER, V, N, rope_theta=10000.0,
                             ttt_steps=steps)
    torch.manual_seed(seed)
    model = Eagle3Drafter(
        arch,
        embed_weight=torch.randn(V, H, generator=g),
        target_lm_head_weight=0.3 * torch.randn(V, H, generator=g),
        d2t=d2t, t2d=t2d, **kw)
    return model.to(dtype)


def make_batch(B: int = 2, T: int = 12, seed: int = 1, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, V, (B, T), generator=g),
        "loss_mask": torch.rand(B, T, generator=g) < 0.8,
        "aux": torch.randn(B, T, 3 * H, generator=g).to(dtype),
        "final": torch.randn(B, T, H, generator=g).to(dtype),
        "attention_mask": torch.ones(B, T, dtype=torch.bool),
    }


# ----------------------------------------------------------------------------- shapes / training


def test_forward_shapes_and_metrics():
    model = make_model(steps=3)
    batch = make_batch(B=2, T=12)
    out = model.ttt_outputs(batch)
    assert len(out.logits) == 3
    for j in range(3):
        assert out.logits[j].shape == (2, 12, N)
        assert out.token_loss[j].shape == out.valid[j].shape == out.correct[j].shape == (2, 12)
        # valid at column t iff the predicted token t+2+j exists and is loss-masked
        exp = torch.zeros(2, 12, dtype=torch.bool)
        exp[:, : 12 - 2 - j] = batch["loss_mask"][:, 2 + j:]
        assert torch.equal(out.valid[j], exp)
    loss, metrics = model(batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    for j in range(3):
        for key in ("loss_step", "acc_step", "valid_step", "correct_step"):
            assert f"{key}{j}" in metrics
        assert int(metrics[f"valid_step{j}"]) == int(out.valid[j].sum())
        assert 0.0 <= float(metrics[f"acc_step{j}"]) <= 1.0
    expected = sum(0.8 ** j * float(metrics[f"loss_step{j}"]) for j in range(3))
    assert float(metrics["loss"]) == pytest.approx(expected, rel=1e-6)
    # custom weights
    loss_w, _ = model(batch, step_weights=[1.0, 0.0, 0.0])
    assert float(loss_w.detach()) == pytest.approx(float(metrics["loss_step0"]), rel=1e-6)


def test_frozen_target_tensors_are_not_parameters():
    model = make_model()
    names = {n for n, _ in model.named_parameters()}
    assert not any("embed" in n or "target_lm_head" in n for n in names)
    assert all(p.shape != (V, H) for p in model.parameters())
    assert "embed_weight" not in model.state_dict()
    assert "target_lm_head_weight" not in model.state_dict()
    assert {"d2t", "t2d"} <= set(model.state_dict())


def _loss_floor(model, batch, steps: int) -> float:
    """The decayed sum over TTT steps of the teacher's entropy on valid columns: the lowest
    loss the soft cross-entropy can reach."""
    with torch.no_grad():
        out = model.ttt_outputs(batch)
        t_logits, _ = model.teacher(batch)
        floor = 0.0
        for j in range(steps):
            p = torch.softmax(model.shift(t_logits, 1 + j), -1)
            ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
            floor += 0.8 ** j * float((ent * out.valid[j]).sum() / out.valid[j].sum())
    return floor


def test_loss_decreases_when_overfitting():
    torch.manual_seed(0)
    model = make_model(steps=2)
    batch = make_batch(B=2, T=12)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss, _ = model(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(x) for x in losses)
    # soft-target CE is bounded below by the teacher entropy: the excess (a KL) must collapse
    floor = _loss_floor(model, batch, 2)
    assert losses[-1] < losses[0]
    assert losses[-1] - floor < 0.2 * (losses[0] - floor), (losses, floor)
    assert model.embed_weight.grad is None and model.target_lm_head_weight.grad is None


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("T", [1, 2, 5, 8])
@pytest.mark.parametrize("step", [0, 1, 3, 6])
def test_ttt_attention_mask_never_sees_the_future(T, step):
    m = ttt_attention_mask(T, step)
    assert m.shape == (T, T * (step + 1)) and m.dtype == torch.bool
    for t in range(T):
        for k in torch.nonzero(m[t]).flatten().tolist():
            block, s = divmod(k, T)
            assert s <= t, f"query {t} sees key column {s} (block {block})"
            if block > 0:
                assert s == t  # later steps: only the column's own continuation
    assert torch.equal(m[:, :T], torch.ones(T, T, dtype=torch.bool).tril())
    for i in range(1, step + 1):
        assert torch.equal(m[:, i * T:(i + 1) * T], torch.eye(T, dtype=torch.bool))


def _future_leaks(model, batch, steps, atol=1e-5):
    """(t, j) pairs where step-j logits at column t change when inputs it must not see change.

    Column t at step j may depend on aux[0..t] and input_ids[0..t+1+j] only (final/loss_mask
    feed the teacher, not the logits). Perturb everything beyond that and compare.
    """
    T = batch["input_ids"].shape[1]
    base = [x.detach() for x in model.ttt_outputs(batch, ttt_steps=steps).logits]
    g = torch.Generator().manual_seed(123)
    leaks = []
    for t in range(T):
        for j in range(steps):
            pert = {k: v.clone() for k, v in batch.items()}
            pert["aux"][:, t + 1:] += 3.0 * torch.randn(pert["aux"][:, t + 1:].shape, generator=g)
            n = pert["input_ids"][:, t + 2 + j:].numel()
            pert["input_ids"][:, t + 2 + j:] = (pert["input_ids"][:, t + 2 + j:]
                                                + torch.randint(1, V, (n,), generator=g).view(
                                                    pert["input_ids"][:, t + 2 + j:].shape)) % V
            pert["final"] = torch.randn(pert["final"].shape, generator=g)
            logits = model.ttt_outputs(pert, ttt_steps=steps).logits[j]
            if not torch.allclose(logits[:, t], base[j][:, t], atol=atol):
                leaks.append((t, j))
    return leaks


@pytest.mark.parametrize("impl", ["chunked", "eager", "dense"])
def test_no_future_information_reaches_a_column(impl, monkeypatch):
    monkeypatch.setattr(drafter_mod, "ATTN_CHUNK", 3)  # several chunks over T=8
    torch.manual_seed(0)
    model = make_model(steps=3, attn_impl=impl)
    batch = make_batch(B=2, T=8)
    with torch.no_grad():
        assert _future_leaks(model, batch, steps=3) == []
        # positive controls: what a column MAY see does change it
        out = model.ttt_outputs(batch).logits
        for j in range(3):
            t = 2
            pert = {k: v.clone() for k, v in batch.items()}
            pert["aux"][:, t] += 1.0
            assert not torch.allclose(model.ttt_outputs(pert).logits[j][:, t], out[j][:, t])
            pert = {k: v.clone() for k, v in batch.items()}
            pert["input_ids"][:, t + 1 + j] = (pert["input_ids"][:, t + 1 + j] + 1) % V
            assert not torch.allclose(model.ttt_outputs(pert).logits[j][:, t], out[j][:, t])


@pytest.mark.parametrize("impl", ["chunked", "eager", "dense"])
def test_leak_check_catches_a_broken_mask(monkeypatch, impl):
    """The perturbation check is real: with masks that let a column see later columns, it
    reports leaks (dense takes causality from ttt_attention_mask, chunked/eager from the
    step-0 ``_key_ok``)."""
    model = make_model(steps=2, attn_impl=impl)
    batch = make_batch(B=1, T=6)
    monkeypatch.setattr(drafter_mod, "ATTN_CHUNK", 4)
    monkeypatch.setattr(drafter_mod, "ttt_attention_mask",
                        lambda T, step, device=None: torch.ones(T, T * (step + 1), dtype=torch.bool,
                                                                device=device))
    monkeypatch.setattr(drafter_mod.Eagle3Attention, "_key_ok", staticmethod(
        lambda am, rows, cols: torch.ones(am.shape[0], 1, rows.stop - rows.start, cols,
                                          dtype=torch.bool)))
    with torch.no_grad():
        leaks = _future_leaks(model, batch, steps=2)
    assert (0, 0) in leaks and (0, 1) in leaks


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_attention_implementations_agree_with_dense(monkeypatch, chunk):
    """chunked (several chunk sizes, with padding) and eager equal the dense reference, in the
    outputs and in every parameter gradient (chunked recomputes in backward)."""
    monkeypatch.setattr(drafter_mod, "ATTN_CHUNK", chunk)
    model = make_model(steps=4, dtype=torch.float64)
    batch = make_batch(B=2, T=10, dtype=torch.float64)
    batch["attention_mask"][0, 7:] = False
    results = {}
    for impl in ("dense", "eager", "chunked"):
        model.zero_grad(set_to_none=True)
        loss, _ = model(batch, attn_impl=impl)
        loss.backward()
        out = model.ttt_outputs(batch, attn_impl=impl)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[impl] = (loss.detach(), [lg.detach() for lg in out.logits], grads)
    ref_loss, ref_logits, ref_grads = results["dense"]
    for impl in ("eager", "chunked"):
        loss, logits, grads = results[impl]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
        for j in range(4):
            torch.testing.assert_close(logits[j], ref_logits[j], rtol=1e-10, atol=1e-10)
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-8, atol=1e-10, msg=n)


def test_out_of_vocab_targets_are_excluded_from_the_loss_not_from_accuracy():
    """A position whose full-vocab target argmax is outside the draft vocab carries no loss
    (vLLM can never accept it) but still counts as a miss in accuracy."""
    steps = 2
    model = make_model(steps=steps, dtype=torch.float64)
    batch = make_batch(B=1, T=12, dtype=torch.float64)
    batch["loss_mask"][:] = True
    oov = int((~model.t2d).nonzero()[0])
    logits = torch.randn(1, 12, V, dtype=torch.float64)
    logits[0, :, int(model.draft_ids[0])] = 40.0  # every other target argmax is draftable
    logits[0, 5, oov] = 50.0  # target argmax at p=5 is OOV: predicted token x_6
    batch["target_logits"] = logits
    out = model.ttt_outputs(batch)
    loss, m = model(batch)
    for j in range(steps):
        t = 5 - 1 - j  # column whose step-j teacher is f_5
        assert out.valid[j][0, t] and not out.trained[j][0, t] and not out.correct[j][0, t]
        assert float(out.token_loss[j][0, t].detach()) == 0.0
        assert int(m[f"trained_step{j}"]) == int(m[f"valid_step{j}"]) - 1
        assert float(m[f"loss_step{j}"]) == pytest.approx(
            float(out.token_loss[j].sum()) / int(m[f"trained_step{j}"]), rel=1e-12)
    # the OOV position's teacher can be anything: the loss does not move
    logits2 = logits.clone()
    logits2[0, 5, :] = torch.randn(V, dtype=torch.float64)
    logits2[0, 5, oov] = 60.0
    loss2, _ = model(dict(batch, target_logits=logits2))
    assert float(loss2) == pytest.approx(float(loss), rel=1e-12)


# ----------------------------------------------------------------------------- hand-computed loss


def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta):  # x [..., D], neox/rotate-half
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def test_loss_matches_hand_computation():
    """k=2, B=1, T=5, fp64, position-by-position loops independent of the module's code."""
    steps, T = 2, 5
    model = make_model(steps=steps, dtype=torch.float64)
    batch = make_batch(B=1, T=T, dtype=torch.float64)
    batch["loss_mask"][:] = True
    batch["loss_mask"][0, 3] = False  # predicted token 3 masked: step 0 col 1 / step 1 col 0
    a = model.arch
    eps, theta = a.rms_norm_eps, a.rope_theta
    L = model.midlayer
    Wq, Wk, Wv, Wo = (getattr(L.self_attn, f"{n}_proj").weight.detach()
                      for n in ("q", "k", "v", "o"))
    E, Wt = model.embed_weight, model.target_lm_head_weight
    tids = torch.arange(N) + model.d2t
    ids, aux, final, lm = (batch["input_ids"][0], batch["aux"][0], batch["final"][0],
                           batch["loss_mask"][0])

    def layer(emb, hid, pos):
        x = torch.cat([_rms(emb, L.input_layernorm.weight, eps), _rms(hid, L.hidden_norm.weight, eps)])
        q = _rope((Wq @ x).view(HEADS, HEAD_DIM), pos, theta)
        k = _rope((Wk @ x).view(KV_HEADS, HEAD_DIM), pos, theta)
        v = (Wv @ x).view(KV_HEADS, HEAD_DIM)
        return q, k, v

    def finish(q, keys, vals, hid):  # keys/vals: lists of [KV_HEADS, D]
        heads = []
        for h in range(HEADS):
            kvh = h // (HEADS // KV_HEADS)
            s = torch.stack([kk[kvh] @ q[h] for kk in keys]) / math.sqrt(HEAD_DIM)
            w = torch.softmax(s, 0)
            heads.append(sum(w[i] * vals[i][kvh] for i in range(len(keys))))
        resid = Wo @ torch.cat(heads) + hid
        m = L.mlp
        y = _rms(resid, L.post_attention_layernorm.weight, eps)
        y = m.down_proj.weight @ (torch.nn.functional.silu(m.gate_proj.weight @ y) * (m.up_proj.weight @ y))
        return y + resid

    with torch.no_grad():
        zero = torch.zeros(H, dtype=torch.float64)
        emb = lambda p: E[ids[p]] if p < T else zero  # noqa: E731
        # step 0: column t = [fc(aux_t) ; emb(x_{t+1})] at position t, causal over columns
        hid0 = [model.fc.weight @ aux[t] for t in range(T)]
        qkv0 = [layer(emb(t + 1), hid0[t], t) for t in range(T)]
        h0 = [finish(qkv0[t][0], [qkv0[s][1] for s in range(t + 1)], [qkv0[s][2] for s in range(t + 1)],
                     hid0[t]) for t in range(T)]
        # step 1: column t = [h0_t ; emb(x_{t+2})] at position t+1; keys: step-0 s<=t, own step-1
        qkv1 = [layer(emb(t + 2), h0[t], t + 1) for t in range(T)]
        h1 = [finish(qkv1[t][0], [qkv0[s][1] for s in range(t + 1)] + [qkv1[t][1]],
                     [qkv0[s][2] for s in range(t + 1)] + [qkv1[t][2]], h0[t]) for t in range(T)]
        total, per_step_logits, n_terms = 0.0, [], []
        for j, hs in enumerate((h0, h1)):
            logits = [model.lm_head.weight @ _rms(hs[t], model.norm.weight, eps) for t in range(T)]
            per_step_logits.append(torch.stack(logits))
            terms = []
            for t in range(T):
                if (t + 2 + j < T and lm[t + 2 + j]
                        and bool(((Wt @ final[t + 1 + j]).argmax() == tids).any())):  # draftable
                    p = torch.softmax((Wt @ final[t + 1 + j])[tids], 0)
                    terms.append(-(p * torch.log_softmax(logits[t], 0)).sum())
            total += 0.8 ** j * (sum(terms) / len(terms) if terms else 0.0)
            n_terms.append(len(terms))

        loss, metrics = model(batch)
        out = model.ttt_outputs(batch)
    for j in range(steps):
        torch.testing.assert_close(out.logits[j][0], per_step_logits[j], rtol=1e-9, atol=1e-9)
    assert abs(float(loss) - float(total)) < 1e-6
    assert int(metrics["valid_step0"]) == 2 and int(metrics["valid_step1"]) == 1
    assert [int(metrics[f"trained_step{j}"]) for j in range(steps)] == n_terms


# ----------------------------------------------------------------------------- padding


def test_padded_batch_matches_unpadded_singles():
    steps = 3
    model = make_model(steps=steps, dtype=torch.float64)
    lengths = [7, 12]
    singles = [make_batch(B=1, T=n, seed=10 + i, dtype=torch.float64) for i, n in enumerate(lengths)]
    T = max(lengths)
    g = torch.Generator().manual_seed(99)
    padded = {  # garbage (not zeros) in the pad region, loss_mask True there: must be ignored
        "input_ids": torch.randint(0, V, (2, T), generator=g),
        "loss_mask": torch.ones(2, T, dtype=torch.bool),
        "aux": torch.randn(2, T, 3 * H, generator=g, dtype=torch.float64),
        "final": torch.randn(2, T, H, generator=g, dtype=torch.float64),
        "attention_mask": torch.zeros(2, T, dtype=torch.bool),
    }
    for i, (s, n) in enumerate(zip(singles, lengths)):
        for k in ("input_ids", "loss_mask", "aux", "final", "attention_mask"):
            padded[k][i, :n] = s[k][0]
    with torch.no_grad():
        pb = model.ttt_outputs(padded)
        loss_b, met_b = model(padded)
        total_sum = [0.0] * steps
        for i, (s, n) in enumerate(zip(singles, lengths)):
            so = model.ttt_outputs(s)
            for j in range(steps):
                assert torch.equal(pb.valid[j][i, :n], so.valid[j][0])
                assert not pb.valid[j][i, n:].any()
                torch.testing.assert_close(pb.token_loss[j][i, :n], so.token_loss[j][0],
                                           rtol=1e-10, atol=1e-10)
                v = so.valid[j][0]
                torch.testing.assert_close(pb.logits[j][i, :n][v], so.logits[j][0][v],
                                           rtol=1e-10, atol=1e-10)
                assert torch.equal(pb.correct[j][i, :n], so.correct[j][0])
                total_sum[j] += float(so.token_loss[j].sum())
    for j in range(steps):
        n_trained = int(met_b[f"trained_step{j}"])
        assert float(met_b[f"loss_step{j}"]) == pytest.approx(total_sum[j] / n_trained, rel=1e-10)
    with pytest.raises(ValueError, match="right-padded"):
        bad = dict(padded, attention_mask=padded["attention_mask"].flip(1))
        model(bad)


# ----------------------------------------------------------------------------- draft vocab


def test_build_draft_vocab_order_ties_and_round_trip():
    counts = torch.tensor([5, 3, 5, 0, 3, 7, 3, 1])
    d2t, t2d = build_draft_vocab(counts, 4)
    ids = draft_target_ids(d2t)
    # top counts: 7 (id 5), 5 (ids 0, 2), then the 3s tie -> lowest id 1 wins over 4, 6
    assert ids.tolist() == [0, 1, 2, 5]
    assert d2t.dtype == torch.long and d2t.tolist() == [0, 0, 0, 2]  # offsets, not ids
    assert t2d.dtype == torch.bool and torch.nonzero(t2d).flatten().tolist() == [0, 1, 2, 5]
    assert draft_to_target(torch.tensor([3, 0]), d2t).tolist() == [5, 0]
    inv = target_to_draft_map(d2t, 8)
    assert inv.tolist() == [0, 1, 2, -1, -1, 3, -1, -1]
    # vocab smaller than the requested draft vocab -> everything, identity map
    d2t_all, t2d_all = build_draft_vocab(counts, 100)
    assert d2t_all.tolist() == [0] * 8 and bool(t2d_all.all())
    # deterministic on all-equal counts: the lowest ids
    assert draft_target_ids(build_draft_vocab(torch.zeros(10, dtype=torch.long), 3)[0]).tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        build_draft_vocab(torch.tensor([1.0, 2.0]), 1)


def test_build_draft_vocab_random_properties():
    g = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 20, (500,), generator=g)  # many ties
    d2t, t2d = build_draft_vocab(counts, 64)
    ids = draft_target_ids(d2t)
    assert ids.numel() == 64 and int(t2d.sum()) == 64
    assert bool(t2d[ids].all())                               # every draft idx -> t2d True
    assert bool((ids[1:] > ids[:-1]).all())                   # ascending target ids
    sel, rest = counts[t2d], counts[~t2d]
    assert int(sel.min()) >= int(rest.max())                  # frequency order
    boundary = int(sel.min())
    if int(rest.max()) == boundary:                           # ties at the cut: lower ids win
        assert int(torch.nonzero(t2d & (counts == boundary)).max()) < \
            int(torch.nonzero(~t2d & (counts == boundary)).min())
    inv = target_to_draft_map(d2t, 500)
    assert torch.equal(draft_to_target(inv[ids], d2t), ids)
    assert bool((inv[~t2d] == -1).all())


# ----------------------------------------------------------------------------- export


def test_export_names_shapes_and_config():
    model = make_model()
    sd = state_dict_for_export(model, dtype=torch.bfloat16)
    assert tuple(sd) == export_param_names()
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    assert shapes["fc.weight"] == (H, 3 * H)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (HEADS * HEAD_DIM, 2 * H)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (KV_HEADS * HEAD_DIM, 2 * H)
    assert shapes["midlayer.self_attn.v_proj.weight"] == (KV_HEADS * HEAD_DIM, 2 * H)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (H, HEADS * HEAD_DIM)
    assert shapes["midlayer.mlp.gate_proj.weight"] == (INTER, H)
    assert shapes["midlayer.mlp.down_proj.weight"] == (H, INTER)
    assert shapes["midlayer.hidden_norm.weight"] == (H,)
    assert shapes["lm_head.weight"] == (N, H)
    assert sd["d2t"].dtype == torch.long and shapes["d2t"] == (N,)
    assert sd["t2d"].dtype == torch.bool and shapes["t2d"] == (V,)
    assert sd["fc.weight"].dtype == torch.bfloat16
    assert not any("embed" in k for k in sd)
    # round trip into a fresh drafter
    fresh = make_model(seed=7)
    fresh.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()})
    assert torch.equal(fresh.d2t, model.d2t)

    target_cfg = {"hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
                  "head_dim": HEAD_DIM, "intermediate_size": INTER, "vocab_size": V,
                  "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                  "max_position_embeddings": 256, "eos_token_id": 2, "dtype": "bfloat16"}
    arch = drafter_arch_from_target_config(target_cfg, N, ttt_steps=5)
    assert arch.rope_theta == 5e5 and arch.draft_vocab_size == N and arch.ttt_steps == 5
    cfg = vllm_config(arch, target_cfg, [2, 4, 5])
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == V and cfg["draft_vocab_size"] == N
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5}
    assert cfg["eos_token_id"] == 2 and cfg["target_hidden_size"] == H
    with pytest.raises(ValueError):
        vllm_config(arch, target_cfg, [4, 2, 5])
    from transformers import LlamaConfig

    lc = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    assert lc.head_dim == HEAD_DIM and lc.rope_parameters["rope_theta"] == 5e5


def test_export_names_map_onto_vllm_eagle3_parameters():
    """Replay vLLM's Eagle3LlamaForCausalLM.load_weights renaming on our export names."""
    utils = pytest.importorskip("vllm.model_executor.models.llama_eagle3")
    mapper = utils.LlamaModel.hf_to_vllm_mapper
    mapped = set()
    for name in export_param_names():
        if "t2d" in name:       # vLLM skips t2d
            continue
        if "d2t" in name:       # -> top-level draft_id_to_target_id
            mapped.add(name.replace("d2t", "draft_id_to_target_id"))
        elif "lm_head" in name:
            mapped.add(name)
        else:                   # "model." prefix, then LlamaModel's own mapper
            mapped.add("model." + mapper.map_name(name))
    assert mapped == {
        "draft_id_to_target_id", "lm_head.weight", "model.fc.weight", "model.norm.weight",
        "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
    }
    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS

    assert _SPECULATIVE_DECODING_MODELS["LlamaForCausalLMEagle3"] == ("llama_eagle3", "Eagle3LlamaForCausalLM")


def test_identity_vocab_and_validation():
    arch = drafter_arch_from(H, HEADS, KV_HEADS, HEAD_DIM, INTER, V, V, ttt_steps=1)
    model = Eagle3Drafter(arch, embed_weight=torch.randn(V, H), target_lm_head_weight=torch.randn(V, H))
    assert torch.equal(model.draft_ids, torch.arange(V)) and bool(model.t2d.all())
    loss, _ = model(make_batch(B=1, T=4))
    assert torch.isfinite(loss)
    arch_n = drafter_arch_from(H, HEADS, KV_HEADS, HEAD_DIM, INTER, V, N)
    with pytest.raises(ValueError):
        Eagle3Drafter(arch_n)  # d2t required when N != V
    with pytest.raises(ValueError):
        Eagle3Drafter(arch_n, d2t=torch.zeros(N, dtype=torch.long) - 1)


def test_two_layer_drafter_trains_exports_and_names_layers_as_vllm():
    """drafter.num_layers = 2: the second layer is a plain Llama layer on H named layers.1.*
    (vLLM: midlayer. -> layers.0.), its TTT uses its own K/V cache under the same mask, and
    the loss falls when overfitting."""
    arch = drafter_arch_from(H, HEADS, KV_HEADS, HEAD_DIM, INTER, V, N, ttt_steps=3, num_layers=2)
    g = torch.Generator().manual_seed(0)
    d2t, t2d = build_draft_vocab(torch.randint(0, 100, (V,), generator=g), N)
    torch.manual_seed(0)
    model = Eagle3Drafter(arch, embed_weight=torch.randn(V, H, generator=g),
                          target_lm_head_weight=0.3 * torch.randn(V, H, generator=g), d2t=d2t)
    sd = state_dict_for_export(model)
    assert tuple(sd) == export_param_names(2)
    assert sd["layers.1.self_attn.q_proj.weight"].shape == (HEADS * HEAD_DIM, H)  # H, not 2H
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (HEADS * HEAD_DIM, 2 * H)
    assert "layers.1.hidden_norm.weight" not in sd
    assert vllm_config(arch, {"hidden_size": H, "vocab_size": V}, [2, 4, 5])["num_hidden_layers"] == 2
    batch = make_batch()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss, _ = model(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    floor = _loss_floor(model, batch, 3)  # soft CE is bounded below by the teacher entropy
    assert losses[-1] - floor < 0.2 * (losses[0] - floor), (losses, floor)
    # the second layer changes the output (it is really in the path)
    with torch.no_grad():
        a = model.ttt_outputs(batch).logits[1]
        for p_ in model.layers["1"].parameters():
            p_.zero_()
        assert not torch.allclose(a, model.ttt_outputs(batch).logits[1])
