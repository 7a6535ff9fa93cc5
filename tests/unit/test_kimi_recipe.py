"""tiny_kimi_cpu is kimi_k25_8gpu with only numbers, paths and CPU-only engine arguments
changed; engine arguments reach vLLM; the CPU vLLM plugin is installed and does its job."""

import dataclasses
import sys
import types

import pytest

from eagle_ray.config import apply_overrides
from eagle_ray.recipes import load_recipe

# Fields that are not numbers but may differ between the twin's recipe and the real one.
PATHS = {"name", "target.path", "storage.out_dir",
         "target.remote_code"}  # what custom code the checkpoint ships: the twin ships none
CPU_ONLY = {"engine.dtype", "engine.enforce_eager", "engine.kv_cache_memory_bytes",
            "engine.attention_backend", "engine.custom_ops", "train.use_gpu", "train.bf16"}


def _flat(recipe) -> dict:
    out = {}
    for sec, val in dataclasses.asdict(recipe).items():
        if isinstance(val, dict):
            out.update({f"{sec}.{k}": v for k, v in val.items()})
        else:
            out[sec] = val
    return out


def _is_number(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def disallowed_differences(cpu, gpu) -> dict:
    a, b = _flat(cpu), _flat(gpu)
    return {k: (a[k], b[k]) for k in a if a[k] != b[k]
            and not (_is_number(a[k]) and _is_number(b[k]))
            and k not in PATHS | CPU_ONLY}


def test_twin_recipe_differs_only_in_numbers_paths_and_cpu_args():
    cpu, gpu = load_recipe("tiny_kimi_cpu"), load_recipe("kimi_k25_8gpu")
    assert disallowed_differences(cpu, gpu) == {}
    # The production path is the same: same architecture, backend, generation mode, and the
    # text-only engine on both.
    assert cpu.target.architecture == gpu.target.architecture == "KimiK25ForConditionalGeneration"
    assert cpu.extract.backend == gpu.extract.backend and cpu.generate.mode == gpu.generate.mode
    assert cpu.engine.language_model_only and gpu.engine.language_model_only
    # The comparison can fail: a structural change in either recipe is reported.
    for bad in (apply_overrides(cpu, ["target.architecture=DeepseekV3ForCausalLM"]),
                apply_overrides(cpu, ["extract.placement=separate", "extract.backend=hf"]),
                apply_overrides(cpu, ["extract.placement=separate"]),
                apply_overrides(cpu, ["engine.language_model_only=false"])):
        assert disallowed_differences(bad, gpu), bad


def test_engine_kwargs_carry_the_architecture_args():
    from eagle_ray.vllm.engine import engine_kwargs

    cpu = engine_kwargs(load_recipe("tiny_kimi_cpu"), "/m")
    assert cpu["language_model_only"] is True and cpu["attention_backend"] == "CPU_MLA"
    assert "compilation_config" not in cpu  # the twin's yarn rope runs in torch on the CPU
    gpu = engine_kwargs(load_recipe("kimi_k25_8gpu"), "/m")
    assert gpu["language_model_only"] is True
    assert "attention_backend" not in gpu and "compilation_config" not in gpu  # CPU args only
    tiny = engine_kwargs(load_recipe("tiny_cpu", ["engine.custom_ops=all,-rotary_embedding"]), "/m")
    assert tiny["compilation_config"] == {"custom_ops": ["all", "-rotary_embedding"]}
    assert "language_model_only" not in engine_kwargs(load_recipe("tiny_cpu"), "/m")
    with pytest.raises(ValueError, match="custom_ops"):
        load_recipe("tiny_cpu", ["engine.custom_ops=rotary_embedding"])


def test_tiny_kimi_alias_resolves_to_the_twin(monkeypatch, tmp_path):
    import eagle_ray.targets.tiny.kimi as kimi
    from eagle_ray.targets.resolve import resolve_target_path

    monkeypatch.setattr(kimi, "ensure_tiny_kimi", lambda: tmp_path / "twin")
    assert resolve_target_path(load_recipe("tiny_kimi_cpu").target) == tmp_path / "twin"


def test_checkpoint_names_split_fused_experts():
    import torch

    from eagle_ray.targets.tiny.kimi import to_checkpoint_state

    gu = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)  # [E, 2I, H], I = 3
    down = torch.arange(2 * 3 * 3, dtype=torch.float32).reshape(2, 3, 3)
    out = to_checkpoint_state({"model.layers.1.mlp.experts.gate_up_proj": gu,
                               "model.layers.1.mlp.experts.down_proj": down,
                               "lm_head.weight": torch.ones(4, 3)})
    p = "language_model.model.layers.1.mlp.experts."
    assert torch.equal(out[p + "1.gate_proj.weight"], gu[1, :3])  # gate rows first
    assert torch.equal(out[p + "1.up_proj.weight"], gu[1, 3:])
    assert torch.equal(out[p + "0.down_proj.weight"], down[0])
    assert set(out) == {f"{p}{e}.{w}_proj.weight" for e in (0, 1) for w in ("gate", "up", "down")} | {
        "language_model.lm_head.weight"}


