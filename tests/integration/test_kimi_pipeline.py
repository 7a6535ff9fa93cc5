"""The whole pipeline on the Kimi-K2.5 twin (`tiny_kimi_cpu`: the production Kimi recipe with
tiny numbers and CPU engine arguments): ingest -> generate -> extract (vLLM backend, through
the multimodal wrapper) -> train -> export -> check -> evaluate. The exported drafter must be
fed the trained features by vLLM (check), serve losslessly, and beat n-gram speculation
online. Layer-level equality of the captured features with transformers is in
test_kimi_twin.py. The run itself is the session fixture `finished_run` (conftest.py), which
test_notebooks.py also reads."""

import pytest

pytestmark = pytest.mark.integration


def test_whole_pipeline_on_the_kimi_twin(finished_run):
    from eagle_ray.store.reader import HiddenStateStore

    run, s = finished_run
    assert s["recipe"]["name"] == "tiny_kimi_cpu"
    assert s["recipe"]["extract"]["backend"] == "vllm"
    store = HiddenStateStore(run / "store")
    assert store.manifest.architecture == "KimiK25ForConditionalGeneration"
    assert s["store_verify"]["ok"] and s["store_verify"]["samples"] == len(store) > 0
    assert s["check"]["max_abs_diff"] < s["check"]["tolerance"]
    ev = s["evaluate"]
    al = {k: ev[k]["mean_acceptance_length"] for k in ("offline", "online", "untrained", "ngram")}
    print("kimi twin mean acceptance length:", {k: round(v, 3) for k, v in al.items()})
    assert ev["outputs_identical"]
    assert al["online"] > al["ngram"] + 1.0 and al["online"] > al["untrained"] + 1.0
