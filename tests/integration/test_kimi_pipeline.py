"""The whole pipeline on the Kimi-K2.5 twin (`tiny_kimi_cpu`: the production Kimi recipe with
tiny numbers and CPU engine arguments): ingest -> generate -> extract (vLLM backend, through
the multimodal wrapper) -> train -> export -> check -> evaluate. The exported drafter must be
fed the trained features by vLLM (check), serve losslessly, and beat n-gram speculation
online. Layer-level equality of the captured features with transformers is in
test_kimi_twin.py."""

import os

import pytest

from eagle_ray.config import load_recipe

pytestmark = pytest.mark.integration

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


def test_whole_pipeline_on_the_kimi_twin(tmp_path, ray_cluster):
    from eagle_ray.pipeline import SAMPLE_DATA, run_end_to_end
    from eagle_ray.store.reader import HiddenStateStore

    r = load_recipe("tiny_kimi_cpu", ["train.max_steps=150", "train.eval_interval=150",
                                      "train.ckpt_interval=150", "train.cpus_per_worker=1"])
    assert r.extract.backend == "vllm"
    s = run_end_to_end(r, SAMPLE_DATA, tmp_path / "run")
    store = HiddenStateStore(tmp_path / "run" / "store")
    assert store.manifest.architecture == "KimiK25ForConditionalGeneration"
    assert s["store_verify"]["ok"] and s["store_verify"]["samples"] == len(store) > 0
    assert s["check"]["max_abs_diff"] < s["check"]["tolerance"]
    ev = s["evaluate"]
    al = {k: ev[k]["mean_acceptance_length"] for k in ("offline", "online", "untrained", "ngram")}
    print("kimi twin mean acceptance length:", {k: round(v, 3) for k, v in al.items()})
    assert ev["outputs_identical"]
    assert al["online"] > al["ngram"] + 1.0 and al["online"] > al["untrained"] + 1.0
