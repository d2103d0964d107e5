"""Qwen3.5 text model (Hugging Face ``Qwen3_5ForCausalLM``, transformers >= 5.2) on fuselm kernels.

Read top to bottom: config, cache, rotary embedding, the two token mixers (Gated DeltaNet and
gated full attention), the decoder layer, the model (forward, prefill, graph-safe decode step,
sampling, generate), weight loading (``from_hf``, ``from_pretrained``).

Architecture (HF ``transformers/models/qwen3_5/modeling_qwen3_5.py``):
    h = embed(ids)
    per layer:  h = h + mixer(norm1(h));  h = h + mlp(norm2(h))
    logits = lm_head(norm(h))
- every decoder norm is zero-centered RMSNorm, ``x_normed * (1 + w)`` (``Qwen3_5RMSNorm``),
  here ``add_rms_norm(..., offset=1.0)`` fused with the residual add before it;
- ``mixer`` is, per ``config.layer_types``, a Gated DeltaNet (``linear_attention``) or gated
  full attention (``full_attention``); ``mlp`` is SwiGLU through ``swiglu_mlp``.

Numerics: fp32 everywhere reproduces HF to summation order (the tests hold 1e-3 absolute on the
logits; measured <= 1.1e-5 on the tiny test model). In bf16/fp16 every op rounds where HF's eager op rounds
(``swiglu_mlp`` included: its gate/up products are rounded before the activation, as HF's
projections are); the fused projections are single GEMMs over concatenated weights (same
products, per-column results as HF's separate GEMMs up to the BLAS's blocking), and the Gated
DeltaNet kernels round at fla-core's points with their own fp32/tf32 sums (the one bf16
difference from HF that matters: benchmarks/results/<gpu>/README.md, "Where the gap comes from").

Cache and batching (``Qwen35Cache``): preallocated once per (max_batch, max_len); row r of a
batch is cache slot r. Prompts of different lengths are RIGHT-padded (``attention_mask`` rows
are ones then zeros): every row's tokens sit at positions 0 .. n_r - 1, so a row's next position
is its length. ``decode_step`` is the CUDA-graph-safe step: one token per cache row, no host
sync, no data-dependent shapes; rows with ``cache.active`` False (padding, finished) write no
state.

Not implemented (HF has them): RoPE scaling types other than "default" (Qwen3.5 ships
"default"); multimodal (vision) inputs and the 3-D M-RoPE positions they need (text-only
positions make M-RoPE plain RoPE: all three position rows are equal); training.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fuselm.ops.attention_decode import apply_rotary_ref, qk_norm_rope_kv_write
from fuselm.ops.decode_linear import decode_linear
from fuselm.ops.gated_delta_rule import chunk_gated_delta_rule, gated_delta_rule_decode_step
from fuselm.ops.gated_delta_rule.naive import decay_gate
from fuselm.ops.rms_norm import add_rms_norm, rms_norm
from fuselm.ops.swiglu_mlp import interleave_gate_up, swiglu_mlp
from fuselm.runtime import check_positive_int

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
# HF's remap_legacy_layer_types (configuration_utils.py)
_LEGACY_LAYER_TYPES = {"mamba": LINEAR_ATTENTION, "conv": LINEAR_ATTENTION, "attention": FULL_ATTENTION}
# Checkpoint tensors that are not part of the text model (Qwen3_5ForConditionalGeneration
# checkpoints): the vision tower and the multi-token-prediction head.
_IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.")


# ============================================================================ config
@dataclass(frozen=True)
class Qwen35Config:
    """The text-model fields of HF ``Qwen3_5TextConfig``; the defaults are HF's."""

    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    # gated full attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    # Gated DeltaNet
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # one of "linear_attention" / "full_attention" per layer; default: every 4th is full
    layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple(
                FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(self.num_hidden_layers)))
        object.__setattr__(self, "layer_types", tuple(_LEGACY_LAYER_TYPES.get(t, t) for t in self.layer_types))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types: {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
        if unknown:
            raise ValueError(f"layer_types: unknown {sorted(unknown)} (expected {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r})")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is implemented (Qwen3.5), got {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                             f"num_attention_heads = {self.num_attention_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_key_heads: {self.linear_num_key_heads} does not divide "
                             f"linear_num_value_heads = {self.linear_num_value_heads}")
        if self.rotary_dim < 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"partial_rotary_factor: head_dim {self.head_dim} x {self.partial_rotary_factor} gives "
                             f"rotary dim {self.rotary_dim}; it must be even, >= 2 and <= head_dim")

    # derived sizes -----------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # HF: int(head_dim * partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v of the delta rule."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_hf(cls, config) -> "Qwen35Config":
        """From an HF ``Qwen3_5TextConfig``, a multimodal ``Qwen3_5Config`` (its ``text_config``),
        or either as a dict (the contents of ``config.json``)."""
        top = config if isinstance(config, dict) else getattr(config, "to_dict", lambda: None)()
        if not isinstance(top, dict):
            raise TypeError(f"config: expected an HF config or a dict, got {type(config).__name__}")
        text = top.get("text_config") or top
        if not isinstance(text, dict):
            text = text.to_dict()
        model_type = text.get("model_type", "qwen3_5_text")
        if model_type not in ("qwen3_5_text", "qwen3_5"):
            raise ValueError(f"config: model_type {model_type!r} is not a Qwen3.5 text model")
        values = {f.name: text[f.name] for f in fields(cls) if f.name in text and text[f.name] is not None
                  and f.name not in ("rope_theta", "partial_rotary_factor", "layer_types")}
        if text is not top:  # multimodal: HF ties the LM head by the top-level flag
            for name in ("tie_word_embeddings", "eos_token_id", "pad_token_id"):
                if top.get(name) is not None and (name == "tie_word_embeddings" or name not in values):
                    values[name] = top[name]
        # RoPE: rope_parameters (or the legacy rope_scaling), then top-level keys, then defaults
        # (Qwen3_5TextConfig.__post_init__ defaults partial_rotary_factor to 0.25).
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_parameters: rope_type {rope_type!r} is not implemented (only 'default')")
        values["rope_theta"] = float(rope.get("rope_theta") or text.get("rope_theta") or cls.rope_theta)
        factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor"))
        values["partial_rotary_factor"] = float(cls.partial_rotary_factor if factor is None else factor)
        if text.get("layer_types"):
            values["layer_types"] = tuple(text["layer_types"])
        else:
            interval = text.get("full_attention_interval", 4)
            layers = values.get("num_hidden_layers", cls.num_hidden_layers)
            values["layer_types"] = tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                                          for i in range(layers))
        return cls(**values)


