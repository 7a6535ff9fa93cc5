"""The trainer that runs inside each of Ray Train's TorchTrainer workers.

Generic: the model computes its own (loss, metrics); the trainer owns DDP, the optimizer and
schedule, gradient accumulation and clipping, resume, evaluation and metrics. Its shape is
torchtitan's: a typed config (`WorkerConfig`, built by the driver in train/run.py), a class
with `train_step` (one optimizer step over a rank's micro-batches), `validate` (held-out
metrics) and `train` (the loop: epochs, steps, reports, checkpoints), and a few-line
`train_loop_per_worker` for Ray Train to call.

Metrics are a dict of tensors per step, kept on the rank and reduced across ranks once per
report (`reduce`); a report is what rank 0 logs (metrics.jsonl, TensorBoard, Ray metrics) and
what every rank hands to `ray.train.report`.

Checkpoints (train/checkpoint.py: `save`, `load`), RUN_DIR/checkpoints/step-NNNNNNN/:
    model.safetensors   drafter parameters + d2t/t2d
    optim.pt            optimizer + scheduler state (torch.save of tensors/primitives only;
                        loaded with weights_only=True)
    rng/rank*.pt        torch CPU (+CUDA) RNG state of every rank
    state.json          step, epoch, step_in_epoch (the data position)
The driver resumes from the newest checkpoint that loads (`WorkerConfig.resume_from`),
skipping damaged newer ones with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

from eagle_ray.config import TrainConfig

logger = logging.getLogger(__name__)


def lr_lambda(warmup: int, total: int, schedule: str = "cosine"):
    """The learning-rate factor at a step (train.lr_schedule): linear warmup over `warmup`
    steps, then cosine or linear decay to 10% of the peak at `total`, or constant."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "constant":
            return 1.0
        if schedule == "linear":
            return 1.0 - 0.9 * progress
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))  # cosine to 10% of peak
    return f


@dataclasses.dataclass(kw_only=True)
class WorkerConfig:
    """What every training worker gets from the driver (train/run.py `fit_with_ray_train`)."""

    run_dir: str                     # RUN_DIR: checkpoints, metrics.jsonl, tensorboard/
    target_dir: str                  # the target checkpoint (embedding and lm_head by name)
    arch: dict[str, Any]             # DrafterArch fields
    d2t: list[int]                   # draft index -> target id offsets
    train_ids: list[str]
    val_ids: list[str]
    train: TrainConfig               # the recipe's training section
    use_gpu: bool                    # resolved against the cluster (train.use_gpu asks)
    ttt_steps: int                   # drafter.ttt_steps
    threads_per_worker: int = 1      # torch threads of a CPU worker
    store: str | None = None         # offline: the hidden-state store
    online: dict[str, Any] | None = None  # online: {"servers", "conversations", "max_seq_len", "depth"}
    resume_from: str | None = None   # the checkpoint to resume (the same for every rank)
    init_state: str | None = None    # a published drafter's converted weights (train.init_from)


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


