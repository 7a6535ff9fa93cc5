"""The CLI end to end: bad input gives a clear message or a reject row, never a traceback."""

import json
import subprocess
import sys

import polars as pl
import pytest


def run(*args, cwd=None):
    p = subprocess.run([sys.executable, "-m", "eagle_ray.cli", *args], capture_output=True,
                       text=True, cwd=cwd, timeout=300)
    assert "Traceback" not in p.stderr, p.stderr
    return p


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    good = [{"messages": [{"role": "user", "content": f"Tell me about the fox number {i}."},
                          {"role": "assistant", "content": "The fox lives in the forest."}]}
            for i in range(20)]
    lines = [json.dumps(g).encode() for g in good]
    lines += [b"{not json", b"[1, 2]", json.dumps({"messages": "hi"}).encode(),
              json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(),
              json.dumps({"messages": [{"role": "user", "content": ""}]}).encode(),
              b'{"prompt": "caf\xe9"}', b"", lines[0]]
    (d / "mine.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (d / "empty.jsonl").write_bytes(b"")
    return d


def test_ingest_counts_add_up_and_rejects_have_reasons(bad_inputs, tmp_path, tiny_target_dir):
    out = tmp_path / "out"
    p = run("ingest", "--input", str(bad_inputs / "mine.jsonl"), "--input",
            str(bad_inputs / "empty.jsonl"), "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "accepted 20 + duplicates 1 + rejected 7 + sampled out 0 = lines read 28" in p.stdout
    rejects = [json.loads(l) for l in (out / "rejects.jsonl").read_text().splitlines()]
    assert sorted(r["reason"] for r in rejects) == sorted(
        ["invalid_json", "not_an_object", "bad_type", "unknown_role", "empty_content",
         "invalid_utf8", "blank_line"])
    assert all(r["source"] == "mine" and r["line"] > 20 for r in rejects)
    assert "empty" in p.stderr  # the empty file is reported, not fatal
    df = pl.read_parquet(out / "prompts.parquet")
    assert df.height == 20 and df["sample_id"].n_unique() == 20
    assert (df["num_loss_tokens"] > 0).all() and (df["num_tokens"] > df["num_loss_tokens"]).all()
    # stats and plan read it back
    s = run("stats", str(out), "--json")
    assert s.returncode == 0 and json.loads(s.stdout)["overall"]["samples"] == 20
    pl_ = run("plan", "--stats", str(out), "--out", str(tmp_path), "--json")
    plan = json.loads(pl_.stdout)
    assert pl_.returncode == 0 and plan["fits"] and plan["hidden_bytes_per_token"] == 1024
    assert plan["num_samples"] == 20 and plan["total_tokens"] == int(df["num_tokens"].sum())


@pytest.mark.parametrize("args,needle", [
    (["ingest", "--input", "/nonexistent/x.jsonl", "--out", "OUT"], "/nonexistent/x.jsonl"),
    (["ingest", "--input", "x.jsonl:1.5", "--out", "OUT"], "count instead"),
    (["plan", "--recipe", "nope"], "known recipes"),
    (["plan", "--recipe", "kimi_k25_8gpu"], "--set data.num_samples"),
    (["plan", "--set", "storage.dtype=int3"], "choose one of"),
    (["stats", "/nonexistent"], "does not exist"),
])
def test_user_errors_exit_2_with_a_message(args, needle, tmp_path):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    p = run(*args)
    assert p.returncode == 2 and needle in p.stderr, p.stderr
    assert not (tmp_path / "out").exists()  # nothing written on a refused start


def test_plan_kimi_prints_57344_and_refuses_when_too_big(tmp_path):
    p = run("plan", "--recipe", "kimi_k25_8gpu", "--set", "data.num_samples=1000000",
            "--set", "data.avg_tokens_per_sample=8000", "--out", str(tmp_path))
    assert "hidden bytes / token    57,344" in p.stdout
    assert p.returncode == 3 and "NO, short by" in p.stdout and "alternative" in p.stdout