# ============================================================================ cache
@dataclass
class AttentionCache:
    """Static KV cache of one full-attention layer: [max_batch, kv_heads, max_len + 1, head_dim].
    Column ``max_len`` is a scratch column: inactive rows write their K/V there during decode
    (an index op with no branch), and no active row ever attends to it."""

    key: torch.Tensor
    value: torch.Tensor


@dataclass
class DeltaNetCache:
    """State of one Gated DeltaNet layer: the conv inputs per row [max_batch, conv_dim, kernel]
    (model dtype), circular: column j holds the input at the latest position p with p % kernel == j
    (zeros for positions before the prompt), so a decode step reads the previous kernel - 1 inputs
    and writes one column (``gated_delta_rule_decode_step``); and the delta-rule state pool
    [max_batch, value_heads, key_head_dim, value_head_dim] (fp32, updated in place)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class Qwen35Cache:
    """All decode state, preallocated: ``lengths`` [max_batch] int64 (tokens in the cache per
    row = the next token's position), ``active`` [max_batch] bool (rows that take part in decode),
    and per layer an ``AttentionCache`` or a ``DeltaNetCache``. Every tensor keeps its address
    for the cache's life (a CUDA graph may capture them)."""

    config: Qwen35Config
    max_len: int
    lengths: torch.Tensor
    active: torch.Tensor
    layers: list
    slots: torch.Tensor = field(repr=False)  # arange(max_batch), int32: each row's state-pool slot
    columns: torch.Tensor = field(repr=False)  # arange(max_len + 1): KV column index, for the mask

    @classmethod
    def allocate(cls, config: Qwen35Config, max_batch: int, max_len: int, dtype, device) -> "Qwen35Cache":
        check_positive_int("max_batch", max_batch)
        check_positive_int("max_len", max_len)
        layers = []
        for layer_type in config.layer_types:
            if layer_type == FULL_ATTENTION:
                shape = (max_batch, config.num_key_value_heads, max_len + 1, config.head_dim)
                layers.append(AttentionCache(torch.zeros(shape, dtype=dtype, device=device),
                                             torch.zeros(shape, dtype=dtype, device=device)))
            else:
                layers.append(DeltaNetCache(
                    torch.zeros(max_batch, config.linear_conv_dim, config.linear_conv_kernel_dim,
                                dtype=dtype, device=device),
                    torch.zeros(max_batch, config.linear_num_value_heads, config.linear_key_head_dim,
                                config.linear_value_head_dim, dtype=torch.float32, device=device)))
        return cls(config, max_len, torch.zeros(max_batch, dtype=torch.int64, device=device),
                   torch.zeros(max_batch, dtype=torch.bool, device=device), layers,
                   torch.arange(max_batch, dtype=torch.int32, device=device),
                   torch.arange(max_len + 1, device=device))

    @property
    def max_batch(self) -> int:
        return self.lengths.shape[0]

    def first_rows(self, rows: int) -> "Qwen35Cache":
        """A cache of rows 0 .. rows-1 that shares this one's memory (every tensor a leading-dim
        view, so contiguous and at the same addresses): a decode step on it reads and writes
        exactly those rows. The engine captures one CUDA graph per batch size on such views."""
        if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= self.max_batch:
            raise ValueError(f"rows: expected an int in [1, {self.max_batch}], got {rows!r}")
        layers = [AttentionCache(layer.key[:rows], layer.value[:rows]) if isinstance(layer, AttentionCache)
                  else DeltaNetCache(layer.conv[:rows], layer.recurrent[:rows]) for layer in self.layers]
        return Qwen35Cache(self.config, self.max_len, self.lengths[:rows], self.active[:rows], layers,
                           self.slots[:rows], self.columns)


@dataclass
class _PrefillStep:
    """What every layer needs to prefill B fresh rows of T (right-padded) tokens."""

    lengths: torch.Tensor  # [B] int64, real tokens per row
    token_mask: torch.Tensor | None  # [B, T] bool, real tokens; None when no row is padded
    cu_seqlens: torch.Tensor | None  # [N + 1] int32 offsets of the packed real tokens (padded batch)
    cos: torch.Tensor  # [1, T, 1, rotary_dim], model dtype
    sin: torch.Tensor


@dataclass
class _DecodeStep:
    """What every layer needs for one token per cache row; all device tensors of static shape."""

    cos: torch.Tensor  # [max_batch, 1, 1, rotary_dim]
    sin: torch.Tensor
    write_column: torch.Tensor  # [max_batch] int64: the token's KV column (max_len for inactive rows)
    key_mask: torch.Tensor  # [max_batch, 1, 1, max_len + 1] bool: columns the token attends to
    state_slots: torch.Tensor  # [max_batch] int32: pool slot, -1 for inactive rows (no state write)
    positions: torch.Tensor  # [max_batch] int64: the token's position (= cache.lengths before the step)


# ============================================================================ rotary embedding
def rotary_inv_freq(config: Qwen35Config) -> torch.Tensor:
    """HF ``compute_default_rope_parameters``: theta ** -(2i / rotary_dim), fp32."""
    dim = config.rotary_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin [..., rotary_dim] for integer positions [...]. The angle is one fp32 product
    (as HF's fp32 ``inv_freq @ position_ids``), cos/sin in fp32, then rounded to the model dtype
    as HF's ``Qwen3_5TextRotaryEmbedding`` returns them. Text-only M-RoPE: the T/H/W position
    rows are equal, so the section interleaving changes nothing."""
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


# ============================================================================ Gated DeltaNet
def _param(*shape) -> nn.Parameter:
    """A weight slot on the meta device; ``Qwen35._load`` assigns the real tensor."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class GatedDeltaNet(nn.Module):
    """HF ``Qwen3_5GatedDeltaNet``: projections -> causal depthwise conv + SiLU over (q, k, v) ->
    gated delta rule with q/k l2-norm -> gated RMSNorm with z -> out_proj.

    Weights: ``in_proj`` [conv_dim + value_dim + 2 HV, D] is HF's in_proj_qkv, in_proj_z,
    in_proj_b, in_proj_a stacked (one GEMM); ``conv_weight`` [conv_dim, 1, kernel]; ``A_log``,
    ``dt_bias`` [HV]; ``norm`` [head_v_dim] (plain RMSNorm weight, not zero-centered);
    ``out_proj`` [D, value_dim]. The H key heads are shared by HV / H value heads each (value
    head hv reads key head hv // (HV / H), HF's repeat_interleave; the kernels index it)."""

    def __init__(self, config: Qwen35Config):
        super().__init__()
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = c.linear_key_dim, c.linear_value_dim, c.linear_conv_dim
        self.kernel_size = c.linear_conv_kernel_dim
        self.eps = c.rms_norm_eps
        self.in_proj = _param(self.conv_dim + self.value_dim + 2 * self.num_v_heads, c.hidden_size)
        self.conv_weight = _param(self.conv_dim, 1, self.kernel_size)
        self.A_log = _param(self.num_v_heads)
        self.dt_bias = _param(self.num_v_heads)
        self.norm = _param(self.head_v_dim)
        self.out_proj = _param(c.hidden_size, self.value_dim)

    def _project(self, x):
        """x [B, T, D] -> (qkv [B, T, conv_dim], z [B, T, HV, Vd], b, a [B, T, HV]), model dtype."""
        proj = F.linear(x, self.in_proj)
        qkv, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        return qkv, z.unflatten(-1, (self.num_v_heads, self.head_v_dim)), b, a

    def _split_heads(self, conv_out):
        """conv_out [B, T, conv_dim] -> q, k [B, T, H, Kd] and v [B, T, HV, Vd] (HF's split)."""
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.unflatten(-1, (self.num_k_heads, self.head_k_dim)), k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                v.unflatten(-1, (self.num_v_heads, self.head_v_dim)))

    def _output(self, o, z):
        """HF ``Qwen3_5RMSNormGated`` then out_proj: ``w * rms_norm(o).to(dtype)`` (Llama rounding:
        ``rms_norm`` with offset 0), times silu(z) in fp32, one rounding to the model dtype."""
        normed = rms_norm(o, self.norm, self.eps, 0.0)
        gated = (normed.float() * F.silu(z.float())).to(o.dtype)
        return F.linear(gated.flatten(-2), self.out_proj)

    def prefill(self, x: torch.Tensor, cache: DeltaNetCache, step: _PrefillStep) -> torch.Tensor:
        B, T, _ = x.shape
        qkv, z, b, a = self._project(x)
        # Causal depthwise conv over the rows' own tokens (zero history), as HF's causal_conv1d_fn:
        # F.conv1d in the weight dtype, SiLU, result in the model dtype. Right padding: padded
        # positions come after a row's real ones and never reach them.
        channels_first = qkv.transpose(1, 2)  # [B, conv_dim, T]
        conv_out = F.silu(F.conv1d(channels_first, self.conv_weight, padding=self.kernel_size - 1,
                                   groups=self.conv_dim)[..., :T]).transpose(1, 2)
        # Conv state: the inputs at positions L - kernel .. L - 1 of a row of L real tokens (zeros
        # before the prompt) in their circular columns, position % kernel.
        history = F.pad(channels_first, (self.kernel_size, 0))  # history[..., p + kernel] = input p
        positions = step.lengths[:, None] + torch.arange(-self.kernel_size, 0, device=x.device)  # [B, kernel]
        inputs = history.gather(2, (positions + self.kernel_size)[:, None, :].expand(B, self.conv_dim, -1))
        cache.conv[:B].scatter_(2, (positions % self.kernel_size)[:, None, :].expand(B, self.conv_dim, -1), inputs)

        q, k, v = self._split_heads(conv_out)
        # HF: g = -exp(A_log) * softplus(a + dt_bias) in fp32; beta = sigmoid(b) in the model dtype.
        g = decay_gate(self.A_log, a, self.dt_bias)
        beta = b.sigmoid()
        if step.token_mask is None:
            o, final = chunk_gated_delta_rule(q, k, v, g, beta, self.head_k_dim ** -0.5, None, True, True)
        else:  # padded batch: the real tokens as one packed varlen sequence (padding never enters the state)
            packed = [t[step.token_mask][None] for t in (q, k, v, g, beta)]
            o_packed, final = chunk_gated_delta_rule(*packed, self.head_k_dim ** -0.5, None, True, True,
                                                     step.cu_seqlens)
            o = v.new_zeros(v.shape)
            o[step.token_mask] = o_packed[0]
        cache.recurrent[:B] = final  # fp32 [B, HV, Kd, Vd]
        return self._output(o, z)

    def decode(self, x: torch.Tensor, cache: DeltaNetCache, step: _DecodeStep) -> torch.Tensor:
        """Three launches: in_proj; conv update + gates + l2-norm + recurrence on the state pool
        (slot -1, an inactive row, reads zeros and writes no state); gated RMSNorm fused into
        out_proj (``decode_linear``). Same math and roundings as ``prefill`` / HF."""
        proj = F.linear(x, self.in_proj)[:, 0]  # x [max_batch, 1, D] -> [max_batch, P]
        o = gated_delta_rule_decode_step(
            proj, cache.conv, self.conv_weight, self.A_log, self.dt_bias, cache.recurrent, step.state_slots,
            step.positions, num_k_heads=self.num_k_heads, head_k_dim=self.head_k_dim,
            num_v_heads=self.num_v_heads, head_v_dim=self.head_v_dim)
        z = proj[:, self.conv_dim:self.conv_dim + self.value_dim]
        y = decode_linear(o.flatten(1), self.out_proj, prologue="gated_rms_norm", gate=z, norm_weight=self.norm,
                          eps=self.eps, head_dim=self.head_v_dim)
        return y[:, None]


# ============================================================================ gated full attention
class GatedAttention(nn.Module):
    """HF ``Qwen3_5Attention``: q_proj gives (query, gate) per head; q/k zero-centered RMSNorm over
    head_dim; partial RoPE; GQA attention with scale head_dim ** -0.5; output * sigmoid(gate);
    o_proj.

    Weights: ``qkv_proj`` [2 nH hd + 2 nKV hd, D] is HF's q_proj (rows per head: query, then
    gate), k_proj, v_proj stacked (one GEMM), ``qkv_bias`` likewise when ``attention_bias``;
    ``q_norm``, ``k_norm`` [hd]; ``o_proj`` [D, nH hd] (+ ``o_bias``)."""

    def __init__(self, config: Qwen35Config):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim ** -0.5
        self.q_size, self.kv_size = 2 * self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, c.hidden_size)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if c.attention_bias else None
        self.q_norm = _param(self.head_dim)
        self.k_norm = _param(self.head_dim)
        self.o_proj = _param(c.hidden_size, self.num_heads * self.head_dim)
        self.o_bias = _param(c.hidden_size) if c.attention_bias else None

    def _project(self, x, cos, sin):
        """x [B, T, D] -> q [B, nH, T, hd], k, v [B, nKV, T, hd], gate [B, T, nH hd]."""
        B, T, _ = x.shape
        q_gate, k, v = F.linear(x, self.qkv_proj, self.qkv_bias).split([self.q_size, self.kv_size, self.kv_size], -1)
        q, gate = q_gate.view(B, T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        # Zero-centered RMSNorm per head: fp32 statistics, (x_normed * (1 + w)) rounded once.
        q = rms_norm(q, self.q_norm, self.eps, 1.0)
        k = rms_norm(k.view(B, T, self.num_kv_heads, self.head_dim), self.k_norm, self.eps, 1.0)
        q, k = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate.reshape(B, T, -1)

    def _output(self, attn, gate):
        """attn [B, nH, T, hd] -> o_proj(attn * sigmoid(gate)), in the model dtype as HF."""
        attn = attn.transpose(1, 2).flatten(2)
        return F.linear(attn * torch.sigmoid(gate), self.o_proj, self.o_bias)


    def prefill(self, x: torch.Tensor, cache: AttentionCache, step: _PrefillStep) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v, gate = self._project(x, step.cos, step.sin)
        cache.key[:B, :, :T] = k
        cache.value[:B, :, :T] = v
        # Causal attention over the prompt (SDPA; HF's sdpa path). Right padding: a real query only
        # sees earlier positions, which are real; the padded positions' K/V land in the cache beyond
        # the row's length, where decode masks them out and overwrites them.
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return self._output(attn, gate)

    def decode(self, x: torch.Tensor, cache: AttentionCache, step: _DecodeStep) -> torch.Tensor:
        """qkv GEMM; q/k norm + RoPE + the K/V write at column write_column[r] of each row r in one
        launch (``qk_norm_rope_kv_write``, the roundings of ``_project``); SDPA over the whole
        static cache, masked to each row's columns 0 .. position; the sigmoid gate fused into
        o_proj (``decode_linear``)."""
        B = x.shape[0]
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)  # x [max_batch, 1, D]
        q = qk_norm_rope_kv_write(qkv, self.q_norm, self.k_norm, step.cos, step.sin, cache.key, cache.value,
                                  step.write_column, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                  head_dim=self.head_dim, eps=self.eps)
        attn = F.scaled_dot_product_attention(q, cache.key, cache.value, attn_mask=step.key_mask, scale=self.scale,
                                              enable_gqa=True)  # [B, heads, 1, head_dim]
        gate = qkv[:, 0, :self.q_size].view(B, self.num_heads, 2, self.head_dim)[:, :, 1].reshape(B, -1)
        y = decode_linear(attn.reshape(B, -1), self.o_proj, prologue="sigmoid_gate", gate=gate)
        if self.o_bias is not None:
            y = y + self.o_bias
        return y[:, None]