# --------------------------------------------------------------------------- vLLM plugin


def test_plugin_entry_point_is_installed():
    """vLLM finds the plugin only through the installed entry point (pip install -e .)."""
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("eagle_ray_cpu_fixes") == "eagle_ray.vllm.plugin:register", (
        "reinstall the package (pip install --no-deps -e .) to register the vLLM plugin")


class _AnswersEverything:
    """Like llvmlite's ffi.lib: every attribute, __dict__ included, is some other object."""

    __slots__ = ()

    def __getattr__(self, name):
        return object()


def _fake_module(**attrs):
    mod = types.ModuleType("eagle_ray_test_fake_kernels")
    mod.__dict__.update(attrs)
    return mod


def test_tolerant_rebind_kernels(monkeypatch):
    from eagle_ray.vllm.plugin import _tolerant_rebind_kernels

    kernel, wrapper = object(), object()

    class Owner:  # a JIT warmup owner holding the kernel
        def __init__(self):
            self.kernel = kernel
            self._kernel_arg_names = ("a",)

    owner = Owner()
    mod = _fake_module(copied_kernel=kernel, owner=owner, lib=_AnswersEverything())
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    with pytest.raises(AttributeError, match="get"):  # vLLM's own scan trips over it
        _upstream()([(kernel, wrapper)])
    mod.copied_kernel, owner.kernel = kernel, kernel
    _tolerant_rebind_kernels([(kernel, wrapper)])
    assert mod.copied_kernel is wrapper and owner.kernel is wrapper
    assert "_kernel_arg_names" not in owner.__dict__


def _upstream():
    """vLLM's unpatched _rebind_kernels (the plugin may already have replaced the attribute)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm.triton_utils.dispatcher")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    return fresh._rebind_kernels


def test_register_on_cpu_installs_the_fixes(monkeypatch):
    from vllm.triton_utils import dispatcher
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from eagle_ray.vllm import plugin as vllm_plugin

    from vllm.v1.attention.backend import MultipleOf

    monkeypatch.setattr(dispatcher, "_rebind_kernels", _upstream())
    monkeypatch.setattr(CPUAttentionBackend, "get_supported_kernel_block_sizes",
                        staticmethod(lambda kv_cache_spec=None: [MultipleOf(32)]))  # as shipped
    vllm_plugin.register()
    assert dispatcher._rebind_kernels is vllm_plugin._tolerant_rebind_kernels
    (size,) = CPUAttentionBackend.get_supported_kernel_block_sizes()
    assert size.base == 16


def test_the_serve_line_carries_kimis_tool_and_reasoning_parsers(tmp_path):
    """Kimi-K2.5 is served as an agent: the export's `vllm serve` line names vLLM's kimi_k2
    tool and reasoning parsers (the twin inherits them); the tiny Llama's Hermes-style
    template gets the hermes parser and no reasoning parser."""
    from eagle_ray.export.drafter import serving_recommendation

    kimi = "--enable-auto-tool-choice --tool-call-parser kimi_k2 --reasoning-parser kimi_k2"
    for name, tail in (("kimi_k25_8gpu", kimi), ("tiny_kimi_cpu", kimi),
                       ("tiny_cpu", "--enable-auto-tool-choice --tool-call-parser hermes")):
        info = {"recipe": dataclasses.asdict(load_recipe(name))}
        cmd = serving_recommendation(info, tmp_path / "drafter")["command"]
        assert cmd.startswith("vllm serve ") and cmd.endswith(tail), cmd
        assert "--speculative-config" in cmd
