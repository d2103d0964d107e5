"""The layers of a Qwen3.5 text model, each mapping its own Hugging Face tensors.

Read top to bottom: what a prefill / decode step hands every layer, the rotary frequencies, the
two token mixers (Gated DeltaNet and gated full attention), the SwiGLU MLP, the sparse MoE block
(Qwen3.5-MoE's MLP), the decoder layer.

Every module has ``hf_shapes()`` (its HF tensor names, relative to the module's HF prefix, and
their shapes under the config) and ``load_hf(take)`` (``take(name)`` returns that HF tensor on
the target device in the target dtype; the module re-lays it once: stacked projections,
interleaved gate/up). Composite modules prefix their children's names, so a layer's MLP can be
replaced by any module with these two methods and ``forward(x)`` (the MoE block, for one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fuselm.models.qwen35.cache import AttentionCache, DeltaNetCache
from fuselm.models.qwen35.config import LINEAR_ATTENTION, Qwen35Config
from fuselm.ops.attention_decode import decode_attention, qk_norm_rope_kv_write
from fuselm.ops.attention_prefill import prefill_attention
from fuselm.ops.causal_conv1d import causal_conv1d_silu
from fuselm.ops.decode_linear import decode_linear, linear_prologue
from fuselm.ops.gated_delta_rule import chunk_gated_delta_rule, gated_delta_gates, gated_delta_rule_decode_step
from fuselm.ops.moe import SwiGLUMoE
from fuselm.ops.swiglu_mlp import SwiGLUMLP, interleave_gate_up
from fuselm.runtime import needs_autograd

TakeTensor = Callable[[str], torch.Tensor]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for the token mixers' input projections and the LM head, but
    on a GPU one token (a decode step at batch 1) goes through ``decode_linear``'s vector kernel,
    whose weight rows load while the norm ahead of it still runs. Both an fp32 accumulator rounded
    once. (On a CPU F.linear: the Triton interpreter would walk a 248k-row LM head in Python.)"""
    if x.is_cuda and bias is None and x.numel() == x.shape[-1] and not needs_autograd(x, weight):
        return decode_linear(x, weight)
    return F.linear(x, weight, bias)


def _param(*shape) -> nn.Parameter:
    """A weight slot on the meta device; ``load_hf`` assigns the real tensor."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


def _assign(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter ``name`` of ``module`` by ``tensor`` (contiguous, no gradient)."""
    setattr(module, name, nn.Parameter(tensor.contiguous(), requires_grad=False))


def prefixed(take: TakeTensor, prefix: str) -> TakeTensor:
    """``take`` for a child module whose HF names sit under ``prefix``."""
    return lambda name: take(prefix + name)


# ============================================================================ step inputs
@dataclass
class PrefillStep:
    """What every layer needs to prefill the next T prompt tokens of B rows (right-padded: row r
    has ``lengths[r]`` real tokens) into the cache slots ``slots``, after the ``starts[r]`` tokens
    each row already has there (0: a fresh request; a chunked prefill continues from the state its
    earlier chunks left). Device tensors of static shape only, so a CUDA graph may capture a step.

    Padded tokens never reach a real one: they come after it (causal), their K/V land beyond the
    row's length (or in the scratch page), and they enter the DeltaNet state with beta = 0 and
    g = 0 (the state passes them unchanged)."""

    slots: torch.Tensor  # [B] int64, the cache slot of each row (a padding row may repeat a real row)
    state_slots: torch.Tensor  # [B] int64: slots, -1 where a row repeats an earlier row's slot (no state write)
    starts: torch.Tensor  # [B] int64, tokens already in the cache (each row's first position here)
    continues: torch.Tensor  # [B] bool, starts > 0: the row's recurrent state continues from its slot
    lengths: torch.Tensor  # [B] int64, real tokens per row in this chunk (>= 1)
    token_mask: torch.Tensor  # [B, T] bool, the real tokens
    positions: torch.Tensor  # [B, T] int64, starts + 0 .. T-1
    fresh: bool  # host-known: every row starts at 0 (zero conv history, plain causal attention)
    pages: torch.Tensor  # [B, pages_per_slot] int64, each row's block-table row (its K/V pages)
    write_page: torch.Tensor  # [B, T] int64: the page of each token's K/V (the scratch page past the row's table)
    write_column: torch.Tensor  # [B, T] int64: its slot in that page
    cos: torch.Tensor  # [B, T, 1, rotary_dim], model dtype
    sin: torch.Tensor