# ============================================================================ decoder layer
class DecoderLayer(nn.Module):
    """Token mixer + SwiGLU MLP. ``input_norm`` / ``post_attention_norm`` [D] are HF's
    input_layernorm / post_attention_layernorm (zero-centered); ``w13`` [2F, D] is gate_proj and
    up_proj interleaved row by row (``interleave_gate_up``, done once at load), ``w2`` [D, F] is
    down_proj. The model runs the norms, fused with the residual adds (``Qwen35._layers``)."""

    def __init__(self, config: Qwen35Config, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.mixer = GatedDeltaNet(config) if layer_type == LINEAR_ATTENTION else GatedAttention(config)
        self.input_norm = _param(config.hidden_size)
        self.post_attention_norm = _param(config.hidden_size)
        self.w13 = _param(2 * config.intermediate_size, config.hidden_size)
        self.w2 = _param(config.hidden_size, config.intermediate_size)


# ============================================================================ sampling
def sample_next_tokens(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                       top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row from logits [B, V], on the device with no host sync (graph-safe).

    temperature 0: argmax. Otherwise HF's order: scores / temperature (fp32), top-k (keep scores
    >= the k-th largest), top-p (keep the smallest set of most likely tokens whose mass reaches
    top_p; the first is always kept), then a draw from softmax by the exponential trick:
    argmax(p / E) with E ~ Exp(1) i.i.d. is distributed as Categorical(p).
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth_largest = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_scores = sorted_scores.masked_fill(mass_before >= top_p, float("-inf"))
        scores = scores.scatter(-1, order, sorted_scores)
    probs = scores.softmax(dim=-1)
    # E = 0 is possible (-log(1 - u) at u = 0): clamp, so that a zero-probability token stays at 0.
    noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)


