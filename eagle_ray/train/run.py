"""Drafter training run (driver side): vocab, split, provenance, Ray Train TorchTrainer.

    store ─▶ split ids (stable hash) ─▶ draft vocab from loss-token counts (train split)
          ─▶ TorchTrainer(train_loop_per_worker, ScalingConfig(num_workers, use_gpu))
          ─▶ RUN_DIR/{checkpoints/, metrics.jsonl, tensorboard/, run.json}

Re-running with the same RUN_DIR resumes from its latest checkpoint (same vocab and split:
they are read back from run.json, never recomputed differently).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle_ray.config import Recipe
from eagle_ray.targets.resolve import resolve_target_path
from eagle_ray.common.outputs import claim_output_dir
from eagle_ray.common.atomic import atomic_write_bytes, atomic_write_json
from eagle_ray.common.provenance import provenance

logger = logging.getLogger(__name__)


SUMMARY_METRICS = (("train/loss", "loss"), ("val/acc_step0", "held-out step-0 accuracy"),
                   ("val/acc_step1", "step-1"), ("train/tokens_per_s", "tokens/s"),
                   ("online/spilled_bytes", "spilled bytes"))


def summary_line(metrics: dict[str, Any], run_dir: str | Path) -> str:
    """Training's one line (`eagle-ray train` and the job): the last report's step, loss,
    held-out accuracy at draft steps 0 and 1, throughput."""
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)

    parts = [f"step {metrics.get('step')}"] + [f"{name} {fmt(metrics[k])}" for k, name in SUMMARY_METRICS
                                                if k in metrics]
    return f"train: {', '.join(parts)} -> {run_dir} (checkpoints/, metrics.jsonl, tensorboard/)"


def drafter_arch(recipe: Recipe, target_dir: Path):
    from eagle_ray.model.drafter import drafter_arch_from_target_config

    cfg = json.loads((target_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    d = recipe.drafter
    over: dict[str, Any] = {}
    heads = d.num_attention_heads or recipe.target.num_attention_heads
    over["num_attention_heads"] = heads
    # Explicit in every recipe; never the target config's head_dim (DeepSeek-V3 writes its
    # rope width there).
    over["head_dim"] = d.head_dim or recipe.target.hidden_size // heads
    if d.num_key_value_heads:
        over["num_key_value_heads"] = d.num_key_value_heads
    over["intermediate_size"] = d.intermediate_size or recipe.target.intermediate_size
    return drafter_arch_from_target_config(cfg, d.draft_vocab_size, ttt_steps=d.ttt_steps,
                                           num_layers=d.num_layers, **over)


def prepare_run(recipe: Recipe, store_dir: str | Path, run_dir: str | Path) -> dict[str, Any]:
    """The run's fixed inputs (written once to run.json; a resumed run reads them back)."""
    import hashlib

    from eagle_ray.store.reader import HiddenStateStore
    from eagle_ray.train.data import loss_token_counts

    from eagle_ray.targets.identity import check_same_target, recorded_target

    run = Path(run_dir)
    path = run / "run.json"
    manifest_bytes = (Path(store_dir) / "manifest.json").read_bytes()
    target_dir = resolve_target_path(recipe.target)
    # Before anything else: features of another target (same shapes, same tokenizer) would
    # train without an error.
    check_same_target(recipe, target_dir, recorded_target(json.loads(manifest_bytes)),
                      f"the store {store_dir}")
    if path.exists():
        info = json.loads(path.read_text())
        if info["store_manifest_sha256"] != hashlib.sha256(manifest_bytes).hexdigest():
            raise ValueError(f"{run} was started on another store; use a new --out run directory")
        return info
    store = HiddenStateStore(store_dir)
    arch = drafter_arch(recipe, target_dir)
    if store.manifest.hidden_size != arch.hidden_size:
        raise ValueError(f"store hidden size {store.manifest.hidden_size} != target's {arch.hidden_size}")
    pub, arch = _published(recipe, target_dir, arch, json.loads(manifest_bytes))
    train_ids, val_ids = _split(store.sample_ids, recipe.train.val_fraction)
    counts = loss_token_counts(((r["input_ids"], r["loss_mask"]) for r in map(store.raw, train_ids)),
                               arch.target_vocab_size)
    claim_output_dir(run, "train")
    vocab = _run_vocab(recipe, run, pub, arch, counts, target_dir)
    info = {"recipe": recipe.to_dict(), "arch": asdict(arch), "store": str(Path(store_dir).resolve()),
            "store_manifest": json.loads(manifest_bytes),
            "store_manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
            "target_dir": str(target_dir), "train_ids": train_ids, "val_ids": val_ids,
            **vocab, "provenance": provenance()}
    atomic_write_json(path, info)
    return info


