"""The EAGLE-3 draft model (one Llama decoder layer) and its training-time-test (TTT) loss.

Structure mirrors vLLM's ``Eagle3LlamaForCausalLM`` (``vllm/model_executor/models/
llama_eagle3.py``) so exported weights load there unchanged:

    g        = fc(aux)                                   aux = [a_l1 ; a_l2 ; a_l3]  (3H -> H)
    residual = g                                         (vLLM default: norm AFTER residual)
    x        = [input_layernorm(emb) ; hidden_norm(g)]   (2H: q/k/v_proj take 2H inputs)
    residual = self_attn(x) + residual
    h_pre    = mlp(post_attention_layernorm(residual)) + residual
    logits   = lm_head(norm(h_pre))                      (H -> draft vocab N)
    next hidden input (TTT step j+1 / vLLM draft step j+1) = h_pre  (BEFORE the final norm:
             vLLM returns ``hidden_prenorm`` as the aux output that it feeds back)

Parameter names (= export names): ``fc.weight``, ``midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``, buffers
``d2t`` [N] int64 and ``t2d`` [V] bool. vLLM maps ``midlayer.`` -> ``layers.0.``, stacks
q/k/v and gate/up, renames ``d2t`` -> ``draft_id_to_target_id`` and skips ``t2d``.
The target's embedding and lm_head are NON-persistent buffers: not parameters (the optimizer
never sees them), not in ``state_dict()``, not exported. vLLM shares the target's
``embed_tokens`` when the drafter checkpoint has none (``_maybe_share_embeddings``); the
drafter has its own ``lm_head`` over the draft vocab.

Data alignment (per sample, T positions; p = target position)
-------------------------------------------------------------

    p              :  0     1     2     3     4    ...  T-1
    input_ids      :  x0    x1    x2    x3    x4        x_{T-1}
    aux  (target)  :  a0    a1    a2    a3    a4        a_{T-1}     a_p = features at p
    final (target) :  f0    f1    f2    f3    f4        f_{T-1}     W f_p -> logits of x_{p+1}

The drafter has one COLUMN per target position t. At TTT step j, column t:

    hidden input   : step 0: g_t = fc(a_t);  step j>0: h_pre of step j-1 at column t
    token input    : emb(x_{t+1+j})          (ground truth, shifted by 1+j)
    rope position  : t + j
    predicts       : x_{t+2+j}
    teacher        : softmax over the draft vocab of (W f_{t+1+j})[draft ids]
    valid iff      : t+2+j < T  and  loss_mask[t+2+j]  and  attention_mask[t+2+j]

    e.g. column t=1:   step 0: [g_1 ; x2] @pos1 -> x3 (f2)   step 1: [h^0_1 ; x3] @pos2 -> x4 (f3)

This is what vLLM does at inference: the first draft pass feeds (target hidden at t, token
t+1) at the TARGET position t, and each further draft step advances positions by 1 while
feeding the drafter's own pre-norm output back as the hidden input. Training feeds the
ground-truth token x_{t+1+j} at step j (SpecForge / speculators TTT) instead of the drafter's
own guess. Columns whose token input would be x_{>=T} get a zero embedding; they are never
valid and (see below) never attended to by a valid column.

Attention in TTT (``ttt_attention_mask``)
-----------------------------------------
Each step adds one K/V block (one key per column). At step j the query of column t may
see the step-0 keys of columns s <= t (the "real" prefix, computed from target features)
and the step-1..j keys of its OWN column t only (what the drafter itself produced for this
continuation). Never a later column. Mask for T=4, step=2 ([T, T*(step+1)], x = allowed):

                 step-0 block     step-1 block     step-2 block
    key column:  0  1  2  3       0  1  2  3       0  1  2  3
    query t=0    x  .  .  .       x  .  .  .       x  .  .  .
    query t=1    x  x  .  .       .  x  .  .       .  x  .  .
    query t=2    x  x  x  .       .  .  x  .       .  .  x  .
    query t=3    x  x  x  x       .  .  .  x       .  .  .  x

Padding (right padding; ``attention_mask`` False at pads): step-0 keys of padded columns
are also masked (a query always keeps its own diagonal key so no row is empty).

Three implementations compute this, and tests check they agree:
``attn_impl="chunked"`` (default; memory LINEAR in T): query rows in chunks of
``ATTN_CHUNK``, each chunk's scores against the step-0 keys it may see plus one dot product
per diagonal key, softmaxed jointly, run under activation checkpointing so no [T, T] block
is ever kept for backward; ``attn_impl="eager"`` (the same math on all rows at once, as
SpecForge's eager path: [B,h,T,T] fp32 scores and probs kept for backward at every TTT step,
O(T^2 * j) memory over an unroll) and ``attn_impl="dense"`` (SDPA over all blocks with the
explicit ``ttt_attention_mask``; the reference). ``bench/bench_ttt_memory.py`` measures them.

Teacher / loss
--------------
Teacher logits = ``final @ target_lm_head.T`` (fp32). The teacher distribution is
RESTRICTED to the draft vocab (columns ``arange(N) + d2t``) and RENORMALIZED there (softmax
over those N logits == full softmax restricted and divided by its mass on the draft vocab).
Per step: soft cross-entropy ``-sum_i p_teacher[i] * log_softmax(draft_logits)[i]`` averaged
over the step's TRAINED columns: valid columns whose teacher argmax over the FULL target vocab
lies inside the draft vocab (``t2d``). A position whose target argmax is outside the draft
vocab can never be accepted by vLLM (the drafter cannot propose that token), so it carries
no signal worth fitting; SpecForge and the EAGLE reference mask it the same way. Total
``sum_j decay**j * loss_j``. Accuracy stays over all VALID columns and compares the draft
argmax (mapped to a target id) with the full-vocab teacher argmax, so an out-of-vocab target
counts as a miss: it is the number acceptance is made of, not a flattering subset.

Multi-GPU note: the frozen target matrices are buffers; wrap with DDP using
``broadcast_buffers=False`` (they are identical on every rank) to avoid re-broadcasting them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from eagle_ray.model.vocab import draft_target_ids

__all__ = [
    "DrafterArch",
    "Eagle3Drafter",
    "TTTOutputs",
    "drafter_arch_from",
    "drafter_arch_from_target_config",
    "ttt_attention_mask",
]

# Query rows per chunk in the "chunked" TTT attention: peak transient scores are
# B x heads x ATTN_CHUNK x T fp32 (64 heads, T=8K: 1 GiB), never kept for backward.
ATTN_CHUNK = 512

# --------------------------------------------------------------------------- architecture


@dataclass(frozen=True, kw_only=True)
class DrafterArch:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    target_vocab_size: int
    draft_vocab_size: int
    num_aux_layers: int = 3
    ttt_steps: int = 7
    num_layers: int = 1
    """Decoder layers: the first takes [emb ; hidden] (2H), the others are plain Llama layers
    on H (vLLM llama_eagle3: `qkv_input_size = 2 * hidden if layer_idx == 0 else hidden`)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings", "target_vocab_size",
                     "draft_vocab_size", "num_aux_layers", "ttt_steps", "num_layers"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DrafterArch.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embedding)")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError("draft_vocab_size cannot exceed target_vocab_size")