# ============================================================================ the model
class Qwen35(nn.Module):
    """Qwen3.5 causal LM for inference. Build it with :meth:`from_hf` or :meth:`from_pretrained`
    (a bare ``Qwen35(config)`` holds meta tensors until weights are loaded).

    - ``model(input_ids, attention_mask=None)`` -> logits [B, T, vocab] (no cache kept);
    - ``model.generate(input_ids, max_new_tokens, temperature=0, top_k=None, top_p=None, ...)``
      -> new token ids [B, n];
    - the engine API: ``cache = model.new_cache(max_batch, max_len)``,
      ``model.prefill(input_ids, cache, attention_mask)`` -> last-token logits [B, vocab],
      ``model.decode_step(token_ids, cache)`` -> logits [max_batch, vocab] (CUDA-graph-safe).
    """

    def __init__(self, config: Qwen35Config):
        super().__init__()
        self.config = config
        self.embed_tokens = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, t) for t in config.layer_types)
        self.norm = _param(config.hidden_size)
        self.lm_head = None if config.tie_word_embeddings else _param(config.vocab_size, config.hidden_size)
        # fp32 always (a plain attribute, so ``model.to(dtype)`` cannot round it); follows the device.
        self.inv_freq = rotary_inv_freq(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def _rotary(self, positions: torch.Tensor):
        if self.inv_freq.device != positions.device:  # metadata only (graph-safe after the first call)
            self.inv_freq = self.inv_freq.to(positions.device)
        return rotary_cos_sin(positions, self.inv_freq, self.dtype)

    def new_cache(self, max_batch: int, max_len: int) -> Qwen35Cache:
        """A cache for up to ``max_batch`` rows of ``max_len`` tokens (prompt + generated)."""
        return Qwen35Cache.allocate(self.config, max_batch, max_len, self.dtype, self.device)

    # ------------------------------------------------------------------------ the layer stack
    def _layers(self, x: torch.Tensor, mix) -> torch.Tensor:
        """The decoder stack on embeddings x [B, T, D]; ``mix(mixer, normed, layer_index)`` runs a
        token mixer. Each residual add is fused with the norm after it: ``add_rms_norm`` rounds
        s = x + residual to the model dtype (as HF's ``residual + hidden_states``) and normalises
        that rounded s (fp32 statistics, zero-centered weight, one rounding). Returns the final
        normed hidden states."""
        eps = self.config.rms_norm_eps
        residual = x
        normed = rms_norm(x, self.layers[0].input_norm, eps, 1.0)
        for i, layer in enumerate(self.layers):
            normed, residual = add_rms_norm(mix(layer.mixer, normed, i), residual, layer.post_attention_norm, eps, 1.0)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            normed, residual = add_rms_norm(swiglu_mlp(normed, layer.w13, layer.w2), residual, next_norm, eps, 1.0)
        return normed

    def _prefill(self, input_ids: torch.Tensor, lengths: list[int], cache: Qwen35Cache) -> torch.Tensor:
        """Fresh prefill of rows 0 .. B-1 of ``cache`` (right-padded, real lengths on the host);
        returns the final normed hidden states [B, T, D]. Rows >= B become inactive."""
        B, T = input_ids.shape
        device = input_ids.device
        lengths_dev = torch.tensor(lengths, dtype=torch.int64, device=device)
        token_mask = cu_seqlens = None
        if min(lengths) < T:
            token_mask = torch.arange(T, device=device)[None, :] < lengths_dev[:, None]
            cu_seqlens = F.pad(torch.cumsum(lengths_dev, 0), (1, 0)).to(torch.int32)
            input_ids = input_ids.masked_fill(~token_mask, 0)  # padding ids may be anything
        cos, sin = self._rotary(torch.arange(T, device=device))
        step = _PrefillStep(lengths_dev, token_mask, cu_seqlens, cos[None, :, None], sin[None, :, None])
        cache.lengths.zero_()
        cache.active.zero_()
        hidden = self._layers(F.embedding(input_ids, self.embed_tokens),
                              lambda mixer, x, i: mixer.prefill(x, cache.layers[i], step))
        cache.lengths[:B] = lengths_dev
        cache.active[:B] = True
        return hidden

    # ------------------------------------------------------------------------ public entry points
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] in the model dtype for every position (HF ``Qwen3_5ForCausalLM``
        logits). ``attention_mask`` [B, T]: 1 for real tokens, 0 for right padding; logits at
        padded positions are not meaningful."""
        lengths = self._check_prompt(input_ids, attention_mask)
        cache = self.new_cache(input_ids.shape[0], input_ids.shape[1])
        return F.linear(self._prefill(input_ids, lengths, cache), self.lm_head_weight)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: Qwen35Cache,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Start B fresh requests in cache rows 0 .. B-1 (right-padded prompts; ``attention_mask``
        as in :meth:`forward`); other rows become inactive. Returns the logits of each row's
        last real token [B, vocab]. Host-side checks and lengths (not graph-captured)."""
        lengths = self._check_prompt(input_ids, attention_mask)
        self._check_cache(cache, input_ids.shape[0], max(lengths), 0)
        return self._prefill_last_logits(input_ids, lengths, cache)

    def _prefill_last_logits(self, input_ids, lengths, cache):
        input_ids = input_ids[:, : max(lengths)]  # trailing all-padding columns carry nothing
        hidden = self._prefill(input_ids, lengths, cache)
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), cache.lengths[: hidden.shape[0]] - 1]
        return F.linear(last, self.lm_head_weight)

    @torch.no_grad()
    def decode_step(self, token_ids: torch.Tensor, cache: Qwen35Cache) -> torch.Tensor:
        """One token per cache row: ``token_ids`` [max_batch] int64 at position ``cache.lengths``;
        returns logits [max_batch, vocab] and advances the active rows' lengths by one.

        CUDA-graph-safe: no host sync, no data-dependent shape (its temporaries have fixed shapes, so
        a graph's private memory pool serves them on replay); its inputs are
        ``token_ids`` and the cache tensors (``lengths``, ``active`` and the per-layer state),
        all updated in place. Inactive rows write no recurrent or conv state and put their K/V in
        the scratch column; their logits are meaningless. The caller keeps every active row's
        length < ``cache.max_len`` (``generate`` checks it before it starts).
        """
        if token_ids.shape != (cache.max_batch,):  # metadata only: no sync
            raise ValueError(f"token_ids: expected [max_batch] = ({cache.max_batch},), got {tuple(token_ids.shape)}")
        positions = cache.lengths
        cos, sin = self._rotary(positions)  # [max_batch, rotary_dim]
        write_column = torch.where(cache.active, positions.clamp(max=cache.max_len), cache.max_len)
        step = _DecodeStep(
            cos=cos[:, None, None], sin=sin[:, None, None], write_column=write_column,
            key_mask=(cache.columns[None, :] <= write_column[:, None])[:, None, None, :],
            state_slots=torch.where(cache.active, cache.slots, -1), positions=positions)
        token_ids = torch.where(cache.active, token_ids, 0)  # an inactive row's id may be anything
        hidden = self._layers(F.embedding(token_ids[:, None], self.embed_tokens),
                              lambda mixer, x, i: mixer.decode(x, cache.layers[i], step))
        cache.lengths.add_(cache.active.to(torch.int64))
        return F.linear(hidden[:, 0], self.lm_head_weight)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, *,
                 attention_mask: torch.Tensor | None = None, eos_token_id: int | Sequence[int] | None = None,
                 pad_token_id: int | None = None, generator: torch.Generator | None = None,
                 cache: Qwen35Cache | None = None, return_logits: bool = False):
        """Generate up to ``max_new_tokens`` tokens per row after right-padded prompts.

        Args:
            input_ids: [B, T] int token ids; ``attention_mask`` [B, T] marks real tokens (ones, then
                zeros for right padding); without it every row has T tokens.
            max_new_tokens: tokens to generate per row (>= 0).
            temperature: 0 is greedy; > 0 samples (``sample_next_tokens``), with optional ``top_k``
                (>= 1) and ``top_p`` (in (0, 1]) and ``generator`` (on the model's device).
            eos_token_id: id or ids that end a row; None uses ``config.eos_token_id``, ``[]`` never
                stops. A finished row's later tokens are ``pad_token_id`` (default: the config's,
                else the first eos id, else 0), and it writes no more state.
            cache: a cache from :meth:`new_cache` to reuse (rows 0 .. B-1); default: a new one of
                B rows x (longest prompt + max_new_tokens).
            return_logits: also return the logits each token was chosen from [B, n, vocab].
        Returns:
            new token ids [B, n] (int64), n = max_new_tokens, or fewer if every row stopped;
            with ``return_logits``, ``(ids, logits)``.

        Host sync: none inside a step; with eos ids, one ``any()`` per step to stop early.
        """
        lengths = self._check_prompt(input_ids, attention_mask)
        B = input_ids.shape[0]
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
        temperature, top_k, top_p = _check_sampling(temperature, top_k, top_p)
        if generator is not None and generator.device.type != self.device.type:
            raise ValueError(f"generator: on {generator.device}, the model is on {self.device}")
        stop_ids, pad = self._stop_and_pad_ids(eos_token_id, pad_token_id)
        if cache is None:
            cache = self.new_cache(B, max(lengths) + max_new_tokens)
        else:
            self._check_cache(cache, B, max(lengths), max_new_tokens)
        new_tokens = torch.full((B, max_new_tokens), pad, dtype=torch.int64, device=self.device)
        step_logits = []
        if max_new_tokens == 0:
            return (new_tokens, torch.empty(B, 0, self.config.vocab_size, dtype=self.dtype, device=self.device)
                    ) if return_logits else new_tokens
        stop = torch.tensor(stop_ids, dtype=torch.int64, device=self.device) if stop_ids else None
        step_input = torch.zeros(cache.max_batch, dtype=torch.int64, device=self.device)  # decode_step's static input
        logits = self._prefill_last_logits(input_ids, lengths, cache)
        generated = max_new_tokens
        for i in range(max_new_tokens):
            if return_logits:
                step_logits.append(logits[:B])
            tokens = sample_next_tokens(logits[:B], temperature, top_k, top_p, generator)
            tokens = torch.where(cache.active[:B], tokens, pad)
            new_tokens[:, i] = tokens
            if stop is not None:
                cache.active[:B] &= ~torch.isin(tokens, stop)
            if i + 1 == max_new_tokens:
                break
            if stop is not None and not bool(cache.active.any()):  # the one host sync per step
                generated = i + 1
                break
            step_input[:B] = tokens
            logits = self.decode_step(step_input, cache)
        new_tokens = new_tokens[:, :generated]
        return (new_tokens, torch.stack(step_logits, dim=1)) if return_logits else new_tokens

    # ------------------------------------------------------------------------ argument checks
    def _check_prompt(self, input_ids, attention_mask) -> list[int]:
        """Real tokens per row (host ints) of a right-padded prompt batch; ValueError/TypeError
        naming the argument otherwise. Reads the ids on the host (prefill is not graph-captured)."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids: expected a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids: expected integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [batch, tokens], got shape {tuple(input_ids.shape)}")
        if input_ids.device != self.device:
            raise ValueError(f"input_ids: on {input_ids.device}, the model is on {self.device}")
        B, T = input_ids.shape
        if B == 0:
            raise ValueError("input_ids: empty batch (0 rows)")
        if T == 0:
            raise ValueError("input_ids: empty prompt (0 tokens); every row needs at least one token")
        if attention_mask is None:
            lengths = [T] * B
            real = input_ids
        else:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask: expected a tensor of input_ids' shape {(B, T)}, got "
                                 f"{tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask!r}")
            mask = attention_mask.to(device=input_ids.device)
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError("attention_mask: values must be 0 or 1")
            mask = mask.to(torch.bool)
            if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
                raise ValueError("attention_mask: prompts must be right-padded (each row ones, then zeros); "
                                 "left-padded batches are not supported (tokenizer padding_side='right')")
            lengths = mask.sum(dim=1).tolist()
            if min(lengths) == 0:
                raise ValueError(f"attention_mask: row {lengths.index(0)} is an empty prompt (0 tokens)")
            real = input_ids[mask]
        low, high = int(real.min()), int(real.max())
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(f"input_ids: token ids must be in [0, {self.config.vocab_size}) (vocab_size); "
                             f"got values in [{low}, {high}]")
        return lengths

    def _check_cache(self, cache, batch: int, longest_prompt: int, max_new_tokens: int) -> None:
        if not isinstance(cache, Qwen35Cache):
            raise TypeError(f"cache: expected a Qwen35Cache from new_cache(), got {type(cache).__name__}")
        if cache.config != self.config or cache.lengths.device != self.device:
            raise ValueError("cache: made for another model (config or device differs); use this model's new_cache()")
        if batch > cache.max_batch:
            raise ValueError(f"input_ids: {batch} rows exceed the cache's max_batch = {cache.max_batch}")
        if longest_prompt > cache.max_len:
            raise ValueError(f"input_ids: a prompt of {longest_prompt} tokens is longer than the cache "
                             f"(max_len = {cache.max_len})")
        if longest_prompt + max_new_tokens > cache.max_len:
            raise ValueError(f"max_new_tokens: {longest_prompt} prompt tokens + {max_new_tokens} new tokens exceed "
                             f"the cache (max_len = {cache.max_len})")

    def _stop_and_pad_ids(self, eos_token_id, pad_token_id) -> tuple[tuple[int, ...], int]:
        stop = self.config.eos_token_id if eos_token_id is None else eos_token_id
        stop_ids = (stop,) if isinstance(stop, int) else tuple(stop or ())
        for name, ids in (("eos_token_id", stop_ids), ("pad_token_id", () if pad_token_id is None else (pad_token_id,))):
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.config.vocab_size for t in ids):
                raise ValueError(f"{name}: expected token ids in [0, {self.config.vocab_size}), got {ids}")
        if pad_token_id is None:
            config_pad = self.config.pad_token_id
            pad_token_id = (config_pad if config_pad is not None and 0 <= config_pad < self.config.vocab_size
                            else stop_ids[0] if stop_ids else 0)
        return stop_ids, pad_token_id

    # ------------------------------------------------------------------------ loading
    @classmethod
    def from_hf(cls, hf_model: nn.Module, dtype: torch.dtype | None = None, device=None) -> "Qwen35":
        """From a live HF ``Qwen3_5ForCausalLM`` (or ``Qwen3_5ForConditionalGeneration``: its
        text model); dtype and device default to the HF model's. Weights are re-laid once."""
        if not hasattr(hf_model, "config") or not hasattr(hf_model, "state_dict"):
            raise TypeError(f"hf_model: expected a Hugging Face Qwen3.5 model, got {type(hf_model).__name__}")
        config = Qwen35Config.from_hf(hf_model.config)
        state = hf_model.state_dict()
        return cls._from_state_dict(config, state, "hf_model", dtype, device)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None) -> "Qwen35":
        """From a local checkpoint directory: ``config.json`` and ``*.safetensors`` (one file or
        shards; a multimodal checkpoint's ``model.language_model.*`` text weights; vision and MTP
        tensors are skipped). Nothing is downloaded. dtype defaults to the checkpoint's."""
        directory = Path(path)
        if not (directory / "config.json").is_file():
            raise ValueError(f"path: {directory} has no config.json (expected a local checkpoint directory)")
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"path: {directory} has no *.safetensors weights")
        try:
            from safetensors.torch import load_file
        except ImportError as error:
            raise ImportError("from_pretrained needs the safetensors package (pip install safetensors)") from error
        config = Qwen35Config.from_hf(json.loads((directory / "config.json").read_text()))
        state = {}
        for file in files:
            state.update(load_file(file, device=str(device) if device is not None else "cpu"))
        return cls._from_state_dict(config, state, f"checkpoint {directory}", dtype, device)

    @classmethod
    def _from_state_dict(cls, config: Qwen35Config, state: dict, source: str, dtype, device) -> "Qwen35":
        tensors = {}
        for key, tensor in state.items():
            key = key.replace("model.language_model.", "model.", 1) if key.startswith("model.language_model.") else key
            if not key.startswith(_IGNORED_PREFIXES):
                tensors[key] = tensor
        if config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)  # HF ties lm_head to embed_tokens
        expected = hf_weight_shapes(config)
        missing = sorted(expected.keys() - tensors.keys())
        unexpected = sorted(tensors.keys() - expected.keys())
        if missing:
            raise ValueError(f"{source}: {len(missing)} tensors the config needs are missing, e.g. {missing[:4]}")
        if unexpected:
            raise ValueError(f"{source}: {len(unexpected)} tensors the config does not describe, e.g. {unexpected[:4]}")
        for key, shape in expected.items():
            if tuple(tensors[key].shape) != shape:
                raise ValueError(f"{source}: {key} has shape {tuple(tensors[key].shape)}, but the config "
                                 f"implies {shape}")
        embed = tensors["model.embed_tokens.weight"]
        dtype = embed.dtype if dtype is None else dtype
        device = embed.device if device is None else torch.device(device)
        model = cls(config)
        model.load_state_dict(relayout_hf_weights(config, tensors, dtype, device), strict=True, assign=True)
        return model.eval()


