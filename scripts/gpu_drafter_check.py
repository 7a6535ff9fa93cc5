"""The EAGLE-3 drafter alone on one CUDA GPU: correctness against the CPU, nccl + DDP, and the
speed and memory of a bf16 training step at real targets' shapes. Torch only (no vLLM, no Ray).

    PYTHONPATH=. python3 scripts/gpu_drafter_check.py --out DIR [--budget-s 400]
    PYTHONPATH=. .venv/bin/python scripts/gpu_drafter_check.py --out DIR --cpu-smoke

Sections (each in its own try/except, so one failure does not lose the others):

a. correctness: one SmolLM2-135M-shaped drafter (hidden 576, 9 heads, 3 KV heads of 64, MLP
   1536, vocab 49152, draft vocab 8192, TTT 3), the same weights on the CPU and on CUDA, both
   float32 with TF32 off; max |diff| of the loss, of the per-step logits, and of a few
   gradients after one backward.
b. nccl: a world-size-1 process group (backend nccl, tcp://127.0.0.1), one all_reduce, the
   drafter wrapped in DistributedDataParallel as eagle_ray.train.loop wraps it, three AdamW
   steps under bf16 autocast on one batch (the loss should fall and stay finite).
c. throughput: a training step (forward with the teacher, backward, AdamW step) under
   torch.autocast(bfloat16) with fp32 master weights (what eagle_ray.train.loop does on a GPU),
   3 warm-ups then the median of 10 steps, torch.cuda.synchronize around each, and
   torch.cuda.max_memory_allocated; 8192 tokens a step (4 x 2048), halved on OOM.
   Shapes: SmolLM2-135M (draft vocab 32000 and 8192, TTT 7 and 1) and Kimi-K2.5 (hidden 7168,
   vocab 163840, draft vocab 32000, TTT 7 and 1) with the drafter layer of the kimi_k25_8gpu
   recipe (64 heads, 64 KV heads of 128, MLP 18432) and, time allowing, a 56-head / 8-KV-head
   variant. Configurations not reached before --budget-s are reported as skipped.

Writes DIR/results.md (the table) and DIR/results.json (every figure). `--cpu-smoke` runs tiny
shapes on the CPU (gloo instead of nccl, no CUDA comparison) to test the script itself.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from eagle_ray.model.drafter import Eagle3Drafter, drafter_arch_from
from eagle_ray.model.vocab import build_draft_vocab
from eagle_ray.job.launch import free_port  # stdlib only: no Ray here

SMOL = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)
KIMI = dict(hidden=7168, heads=64, kv_heads=64, head_dim=128, intermediate=18432, vocab=163840)
KIMI_56 = dict(KIMI, heads=56, kv_heads=8)
TINY = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64, vocab=512)


def build(shape: dict, draft_vocab: int, ttt: int, device: str, seed: int = 0) -> Eagle3Drafter:
    """A drafter of `shape` with seeded random weights and frozen target tensors, on `device`."""
    torch.manual_seed(seed)
    V, H = shape["vocab"], shape["hidden"]
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = build_draft_vocab(torch.randint(0, 100, (V,), generator=g), draft_vocab)
    arch = drafter_arch_from(H, shape["heads"], shape["kv_heads"], shape["head_dim"],
                             shape["intermediate"], V, draft_vocab, ttt_steps=ttt)
    with torch.device(device):
        gd = torch.Generator(device=device).manual_seed(seed)
        embed = 0.02 * torch.randn(V, H, generator=gd, device=device)
        lm = 0.02 * torch.randn(V, H, generator=gd, device=device)
        model = Eagle3Drafter(arch, embed_weight=embed, target_lm_head_weight=lm,
                              d2t=d2t.to(device), t2d=t2d.to(device))
    return model


def make_batch(shape: dict, B: int, T: int, device: str, seed: int = 1, pad: bool = False) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    H, V = shape["hidden"], shape["vocab"]
    am = torch.ones(B, T, dtype=torch.bool, device=device)
    if pad and B > 1:
        am[-1, T - T // 4:] = False  # right padding on the last row
    return {"input_ids": torch.randint(0, V, (B, T), generator=g, device=device),
            "loss_mask": (torch.rand(B, T, generator=g, device=device) < 0.5) & am,
            "aux": torch.randn(B, T, 3 * H, generator=g, device=device),
            "final": torch.randn(B, T, H, generator=g, device=device),
            "attention_mask": am}


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a-b|, max |a-b| / max |a|)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    d = (a - b).abs().max().item()
    return d, d / max(a.abs().max().item(), 1e-30)


# --------------------------------------------------------------------------- a. correctness


def check_correctness(res: dict, smoke: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shape, N, ttt = (TINY, 128, 3) if smoke else (SMOL, 8192, 3)
    B, T = (2, 40) if smoke else (2, 640)  # 640 > ATTN_CHUNK (512): two query chunks
    dev = "cpu" if smoke else "cuda"
    cpu = build(shape, N, ttt, "cpu")
    gpu = copy.deepcopy(cpu).to(dev)
    batch = make_batch(shape, B, T, "cpu", pad=True)
    out: dict = {"shape": shape, "draft_vocab": N, "ttt": ttt, "B": B, "T": T, "device": dev,
                 "tf32": False}
    o_c = cpu.ttt_outputs(batch)
    o_g = gpu.ttt_outputs({k: v.to(dev) for k, v in batch.items()})
    out["logits_maxabs"] = max(maxdiff(a, b)[0] for a, b in zip(o_c.logits, o_g.logits))
    out["logits_maxrel"] = max(maxdiff(a, b)[1] for a, b in zip(o_c.logits, o_g.logits))
    out["logits_absmax_cpu"] = max(x.abs().max().item() for x in o_c.logits)
    out["token_loss_maxabs"] = max(maxdiff(a, b)[0] for a, b in zip(o_c.token_loss, o_g.token_loss))
    out["masks_equal"] = all(bool((a == b.cpu()).all()) for a, b in
                             zip(o_c.valid + o_c.trained + o_c.correct, o_g.valid + o_g.trained + o_g.correct))
    l_c, m_c = cpu(batch)
    l_g, m_g = gpu({k: v.to(dev) for k, v in batch.items()})
    out["loss_cpu"], out["loss_cuda"] = l_c.item(), l_g.item()
    out["loss_absdiff"] = abs(l_c.item() - l_g.item())
    out["acc_step0_cpu"], out["acc_step0_cuda"] = m_c["acc_step0"].item(), m_g["acc_step0"].item()
    l_c.backward()
    l_g.backward()
    gp = dict(gpu.named_parameters())
    grads = {}
    for name, p in cpu.named_parameters():
        d, r = maxdiff(p.grad, gp[name].grad)
        grads[name] = {"maxabs": d, "maxrel": r, "grad_absmax_cpu": p.grad.abs().max().item()}
    out["grads"] = grads
    out["grad_maxabs_all"] = max(v["maxabs"] for v in grads.values())
    out["grad_maxrel_all"] = max(v["maxrel"] for v in grads.values())
    res["correctness"] = out
    print(f"[a] loss cpu {out['loss_cpu']:.6f} cuda {out['loss_cuda']:.6f} |diff| {out['loss_absdiff']:.3g}; "
          f"logits max|diff| {out['logits_maxabs']:.3g} (rel {out['logits_maxrel']:.3g}); "
          f"grads max|diff| {out['grad_maxabs_all']:.3g} (rel {out['grad_maxrel_all']:.3g}); "
          f"masks equal {out['masks_equal']}", flush=True)
    for name in ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight",
                 "lm_head.weight"):
        print(f"    grad {name}: max|diff| {grads[name]['maxabs']:.3g} rel {grads[name]['maxrel']:.3g}")


# --------------------------------------------------------------------------- b. nccl + DDP


def check_ddp(res: dict, smoke: bool) -> None:
    import torch.distributed as dist

    backend, dev = ("gloo", "cpu") if smoke else ("nccl", "cuda:0")
    out: dict = {"backend": backend}
    res["ddp"] = out
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        x = torch.arange(4, dtype=torch.float32, device=dev)
        dist.all_reduce(x)
        out["all_reduce"] = x.tolist()
        out["all_reduce_ok"] = x.tolist() == [0.0, 1.0, 2.0, 3.0]
        shape, N, ttt, B, T = (TINY, 128, 3, 2, 32) if smoke else (SMOL, 8192, 3, 2, 1024)
        model = build(shape, N, ttt, dev)
        DDP = torch.nn.parallel.DistributedDataParallel
        DDP._set_params_and_buffers_to_ignore_for_model(  # noqa: SLF001  (as eagle_ray.train.loop)
            model, [name for name, _ in model.named_buffers()])
        ids = [0] if not smoke else None
        try:  # exactly eagle_ray.train.loop's call
            ddp = DDP(model, device_ids=ids, forward_sync_buffers=False)
            out["ddp_kwarg"] = "forward_sync_buffers=False"
        except TypeError as e:  # torch before forward_sync_buffers existed
            out["forward_sync_buffers_error"] = f"{type(e).__name__}: {e}"
            print(f"[b] DDP(forward_sync_buffers=False) failed: {e}; retrying with broadcast_buffers=False",
                  flush=True)
            ddp = DDP(model, device_ids=ids, broadcast_buffers=False)
            out["ddp_kwarg"] = "broadcast_buffers=False"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
        batch = make_batch(shape, B, T, dev.split(":")[0])
        losses = []
        for _ in range(3):
            ctx = torch.autocast("cuda", dtype=torch.bfloat16) if not smoke else torch.autocast("cpu", enabled=False)
            with ctx:
                loss, _ = ddp(batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        out["losses"] = losses
        out["finite"] = all(map(lambda v: v == v and abs(v) != float("inf"), losses))
        out["decreasing"] = all(b < a for a, b in zip(losses, losses[1:]))
        out["ok"] = out["all_reduce_ok"] and out["finite"] and out["decreasing"]
        print(f"[b] {backend}: all_reduce {out['all_reduce']}, DDP({out['ddp_kwarg']}) losses "
              f"{[round(v, 5) for v in losses]} finite {out['finite']} decreasing {out['decreasing']}", flush=True)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- c. throughput


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def run_config(name: str, shape: dict, N: int, ttt: int, B: int, T: int, dev: str,
               warmup: int, iters: int) -> dict:
    model = build(shape, N, ttt, dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    batch = make_batch(shape, B, T, dev)
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if dev == "cuda" else torch.autocast("cpu", enabled=False)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(warmup + iters):
        sync(dev)
        t0 = time.perf_counter()
        with ac:
            loss, _ = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if i >= warmup:
            times.append(dt)
    med = statistics.median(times)
    n_params = sum(p.numel() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else 0
    return {"name": name, "draft_vocab": N, "ttt": ttt, "B": B, "T": T, "tokens": B * T,
            "step_s_median": med, "step_s_min": min(times), "step_s_max": max(times),
            "tokens_per_s": B * T / med, "peak_mem_gib": peak / 2**30, "params_m": n_params / 1e6,
            "loss_first": losses[0], "loss_last": losses[-1], "ok": True}


def free(dev: str) -> None:
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


def check_throughput(res: dict, smoke: bool, deadline: float) -> None:
    dev = "cpu" if smoke else "cuda"
    if smoke:
        configs = [("tiny", TINY, 128, 3, 2, 32)]
        warmup, iters = 1, 2
    else:
        configs = [("SmolLM2-135M", SMOL, 32000, 7, 4, 2048), ("SmolLM2-135M", SMOL, 32000, 1, 4, 2048),
                   ("SmolLM2-135M", SMOL, 8192, 7, 4, 2048), ("SmolLM2-135M", SMOL, 8192, 1, 4, 2048),
                   ("Kimi-K2.5 (64h/64kv)", KIMI, 32000, 7, 4, 2048),
                   ("Kimi-K2.5 (64h/64kv)", KIMI, 32000, 1, 4, 2048),
                   ("Kimi-K2.5 (56h/8kv)", KIMI_56, 32000, 7, 4, 2048),
                   ("Kimi-K2.5 (56h/8kv)", KIMI_56, 32000, 1, 4, 2048),
                   ("Kimi-K2.5 (64h/64kv)", KIMI, 32000, 7, 1, 8192)]
        warmup, iters = 3, 10
    rows = res.setdefault("throughput", [])
    res["throughput_mode"] = ("torch.autocast('cuda', bfloat16), fp32 weights and AdamW state "
                              "(as eagle_ray.train.loop with train.bf16); no DDP wrapper"
                              if not smoke else "CPU float32 (smoke)")
    for name, shape, N, ttt, B, T in configs:
        base = {"name": name, "draft_vocab": N, "ttt": ttt, "shape": shape}
        if time.monotonic() > deadline:
            rows.append({**base, "ok": False, "error": "skipped: time budget spent"})
            print(f"[c] {name} N={N} TTT={ttt}: skipped (time budget)", flush=True)
            continue
        t_start = time.monotonic()
        while True:
            try:
                r = run_config(name, shape, N, ttt, B, T, dev, warmup, iters)
                r["shape"] = shape
                r["wall_s"] = time.monotonic() - t_start
                rows.append(r)
                print(f"[c] {name} N={N} TTT={ttt} {B}x{T}: {r['step_s_median']*1e3:.1f} ms/step, "
                      f"{r['tokens_per_s']:.0f} tok/s, peak {r['peak_mem_gib']:.1f} GiB "
                      f"(loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}; {r['wall_s']:.0f} s)", flush=True)
                break
            except torch.OutOfMemoryError as e:
                free(dev)
                msg = str(e).splitlines()[0]
                print(f"[c] {name} N={N} TTT={ttt} {B}x{T}: OOM ({msg[:160]})", flush=True)
                base.setdefault("oom_at", []).append(B * T)
                if B > 1:
                    B //= 2
                elif T > 256:
                    T //= 2
                else:
                    rows.append({**base, "ok": False, "error": f"OOM down to {B}x{T}: {msg}"})
                    break
            except Exception as e:  # noqa: BLE001
                rows.append({**base, "B": B, "T": T, "ok": False,
                             "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
                print(f"[c] {name} N={N} TTT={ttt}: FAILED {type(e).__name__}: {e}", flush=True)
                break
        if rows[-1].get("ok") and "oom_at" in base:
            rows[-1]["oom_at"] = base["oom_at"]
        free(dev)


# --------------------------------------------------------------------------- report


def table(res: dict) -> str:
    lines = [f"torch {res['env'].get('torch')}, {res['env'].get('gpu')}; "
             f"throughput mode: {res.get('throughput_mode')}", ""]
    c = res.get("correctness")
    if c:
        lines += ["| check | result |", "|---|---|",
                  f"| CPU vs CUDA fp32 (TF32 off), {c['B']}x{c['T']}, N={c['draft_vocab']}, TTT {c['ttt']}: loss | "
                  f"cpu {c['loss_cpu']:.6f} / cuda {c['loss_cuda']:.6f}, abs diff {c['loss_absdiff']:.3g} |",
                  f"| logits max abs diff (rel to max logit) | {c['logits_maxabs']:.3g} ({c['logits_maxrel']:.3g}) |",
                  f"| token loss max abs diff | {c['token_loss_maxabs']:.3g} |",
                  f"| grads max abs diff over all params (rel) | {c['grad_maxabs_all']:.3g} ({c['grad_maxrel_all']:.3g}) |",
                  f"| valid/trained/correct masks equal | {c['masks_equal']} |"]
    elif "correctness_error" in res:
        lines += [f"correctness FAILED: {res['correctness_error']}"]
    d = res.get("ddp")
    if d and "losses" in d:
        lines += [f"| {d['backend']} all_reduce + DDP ({d.get('ddp_kwarg')}), 3 AdamW steps | losses "
                  f"{', '.join(f'{v:.5f}' for v in d['losses'])}; ok {d['ok']} |"]
        if "forward_sync_buffers_error" in d:
            lines += [f"| DDP(forward_sync_buffers=False) as in train/loop.py | {d['forward_sync_buffers_error']} |"]
    if "ddp_error" in res:
        lines += [f"ddp FAILED: {res['ddp_error']}"]
    lines += ["", "| target shape | draft vocab | TTT | batch x seq | tokens | step ms (median of 10) | "
                  "tokens/s | peak mem GiB | drafter params M | note |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("throughput", []):
        s = r.get("shape", {})
        tag = f"{r['name']} [H {s.get('hidden')}, {s.get('heads')}h/{s.get('kv_heads')}kv x {s.get('head_dim')}, MLP {s.get('intermediate')}, V {s.get('vocab')}]"
        if r.get("ok"):
            note = f"OOM at {r['oom_at']} tokens" if r.get("oom_at") else ""
            lines.append(f"| {tag} | {r['draft_vocab']} | {r['ttt']} | {r['B']}x{r['T']} | {r['tokens']} | "
                         f"{r['step_s_median']*1e3:.1f} | {r['tokens_per_s']:.0f} | {r['peak_mem_gib']:.2f} | "
                         f"{r['params_m']:.1f} | {note} |")
        else:
            lines.append(f"| {tag} | {r['draft_vocab']} | {r['ttt']} | - | - | - | - | - | - | "
                         f"{r.get('error', '')[:200]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU; gloo; no CUDA")
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="start no throughput configuration after this many seconds")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.cpu_smoke:
        torch.set_num_threads(1)
    env = {"torch": torch.__version__, "python": sys.version.split()[0],
           "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
           "modules_loaded_by_eagle_ray_model": sorted({m.split(".")[0] for m in sys.modules
                                                        if m.split(".")[0] in ("vllm", "ray", "transformers")})}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_mem_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        env["gpu"] = "no GPU"
    try:
        env["nvidia_smi_L"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                             timeout=30).stdout.strip()
    except Exception as e:  # noqa: BLE001
        env["nvidia_smi_L"] = f"unavailable: {e}"
    res: dict = {"env": env, "cpu_smoke": a.cpu_smoke}
    print(json.dumps(env, indent=1), flush=True)
    if not a.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: use --cpu-smoke", flush=True)
        return 2
    for key, fn in (("correctness", lambda: check_correctness(res, a.cpu_smoke)),
                    ("ddp", lambda: check_ddp(res, a.cpu_smoke)),
                    ("throughput", lambda: check_throughput(res, a.cpu_smoke, t0 + a.budget_s))):
        ts = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            res[f"{key}_error"] = f"{type(e).__name__}: {e}"
            res[f"{key}_traceback"] = traceback.format_exc()
            print(f"[{key}] FAILED:\n{traceback.format_exc()}", flush=True)
        res[f"{key}_wall_s"] = time.monotonic() - ts
        free("cuda" if torch.cuda.is_available() else "cpu")
        (a.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    res["total_wall_s"] = time.monotonic() - t0
    md = table(res)
    print("\n" + md, flush=True)
    (a.out / "results.md").write_text(md + "\n")
    (a.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