@dataclass
class DecodeStep:
    """What every layer needs for one token per row of a decode batch (row n decodes cache slot
    ``slots[n]``); all device tensors of static shape."""

    cos: torch.Tensor  # [B, 1, 1, rotary_dim]
    sin: torch.Tensor
    write_page: torch.Tensor  # [B] int64: the page of the token's K/V (the scratch page for inactive rows)
    write_column: torch.Tensor  # [B] int64: its slot in that page
    kv_lengths: torch.Tensor  # [B] int64: positions the token attends to (position + 1; 0 inactive)
    block_table: torch.Tensor  # [B, pages_per_slot] int64: each row's K/V pages (its slot's block-table row)
    state_slots: torch.Tensor  # [B] int32: the row's slot in the state pools, -1 for inactive rows (no state write)
    positions: torch.Tensor  # [B] int64: the token's position (its slot's length before the step)


# ============================================================================ rotary embedding
def rotary_inv_freq(config: Qwen35Config) -> torch.Tensor:
    """HF ``compute_default_rope_parameters``: theta ** -(2i / rotary_dim), fp32."""
    dim = config.rotary_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


# ============================================================================ Gated DeltaNet
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
        self.heads_dim = self.value_dim  # the delta rule's output width (``output``'s input)
        self.kernel_size = c.linear_conv_kernel_dim
        self.hidden_size = c.hidden_size
        self.eps = c.rms_norm_eps
        self.in_proj = _param(self.conv_dim + self.value_dim + 2 * self.num_v_heads, c.hidden_size)
        self.conv_weight = _param(self.conv_dim, 1, self.kernel_size)
        self.A_log = _param(self.num_v_heads)
        self.dt_bias = _param(self.num_v_heads)
        self.norm = _param(self.head_v_dim)
        self.out_proj = _param(c.hidden_size, self.value_dim)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF ``linear_attn.*`` tensors (relative names) and their shapes."""
        D, HV = self.hidden_size, self.num_v_heads
        return {"in_proj_qkv.weight": (self.conv_dim, D), "in_proj_z.weight": (self.value_dim, D),
                "in_proj_b.weight": (HV, D), "in_proj_a.weight": (HV, D),
                "conv1d.weight": (self.conv_dim, 1, self.kernel_size), "A_log": (HV,), "dt_bias": (HV,),
                "norm.weight": (self.head_v_dim,), "out_proj.weight": (D, self.value_dim)}

    def load_hf(self, take: TakeTensor) -> None:
        """The four input projections stacked into ``in_proj`` (one GEMM); A_log and dt_bias in
        the model dtype, as HF loads them."""
        _assign(self, "in_proj", torch.cat([take(f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]))
        _assign(self, "conv_weight", take("conv1d.weight"))
        _assign(self, "A_log", take("A_log"))
        _assign(self, "dt_bias", take("dt_bias"))
        _assign(self, "norm", take("norm.weight"))
        _assign(self, "out_proj", take("out_proj.weight"))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The input projection x [..., D] -> [..., conv_dim + value_dim + 2 HV] (one GEMM);
        ``prefill`` and ``decode`` take it ready-made as ``projected`` (a mixed step computes it
        for its decode rows and prompt tokens in one GEMM)."""
        return linear(x, self.in_proj)

    def _split_projection(self, proj):
        """proj [B, T, P] -> (qkv [B, T, conv_dim], b, a [B, T, HV]), model dtype (z: ``_z``)."""
        qkv, _, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        return qkv, b, a

    def _split_heads(self, conv_out):
        """conv_out [B, T, conv_dim] -> q, k [B, T, H, Kd] and v [B, T, HV, Vd] (HF's split)."""
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.unflatten(-1, (self.num_k_heads, self.head_k_dim)), k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                v.unflatten(-1, (self.num_v_heads, self.head_v_dim)))

    def _z(self, projected: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm's gate z [..., value_dim], a view of ``projected`` [..., P]."""
        return projected[..., self.conv_dim:self.conv_dim + self.value_dim]

    def output(self, heads: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        """The delta rule's output ``heads`` [..., value_dim] -> [..., D]: HF ``Qwen3_5RMSNormGated``
        with z from ``projected`` [..., P] (``w * rms_norm(o).to(dtype)``, Llama rounding, times
        silu(z) in fp32, one rounding to the model dtype), then out_proj: ``decode_linear``'s
        gated_rms_norm prologue, fused into the GEMV (the decode step at one row, or a head_v_dim
        the decode kernel cannot norm). Elsewhere the heads come normed (``gate_heads``, the
        kernels' fused norms) and ``project_out`` runs the plain projection."""
        return decode_linear(heads, self.out_proj, prologue="gated_rms_norm", gate=self._z(projected),
                             norm_weight=self.norm, eps=self.eps, head_dim=self.head_v_dim)

    def project_out(self, heads: torch.Tensor) -> torch.Tensor:
        """out_proj of heads already through the gated RMSNorm (``prefill_heads``,
        ``decode_heads(..., normed=True or gated=True)``) -> [..., D]."""
        return decode_linear(heads, self.out_proj)

    def gate_heads(self, heads: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm of ``output`` on ``heads`` [..., value_dim] in place (z from
        ``projected`` [..., P]): ``linear_prologue`` (one launch for a power-of-two head_v_dim),
        ``output``'s roundings."""
        return linear_prologue(heads, "gated_rms_norm", self._z(projected), norm_weight=self.norm, eps=self.eps,
                               head_dim=self.head_v_dim, out=heads)

    def prefill(self, x: torch.Tensor, cache: DeltaNetCache, step: PrefillStep,
                projected: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] (or ``projected`` = ``project(x)`` [B, T, P]) -> [B, T, D]."""
        projected = self.project(x) if projected is None else projected
        return self.project_out(self.prefill_heads(projected, cache, step))

    def prefill_heads(self, projected: torch.Tensor, cache: DeltaNetCache, step: PrefillStep,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """``project(x)`` [B, T, P] -> the delta rule's output through the gated RMSNorm (``output``'s
        prologue, which the chunk output kernel applies as it stores) [B, T, value_dim], into ``out``
        when given (a contiguous buffer of that shape): ``project_out`` follows plain."""
        qkv, b, a = self._split_projection(projected)
        # Causal depthwise conv + SiLU over each row's tokens after the inputs before the chunk
        # (the slot's conv state; zeros before position 0), as HF's causal_conv1d_fn rounds it;
        # the kernel also leaves the slot's new conv state (``causal_conv1d_silu``).
        conv_out = causal_conv1d_silu(qkv, self.conv_weight, cache.conv, step.slots, step.starts, step.lengths)
        q, k, v = self._split_heads(conv_out)
        # HF: g = -exp(A_log) * softplus(a + dt_bias) in fp32; beta = sigmoid(b) in the model dtype.
        # Padded tokens get g = 0, beta = 0: S <- S * e^0 + 0, the state passes them unchanged.
        g, beta = gated_delta_gates(self.A_log, a, self.dt_bias, b, step.token_mask)
        # q, k, v are read as slices of conv_out (no copies). The recurrent state pool is
        # [slots, HV, Kd, Vd] in the cache's state dtype (read into fp32; each final state rounded
        # once into it). Where no row repeats another (fresh chunks: all start from zeros; a single
        # row, as a mixed step's chunk) the kernels read and write each row's slot in place (a
        # padding row repeating a slot has state slot -1: it writes none). Otherwise a padding row
        # must start from the state of the row it repeats, to compute (and write into the K/V
        # cache) exactly what that row does, and in place it could read the slot after that row
        # had written it: the rows' states are gathered first and the finals scattered.
        B, T = projected.shape[:2]
        out = None if out is None else out.view(B, T, self.num_v_heads, self.head_v_dim)
        scale = self.head_k_dim ** -0.5
        norm = dict(norm_weight=self.norm, norm_gate=self._z(projected), norm_eps=self.eps)
        if step.fresh or B == 1:
            o = chunk_gated_delta_rule(q, k, v, g, beta, scale, cache.recurrent, True, True,
                                       state_indices=step.state_slots, has_initial_state=step.continues, out=out,
                                       **norm)[0]
        else:
            initial = torch.where(step.continues[:, None, None, None], cache.recurrent[step.slots], 0)
            o, final = chunk_gated_delta_rule(q, k, v, g, beta, scale, initial, True, True, out=out, **norm)
            cache.recurrent.index_copy_(0, step.slots, final.to(cache.recurrent.dtype))
        return o.flatten(-2)

    def decode(self, x: torch.Tensor, cache: DeltaNetCache, step: DecodeStep,
               projected: torch.Tensor | None = None) -> torch.Tensor:
        """x [max_batch, 1, D] (or ``projected`` = ``project(x)``) -> [max_batch, 1, D]. in_proj;
        conv update + gates + l2-norm + recurrence on the state pool in one launch (slot -1, an
        inactive row, reads zeros and writes no state); the gated RMSNorm and out_proj. At one row
        the norm is the out projection's fused prologue (``output``: one launch); past it the step
        applies it to each whole head before it stores (a power-of-two head_v_dim), and the out
        projection runs plain: no prologue kernel between them. Same math and roundings as
        ``prefill`` / HF."""
        projected = self.project(x) if projected is None else projected
        if projected.shape[0] == 1 or self.head_v_dim & (self.head_v_dim - 1):
            return self.output(self.decode_heads(projected, cache, step), projected)
        return self.project_out(self.decode_heads(projected, cache, step, normed=True))

    def decode_heads(self, projected: torch.Tensor, cache: DeltaNetCache, step: DecodeStep,
                     out: torch.Tensor | None = None, normed: bool = False, gated: bool = False) -> torch.Tensor:
        """``project(x)`` [max_batch, 1, P] -> the delta rule's output [max_batch, 1, value_dim]
        (into ``out`` when given, a contiguous buffer of that shape), through the gated RMSNorm
        (``output``'s prologue) with ``normed`` (the step kernel applies it, one program a whole
        head; a power-of-two head_v_dim: the decode step's way) or ``gated`` (``gate_heads`` after
        the kernel, whose programs stay short: a mixed step's way, where long programs would hold
        the multiprocessors the prompt chunk's kernels wait for, NOTES.md 83)."""
        N = projected.shape[0]
        o = gated_delta_rule_decode_step(
            projected[:, 0], cache.conv, self.conv_weight, self.A_log, self.dt_bias, cache.recurrent,
            step.state_slots, step.positions, num_k_heads=self.num_k_heads, head_k_dim=self.head_k_dim,
            num_v_heads=self.num_v_heads, head_v_dim=self.head_v_dim,
            norm_weight=self.norm if normed else None, eps=self.eps,
            out=None if out is None else out.view(N, self.num_v_heads, self.head_v_dim))
        o = o.flatten(1)[:, None]
        return self.gate_heads(o, projected) if gated and not normed else o


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
        self.hidden_size = c.hidden_size
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim ** -0.5
        self.q_size, self.kv_size = 2 * self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.heads_dim = self.num_heads * self.head_dim  # attention's output width (``output``'s input)
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, c.hidden_size)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if c.attention_bias else None
        self.q_norm = _param(self.head_dim)
        self.k_norm = _param(self.head_dim)
        self.o_proj = _param(c.hidden_size, self.num_heads * self.head_dim)
        self.o_bias = _param(c.hidden_size) if c.attention_bias else None

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF ``self_attn.*`` tensors (relative names) and their shapes."""
        D, q_rows = self.hidden_size, self.q_size
        shapes = {"q_proj.weight": (q_rows, D), "k_proj.weight": (self.kv_size, D), "v_proj.weight": (self.kv_size, D),
                  "o_proj.weight": (D, q_rows // 2), "q_norm.weight": (self.head_dim,),
                  "k_norm.weight": (self.head_dim,)}
        if self.qkv_bias is not None:
            shapes.update({"q_proj.bias": (q_rows,), "k_proj.bias": (self.kv_size,), "v_proj.bias": (self.kv_size,),
                           "o_proj.bias": (D,)})
        return shapes

    def load_hf(self, take: TakeTensor) -> None:
        """q, k and v projections stacked into ``qkv_proj`` (one GEMM), biases likewise."""
        _assign(self, "qkv_proj", torch.cat([take(f"{n}_proj.weight") for n in ("q", "k", "v")]))
        if self.qkv_bias is not None:
            _assign(self, "qkv_bias", torch.cat([take(f"{n}_proj.bias") for n in ("q", "k", "v")]))
            _assign(self, "o_bias", take("o_proj.bias"))
        _assign(self, "q_norm", take("q_norm.weight"))
        _assign(self, "k_norm", take("k_norm.weight"))
        _assign(self, "o_proj", take("o_proj.weight"))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The q/gate, k, v projection x [..., D] -> [..., 2 nH hd + 2 nKV hd] (one GEMM; see
        ``GatedDeltaNet.project``)."""
        return linear(x, self.qkv_proj, self.qkv_bias)

    def output(self, heads: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        """Attention's output ``heads`` [..., nH hd] -> o_proj(heads * sigmoid(gate)) [..., D] with
        the gate from ``projected`` [..., P], in the model dtype as HF (sigmoid rounded, product
        rounded: ``decode_linear``'s sigmoid_gate prologue), any number of rows. The bias (when
        ``attention_bias``) is added to the rounded product: a second rounding where HF's linear
        has one."""
        y = decode_linear(heads, self.o_proj, prologue="sigmoid_gate", gate=self._gate(projected))
        return y if self.o_bias is None else y + self.o_bias

    def project_out(self, heads: torch.Tensor) -> torch.Tensor:
        """o_proj (+ bias) of heads already gated (``prefill_heads``, ``decode_heads(..., gated=True)``)
        -> [..., D]."""
        y = decode_linear(heads, self.o_proj)
        return y if self.o_bias is None else y + self.o_bias

    def _gate(self, projected: torch.Tensor) -> torch.Tensor:
        """The output gate [..., nH, hd] in place in ``projected`` [..., P] (heads strided: each
        head's query then its gate)."""
        return projected[..., :self.q_size].unflatten(-1, (self.num_heads, 2, self.head_dim))[..., 1, :]

    def prefill(self, x: torch.Tensor, cache: AttentionCache, step: PrefillStep,
                projected: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] (or ``projected`` = ``project(x)`` [B, T, P]) -> [B, T, D]."""
        projected = self.project(x) if projected is None else projected
        return self.project_out(self.prefill_heads(projected, cache, step))

    def prefill_heads(self, projected: torch.Tensor, cache: AttentionCache, step: PrefillStep,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """``project(x)`` [B, T, P] -> attention's output times its sigmoid gate (``output``'s
        prologue, in place on the rows: ``linear_prologue``) [B, T, nH hd], copied into ``out``
        when given: ``project_out`` follows plain."""
        # q/k norm + RoPE + the K/V write, each token a row of ``qk_norm_rope_kv_write`` (HF's
        # roundings: zero-centered RMSNorm per head, fp32 statistics, one rounding; RoPE's products
        # and sum rounded as PyTorch's eager ops round them). K/V of position p go into slot p % P
        # of page pages[p // P] (P = page size), positions past the block-table row (only padding
        # gets there) into the scratch page: the step's write_page / write_column. Padded positions
        # land beyond their row's length, where decode never reads and a later token overwrites.
        B, T, _ = projected.shape
        k = projected.new_empty(B * T, self.num_kv_heads, self.head_dim) if step.fresh else None
        q = qk_norm_rope_kv_write(projected.reshape(B * T, -1), self.q_norm, self.k_norm, step.cos.reshape(B * T, -1),
                                  step.sin.reshape(B * T, -1), cache.key, cache.value, step.write_column.reshape(-1),
                                  num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                  eps=self.eps, write_row=step.write_page.reshape(-1), k_out=k)
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        # Causal attention, fp32 softmax. A fresh chunk attends within itself (SDPA, HF's sdpa
        # path); a later one to its row's positions 0 .. position, the earlier chunks' K/V and its
        # own, read from its pages where they lie (``prefill_attention``: no gather, no mask
        # tensor; padded queries give zeros).
        if step.fresh:
            k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = projected[..., self.q_size + self.kv_size:].unflatten(-1, (self.num_kv_heads, self.head_dim))
            attn = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, scale=self.scale,
                                                  enable_gqa=True)
        else:
            attn = prefill_attention(q, cache.key, cache.value, step.pages, step.starts, step.lengths, self.scale)
        if out is None:
            out = attn.transpose(1, 2).reshape(B, T, -1)
        else:
            out.view(B, T, self.num_heads, self.head_dim).copy_(attn.transpose(1, 2))
        return linear_prologue(out, "sigmoid_gate", self._gate(projected), out=out)

    def decode(self, x: torch.Tensor, cache: AttentionCache, step: DecodeStep,
               projected: torch.Tensor | None = None) -> torch.Tensor:
        """x [max_batch, 1, D] (or ``projected`` = ``project(x)``) -> [max_batch, 1, D]. qkv GEMM;
        q/k norm + RoPE + the K/V write into each row's page and slot in one launch
        (``qk_norm_rope_kv_write``, as ``prefill_heads``); attention over each
        row's positions 0 .. position only, through its block-table row (``decode_attention``:
        split over the sequence, fp32 softmax); the sigmoid gate, then o_proj. At one row the gate
        is the projection's fused prologue (``output``, reading the gate in place); past it the
        attention's split-K combine applies it before it stores, and o_proj runs plain."""
        projected = self.project(x) if projected is None else projected
        if projected.shape[0] == 1:
            return self.output(self.decode_heads(projected, cache, step), projected)
        return self.project_out(self.decode_heads(projected, cache, step, gated=True))

    def decode_heads(self, projected: torch.Tensor, cache: AttentionCache, step: DecodeStep,
                     out: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
        """``project(x)`` [max_batch, 1, P] -> attention's output [max_batch, 1, nH hd] (copied into
        ``out`` when given); with ``gated``, times its sigmoid gate (``output``'s prologue)."""
        q = qk_norm_rope_kv_write(projected, self.q_norm, self.k_norm, step.cos, step.sin, cache.key, cache.value,
                                  step.write_column, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                  head_dim=self.head_dim, eps=self.eps, write_row=step.write_page)
        attn = decode_attention(q, cache.key, cache.value, step.kv_lengths, self.scale, block_table=step.block_table,
                                gate=self._gate(projected)[:, 0] if gated else None)  # [B, heads, head_dim]
        return attn.flatten(1)[:, None] if out is None else out.copy_(attn.flatten(1)[:, None])


# ============================================================================ MLP
class MLP(SwiGLUMLP):
    """HF ``Qwen3_5MLP`` on ``swiglu_mlp``: ``w13`` [2F, D] is gate_proj and up_proj interleaved row
    by row (``interleave_gate_up``, done once at load), ``w2`` [D, F] is down_proj."""

    def __init__(self, config: Qwen35Config):
        super().__init__(config.hidden_size, config.intermediate_size, "silu", device="meta")
        self.requires_grad_(False)
        self.hidden_size, self.intermediate_size = config.hidden_size, config.intermediate_size

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        D, F_ = self.hidden_size, self.intermediate_size
        return {"gate_proj.weight": (F_, D), "up_proj.weight": (F_, D), "down_proj.weight": (D, F_)}

    def load_hf(self, take: TakeTensor) -> None:
        _assign(self, "w13", interleave_gate_up(take("gate_proj.weight"), take("up_proj.weight")))
        _assign(self, "w2", take("down_proj.weight"))


# ============================================================================ MoE
class MoE(SwiGLUMoE):
    """HF ``Qwen3_5MoeSparseMoeBlock`` on ``SwiGLUMoE`` (routing and grouped expert GEMMs): a
    router over ``num_experts`` SwiGLU experts, ``num_experts_per_tok`` per token, plus the shared
    expert scaled by its sigmoid gate. HF names are the checkpoints' (one tensor per expert:
    ``experts.{j}.gate_proj.weight``, as ``save_pretrained`` writes them; a live model's fused
    ``experts.gate_up_proj`` is split into those views by the loader); ``load_hf`` stacks them into
    the kernels' layout once."""

    def __init__(self, config: Qwen35Config):
        c = config
        E, H, F_, F_s = c.num_experts, c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size
        meta = lambda *shape: torch.empty(*shape, device="meta")  # noqa: E731
        super().__init__(meta(E, H), c.num_experts_per_tok, meta(E, 2 * F_, H), meta(E, H, F_), meta(F_s, H),
                         meta(F_s, H), meta(H, F_s), meta(1, H))
        self.shared_intermediate_size = F_s

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        E, H, F_, F_s = self.num_experts, self.hidden_size, self.intermediate_size, self.shared_intermediate_size
        shapes = {"gate.weight": (E, H), "shared_expert_gate.weight": (1, H),
                  "shared_expert.gate_proj.weight": (F_s, H), "shared_expert.up_proj.weight": (F_s, H),
                  "shared_expert.down_proj.weight": (H, F_s)}
        for j in range(E):
            shapes.update({f"experts.{j}.gate_proj.weight": (F_, H), f"experts.{j}.up_proj.weight": (F_, H),
                           f"experts.{j}.down_proj.weight": (H, F_)})
        return shapes

    def load_hf(self, take: TakeTensor) -> None:
        experts = range(self.num_experts)
        weights = self.kernel_weights(take("gate.weight"), [take(f"experts.{j}.gate_proj.weight") for j in experts],
                                      [take(f"experts.{j}.up_proj.weight") for j in experts],
                                      [take(f"experts.{j}.down_proj.weight") for j in experts],
                                      take("shared_expert.gate_proj.weight"), take("shared_expert.up_proj.weight"),
                                      take("shared_expert.down_proj.weight"), take("shared_expert_gate.weight"))
        for name, tensor in weights.items():
            _assign(self, name, tensor)


def split_fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A live HF MoE model's state dict with each fused ``mlp.experts.gate_up_proj`` [E, 2F, H] /
    ``down_proj`` [E, H, F] replaced by the checkpoints' per-expert names (views, no copies)."""
    out = {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition("experts.")
        if leaf == "gate_up_proj":
            F_ = tensor.shape[1] // 2
            for j in range(tensor.shape[0]):
                out[f"{prefix}experts.{j}.gate_proj.weight"] = tensor[j, :F_]
                out[f"{prefix}experts.{j}.up_proj.weight"] = tensor[j, F_:]
        elif leaf == "down_proj":
            for j in range(tensor.shape[0]):
                out[f"{prefix}experts.{j}.down_proj.weight"] = tensor[j]
        else:
            out[name] = tensor
    return out


# ============================================================================ decoder layer
class DecoderLayer(nn.Module):
    """Token mixer + MLP. ``input_norm`` / ``post_attention_norm`` [D] are HF's input_layernorm /
    post_attention_layernorm (zero-centered); the model runs them, fused with the residual adds
    (``Qwen35._layers``)."""

    def __init__(self, config: Qwen35Config, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.mixer = GatedDeltaNet(config) if layer_type == LINEAR_ATTENTION else GatedAttention(config)
        self.mixer_hf_prefix = "linear_attn." if layer_type == LINEAR_ATTENTION else "self_attn."
        self.mlp = MoE(config) if config.is_moe else MLP(config)
        self.input_norm = _param(config.hidden_size)
        self.post_attention_norm = _param(config.hidden_size)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        D = self.input_norm.shape[0]
        shapes = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,)}
        shapes.update({self.mixer_hf_prefix + name: shape for name, shape in self.mixer.hf_shapes().items()})
        shapes.update({"mlp." + name: shape for name, shape in self.mlp.hf_shapes().items()})
        return shapes

    def load_hf(self, take: TakeTensor) -> None:
        _assign(self, "input_norm", take("input_layernorm.weight"))
        _assign(self, "post_attention_norm", take("post_attention_layernorm.weight"))
        self.mixer.load_hf(prefixed(take, self.mixer_hf_prefix))
        self.mlp.load_hf(prefixed(take, "mlp."))
