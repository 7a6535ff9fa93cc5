"""The tiny local target: a seeded Llama-architecture causal LM built in seconds on the CPU.

`build_tiny_target(out_dir)` trains a byte-level BPE tokenizer on the shipped corpus
(`eagle_ray.targets.tiny.corpus`), then trains a small Llama briefly on chat-formatted corpus
conversations so its greedy continuations are real sentences (random weights repeat one
token). The result is an ordinary HF directory (config.json, model.safetensors,
tokenizer.json, chat template) that AutoTokenizer, AutoModelForCausalLM and vLLM load.

`ensure_tiny_target()` builds it once into the cache (atomically, under a file lock) and is
what the `tiny_cpu` recipe resolves "tiny" to.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# Bump when anything below changes what gets built, so caches rebuild.
TINY_VERSION = 2  # 2: the chat template renders tools, tool calls and tool results

# head_dim = 128 / 4 = 32: vLLM's CPU attention needs head_dim >= 32.
# 8 layers so the default aux layers (2, L//2, L-3) = (2, 4, 5) are distinct.
TINY_ARCH = dict(hidden_size=128, num_layers=8, vocab_size=1024, num_attention_heads=4,
                 intermediate_size=256)
TINY_MAX_POSITIONS = 1024

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# System/user/assistant turns; the final assistant turn carries its reasoning in a
# <think> block (earlier turns drop it, as reasoning chat templates do). Written without
# newlines inside control blocks so whitespace is exact.
#
# Tools in the Hermes / Qwen style of ChatML tool-use templates: the request's tools in the
# system turn (after its own system prompt), each call as <tool_call>{"name", "arguments"}
# </tool_call> after the turn's text, each result as a `tool` turn in <tool_response>. A
# conversation without tools renders exactly as it did before tools were added (v1).
def turns_template(tool_declaration: str, tool_call: str, tool_result: str, *,
                   system_in_declaration: bool = True) -> str:
    """ChatML turns with the given jinja pieces for tools; shared by both tiny targets, so
    text renders identically in both and only the tool syntax differs.
    `system_in_declaration`: the system prompt is printed inside the tool declaration turn
    (then its own turn is skipped)."""
    merge = "tools and messages and messages[0]['role'] == 'system'" if system_in_declaration else "false"
    return (
        "{%- set sys_in_tools = " + merge + " -%}"
        "{%- if tools -%}" + tool_declaration + "{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if not (sys_in_tools and loop.first) -%}"
        "{%- if message['role'] == 'tool' -%}" + tool_result + "{%- else -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['role'] == 'assistant' and loop.last and message.get('reasoning_content') -%}"
        "{{ '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n' }}"
        "{%- endif -%}"
        "{{ message['content'] or '' }}"
        "{%- if message.get('tool_calls') -%}" + tool_call + "{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


CHAT_TEMPLATE = turns_template(
    tool_declaration=(
        "{{ '<|im_start|>system\\n' }}"
        "{%- if sys_in_tools -%}{{ messages[0]['content'] + '\\n\\n' }}{%- endif -%}"
        "{{ '# Tools\\n\\nYou may call one or more functions. Function signatures:\\n<tools>' }}"
        "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}"
        "{{ '\\n</tools><|im_end|>\\n' }}"),
    tool_call=(
        "{%- for tc in message['tool_calls'] -%}"
        "{%- if message['content'] or not loop.first -%}{{ '\\n' }}{%- endif -%}"
        "{{ '<tool_call>\\n' + ({'name': tc['function']['name'], 'arguments': tc['function']['arguments']}"
        " | tojson) + '\\n</tool_call>' }}"
        "{%- endfor -%}"),
    tool_result=(
        "{{ '<|im_start|>tool\\n<tool_response>\\n' + (message['content'] or '') "
        "+ '\\n</tool_response><|im_end|>\\n' }}"),
)


def _train_tokenizer(texts: list[str]):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [PAD, IM_START, IM_END]
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_ARCH["vocab_size"] - 2,  # room for the two <think> tokens
        special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # Not "special": vLLM's detokenizer keeps them in the text, so reasoning is visible.
    tok.add_tokens([AddedToken(THINK_OPEN, normalized=False, special=False),
                    AddedToken(THINK_CLOSE, normalized=False, special=False)])
    return tok


def _hf_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD,
                                 bos_token=None, unk_token=None)
    hf.chat_template = CHAT_TEMPLATE
    hf.model_max_length = TINY_MAX_POSITIONS
    return hf


def train_briefly(model, data, gen, *, train_steps: int, batch_size: int, seq_len: int,
                  label: str) -> float:
    """Causal-LM training on random windows of one packed token stream (AdamW, one-cycle
    schedule), enough for non-degenerate greedy text. Deterministic given `gen`. Returns the
    last loss; leaves the model in eval mode. Shared by both tiny targets."""
    import torch

    n_windows = (len(data) - 1) // seq_len
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=train_steps,
                                                pct_start=0.1)
    model.train()
    loss_val = float("nan")
    for step in range(train_steps):
        starts = torch.randint(0, n_windows, (batch_size,), generator=gen) * seq_len
        batch = torch.stack([data[s:s + seq_len] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_val = loss.item()
        if step % 50 == 0 or step == train_steps - 1:
            logger.info("%s: step %d/%d loss %.3f", label, step + 1, train_steps, loss_val)
    model.eval()
    return loss_val


def build_tiny_target(out_dir: str | Path, *, seed: int = 0, train_steps: int = 160,
                      batch_size: int = 16, seq_len: int = 128) -> dict:
    """Build the tiny target into out_dir (must not exist or be empty). Returns build stats."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle_ray.targets.tiny import corpus

    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)

    convs = corpus.conversations(4000, seed=seed)
    tok = _train_tokenizer(corpus.plain_text(4000, seed=seed + 1) + [
        m["content"] for c in convs[:1000] for m in c])
    hf_tok = _hf_tokenizer(tok)
    assert len(hf_tok) <= TINY_ARCH["vocab_size"], len(hf_tok)

    config = LlamaConfig(
        vocab_size=TINY_ARCH["vocab_size"], hidden_size=TINY_ARCH["hidden_size"],
        intermediate_size=TINY_ARCH["intermediate_size"],
        num_hidden_layers=TINY_ARCH["num_layers"],
        num_attention_heads=TINY_ARCH["num_attention_heads"],
        num_key_value_heads=TINY_ARCH["num_attention_heads"],
        max_position_embeddings=TINY_MAX_POSITIONS, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=hf_tok.convert_tokens_to_ids(IM_END),
        pad_token_id=hf_tok.convert_tokens_to_ids(PAD), torch_dtype="float32")
    model = LlamaForCausalLM(config)

    # Pack chat-formatted conversations into one token stream, then train on windows.
    texts = hf_tok.apply_chat_template(convs, tokenize=False)
    stream = [i for ids in hf_tok(texts, add_special_tokens=False)["input_ids"] for i in ids]
    data = torch.tensor(stream, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    loss_val = train_briefly(model, data, gen, train_steps=train_steps, batch_size=batch_size,
                             seq_len=seq_len, label="tiny target")

    model.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)
    # Keep the template in tokenizer_config.json too (older loaders read it from there).
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    tc_path.write_text(json.dumps(tc, indent=2))
    stats = {"version": TINY_VERSION, "seed": seed, "train_steps": train_steps,
             "final_loss": loss_val, "tokens_in_corpus": len(stream),
             "num_parameters": sum(p.numel() for p in model.parameters()),
             "build_seconds": round(time.time() - t0, 2)}
    (out / "eagle_ray_tiny.json").write_text(json.dumps(stats, indent=2))
    return stats