def drafter_arch_from(hidden_size: int, num_heads: int, kv_heads: int, head_dim: int,
                      intermediate: int, target_vocab: int, draft_vocab: int, *,
                      rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0,
                      max_position_embeddings: int = 4096, num_aux_layers: int = 3,
                      ttt_steps: int = 7, num_layers: int = 1) -> DrafterArch:
    return DrafterArch(
        hidden_size=hidden_size, num_attention_heads=num_heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, intermediate_size=intermediate, rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta, max_position_embeddings=max_position_embeddings,
        target_vocab_size=target_vocab, draft_vocab_size=min(draft_vocab, target_vocab),
        num_aux_layers=num_aux_layers, ttt_steps=ttt_steps, num_layers=num_layers)


def _target_rope_theta(cfg: Mapping[str, Any]) -> float:
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp, Mapping) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))


def drafter_arch_from_target_config(target_config: Mapping[str, Any], draft_vocab_size: int, *,
                                    num_aux_layers: int = 3, ttt_steps: int = 7,
                                    **overrides: Any) -> DrafterArch:
    """A drafter shaped like one decoder layer of the target (an HF config.json dict)."""
    H = int(target_config["hidden_size"])
    heads = int(target_config["num_attention_heads"])
    kw: dict[str, Any] = dict(
        hidden_size=H,
        num_attention_heads=heads,
        num_key_value_heads=int(target_config.get("num_key_value_heads") or heads),
        head_dim=int(target_config.get("head_dim") or H // heads),
        intermediate_size=int(target_config["intermediate_size"]),
        rms_norm_eps=float(target_config.get("rms_norm_eps", 1e-6)),
        rope_theta=_target_rope_theta(target_config),
        max_position_embeddings=int(target_config.get("max_position_embeddings", 4096)),
        target_vocab_size=int(target_config["vocab_size"]),
        num_aux_layers=num_aux_layers,
        ttt_steps=ttt_steps,
    )
    kw.update(overrides)
    kw["draft_vocab_size"] = min(int(draft_vocab_size), kw["target_vocab_size"])
    return DrafterArch(**kw)


# --------------------------------------------------------------------------- masks / rope


def ttt_attention_mask(T: int, step: int, device: torch.device | str | None = None) -> torch.Tensor:
    """bool [T, T*(step+1)]: may the query of column t at TTT step ``step`` see key k?

    Key index k = i*T + s is the step-i key of column s. Block i=0 is causal (s <= t);
    blocks 1..step are diagonal (s == t). See the module docstring for a drawing.
    """
    if T < 1 or step < 0:
        raise ValueError(f"need T >= 1 and step >= 0, got T={T}, step={step}")
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 -> fp32 for numerically sensitive math; fp32/fp64 unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style (rotate-half) rotary, as vLLM's Llama (is_neox_style=True) and HF use."""
    xf = _upcast(x)
    return (xf * cos.to(xf.dtype) + _rotate_half(xf) * sin.to(xf.dtype)).to(x.dtype)


# --------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _upcast(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Eagle3MLP(nn.Module):
    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        H, I = arch.hidden_size, arch.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v take the 2H ``[emb ; hidden]`` input (the first layer; H in
    later layers), with a TTT K/V cache."""

    def __init__(self, arch: DrafterArch, in_features: int | None = None) -> None:
        super().__init__()
        H, D = arch.hidden_size, arch.head_dim
        IN = 2 * H if in_features is None else in_features
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_attention_heads, arch.num_key_value_heads, D)
        self.q_proj = nn.Linear(IN, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(IN, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(IN, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.scaling = D ** -0.5

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        rep = self.num_heads // self.num_kv_heads
        return x if rep == 1 else x.repeat_interleave(rep, dim=1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]], am: torch.Tensor,
                attn_impl: str = "chunked") -> torch.Tensor:
        """x [B,T,2H]; cos/sin [T,D] for this step's positions; ``cache`` holds the (k, v) of
        earlier steps and gets this step's appended; ``am`` bool [B,T] is the right-padding
        mask (a step-0 key is visible iff its column is real, or it is the query's own column).
        Causality comes from ``ttt_attention_mask`` in every implementation. Returns [B,T,H]."""
        B, T, _ = x.shape
        D = self.head_dim
        q = self.q_proj(x).view(B, T, self.num_heads, D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, D).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        cache.append((k, v))
        step = len(cache) - 1
        if attn_impl == "chunked":
            out = self._chunked(q, cache, am)
        elif attn_impl == "eager":
            out = self._eager(q, cache, am)
        elif attn_impl == "dense":
            out = self._dense(q, cache, am, step)
        else:
            raise ValueError(f"unknown attn_impl {attn_impl!r}; choose chunked, eager or dense")
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * D))

    @staticmethod
    def _key_ok(am: torch.Tensor, rows: slice, cols: int) -> torch.Tensor:
        """bool [B,1,len(rows),cols]: step-0 mask of query rows ``rows`` against key columns
        0..cols-1 (causal, and padded key columns hidden except a query's own)."""
        r = torch.arange(rows.start, rows.stop, device=am.device)[:, None]
        c = torch.arange(cols, device=am.device)[None, :]
        return ((c <= r) & (am[:, None, :cols] | (c == r)))[:, None]

    def _attend_rows(self, q_c: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                     am: torch.Tensor, r0: int, *diag_kv: torch.Tensor) -> torch.Tensor:
        """Attention of query rows r0..r0+C-1 (q_c [B,h,C,D]): scores against the step-0 keys
        of columns 0..r0+C-1 (later columns are masked anyway, so never computed) plus one
        score per diagonal key (its own column at steps 1..j), softmaxed jointly.
        ``diag_kv`` = (k_1, v_1, k_2, v_2, ...) already cut to these rows. Returns [B,h,C,D]."""
        C = q_c.shape[2]
        cols = r0 + C
        scores = _upcast(torch.matmul(q_c, k0[:, :, :cols].transpose(-1, -2))) * self.scaling
        scores = scores.masked_fill(~self._key_ok(am, slice(r0, cols), cols), float("-inf"))
        ks, vs = diag_kv[0::2], diag_kv[1::2]
        diag = [(_upcast((q_c * ki).sum(-1)) * self.scaling).unsqueeze(-1) for ki in ks]
        probs = torch.softmax(torch.cat([scores] + diag, dim=-1), dim=-1).to(q_c.dtype)
        out = torch.matmul(probs[..., :cols], v0[:, :, :cols])
        for i, vi in enumerate(vs):
            out = out + probs[..., cols + i:cols + i + 1] * vi
        return out

    def _chunked(self, q: torch.Tensor, cache, am: torch.Tensor) -> torch.Tensor:
        # Linear memory in T: query rows are processed ATTN_CHUNK at a time, and under autograd
        # each chunk runs in activation checkpointing, so the [B,h,C,<=T] scores/probs exist
        # for one chunk at a time and are recomputed in backward instead of being kept (the
        # eager version keeps [B,h,T,T] fp32 scores AND probs for every TTT step: tens of GB
        # at 64 heads and T=8K). What stays for backward is q/k/v and the [B,h,T,D] output.
        from torch.utils.checkpoint import checkpoint

        T = q.shape[2]
        k0, v0 = (self._repeat_kv(t) for t in cache[0])
        diag = [self._repeat_kv(t) for kv in cache[1:] for t in kv]     # k_1, v_1, k_2, ...
        outs = []
        for r0 in range(0, T, ATTN_CHUNK):
            rows = slice(r0, min(T, r0 + ATTN_CHUNK))
            args = (q[:, :, rows], k0, v0, am, r0, *[d[:, :, rows] for d in diag])
            if torch.is_grad_enabled() and q.requires_grad:
                outs.append(checkpoint(self._attend_rows, *args, use_reentrant=False))
            else:
                outs.append(self._attend_rows(*args))
        return torch.cat(outs, dim=2)

    def _eager(self, q: torch.Tensor, cache, am: torch.Tensor) -> torch.Tensor:
        # Step-0 block: full [T,T] scores under the causal mask. Blocks 1..j are diagonal (a
        # column sees only its own later-step keys), so each is one dot product per column.
        # Quadratic memory, kept for backward: the reference the chunked version is tested on.
        k0, v0 = (self._repeat_kv(t) for t in cache[0])
        diag = [self._repeat_kv(t) for kv in cache[1:] for t in kv]
        return self._attend_rows(q, k0, v0, am, 0, *diag)

    def _dense(self, q: torch.Tensor, cache, am: torch.Tensor, step: int) -> torch.Tensor:
        B, _, T, _ = q.shape
        keys = self._repeat_kv(torch.cat([kk for kk, _ in cache], dim=2))
        vals = self._repeat_kv(torch.cat([vv for _, vv in cache], dim=2))
        base = ttt_attention_mask(T, step, device=q.device)                    # [T, T(step+1)]
        pad = torch.cat([self._key_ok(am, slice(0, T), T),
                         torch.ones(B, 1, T, T * step, dtype=torch.bool, device=q.device)], dim=-1)
        mask = base & pad
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=self.scaling)


class Eagle3DecoderLayer(nn.Module):
    """vLLM ``llama_eagle3.LlamaDecoderLayer`` with layer_idx 0 and norm_before_residual=False."""

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        H, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Eagle3Attention(arch)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = Eagle3MLP(arch)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, cache, am: torch.Tensor, attn_impl: str = "chunked"
                ) -> torch.Tensor:
        """Returns the PRE-final-norm output (vLLM's ``hidden_prenorm``)."""
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        residual = self.self_attn(x, cos, sin, cache, am, attn_impl) + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual


class Eagle3LaterLayer(nn.Module):
    """vLLM ``llama_eagle3.LlamaDecoderLayer`` with layer_idx > 0: a plain pre-norm Llama layer
    on H. vLLM carries (hidden, residual) apart and adds them in the next norm; the sum it
    hands on is this layer's output, so `x + attn(...)`, then `+ mlp(...)`, as here."""

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        H, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Eagle3Attention(arch, in_features=H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = Eagle3MLP(arch)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
                am: torch.Tensor, attn_impl: str = "chunked") -> torch.Tensor:
        residual = self.self_attn(self.input_layernorm(x), cos, sin, cache, am, attn_impl) + x
        return self.mlp(self.post_attention_layernorm(residual)) + residual


# --------------------------------------------------------------------------- drafter


@dataclass
class TTTOutputs:
    """Per-step results of a TTT unroll (lists indexed by step j; all [B, T] unless noted)."""

    logits: list[torch.Tensor] = field(default_factory=list)      # [B, T, N] draft logits
    token_loss: list[torch.Tensor] = field(default_factory=list)  # soft CE, 0 where invalid
    valid: list[torch.Tensor] = field(default_factory=list)       # bool: position scored
    trained: list[torch.Tensor] = field(default_factory=list)     # bool: valid & target argmax in draft vocab
    correct: list[torch.Tensor] = field(default_factory=list)     # bool, False where invalid


class Eagle3Drafter(nn.Module):
    def __init__(self, arch: DrafterArch, *, embed_weight: torch.Tensor | None = None,
                 target_lm_head_weight: torch.Tensor | None = None,
                 d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None,
                 loss_decay: float = 0.8, attn_impl: str = "chunked") -> None:
        super().__init__()
        self.arch = arch
        self.loss_decay = float(loss_decay)
        self.attn_impl = attn_impl
        H, V, N = arch.hidden_size, arch.target_vocab_size, arch.draft_vocab_size

        self.fc = nn.Linear(arch.num_aux_layers * H, H, bias=False)
        self.midlayer = Eagle3DecoderLayer(arch)
        # Named as vLLM names them ("midlayer." is its "layers.0."): layers.1, layers.2, ...
        self.layers = nn.ModuleDict({str(i): Eagle3LaterLayer(arch)
                                     for i in range(1, arch.num_layers)})
        self.norm = RMSNorm(H, arch.rms_norm_eps)
        self.lm_head = nn.Linear(H, N, bias=False)

        if d2t is None:
            if N != V:
                raise ValueError("d2t is required when draft_vocab_size != target_vocab_size")
            d2t = torch.zeros(N, dtype=torch.long)
        d2t = torch.as_tensor(d2t).to(torch.long).detach().clone()
        if d2t.shape != (N,):
            raise ValueError(f"d2t must have shape ({N},), got {tuple(d2t.shape)}")
        tids = torch.arange(N) + d2t
        if int(tids.min()) < 0 or int(tids.max()) >= V or tids.unique().numel() != N:
            raise ValueError("d2t must map draft indices to distinct target ids in [0, V)")
        if t2d is None:
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[tids] = True
        t2d = torch.as_tensor(t2d).to(torch.bool).detach().clone()
        if t2d.shape != (V,) or not bool(t2d[tids].all()) or int(t2d.sum()) != N:
            raise ValueError("t2d is inconsistent with d2t")
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

        # Frozen target tensors: buffers (never parameters), non-persistent (never saved).
        self.register_buffer("embed_weight", None, persistent=False)
        self.register_buffer("target_lm_head_weight", None, persistent=False)
        self.set_target_weights(embed_weight, target_lm_head_weight)

    # -- frozen target tensors -------------------------------------------------------------

    def set_target_weights(self, embed_weight: torch.Tensor | None,
                           target_lm_head_weight: torch.Tensor | None) -> None:
        V, H = self.arch.target_vocab_size, self.arch.hidden_size
        for name, w in (("embed_weight", embed_weight), ("target_lm_head_weight", target_lm_head_weight)):
            if w is None:
                continue
            if tuple(w.shape) != (V, H):
                raise ValueError(f"{name} must be [{V}, {H}], got {tuple(w.shape)}")
            setattr(self, name, w.detach().requires_grad_(False))

    @torch.no_grad()
    def init_lm_head_from_target(self) -> None:
        """Optional warm start: lm_head rows = the target lm_head rows of the draft tokens."""
        if self.target_lm_head_weight is None:
            raise RuntimeError("target_lm_head_weight is not set")
        rows = self.target_lm_head_weight[draft_target_ids(self.d2t)]
        self.lm_head.weight.copy_(rows.to(self.lm_head.weight))

    @property
    def draft_ids(self) -> torch.Tensor:
        """[N] target id of every draft index."""
        return draft_target_ids(self.d2t)

    # -- pieces ----------------------------------------------------------------------------

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [len(positions), head_dim], computed in fp64 then cast to fp32 (or fp64
        when the model runs in fp64)."""
        D = self.arch.head_dim
        inv_freq = 1.0 / (self.arch.rope_theta ** (
            torch.arange(0, D, 2, dtype=torch.float64, device=positions.device) / D))
        freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        dt = torch.float64 if self.fc.weight.dtype == torch.float64 else torch.float32
        return emb.cos().to(dt), emb.sin().to(dt)

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """g = fc(aux) (vLLM's ``combine_hidden_states`` without fc/input norms)."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def compute_logits(self, hidden_prenorm: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden_prenorm))

    @torch.no_grad()
    def teacher(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(restricted teacher logits [B,T,N] fp32, full-vocab teacher argmax [B,T] target ids).

        Uses ``batch["target_logits"]`` [B,T,V] when present, else ``final @ W_lm.T``
        computed in row chunks so the [rows, V] block stays ~<= 512 MB.
        """
        tids = self.draft_ids
        if "target_logits" in batch:
            full = batch["target_logits"]
            return _upcast(full[..., tids]), full.argmax(-1)
        W = self.target_lm_head_weight
        if W is None:
            raise RuntimeError("target_lm_head_weight is not set (or pass batch['target_logits'])")
        final = batch["final"]
        B, T, H = final.shape
        x = final.reshape(B * T, H).to(W.dtype)
        rows = max(1, (1 << 27) // W.shape[0])
        restricted, argmax = [], []
        for chunk in x.split(rows):
            lg = _upcast(chunk @ W.T)
            argmax.append(lg.argmax(-1))
            restricted.append(lg[:, tids])
        return (torch.cat(restricted).view(B, T, -1), torch.cat(argmax).view(B, T))

    # -- TTT -------------------------------------------------------------------------------

    @staticmethod
    def shift(x: torch.Tensor, n: int, fill: float | bool = 0) -> torch.Tensor:
        """out[:, t] = x[:, t+n]; positions past the end get ``fill``."""
        if n == 0:
            return x
        out = torch.full_like(x, fill)
        if n < x.shape[1]:
            out[:, : x.shape[1] - n] = x[:, n:]
        return out

    def ttt_outputs(self, batch: Mapping[str, torch.Tensor], *, ttt_steps: int | None = None,
                    attn_impl: str | None = None) -> TTTOutputs:
        steps = self.arch.ttt_steps if ttt_steps is None else int(ttt_steps)
        impl = attn_impl or self.attn_impl
        ids = batch["input_ids"]
        B, T = ids.shape
        dev = ids.device
        loss_mask = batch["loss_mask"].to(torch.bool)
        am = batch.get("attention_mask")
        am = torch.ones(B, T, dtype=torch.bool, device=dev) if am is None else am.to(torch.bool)
        if T > 1 and bool((am[:, 1:] & ~am[:, :-1]).any()):
            raise ValueError("attention_mask must be right-padded (valid prefix, then padding)")
        if self.embed_weight is None:
            raise RuntimeError("embed_weight is not set")

        dtype = self.fc.weight.dtype
        emb_all = F.embedding(ids, self.embed_weight).to(dtype)             # emb(x_p) [B,T,H]
        hidden = self.combine_hidden_states(batch["aux"])                   # g_t [B,T,H]
        t_logits, t_argmax = self.teacher(batch)                            # at position p
        target_ok = loss_mask & am                                          # predicted-token mask
        in_vocab = self.t2d[t_argmax]                                       # target argmax draftable

        idx = torch.arange(T, device=dev)

        tids = self.draft_ids
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        later_caches: dict[str, list] = {name: [] for name in self.layers}  # one per layer
        out = TTTOutputs()
        for j in range(steps):
            embeds = self.shift(emb_all, 1 + j)                            # emb(x_{t+1+j})
            cos, sin = self.rope(idx + j)                                   # position t+j
            h_pre = self.midlayer(embeds, hidden, cos, sin, cache, am, impl)
            for name, layer in self.layers.items():                         # same mask, own K/V
                h_pre = layer(h_pre, cos, sin, later_caches[name], am, impl)
            logits = self.compute_logits(h_pre)                             # [B,T,N]
            valid = self.shift(target_ok, 2 + j, False)                    # x_{t+2+j} masked in
            teacher_p = torch.softmax(self.shift(t_logits, 1 + j), dim=-1)  # from f_{t+1+j}
            tok_loss = -(teacher_p * torch.log_softmax(_upcast(logits), dim=-1)).sum(-1)
            trained = valid & self.shift(in_vocab, 1 + j, False)
            tok_loss = torch.where(trained, tok_loss, torch.zeros_like(tok_loss))
            pred = tids[logits.detach().argmax(-1)]
            correct = (pred == self.shift(t_argmax, 1 + j)) & valid
            out.logits.append(logits)
            out.token_loss.append(tok_loss)
            out.valid.append(valid)
            out.trained.append(trained)
            out.correct.append(correct)
            hidden = h_pre                                                  # pre-norm feedback
        return out

    def forward(self, batch: Mapping[str, torch.Tensor], *, ttt_steps: int | None = None,
                loss_decay: float | None = None, step_weights: Sequence[float] | None = None,
                attn_impl: str | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Returns (loss, metrics). Metrics are detached 0-d tensors: ``loss``,
        ``loss_step{j}`` (mean over trained columns), ``acc_step{j}`` (over valid columns),
        ``valid_step{j}``, ``trained_step{j}``, ``correct_step{j}`` (counts)."""
        o = self.ttt_outputs(batch, ttt_steps=ttt_steps, attn_impl=attn_impl)
        steps = len(o.logits)
        if step_weights is None:
            decay = self.loss_decay if loss_decay is None else float(loss_decay)
            step_weights = [decay ** j for j in range(steps)]
        if len(step_weights) != steps:
            raise ValueError(f"need {steps} step weights, got {len(step_weights)}")
        total = _upcast(o.token_loss[0]).new_zeros(())
        metrics: dict[str, torch.Tensor] = {}
        for j in range(steps):
            n = o.valid[j].sum()
            n_trained = o.trained[j].sum()
            loss_j = o.token_loss[j].sum() / n_trained.clamp(min=1).to(total.dtype)
            total = total + step_weights[j] * loss_j
            correct = o.correct[j].sum()
            metrics[f"loss_step{j}"] = loss_j.detach()
            metrics[f"acc_step{j}"] = (correct.to(total.dtype) / n.clamp(min=1).to(total.dtype)).detach()
            metrics[f"valid_step{j}"] = n.detach()
            metrics[f"trained_step{j}"] = n_trained.detach()
            metrics[f"correct_step{j}"] = correct.detach()
        metrics["loss"] = total.detach()
        return total, metrics