def _check_sampling(temperature, top_k, top_p):
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature: expected a finite number >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k: expected None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p: expected None or a number in (0, 1], got {top_p!r}")
    return float(temperature), top_k, top_p


def hf_weight_shapes(config: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF ``Qwen3_5ForCausalLM`` state dict and its shape under ``config``."""
    c = config
    D, F_ = c.hidden_size, c.intermediate_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, D), "model.norm.weight": (D,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, D)
    for i, layer_type in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "mlp.gate_proj.weight": (F_, D), p + "mlp.up_proj.weight": (F_, D),
                       p + "mlp.down_proj.weight": (D, F_)})
        if layer_type == LINEAR_ATTENTION:
            a, HV = p + "linear_attn.", c.linear_num_value_heads
            shapes.update({a + "in_proj_qkv.weight": (c.linear_conv_dim, D), a + "in_proj_z.weight": (c.linear_value_dim, D),
                           a + "in_proj_b.weight": (HV, D), a + "in_proj_a.weight": (HV, D),
                           a + "conv1d.weight": (c.linear_conv_dim, 1, c.linear_conv_kernel_dim),
                           a + "A_log": (HV,), a + "dt_bias": (HV,), a + "norm.weight": (c.linear_value_head_dim,),
                           a + "out_proj.weight": (D, c.linear_value_dim)})
        else:
            a, q_size, kv_size = p + "self_attn.", 2 * c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            shapes.update({a + "q_proj.weight": (q_size, D), a + "k_proj.weight": (kv_size, D),
                           a + "v_proj.weight": (kv_size, D), a + "o_proj.weight": (D, q_size // 2),
                           a + "q_norm.weight": (c.head_dim,), a + "k_norm.weight": (c.head_dim,)})
            if c.attention_bias:
                shapes.update({a + "q_proj.bias": (q_size,), a + "k_proj.bias": (kv_size,),
                               a + "v_proj.bias": (kv_size,), a + "o_proj.bias": (D,)})
    return shapes


def relayout_hf_weights(config: Qwen35Config, tensors: dict, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """HF tensor names -> this module's parameters, re-laid once: gate/up interleaved (``w13``),
    the DeltaNet's four input projections stacked, q/k/v stacked; all contiguous, in ``dtype``
    (as HF loads every parameter, A_log and dt_bias included, in the model dtype)."""
    def get(key):
        return tensors[key].detach().to(device=device, dtype=dtype)

    weights = {"embed_tokens": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
    if not config.tie_word_embeddings:
        weights["lm_head"] = get("lm_head.weight")
    for i, layer_type in enumerate(config.layer_types):
        hf, me = f"model.layers.{i}.", f"layers.{i}."
        weights[me + "input_norm"] = get(hf + "input_layernorm.weight")
        weights[me + "post_attention_norm"] = get(hf + "post_attention_layernorm.weight")
        weights[me + "w13"] = interleave_gate_up(get(hf + "mlp.gate_proj.weight"), get(hf + "mlp.up_proj.weight"))
        weights[me + "w2"] = get(hf + "mlp.down_proj.weight")
        if layer_type == LINEAR_ATTENTION:
            a = hf + "linear_attn."
            weights[me + "mixer.in_proj"] = torch.cat([get(a + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")])
            weights[me + "mixer.conv_weight"] = get(a + "conv1d.weight")
            for name in ("A_log", "dt_bias"):
                weights[me + "mixer." + name] = get(a + name)
            weights[me + "mixer.norm"] = get(a + "norm.weight")
            weights[me + "mixer.out_proj"] = get(a + "out_proj.weight")
        else:
            a = hf + "self_attn."
            weights[me + "mixer.qkv_proj"] = torch.cat([get(a + f"{n}_proj.weight") for n in ("q", "k", "v")])
            if config.attention_bias:
                weights[me + "mixer.qkv_bias"] = torch.cat([get(a + f"{n}_proj.bias") for n in ("q", "k", "v")])
                weights[me + "mixer.o_bias"] = get(a + "o_proj.bias")
            weights[me + "mixer.q_norm"] = get(a + "q_norm.weight")
            weights[me + "mixer.k_norm"] = get(a + "k_norm.weight")
            weights[me + "mixer.o_proj"] = get(a + "o_proj.weight")
    return {name: t.contiguous() for name, t in weights.items()}