def ensure_tiny_target(cache_dir: str | Path | None = None) -> Path:
    """The cached tiny target directory, built on first use (safe across processes)."""
    return ensure_built("tiny-target", TINY_VERSION, build_tiny_target, cache_dir)


def default_cache_dir() -> Path:
    """Where built artifacts (the tiny targets) live: $EAGLE_RAY_CACHE or ~/.cache/eagle_ray.
    (Here, not in eagle_ray.config: the tiny package never imports the config; the config
    imports the tiny targets' numbers.)"""
    env = os.environ.get("EAGLE_RAY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "eagle_ray"


def ensure_built(name: str, version: int, build, cache_dir: str | Path | None = None) -> Path:
    """CACHE/<name>-v<version>, built once by `build(tmp_dir)` (used for both tiny targets).

    Safe across processes: builders take a file lock (a second process waits, then finds it
    built), build into a temporary directory and rename it into place, so a directory with
    the eagle_ray_tiny.json marker is always complete. A version bump builds a new directory.
    """
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / f"{name}-v{version}"
    if (final / "eagle_ray_tiny.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}-v{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits, then finds it built
        if (final / "eagle_ray_tiny.json").exists():
            return final
        tmp = root / f".{name}-v{version}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        logger.info("building %s into %s (first use; ~1 min)", name, final)
        build(tmp)
        shutil.rmtree(final, ignore_errors=True)  # a stale partial dir without the marker
        os.replace(tmp, final)
    return final
