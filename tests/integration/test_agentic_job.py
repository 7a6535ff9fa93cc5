"""The user's agent sessions through the whole job (issue 31): the example gateway export
(examples/data/agentic.jsonl: tools, parallel calls, tool results, reasoning, legacy
function calls, broken records) ingested, kept as logged with every assistant turn in the
loss (data.train_turns=all), captured, trained, exported, checked and evaluated; the report
splits acceptance by what is drafted: tool calls or text."""

import json

import pytest

# make test-all: a whole job of its own (~5 min on 2 cores); CI checks the parts
# (tests/unit/data/test_agentic.py: accounting, rendering as vLLM does, masks, tool-call tokens).
pytestmark = [pytest.mark.integration, pytest.mark.long]

SETS = ["generate.mode=keep_logged", "data.train_turns=all", "data.max_seq_len=1000",
        "train.max_steps=150", "train.val_fraction=0.2", "evaluate.prompts=8"]


def test_agent_sessions_through_the_job_with_acceptance_on_tool_calls_and_text(ray_cluster, tmp_path):
    from pathlib import Path

    from eagle_ray.job.pipeline import run_end_to_end
    from eagle_ray.recipes import load_recipe

    data = Path(__file__).resolve().parents[2] / "examples" / "data" / "agentic.jsonl"
    out = tmp_path / "run"
    s = run_end_to_end(load_recipe("tiny_cpu", SETS), [f"{data}::agentic"], out)
    assert s["ingest"]["accepted"] == 37 and s["ingest"]["rejected"] == 6
    assert s["generate"]["generated"] == 37 and s["store_verify"]["ok"]
    assert s["check"]["ok"]
    ev = s["evaluate"]
    assert ev["outputs_identical"] is True
    kinds = ev["offline"]["per_turn_kind"]
    assert set(kinds) == {"tool_call", "text"} and all(k["num_drafts"] > 0 for k in kinds.values())
    print("agentic offline acceptance by kind:",
          {k: round(v["mean_acceptance_length"], 3) for k, v in kinds.items()})
    # Tool-call arguments are the predictable part (measured 4.60 vs text 3.38).
    assert kinds["tool_call"]["mean_acceptance_length"] > kinds["text"]["mean_acceptance_length"]
    report = (out / "evaluate" / "report.md").read_text()
    assert "## Tool calls vs text" in report
    rep = json.loads((out / "evaluate" / "report.json").read_text())
    # Long sessions that do not fit the engine with max_tokens to spare are skipped, counted.
    assert rep["prompts"] + rep["prompts_skipped_too_long"] <= 8 and rep["prompts"] > 0
