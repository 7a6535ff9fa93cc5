"""The per-worker training loop (runs inside Ray Train's TorchTrainer workers).

Generic: the model computes its own (loss, metrics); this loop owns DDP, the optimizer and
schedule, gradient accumulation and clipping, checkpoints and resume, evaluation, metrics.

Checkpoints (rank 0 writes, every rank reads on resume), RUN_DIR/checkpoints/step-NNNNNNN/:
    model.safetensors   drafter parameters + d2t/t2d
    optim.pt            optimizer + scheduler state (torch.save of tensors/primitives only;
                        loaded with weights_only=True)
    rng/rank*.pt        torch CPU (+CUDA) RNG state of every rank
    state.json          step, epoch, step_in_epoch (the data position)
A checkpoint directory is written as .tmp, fsynced and renamed, with every file's size and
hash in state.json (train/checkpoint.py); the driver resumes from the newest checkpoint that
loads (cfg["resume_from"]), skipping damaged newer ones with a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint that loads (damaged newer ones are skipped with a warning)."""
    from eagle_ray.train.checkpoint import newest_loadable

    return newest_loadable(run_dir)


def lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))  # cosine to 10% of peak
    return f


def _save_checkpoint(run_dir: Path, step: int, model, opt, sched, state: dict, rng_dir: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    from eagle_ray.train.checkpoint import commit_checkpoint

    final = run_dir / "checkpoints" / f"step-{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp / "optim.pt")
        os.replace(rng_dir, tmp / "rng")
        return commit_checkpoint(tmp, final, state)  # fsync files + dir, hashes, rename
    except Exception as e:
        if not disk_full(final.parent, e):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # the half-written checkpoint, never loaded
        raise _disk_full_error(run_dir, final.name) from e


def _disk_full_error(run_dir: Path, name: str):
    from eagle_ray.train.checkpoint import CheckpointError, newest_loadable

    prev = newest_loadable(run_dir)
    return CheckpointError(
        f"disk full at {run_dir / 'checkpoints'} while writing checkpoint {name}; "
        + (f"{prev.name} is intact" if prev else "no earlier checkpoint was written")
        + "; free space and re-run to resume")


def disk_full(path: Path, e: BaseException, margin: int = 16 << 20) -> bool:
    """Whether a failed write failed because the disk is full. torch.save's zip writer says
    only "[enforce fail at inline_container.cc] unexpected pos N vs M" (no errno), so when
    no ENOSPC/EDQUOT is in the exception chain, ask the filesystem."""
    import errno

    x, seen = e, set()
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        x = x.__cause__ or x.__context__
    try:
        return shutil.disk_usage(path).free < margin
    except OSError:
        return False


def _distributed_rng_save(run_dir: Path, step: int, rank: int) -> None:
    """Each rank writes its RNG states next to the checkpoint (before rank 0 renames it)."""
    import torch

    d = run_dir / "checkpoints" / f"rng-{step:07d}"
    d.mkdir(parents=True, exist_ok=True)
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    try:
        torch.save(states, d / f"rank{rank}.pt")
    except Exception as e:
        if not disk_full(d, e):
            raise
        raise _disk_full_error(run_dir, f"step-{step:07d}") from e


def _record_metrics(m: dict[str, float]) -> None:
    """Rank 0's report into Ray's metrics (the dashboard / Grafana training panels)."""
    from eagle_ray.ops.metrics import record

    record("eagle_ray_train_step", m.get("step"), stage="train")
    record("eagle_ray_train_loss", m.get("train/loss"), stage="train")
    record("eagle_ray_train_tokens_per_s", m.get("train/tokens_per_s"), stage="train")
    record("eagle_ray_train_data_wait_fraction", m.get("train/data_wait_frac"), stage="train")
    for k, v in m.items():
        if k.startswith("train/acc_step"):
            record("eagle_ray_train_accuracy", v, stage="train", ttt_step=k[len("train/acc_step"):])
        elif k.startswith("val/acc_step"):
            record("eagle_ray_train_accuracy", v, stage="val", ttt_step=k[len("val/acc_step"):])


# noqa below: 223 lines, complexity 38; its split into a trainer class (train_step, validate,
# train; a typed worker config; checkpoint code in one place) is the open rooms issue.
def train_loop_per_worker(cfg: dict[str, Any]) -> None:  # noqa: C901
    import ray.train
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from eagle_ray.model.drafter import DrafterArch, Eagle3Drafter
    from eagle_ray.store.reader import HiddenStateStore
    from eagle_ray.store.batch import collate
    from eagle_ray.train.data import Prefetcher, RankBatches, make_batches
    from eagle_ray.targets.load import load_embed_and_lm_head

    from eagle_ray.common import logs

    logs.add_file_handler("train")  # Ray Train replaced the worker's root handlers with its own
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    run_dir = Path(cfg["run_dir"])
    t = cfg["train"]
    use_gpu = t["use_gpu"] and torch.cuda.is_available()
    device = torch.device(f"cuda:{ctx.get_local_rank()}" if use_gpu else "cpu")
    if not use_gpu:
        torch.set_num_threads(max(1, int(cfg.get("threads_per_worker", 1))))
    torch.manual_seed(t["seed"])  # identical init on every rank (DDP also broadcasts)
    random.seed(t["seed"] + rank)

    online = cfg.get("online")
    if online:  # features from the extractor actors (train/online.py), no store
        from eagle_ray.extract.stage import read_windows
        from eagle_ray.train.online import OnlineBatches, batch_from_features

        windows = read_windows(online["conversations"], online["max_seq_len"])
        store = None

        length = windows.length
    else:
        store = HiddenStateStore(cfg["store"])

        length = store.num_tokens
    embed, lm_head = load_embed_and_lm_head(cfg["target_dir"])
    arch = DrafterArch(**cfg["arch"])
    model = Eagle3Drafter(arch, embed_weight=embed.float(), target_lm_head_weight=lm_head.float(),
                          d2t=torch.tensor(cfg["d2t"]), loss_decay=t["loss_decay"]).to(device)
    # Buffers (the frozen V x H target embedding/lm_head, d2t, t2d) are loaded identically on
    # every rank and never change: DDP must not broadcast them, neither at init (GBs for
    # Kimi-K2.5) nor each forward. torch 2.13 deprecates broadcast_buffers=False, and its
    # replacement forward_sync_buffers=False still syncs at init; ignoring them does neither.
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(  # noqa: SLF001
        model, [name for name, _ in model.named_buffers()])
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if use_gpu else None, forward_sync_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=t["lr"], betas=(0.9, 0.95),
                            weight_decay=t["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t["warmup_steps"], t["max_steps"]))

    step, epoch, step_in_epoch = 0, 0, 0
    # The driver picked the newest checkpoint that loads (every rank must use the same one).
    ckpt = Path(cfg["resume_from"]) if cfg.get("resume_from") else None
    if ckpt is None and cfg.get("init_state"):
        # A run started from a published drafter (train.init_from): its weights (the driver
        # converted and checked them, RUN/init/), a fresh optimizer; resume takes precedence.
        model.load_state_dict(load_file(cfg["init_state"]), strict=True)
        if rank == 0:
            logger.info("initial weights from %s", cfg["init_state"])
    if ckpt is not None:
        model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
        o = torch.load(ckpt / "optim.pt", weights_only=True, map_location=device)
        opt.load_state_dict(o["optimizer"])
        sched.load_state_dict(o["scheduler"])
        state = json.loads((ckpt / "state.json").read_text())
        step, epoch, step_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
        rng_dir = ckpt / "rng"
        if (rng_dir / f"rank{rank}.pt").exists():
            r = torch.load(rng_dir / f"rank{rank}.pt", weights_only=True)
            torch.set_rng_state(r["torch"])
            if use_gpu and "cuda" in r:
                torch.cuda.set_rng_state(r["cuda"])
        if rank == 0:
            logger.info("resumed from %s (step %d, epoch %d)", ckpt, step, epoch)

    writer = None
    if rank == 0:
        from tensorboardX import SummaryWriter

        # purge_step: events past the checkpoint (from the killed run) are dropped, not repeated
        writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=step + 1 if ckpt else None)
    metrics_path = run_dir / "metrics.jsonl"

    def all_reduce(x):
        x = x.to(device)
        dist.all_reduce(x)
        return x

    steps = t["ttt_steps"]
    verify = t.get("verify_checksums", True)  # a corrupted sample stops training, named

    val_cache: dict[int, dict] = {}

    def val_batch(ids: list[str], bi: int) -> dict:
        if store is not None:
            return collate(store, ids, verify=verify)
        if bi not in val_cache:  # online: the small held-out set is extracted once, kept in memory
            import ray

            server = online["servers"][bi % len(online["servers"])]
            enc = ray.get(server.features.remote([windows[s][0] for s in ids]))
            val_cache[bi] = batch_from_features(ids, enc, windows)
        return val_cache[bi]

    def evaluate() -> dict[str, float]:
        """Held-out metrics over the validation split (sharded by rank, summed)."""
        model.eval()
        val = cfg["val_ids"]
        lengths = [length(s) for s in val]
        batches = make_batches(lengths, t["tokens_per_batch"], seed=0)
        sums = torch.zeros(4 * steps, dtype=torch.float64)
        with torch.no_grad():
            for bi in range(rank, len(batches), world):
                batch = {k: v.to(device) for k, v in val_batch([val[i] for i in batches[bi]], bi).items()}
                _, m = model(batch)
                for j in range(steps):
                    n_trained = m[f"trained_step{j}"].double().cpu()
                    sums[4 * j] += m[f"loss_step{j}"].double().cpu() * n_trained
                    sums[4 * j + 1] += n_trained
                    sums[4 * j + 2] += m[f"correct_step{j}"].double().cpu()
                    sums[4 * j + 3] += m[f"valid_step{j}"].double().cpu()
        sums = all_reduce(sums).cpu()
        model.train()
        out = {}
        for j in range(steps):
            out[f"val/loss_step{j}"] = sums[4 * j].item() / max(1.0, sums[4 * j + 1].item())
            out[f"val/acc_step{j}"] = sums[4 * j + 2].item() / max(1.0, sums[4 * j + 3].item())
        return out

    def log(m: dict[str, float]) -> None:
        if rank == 0:
            _record_metrics(m)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(m) + "\n")
            for k, v in m.items():
                if k != "step" and isinstance(v, (int, float)):
                    writer.add_scalar(k, v, m["step"])
            writer.flush()
        ray.train.report({k: v for k, v in m.items() if isinstance(v, (int, float))})

    if step == 0 and ckpt is None:
        log({"step": 0, **evaluate()})  # the untrained drafter's held-out accuracy

    model.train()
    tokens = 0
    t_start = time.perf_counter()
    step_start = step  # a resumed run's ETA counts this run's steps only
    wait_total = 0.0
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if (use_gpu and t["bf16"]) else None
    while step < t["max_steps"]:
        rb = RankBatches([length(s) for s in cfg["train_ids"]], cfg["train_ids"],
                         tokens_per_batch=t["tokens_per_batch"], seed=t["seed"], epoch=epoch,
                         rank=rank, world=world, accum=t["grad_accum"])
        if rb.steps == 0:
            raise ValueError(f"not enough training data for one step of {world} workers x "
                             f"{t['grad_accum']} micro-batches; lower train.tokens_per_batch")
        if online:  # every epoch extracts its batches again
            pre = OnlineBatches(rb, step_in_epoch, online["servers"], windows, online["depth"])
        else:
            pre = Prefetcher(rb, step_in_epoch, lambda ids: collate(store, ids, verify=verify))
        for s_epoch, micro in pre:
            sums = torch.zeros(2 + 2 * steps, dtype=torch.float64)
            for k, batch in enumerate(micro):
                batch = {n: v.to(device, non_blocking=True) for n, v in batch.items()}
                sync = k == len(micro) - 1  # all-reduce gradients once per optimizer step
                ctx_mgr = ddp.no_sync() if not sync else contextlib.nullcontext()
                with ctx_mgr:
                    if autocast:
                        with autocast:
                            loss, m = ddp(batch)
                    else:
                        loss, m = ddp(batch)
                    (loss / len(micro)).backward()  # each backward sums grads => average here
                sums[0] += loss.detach().double().cpu() / len(micro)
                sums[1] += batch["attention_mask"].sum().item()
                for j in range(steps):
                    sums[2 + 2 * j] += m[f"correct_step{j}"].double().cpu()
                    sums[3 + 2 * j] += m[f"valid_step{j}"].double().cpu()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            step_in_epoch = s_epoch + 1
            sums = all_reduce(sums).cpu()
            tokens += int(sums[1].item())
            if step % t["log_interval"] == 0 or step == t["max_steps"]:
                elapsed = time.perf_counter() - t_start
                m_out = {"step": step, "epoch": epoch, "train/loss": sums[0].item() / world,
                         "train/lr": sched.get_last_lr()[0], "train/grad_norm": float(gnorm),
                         "train/tokens_per_s": tokens / max(1e-9, elapsed),
                         "train/data_wait_frac": (wait_total + pre.wait_s) / max(1e-9, elapsed)}
                for j in range(steps):
                    m_out[f"train/acc_step{j}"] = sums[2 + 2 * j].item() / max(1.0, sums[3 + 2 * j].item())
                if step % t["eval_interval"] == 0 or step == t["max_steps"]:
                    m_out.update(evaluate())
                if rank == 0:
                    from eagle_ray.common.progress import hms

                    eta = elapsed / max(1, step - step_start) * (t["max_steps"] - step)
                    logger.info("train: step %d/%d, loss %.4f, acc0 %.3f, %.0f tokens/s, data wait "
                                "%.1f%%%s, ETA %s", step, t["max_steps"], m_out["train/loss"],
                                m_out["train/acc_step0"], m_out["train/tokens_per_s"],
                                100 * m_out["train/data_wait_frac"],
                                f", val acc0 {m_out['val/acc_step0']:.3f}" if "val/acc_step0" in m_out else "",
                                hms(eta))
                log(m_out)
            if step % t["ckpt_interval"] == 0 or step == t["max_steps"]:
                _checkpoint(run_dir, step, epoch, step_in_epoch, model, opt, sched, rank, world, dist,
                            keep=t.get("keep_checkpoints", 0))
            if step >= t["max_steps"]:
                break
        wait_total += pre.wait_s
        if step < t["max_steps"]:
            epoch, step_in_epoch = epoch + 1, 0
    if writer is not None:
        writer.close()


def _checkpoint(run_dir, step, epoch, step_in_epoch, model, opt, sched, rank, world, dist, keep=0):
    """Every rank saves its RNG state, then rank 0 writes the rest and renames atomically,
    then keeps only the newest `keep` checkpoints (0: all)."""
    _distributed_rng_save(run_dir, step, rank)
    dist.barrier()
    if rank == 0:
        state = {"step": step, "epoch": epoch, "step_in_epoch": step_in_epoch, "world": world}
        _save_checkpoint(run_dir, step, model, opt, sched, state,
                         run_dir / "checkpoints" / f"rng-{step:07d}")
        from eagle_ray.train.checkpoint import prune

        prune(run_dir, keep)
    dist.barrier()