class Trainer:
    """One worker's share of a training run (module docstring)."""

    def __init__(self, cfg: WorkerConfig) -> None:
        import ray.train
        import torch
        import torch.distributed as dist

        from eagle_ray.common import logs

        logs.add_file_handler("train")  # Ray Train replaced the worker's root handlers with its own
        self.cfg, self.t = cfg, cfg.train
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.run_dir = Path(cfg.run_dir)
        self.use_gpu = cfg.use_gpu and torch.cuda.is_available()
        self.device = torch.device(f"cuda:{ctx.get_local_rank()}" if self.use_gpu else "cpu")
        if not self.use_gpu:
            torch.set_num_threads(max(1, cfg.threads_per_worker))
        torch.manual_seed(self.t.seed)  # identical init on every rank (DDP also broadcasts)
        random.seed(self.t.seed + self.rank)
        self.dist = dist
        self._init_data()
        self._init_model()
        self.position = self._resume_or_init()
        self.writer = None
        if self.rank == 0:
            from tensorboardX import SummaryWriter

            # purge_step: events past the checkpoint (from the killed run) are dropped, not repeated
            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"),
                                        purge_step=self.position["step"] + 1 if cfg.resume_from else None)

    # -- set-up ----------------------------------------------------------------------------

    def _init_data(self) -> None:
        from eagle_ray.store.batch import collate
        from eagle_ray.store.reader import HiddenStateStore

        self.verify = self.t.verify_checksums  # a corrupted sample stops training, named
        self.val_cache: dict[int, dict] = {}
        online = self.cfg.online
        if online:  # features from the extractor actors (train/online.py), no store
            from eagle_ray.extract.stage import read_windows

            self.windows = read_windows(online["conversations"], online["max_seq_len"])
            self.store = None
            self.length = self.windows.length
        else:
            self.store = HiddenStateStore(self.cfg.store)
            self.length = self.store.num_tokens
            self.read = lambda ids: collate(self.store, ids, verify=self.verify)

    def _init_model(self) -> None:
        import torch

        from eagle_ray.model.drafter import DrafterArch, Eagle3Drafter
        from eagle_ray.targets.load import load_embed_and_lm_head

        embed, lm_head = load_embed_and_lm_head(self.cfg.target_dir)
        model = Eagle3Drafter(DrafterArch(**self.cfg.arch), embed_weight=embed.float(),
                              target_lm_head_weight=lm_head.float(), d2t=torch.tensor(self.cfg.d2t),
                              loss_decay=self.t.loss_decay).to(self.device)
        # Buffers (the frozen V x H target embedding/lm_head, d2t, t2d) are loaded identically on
        # every rank and never change: DDP must not broadcast them, neither at init (GBs for
        # Kimi-K2.5) nor each forward. torch 2.13 deprecates broadcast_buffers=False, and its
        # replacement forward_sync_buffers=False still syncs at init; ignoring them does neither.
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(  # noqa: SLF001
            model, [name for name, _ in model.named_buffers()])
        self.model = model
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[self.device.index] if self.use_gpu else None, forward_sync_buffers=False)
        self.opt = torch.optim.AdamW(model.parameters(), lr=self.t.lr, betas=(0.9, 0.95),
                                     weight_decay=self.t.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_lambda(self.t.warmup_steps, self.t.max_steps, self.t.lr_schedule))
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                         if (self.use_gpu and self.t.bf16) else None)

    def _resume_or_init(self) -> dict[str, int]:
        """The data position to start from: a checkpoint's (the driver picked the newest that
        loads), else 0 with a published drafter's weights when the run starts from one."""
        from eagle_ray.train import checkpoint

        if self.cfg.resume_from:
            pos = checkpoint.load(Path(self.cfg.resume_from), self.model, self.opt, self.sched,
                                  rank=self.rank, device=self.device, use_gpu=self.use_gpu)
            if self.rank == 0:
                logger.info("resumed from %s (step %d, epoch %d)", self.cfg.resume_from, pos["step"],
                            pos["epoch"])
            return pos
        if self.cfg.init_state:
            from safetensors.torch import load_file

            # Its weights (the driver converted and checked them, RUN/init/), a fresh optimizer.
            self.model.load_state_dict(load_file(self.cfg.init_state), strict=True)
            if self.rank == 0:
                logger.info("initial weights from %s", self.cfg.init_state)
        return {"step": 0, "epoch": 0, "step_in_epoch": 0}

    # -- metrics ---------------------------------------------------------------------------

    def reduce(self, metrics: dict[str, Any]) -> dict[str, float]:
        """Sum a dict of tensors over the ranks (one all-reduce) -> floats."""
        import torch

        names = list(metrics)
        x = torch.stack([torch.as_tensor(metrics[n], dtype=torch.float64) for n in names]).to(self.device)
        self.dist.all_reduce(x)
        return dict(zip(names, x.cpu().tolist()))

    def report(self, m: dict[str, float]) -> None:
        import ray.train

        if self.rank == 0:
            _record_metrics(m)
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(m) + "\n")
            for k, v in m.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, m["step"])
            self.writer.flush()
        ray.train.report({k: v for k, v in m.items() if isinstance(v, (int, float))})

    # -- the three verbs -------------------------------------------------------------------

    def _val_batch(self, ids: list[str], bi: int) -> dict:
        if self.store is not None:
            return self.read(ids)
        if bi not in self.val_cache:  # online: the small held-out set is extracted once, kept in memory
            import ray

            from eagle_ray.train.online import batch_from_features

            servers = self.cfg.online["servers"]
            enc = ray.get(servers[bi % len(servers)].features.remote([self.windows[s][0] for s in ids]))
            self.val_cache[bi] = batch_from_features(ids, enc, self.windows)
        return self.val_cache[bi]

    def validate(self) -> dict[str, float]:
        """Held-out metrics over the validation split (sharded by rank, summed)."""
        import torch

        from eagle_ray.train.data import make_batches

        self.model.eval()
        val = self.cfg.val_ids
        batches = make_batches([self.length(s) for s in val], self.t.tokens_per_batch, seed=0)
        sums = {f"{k}{j}": torch.zeros((), dtype=torch.float64)
                for j in range(self.cfg.ttt_steps) for k in ("loss_x_trained", "trained", "correct", "valid")}
        with torch.no_grad():
            for bi in range(self.rank, len(batches), self.world):
                batch = {k: v.to(self.device) for k, v in self._val_batch([val[i] for i in batches[bi]], bi).items()}
                _, m = self.model(batch)
                for j in range(self.cfg.ttt_steps):
                    n_trained = m[f"trained_step{j}"].double().cpu()
                    sums[f"loss_x_trained{j}"] += m[f"loss_step{j}"].double().cpu() * n_trained
                    sums[f"trained{j}"] += n_trained
                    sums[f"correct{j}"] += m[f"correct_step{j}"].double().cpu()
                    sums[f"valid{j}"] += m[f"valid_step{j}"].double().cpu()
        s = self.reduce(sums)
        self.model.train()
        out = {}
        for j in range(self.cfg.ttt_steps):
            out[f"val/loss_step{j}"] = s[f"loss_x_trained{j}"] / max(1.0, s[f"trained{j}"])
            out[f"val/acc_step{j}"] = s[f"correct{j}"] / max(1.0, s[f"valid{j}"])
        return out

    def train_step(self, micro: list[dict]) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches (gradients all-reduced once, on
        the last); this rank's metrics of the step as tensors: the mean loss, tokens, and
        per TTT step the correct and valid positions."""
        import torch

        m_step: dict[str, Any] = {"loss": torch.zeros((), dtype=torch.float64), "tokens": 0}
        for k, batch in enumerate(micro):
            batch = {n: v.to(self.device, non_blocking=True) for n, v in batch.items()}
            sync = k == len(micro) - 1  # all-reduce gradients once per optimizer step
            with self.ddp.no_sync() if not sync else contextlib.nullcontext():
                with self.autocast or contextlib.nullcontext():
                    loss, m = self.ddp(batch)
                (loss / len(micro)).backward()  # each backward sums grads => average here
            m_step["loss"] += loss.detach().double().cpu() / len(micro)
            m_step["tokens"] += batch["attention_mask"].sum().item()
            for j in range(self.cfg.ttt_steps):
                for key in ("correct", "valid"):
                    name = f"{key}_step{j}"
                    m_step[name] = m_step.get(name, 0) + m[name].double().cpu()
        m_step["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.t.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return m_step

    def train(self) -> None:
        from eagle_ray.train import checkpoint

        t, pos = self.t, self.position
        if pos["step"] == 0 and not self.cfg.resume_from:
            self.report({"step": 0, **self.validate()})  # the untrained drafter's held-out accuracy
        self.model.train()
        clock = {"start": time.perf_counter(), "first_step": pos["step"], "wait": 0.0, "tokens": 0}
        while pos["step"] < t.max_steps:
            pre = self._epoch(pos)
            for s_epoch, micro in pre:
                m = self.train_step(micro)
                pos["step"] += 1
                pos["step_in_epoch"] = s_epoch + 1
                clock["tokens"] += m["tokens"]
                step = pos["step"]
                if step % t.log_interval == 0 or step == t.max_steps:
                    self.report(self._train_report(m, pos, clock, pre.wait_s))
                if step % t.ckpt_interval == 0 or step == t.max_steps:
                    checkpoint.save(self.run_dir, dict(pos), self.model, self.opt, self.sched,
                                    rank=self.rank, world=self.world, barrier=self.dist.barrier,
                                    keep=t.keep_checkpoints)
                if step >= t.max_steps:
                    break
            clock["wait"] += pre.wait_s
            if pos["step"] < t.max_steps:
                pos["epoch"], pos["step_in_epoch"] = pos["epoch"] + 1, 0
        if self.writer is not None:
            self.writer.close()

    # -- pieces of train() -----------------------------------------------------------------

    def _epoch(self, pos: dict[str, int]):
        """This rank's batches of the epoch at `pos`, read ahead from its data position."""
        from eagle_ray.train.data import Prefetcher, RankBatches

        t = self.t
        rb = RankBatches([self.length(s) for s in self.cfg.train_ids], self.cfg.train_ids,
                         tokens_per_batch=t.tokens_per_batch, seed=t.seed, epoch=pos["epoch"],
                         rank=self.rank, world=self.world, accum=t.grad_accum)
        if rb.steps == 0:
            raise ValueError(f"not enough training data for one step of {self.world} workers x "
                             f"{t.grad_accum} micro-batches; lower train.tokens_per_batch")
        if self.cfg.online:  # every epoch extracts its batches again
            from eagle_ray.train.online import OnlineBatches

            o = self.cfg.online
            return OnlineBatches(rb, pos["step_in_epoch"], o["servers"], self.windows, o["depth"])
        return Prefetcher(rb, pos["step_in_epoch"], self.read)

    def _train_report(self, m: dict[str, Any], pos: dict[str, int], clock: dict, epoch_wait_s: float
                      ) -> dict[str, float]:
        """The report of the step just taken: its metrics reduced over the ranks (loss and
        accuracy of this step, tokens since the start), and validation when it is due."""
        from eagle_ray.common.progress import hms

        t, step = self.t, pos["step"]
        local = {k: v for k, v in m.items() if k not in ("grad_norm", "tokens")}
        s = self.reduce({**local, "tokens": clock["tokens"]})
        elapsed = time.perf_counter() - clock["start"]
        out = {"step": step, "epoch": pos["epoch"], "train/loss": s["loss"] / self.world,
               "train/lr": self.sched.get_last_lr()[0], "train/grad_norm": float(m["grad_norm"]),
               "train/tokens_per_s": s["tokens"] / max(1e-9, elapsed),
               "train/data_wait_frac": (clock["wait"] + epoch_wait_s) / max(1e-9, elapsed)}
        for j in range(self.cfg.ttt_steps):
            out[f"train/acc_step{j}"] = s[f"correct_step{j}"] / max(1.0, s[f"valid_step{j}"])
        if step % t.eval_interval == 0 or step == t.max_steps:
            out.update(self.validate())
        if self.rank == 0:
            eta = elapsed / max(1, step - clock["first_step"]) * (t.max_steps - step)
            logger.info("train: step %d/%d, loss %.4f, acc0 %.3f, %.0f tokens/s, data wait "
                        "%.1f%%%s, ETA %s", step, t.max_steps, out["train/loss"],
                        out["train/acc_step0"], out["train/tokens_per_s"], 100 * out["train/data_wait_frac"],
                        f", val acc0 {out['val/acc_step0']:.3f}" if "val/acc_step0" in out else "",
                        hms(eta))
        return out


def loop_config(cfg: WorkerConfig) -> dict[str, Any]:
    """`cfg` as Ray Train's train_loop_config: a dict (its state tracking, which fills the
    dashboard's Train page, refuses anything else), one entry per field."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """What Ray Train runs in each worker (`config`: `loop_config`)."""
    Trainer(WorkerConfig(**config)).train()