def _split(ids, val_fraction: float) -> tuple[list[str], list[str]]:
    """The stable train/validation split of the run's samples (never an empty validation set)."""
    from eagle_ray.train.data import split_ids

    train_ids, val_ids = split_ids(sorted(ids), val_fraction)
    if not val_ids:
        train_ids, val_ids = train_ids[1:], train_ids[:1]
    return train_ids, val_ids


def _vocab_fields(counts, arch) -> dict[str, Any]:
    """run.json's draft vocabulary (d2t) and loss-token frequency facts, from loss-token counts."""
    from eagle_ray.model.vocab import build_draft_vocab

    d2t, _ = build_draft_vocab(counts, arch.draft_vocab_size)
    return {"d2t": d2t.tolist(), "most_common_token": int(counts.argmax()),
            "most_common_token_share": float(counts.max() / max(1, counts.sum()))}


def _run_vocab(recipe: Recipe, run: Path, pub, arch, counts, target_dir: Path) -> dict[str, Any]:
    """run.json's vocabulary fields (offline and online runs alike): the data's draft vocabulary
    or the published drafter's, and how much of the training loss tokens it holds."""
    return _coverage(_init_fields(recipe, run, pub, arch, _vocab_fields(counts, arch), target_dir), counts)


def _coverage(vocab: dict[str, Any], counts) -> dict[str, Any]:
    """vocab plus draft_vocab_coverage: the share of the training split's loss tokens that the
    run's draft vocabulary (its final d2t: the data's, or a published drafter's) holds. A token
    outside it can never be drafted, so this bounds every position's acceptance (held-out text
    is covered a little less)."""
    import torch

    from eagle_ray.model.vocab import draft_target_ids

    covered = int(counts[draft_target_ids(torch.as_tensor(vocab["d2t"]))].sum())
    share = covered / max(1, int(counts.sum()))
    logger.info("train: the draft vocabulary (%d tokens) holds %.1f%% of the training split's "
                "loss tokens", len(vocab["d2t"]), 100 * share)
    return {**vocab, "draft_vocab_coverage": share}


def _published(recipe: Recipe, target_dir: Path, arch, manifest: dict[str, Any]):
    """(the published drafter of train.init_from, the run's arch) after every check, or
    (None, arch). The drafter's rope theta and norm eps are part of what its weights mean,
    so the run takes them."""
    import dataclasses

    if not recipe.train.init_from:
        return None, arch
    from eagle_ray.targets.identity import check_same_target
    from eagle_ray.train.init import check_published, read_published

    pub = read_published(recipe.train.init_from)
    check_same_target(recipe, target_dir, pub.recorded_target,
                      f"the drafter train.init_from={pub.path}")
    check_published(pub, arch, manifest, recipe.train.init_vocab)
    c = pub.config
    arch = dataclasses.replace(arch, rms_norm_eps=c["rms_norm_eps"],
                               rope_theta=c["rope_theta"] or arch.rope_theta)
    return pub, arch


def _write_init_state(run: Path, state: dict[str, Any]) -> tuple[str, str]:
    """RUN/init/model.safetensors, the initial state every rank loads: (its path, sha256)."""
    import hashlib

    from safetensors.torch import save

    (run / "init").mkdir(parents=True, exist_ok=True)
    data = save({k: v.contiguous() for k, v in state.items()})
    atomic_write_bytes(run / "init" / "model.safetensors", data)
    return str(run / "init" / "model.safetensors"), hashlib.sha256(data).hexdigest()


