"""Storage-dtype reconstruction error on the tiny target (fp32 capture as the reference).

    .venv/bin/python bench/bench_fp8_error.py [--samples 64]

Extracts the same conversations (HF backend, no Ray) into fp32, bf16 and fp8_e4m3 stores
and prints the relative L2 error of the aux and final features and the worst per-token
error relative to that token's absmax.
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import pyarrow as pa


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from eagle_ray.recipes import load_recipe
    from eagle_ray.targets.resolve import resolve_target_path
    from eagle_ray.data.tokenize import tokenize_conversation
    from eagle_ray.extract.run import make_manifest
    from eagle_ray.extract.stage import ExtractUDF
    from eagle_ray.store.reader import HiddenStateStore
    from eagle_ray.targets.tiny import corpus

    model = resolve_target_path(load_recipe("tiny_cpu").target)
    tok = AutoTokenizer.from_pretrained(str(model))
    rows = {"sample_id": [], "source": [], "prompt_token_ids": [], "completion_token_ids": []}
    for i, conv in enumerate(corpus.conversations(args.samples, seed=77, max_turns=3)):
        t = tokenize_conversation(tok, conv, 4096)
        first = int(t.loss_mask.argmax())
        rows["sample_id"].append(f"x{i}")
        rows["source"].append("bench")
        rows["prompt_token_ids"].append(t.input_ids[:first].tolist())
        rows["completion_token_ids"].append(t.input_ids[t.loss_mask].tolist())
    table = pa.table(rows)
    root = Path(tempfile.mkdtemp(prefix="bench_fp8_"))
    stores = {}
    for dt in ("fp32", "bf16", "fp8_e4m3"):
        r = load_recipe("tiny_cpu", ["extract.backend=hf", f"storage.dtype={dt}"])
        udf = ExtractUDF(r, str(model), str(root / dt), make_manifest(r, model))
        for i in range(0, table.num_rows, 16):
            udf(table.slice(i, 16))
        stores[dt] = HiddenStateStore(root / dt)
    ref = stores["fp32"]
    print(f"\n{args.samples} samples from the tiny target (H=128), fp32 capture as reference\n")
    print(f"| {'dtype':<9} | {'rel. L2 aux':>11} | {'rel. L2 final':>13} | {'max err / token absmax':>22} |")
    print(f"|{'-' * 11}|{'-' * 13}|{'-' * 15}|{'-' * 24}|")
    for dt in ("bf16", "fp8_e4m3"):
        na = da = nf = df = 0.0
        worst = 0.0
        for sid in ref.sample_ids:
            a, b = ref.get(sid), stores[dt].get(sid)
            na += float(a["aux"].norm() ** 2)
            da += float((a["aux"] - b["aux"]).norm() ** 2)
            nf += float(a["final"].norm() ** 2)
            df += float((a["final"] - b["final"]).norm() ** 2)
            worst = max(worst, float(((a["aux"] - b["aux"]).abs()
                                      / a["aux"].abs().amax(-1, keepdim=True)).max()))
        print(f"| {dt:<9} | {(da / na) ** 0.5:>11.4f} | {(df / nf) ** 0.5:>13.4f} | {worst:>22.4f} |")
    shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
