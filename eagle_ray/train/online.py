"""Online training: the target's features go from extractor actors through Ray's object store
straight into the Ray Train workers; no hidden state is written to disk.

    generate/conversations.parquet (token ids only) ─▶ every worker: its batch plan
    worker, step s ─ features.remote(token ids of its micro-batches) ─▶ FeatureServer actors
                    (the target's prefill, as `eagle-ray extract` runs it: same backend,
                     same window, features encoded in storage.dtype, as a store holds them)
                  ◀─ object refs (object store) ── decoded, collated, trained on

Why actors the workers call, and not Ray Data's `get_dataset_shard`: a streaming split hands
blocks to whichever worker asks first, so which samples a rank trains on, and in what order,
would depend on timing. Here every rank computes the same batch plan as offline training
(`RankBatches`: the same samples, the same micro-batches, the same steps) and asks for
exactly its micro-batches, a few steps ahead. Consequences:
  - the data position is the offline one, (epoch, step): a resumed run re-extracts the
    batches from the checkpoint's step on, and no sample is trained twice in an epoch;
  - every epoch extracts again (nothing is kept but the small validation set, in memory);
  - bytes in flight are bounded: at most `depth` steps requested ahead plus one queued
    (depth from train.online_bytes_in_flight), so the object store holds O(depth) steps'
    features, never the data set; spilling would be a store by the back door, and the driver
    reports any (run.json "online" -> spilled_bytes).
Same model code, loss, checkpoints and metrics as offline (train/loop.py); only where a
micro-batch's features come from differs.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from pathlib import Path
from typing import Any, Sequence

from eagle_ray.train.data import Prefetcher

logger = logging.getLogger(__name__)


class FeatureServer:
    """Ray actor: the target loaded once (the recipe's extraction backend); returns the
    features of token sequences encoded as a store would hold them."""

    def __init__(self, recipe, model_path: str):
        from eagle_ray.extract.stage import make_backend

        self.backend = make_backend(recipe, model_path)
        self.dtype = recipe.storage.dtype
        self.n_aux = len(recipe.target.resolved_aux_layer_ids)

    def ready(self) -> bool:
        return True

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    def features(self, sequences: list[list[int]]) -> list[dict]:
        from eagle_ray.ops.metrics import InFlight, record
        from eagle_ray.store.writer import encode

        with InFlight("extract"):
            feats = self.backend.capture(sequences)
            out = [encode(aux, final, self.dtype, self.n_aux) for aux, final in feats]
        record("eagle_ray_tokens_committed", sum(len(s) for s in sequences), stage="online")
        record("eagle_ray_samples_committed", len(sequences), stage="online")
        return out


def start_servers(recipe, model_dir: Path, timeout_s: float = 900.0) -> list:
    """extract.max_replicas FeatureServer actors (named `online-extractor-N:<job>` in the
    eagle_ray namespace), started and loaded before training starts."""
    import ray

    from eagle_ray.ops.control import NAMESPACE, job_key
    from eagle_ray.vllm.engine import ENGINE_ENV, replica_memory_bytes

    e, tp = recipe.extract, recipe.target.tensor_parallel_size
    gpus = 1 if e.gpus_per_replica > 0 and tp == 1 else 0  # TP > 1: vLLM's executor places them
    cls = ray.remote(FeatureServer)
    key = job_key()
    servers = [cls.options(name=f"online-extractor-{i}:{key}", namespace=NAMESPACE,
                           num_cpus=e.num_cpus_per_replica, num_gpus=gpus, max_restarts=0,
                           memory=replica_memory_bytes(recipe, e.gpus_per_replica, model_dir),
                           runtime_env={"env_vars": ENGINE_ENV}).remote(recipe, str(model_dir))
               for i in range(e.max_replicas)]
    try:
        ray.get([s.ready.remote() for s in servers], timeout=timeout_s)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: Sequence) -> None:
    import ray

    try:  # let each engine shut down and remove its transfer directory, then end them
        ray.get([s.close.remote() for s in servers], timeout=60)
    except Exception as e:
        logger.debug("extractor close: %r", e)
    for s in servers:
        try:
            ray.kill(s)
        except Exception:
            pass


def check_placement(recipe, nodes: list[dict]) -> None:
    """Refuse, naming what is missing, when extractors and trainers cannot run at once.
    `nodes`: `ray.nodes()` entries (alive ones count)."""
    t, e = recipe.train, recipe.extract
    tp = recipe.target.tensor_parallel_size
    alive = [n for n in nodes if n.get("Alive", n.get("alive", True))]
    gpus_per_node = [int(n.get("Resources", {}).get("GPU", 0)) for n in alive]
    cpus = sum(float(n.get("Resources", {}).get("CPU", 0)) for n in alive)
    need_cpus = e.max_replicas * e.num_cpus_per_replica + t.num_workers * t.cpus_per_worker
    if need_cpus > cpus:
        raise ValueError(
            f"online training runs {e.max_replicas} extractor(s) x {e.num_cpus_per_replica:g} CPU "
            f"and {t.num_workers} trainer(s) x {t.cpus_per_worker:g} CPU at once: {need_cpus:g} "
            f"CPUs, the cluster has {cpus:g}. Lower extract.max_replicas, "
            "extract.num_cpus_per_replica or train.cpus_per_worker")
    if not t.use_gpu and e.gpus_per_replica == 0:
        return
    ext_gpus = e.max_replicas * (tp if e.gpus_per_replica > 0 else 0)
    train_gpus = t.num_workers if t.use_gpu else 0
    if tp > 1 and e.gpus_per_replica > 0 and train_gpus:
        # A TP group lives on one node; if it fills that node, the trainers need other nodes.
        fitting = [g for g in gpus_per_node if g >= tp]
        if not fitting:
            raise ValueError(f"online training with {recipe.name}: the target needs a node with "
                             f"{tp} GPUs (TP={tp}); the cluster's nodes have {gpus_per_node} GPUs")
        spare = sum(gpus_per_node) - tp * e.max_replicas
        if max(gpus_per_node) <= tp and spare < train_gpus:
            raise ValueError(
                f"online training with {recipe.name} needs a second node: the target takes all "
                f"{tp} GPUs of a node (TP={tp}) for the extractor, and the {train_gpus} trainer "
                f"workers need {train_gpus} more GPUs on other nodes (the cluster has "
                f"{len(alive)} node(s) with {gpus_per_node} GPUs). Add a GPU worker node "
                "(cluster.yaml: worker_8gpu), or train offline from a store "
                "(eagle-ray extract, then eagle-ray train --store)")
    total = sum(gpus_per_node)
    if ext_gpus + train_gpus > total:
        raise ValueError(
            f"online training with {recipe.name} runs {e.max_replicas} extractor replica(s) "
            f"x {tp if e.gpus_per_replica else 0} GPU(s) and {train_gpus} trainer GPU(s) at once: "
            f"{ext_gpus + train_gpus} GPUs, the cluster has {total}. Lower extract.max_replicas "
            "or train.num_workers (e.g. 4 + 4 on one 8-GPU node)")


def prefetch_depth(recipe) -> int:
    """Steps requested ahead so that about train.online_bytes_in_flight bytes of features are
    in flight per worker (at least 1)."""
    from eagle_ray.plan.budget import hidden_bytes_per_token

    t = recipe.train
    per_step = t.tokens_per_batch * t.grad_accum * hidden_bytes_per_token(recipe.target,
                                                                          recipe.storage.dtype)
    return max(1, min(8, t.online_bytes_in_flight // max(1, per_step) - 1))


class OnlineBatches(Prefetcher):
    """Worker side: the micro-batches of steps [start, rb.steps) of one rank, requested from
    the FeatureServers `depth` steps ahead; iterated (and its data wait timed) as the
    store's Prefetcher."""

    def __init__(self, rb, start_step: int, servers: Sequence, windows: dict, depth: int):
        self.q: queue.Queue = queue.Queue(maxsize=1)
        self.wait_s = 0.0
        self.rb, self.servers, self.windows, self.depth = rb, list(servers), windows, depth
        self._t = threading.Thread(target=self._run, args=(start_step,), daemon=True)
        self._t.start()

    def _submit(self, step: int):
        rb = self.rb
        refs = []
        for k, mb in enumerate(rb.micro_batches(step)):
            g = step * rb.world * rb.accum + rb.rank * rb.accum + k  # spreads ranks over servers
            server = self.servers[g % len(self.servers)]
            refs.append((mb, server.features.remote([self.windows[s][0] for s in mb])))
        return step, refs

    def _collect(self, item):
        import ray

        step, refs = item
        return step, [batch_from_features(mb, ray.get(ref), self.windows) for mb, ref in refs]

    def _run(self, start: int) -> None:
        try:
            inflight: collections.deque = collections.deque()
            for step in range(start, self.rb.steps):
                inflight.append(self._submit(step))
                if len(inflight) >= self.depth:
                    self.q.put(self._collect(inflight.popleft()))
            while inflight:
                self.q.put(self._collect(inflight.popleft()))
        except BaseException as e:  # a dead extractor stops training with its error
            self.q.put(e)
            return
        self.q.put(None)



def batch_from_features(ids: Sequence[str], encoded: list[dict], windows: dict) -> dict[str, Any]:
    """Collated batch of micro-batch `ids` from the servers' encoded features."""
    from eagle_ray.extract.stage import decode_window
    from eagle_ray.store.batch import collate_samples

    return collate_samples([decode_window(sid, enc, windows) for sid, enc in zip(ids, encoded)])


def spilled_bytes() -> int | None:
    """Bytes Ray has spilled from the object store to disk in this cluster session."""
    try:
        import ray
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
        return int(reply.store_stats.spilled_bytes_total)
    except Exception as e:
        logger.debug("spilled bytes unavailable: %r", e)
        return None