def _init_fields(recipe: Recipe, run: Path, pub, arch, vocab: dict[str, Any],
                 target_dir: Path) -> dict[str, Any]:
    """run.json fields of a run started from a published drafter: its d2t (init_vocab keep)
    or the data's (init_vocab data, rows carried), and RUN/init/model.safetensors, the
    initial state every rank loads; or of a fresh drafter started from the target's weights
    (train.init_from_target)."""
    import torch

    from eagle_ray.train.init import init_state, published_d2t, target_init_state

    what = recipe.train.init_from_target
    if pub is None and what != "none":
        state, names = target_init_state(target_dir, arch, torch.tensor(vocab["d2t"]),
                                         recipe.train.seed, what)
        path, digest = _write_init_state(run, state)
        logger.info("train: starting from the target's weights (%s): %d tensors", what, len(names))
        return {**vocab, "init_from": {"target": str(target_dir), "what": what, "tensors": names,
                                       "state": path, "sha256": digest}}
    if pub is None:
        return vocab
    if recipe.train.init_vocab == "keep":
        vocab = {**vocab, "d2t": published_d2t(pub).tolist()}
    state, rows = init_state(pub, arch, torch.tensor(vocab["d2t"]), recipe.train.seed)
    path, digest = _write_init_state(run, state)
    logger.info("train: starting from %s (%s layout), draft vocabulary %s: %d lm_head rows "
                "carried, %d fresh", pub.path, pub.layout, recipe.train.init_vocab,
                rows["carried_rows"], rows["fresh_rows"])
    return {**vocab, "init_from": {"dir": str(pub.path.resolve()), "layout": pub.layout,
                                   "vocab": recipe.train.init_vocab, **rows,
                                   "state": path, "sha256": digest}}


def run_train(recipe: Recipe, store_dir: str | Path | None, run_dir: str | Path, *,
              conversations: str | Path | None = None) -> dict[str, Any]:
    """Train (or resume) the drafter; returns the last logged metrics. From a store, or online
    (store_dir None, `conversations` = a generate output): features straight from extractor
    actors, no store (train/online.py)."""
    from eagle_ray.common.outputs import check_output_dir
    from eagle_ray.store.lock import store_lock
    from eagle_ray.store.reader import check_store_whole, read_manifest

    run = check_output_dir(Path(run_dir).resolve(), "train")  # refused before anything is written
    if store_dir is None:
        if conversations is None:
            raise ValueError("train needs --store STORE (offline) or --conversations GEN_DIR (online)")
        return _train_online(recipe, conversations, run)
    read_manifest(store_dir)  # a clear error for a path that is not a store
    # Training trusts the store only when it is whole (structural verify: index vs shards,
    # sizes, duplicates, orphans; checksums are checked as samples are read), and holds it
    # shared so that no extract or repair changes it meanwhile.
    with store_lock(store_dir, exclusive=False, command="eagle-ray train"):
        check_store_whole(store_dir)
        return _train_on_whole_store(recipe, store_dir, run)


def _train_on_whole_store(recipe: Recipe, store_dir: str | Path, run: Path) -> dict[str, Any]:
    from eagle_ray.store.reader import HiddenStateStore
    from eagle_ray.train.data import check_enough_for_a_step, sample_lengths

    info = prepare_run(recipe, store_dir, run)
    _check_ids_in_store(store_dir, info)
    t = recipe.train
    check_enough_for_a_step(sample_lengths(HiddenStateStore(store_dir), info["train_ids"]),
                            tokens_per_batch=t.tokens_per_batch, seed=t.seed,
                            world=t.num_workers, accum=t.grad_accum)
    return fit_with_ray_train(recipe, run, info, {"store": info["store"]})


def prepare_run_online(recipe: Recipe, conversations: str | Path, run_dir: Path,
                       windows: dict) -> dict[str, Any]:
    """run.json of an online run: the split and draft vocabulary offline training would
    compute from a store extracted from these conversations (same ids, same loss tokens)."""
    import hashlib

    from eagle_ray.train.data import loss_token_counts

    from eagle_ray.extract.run import generation_provenance
    from eagle_ray.targets.identity import check_same_target

    path = run_dir / "run.json"
    conv = Path(conversations).resolve()
    conv_file = conv / "conversations.parquet" if conv.is_dir() else conv
    digest = hashlib.sha256(conv_file.read_bytes()).hexdigest()
    gen = (generation_provenance(conv_file.parent) or {}).get("target") or {}
    check_same_target(recipe, resolve_target_path(recipe.target),
                      {"path": gen.get("path"), "architecture": None,
                       "fingerprint": gen.get("fingerprint")},
                      f"the conversations {conv_file.parent} (generated by it)")
    if path.exists():
        info = json.loads(path.read_text())
        if info.get("conversations_sha256") != digest:
            raise ValueError(f"{run_dir} was started on other data; use a new --out run directory")
        return info
    target_dir = resolve_target_path(recipe.target)
    arch = drafter_arch(recipe, target_dir)
    from eagle_ray.extract.run import make_manifest

    # The identity of the features trained on, as a store extracted from these conversations
    # would record it (export writes it into the drafter's config; no store exists).
    manifest = make_manifest(recipe, target_dir, generation_provenance(conv_file.parent)).to_dict()
    pub, arch = _published(recipe, target_dir, arch, manifest)
    train_ids, val_ids = _split(windows, recipe.train.val_fraction)
    counts = loss_token_counts((windows[s][:2] for s in train_ids), arch.target_vocab_size)
    claim_output_dir(run_dir, "train")
    vocab = _run_vocab(recipe, run_dir, pub, arch, counts, target_dir)
    info = {"recipe": recipe.to_dict(), "arch": asdict(arch), "online": True, "store": None,
            "store_manifest": manifest,
            "conversations": str(conv_file), "conversations_sha256": digest,
            "target_dir": str(target_dir), "train_ids": train_ids, "val_ids": val_ids,
            **vocab, "provenance": provenance()}
    atomic_write_json(path, info)
    return info


def _train_online(recipe: Recipe, conversations: str | Path, run: Path) -> dict[str, Any]:
    import ray

    from eagle_ray.ops.cluster import init_ray
    from eagle_ray.extract.run import check_target_shape
    from eagle_ray.extract.stage import read_windows
    from eagle_ray.train import online
    from eagle_ray.train.data import check_enough_for_a_step

    windows = read_windows(conversations, recipe.data.max_seq_len)
    if not windows:
        raise ValueError(f"{conversations} holds no ok conversation to train on")
    info = prepare_run_online(recipe, conversations, run, windows)
    gone = [s for s in info["train_ids"] + info["val_ids"] if s not in windows]
    if gone:
        raise ValueError(f"{len(gone)} sample(s) this run trains on (e.g. {gone[0]}) are no longer "
                         f"in {conversations}; train into a new --out run directory")
    t = recipe.train
    check_enough_for_a_step([windows.length(s) for s in info["train_ids"]],
                            tokens_per_batch=t.tokens_per_batch, seed=t.seed,
                            world=t.num_workers, accum=t.grad_accum, what="the conversations'")
    model_dir = resolve_target_path(recipe.target)
    check_target_shape(recipe, model_dir)
    init_ray()
    online.check_placement(recipe, ray.nodes())
    spilled0 = online.spilled_bytes()
    depth = online.prefetch_depth(recipe)
    logger.info("online training: %d extractor replica(s) + %d trainer worker(s), %d step(s) "
                "prefetched per worker", recipe.extract.max_replicas, t.num_workers, depth)
    servers = online.start_servers(recipe, model_dir)
    try:
        metrics = fit_with_ray_train(recipe, run, info, {"online": {
            "servers": servers, "conversations": info["conversations"],
            "max_seq_len": recipe.data.max_seq_len, "depth": depth}})
    finally:
        online.stop_servers(servers)
    spilled1 = online.spilled_bytes()
    spilled = (spilled1 - spilled0) if spilled0 is not None and spilled1 is not None else None
    if spilled:
        logger.warning("online training: Ray spilled %d bytes of objects to disk; lower "
                       "train.online_bytes_in_flight or give the object store more memory", spilled)
    metrics = {**metrics, "online/spilled_bytes": spilled, "online/prefetch_depth": depth}
    atomic_write_json(run / "online.json", {"spilled_bytes": spilled, "prefetch_depth": depth,
                                            "extractor_replicas": recipe.extract.max_replicas})
    return metrics


def fit_with_ray_train(recipe: Recipe, run: Path, info: dict, data: dict) -> dict[str, Any]:
    """Ray Train over the run's data source (`data`: {"store": path} or {"online": {...}})."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from eagle_ray.common import logs
    from eagle_ray.common.errors import user_fault
    from eagle_ray.train.checkpoint import newest_loadable
    from eagle_ray.train.loop import WorkerConfig, loop_config, train_loop_per_worker

    t = recipe.train
    resume = newest_loadable(run)  # skips (with a warning) checkpoints that do not load
    resume_step = json.loads((resume / "state.json").read_text())["step"] if resume else None
    _truncate_metrics(run / "metrics.jsonl", resume_step)
    from eagle_ray.ops.cluster import init_ray

    init_ray()
    # Ray Train's state tracking (read by the trainer in this process): the dashboard's Train
    # page then lists the run, its workers and their state. Off by default in Ray 2.60; on
    # here when the cluster has a dashboard (its state actor polls the dashboard's API and
    # fills the log with connection errors without one).
    if _dashboard_url():
        os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")
    use_gpu = t.use_gpu and ray.cluster_resources().get("GPU", 0) >= t.num_workers
    if t.use_gpu and not use_gpu:
        raise ValueError(f"recipe {recipe.name} trains on {t.num_workers} GPU workers but the Ray "
                         f"cluster has {ray.cluster_resources().get('GPU', 0):g} GPUs; use "
                         "--set train.use_gpu=false (CPU, gloo) or add GPUs")
    cpus = ray.cluster_resources().get("CPU", 0)
    if t.num_workers * t.cpus_per_worker > cpus:
        # Ray Train would wait for the workers' CPUs, retrying its start every minute, silently.
        raise ValueError(f"recipe {recipe.name} trains on {t.num_workers} worker(s) x "
                         f"{t.cpus_per_worker:g} CPU = {t.num_workers * t.cpus_per_worker:g} CPUs "
                         f"but the Ray cluster has {cpus:g}; lower train.num_workers or "
                         "train.cpus_per_worker, or add CPUs")
    cfg = WorkerConfig(run_dir=str(run), **data, target_dir=info["target_dir"], arch=info["arch"],
                       d2t=info["d2t"], train_ids=info["train_ids"], val_ids=info["val_ids"],
                       resume_from=str(resume) if resume else None,
                       init_state=(info.get("init_from") or {}).get("state"),
                       train=t, use_gpu=use_gpu, ttt_steps=recipe.drafter.ttt_steps,
                       threads_per_worker=max(1, int(t.cpus_per_worker)))
    resources = {"CPU": t.cpus_per_worker} | ({"GPU": 1} if use_gpu else {})
    trainer = _trainer_class()(
        train_loop_per_worker, train_loop_config=loop_config(cfg),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=t.num_workers, use_gpu=use_gpu,
                                     resources_per_worker=resources),
        run_config=RunConfig(name="train", storage_path=str(run / "ray"),
                             failure_config=FailureConfig(max_failures=0),
                             # Ray Train's INFO (each report as a whole dict) to its files only
                             logging_config=ray.LoggingConfig(
                                 log_level="DEBUG" if logs.verbose() else "WARNING")))
    try:
        trainer.fit()
    except Exception as e:  # a store/checkpoint/disk fault inside a worker: raise it as itself
        fault = user_fault(e)
        if fault is None or fault is e:
            raise
        raise fault from e
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1]) if lines else {}


def _dashboard_url() -> str | None:
    try:
        import ray._private.worker

        return ray._private.worker.get_dashboard_url() or None  # noqa: SLF001 (no public getter; pinned Ray)
    except Exception:
        return None


def _trainer_class():
    """TorchTrainer without Ray Train 2.60's PlacementGroupCleaner.

    The cleaner (a detached actor) polls the state API for the controller and removes the
    run's placement group when the answer lacks it. On a loaded machine with no dashboard
    (tests, CI) the state API fails for a while and then answers without the controller
    actor: the cleaner decided a live controller was dead and removed the placement group of
    a running training, killing every worker mid-step (seen here at step 40 of 150). The run's
    placement group is owned by the job and removed when the job ends, which is the cleanup
    we rely on instead. Checked against ray==2.60.0 (`DataParallelTrainer._create_default_callbacks`).
    """
    from ray.train.torch import TorchTrainer

    class EagleRayTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            return [c for c in super()._create_default_callbacks()
                    if type(c).__name__ != "PlacementGroupCleanerCallback"]

    return EagleRayTrainer


def _check_ids_in_store(store_dir: str | Path, info: dict) -> None:
    """A resumed run trains on the ids in run.json: all must still be in the store."""
    from eagle_ray.store.reader import committed_ids

    import pyarrow as pa
    import pyarrow.compute as pc

    ids = pa.array(info["train_ids"] + info["val_ids"], pa.string())
    gone = ids.filter(pc.invert(pc.is_in(ids, value_set=committed_ids(store_dir)))).to_pylist()
    if gone:
        raise ValueError(f"{len(gone)} sample(s) this run trains on (e.g. {gone[0]}) are no longer "
                         f"in {store_dir}; re-run `eagle-ray extract` into it to restore them, or "
                         "train into a new --out run directory")


def _truncate_metrics(path: Path, step: int | None) -> None:
    """Resume: drop rows logged after the checkpoint (the killed run's), so none repeats."""
    if not path.exists():
        return
    rows = path.read_text().splitlines()
    keep = [r for r in rows if step is not None and _row_step(r) <= step]
    if len(keep) != len(rows):
        atomic_write_bytes(path, "".join(r + "\n" for r in keep).encode())


def _row_step(row: str) -> int:
    try:
        return int(json.loads(row)["step"])
    except (ValueError, KeyError, TypeError):  # a torn last line from a kill
        return 1 << 62
