"""``patch_hf``: train a Hugging Face model instance on fuselm's kernels (Liger-Kernel style).

    model = Qwen3_5ForCausalLM.from_pretrained(...)
    fuselm.patch_hf(model)                      # in place; returns the model
    loss = model(input_ids=ids, labels=ids).loss  # fused loss, output.logits is None in training

``fuselm.patch_hf(model)`` takes an HF transformers (5.x) model *instance* and replaces the
forwards of its modules, in place, with fuselm's ops. Nothing else changes: the parameters stay
the same tensors (an optimizer built before or after the patch, ``state_dict``, ``save_pretrained``,
tied embeddings, LoRA adapters on the projections are unaffected), so HF's Trainer or a plain
training loop runs unchanged and faster, with less activation memory.

Per part (each a keyword of :func:`patch_hf`, True by default; False leaves that part HF's):

- ``rms_norm``: the decoder's RMSNorm modules (input / post-attention norms, the final norm,
  q_norm / k_norm) call :func:`fuselm.rms_norm` (forward and backward kernels). Qwen3.5's norms
  are zero-centered, ``(x_normed * (1 + w.float())).to(dtype)``: ``offset=1``, one rounding;
  Llama's and Qwen3's are ``w * x_normed.to(dtype)``: ``offset=0``, the normalised row rounded to
  the input dtype first, as HF. Where HF's output dtype would differ from the input's (a Llama
  norm with an fp32 weight on bf16 activations: HF promotes to fp32) or the dtype is not a kernel
  dtype (fp64), the call runs HF's own forward. Qwen3.5's gated norm after each Gated DeltaNet
  (``RMSNormGated``: ``w * norm(x).to(dtype) * silu(gate)``) calls
  :func:`fuselm.ops.gated_rms_norm.gated_rms_norm`: HF's roundings forward, an fp32 backward,
  x and gate kept for the backward where HF's eager steps keep five tensors, three of them fp32.
- ``swiglu``: the gated MLP ``down(act(gate(x)) * up(x))`` keeps its three ``nn.Linear``
  projections (cuBLAS GEMMs, gradients straight to the original weights, LoRA/hooks still apply)
  and replaces ``act(gate) * up`` by :func:`fuselm.silu_mul`: one kernel forward and one backward,
  saving only gate and up for the backward, where eager PyTorch also keeps silu(gate) and runs two
  elementwise kernels forward, three backward. Numerics: silu(gate) rounded to the dtype, times
  up, one rounding (HF's). Only SiLU MLPs are patched. (``gemm_swiglu`` / ``swiglu_mlp`` fuse the
  gate/up GEMM too but read a [2F, D] interleaved weight: HF's separate gate/up parameters would
  have to be copied every call, or the parameters replaced, which would change the ``state_dict``.)
- ``gated_delta_net`` (Qwen3.5, Qwen3.5-MoE): the Gated DeltaNet layer's forward follows HF's line
  by line (projections, the causal conv1d, gates, HF's gated RMSNorm, out_proj) with the chunked
  recurrence, HF's ``torch_chunk_gated_delta_rule`` (fla's kernel when fla-core is installed),
  replaced by :func:`fuselm.ops.gated_delta_rule.chunk_gated_delta_rule` with
  ``use_qk_l2norm_in_kernel=True`` as HF calls it (forward and backward kernels). q and k are
  passed with their key heads, not repeated to the value heads (the kernel reads key head
  ``hv // (HV // H)`` for value head hv, which is ``repeat_interleave``'s order). Without a cache
  or with an empty one (HF creates a ``DynamicCache`` whenever ``use_cache`` is on, training
  included) the fuselm path runs and fills the cache as HF does; a cache that already holds
  this layer's state (generation's decode steps, a continued prefill) runs HF's own forward.
  Packed sequences (``cu_seq_lens_q`` from a flattening collator) go to the kernel as
  ``cu_seqlens``, as HF passes them to fla's kernel (HF's torch fallback drops them and runs the
  pack as one sequence). The conv1d + SiLU of whole sequences is
  :func:`fuselm.ops.causal_conv1d.short_conv_silu` (forward and backward kernels on the [B, T, C]
  projection, no transposes; HF's two roundings in the forward, an fp32 backward; an empty cache
  gets its conv state from HF's ``update_conv_state``); for packed sequences (HF's torch conv
  does not stop at their boundaries either) or a conv bias it stays HF's.
- ``add_rms_norm``: each decoder layer's forward is HF's, line by line, except that the residual
  add after the token mixer and the post-attention norm run as one :func:`fuselm.add_rms_norm`
  (forward and backward kernels: the sum rounded to the dtype, then normalised, HF's roundings);
  where the norm is not patched (``rms_norm=False``), has hooks (accelerate offload) or would run
  HF's own forward (the dtype rules of ``rms_norm`` above) the two steps stay HF's. The add after
  the MLP stays a plain add (it meets the next layer's norm across HF's layer loop).
- ``cross_entropy`` (models with an ``lm_head``: ``*ForCausalLM``, ``*ForConditionalGeneration``):
  in training mode (``model.training``), a forward with ``labels`` computes the loss with
  :func:`fuselm.linear_cross_entropy` on the final hidden states and ``lm_head.weight``: the
  [tokens, vocab] logits are never materialised, and the output's ``logits`` is None (as Liger's
  ``skip_logits``). HF's loss semantics are kept: labels shifted left by one (or
  ``shift_labels`` as given), ``ignore_index`` (-100) rows skipped, the mean over the counted rows,
  or with ``num_items_in_batch`` (HF Trainer's gradient accumulation) the sum divided by it; the
  loss is fp32 (HF upcasts the logits). HF's own forward runs the model, so everything around the
  loss stays HF's (MoE router aux loss, multimodal inputs, ``logits_to_keep``: the loss is taken
  over the kept positions as HF takes it, labels of the kept length). Under autocast the hidden
  states and the weight are cast to the autocast dtype, as ``lm_head`` would be. In eval mode,
  without labels, or when ``model.loss_function`` was replaced by the user (or a config
  ``loss_type`` other than causal LM), HF's forward runs unchanged (logits computed).
  Difference: where every label is ignored the loss is 0 (HF: NaN).

What stays HF's everywhere: attention (HF's SDPA / flash attention), rotary embeddings, the
embeddings, the MoE router and routed experts (``Qwen3_5MoeExperts``: fuselm's grouped-GEMM MoE
has no backward), the GDN conv1d for packed sequences, the vision tower, the residual add after each
MLP. Patching is per instance and idempotent (a patched module carries ``_fuselm_patch``;
patching again skips it); a deep copy of a patched model is patched (its forwards are bound
methods, rebound by ``copy.deepcopy``). With PEFT, patch the base
model (``peft_model.get_base_model()``): the wrapper is not one of :data:`SUPPORTED`. An
``lm_head`` replaced after the patch (``resize_token_embeddings``) is not patched: the loss then
runs HF's way until ``patch_hf`` is called again. Eager mode: the patched forwards set
and reset a flag around the call, which is not meant to be traced by ``torch.compile``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from fuselm.runtime import KERNEL_DTYPES

__all__ = ["patch_hf", "patch_qwen3_5", "patch_qwen3_5_moe", "patch_qwen3", "patch_llama", "patched_parts", "SUPPORTED"]

_MARK = "_fuselm_patch"  # on a patched module: the part that patched it
_ORIGINAL = "_fuselm_original_forward"  # its forward before the patch (bound), for the fallbacks
_PASS_HIDDEN = "_fuselm_pass_hidden"  # on a patched lm_head: return the hidden states (loss path)

# family -> (HF modeling module, supported classes, RMSNorm class, zero-centered?, MLP class, GDN class,
#            decoder layer class)
_FAMILIES = {
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5",
                ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5TextModel", "Qwen3_5Model"),
                "Qwen3_5RMSNorm", True, "Qwen3_5MLP", "Qwen3_5GatedDeltaNet", "Qwen3_5DecoderLayer"),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeTextModel",
                     "Qwen3_5MoeModel"),
                    "Qwen3_5MoeRMSNorm", True, "Qwen3_5MoeMLP", "Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeDecoderLayer"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", ("Qwen3ForCausalLM", "Qwen3Model"),
              "Qwen3RMSNorm", False, "Qwen3MLP", None, "Qwen3DecoderLayer"),
    "llama": ("transformers.models.llama.modeling_llama", ("LlamaForCausalLM", "LlamaModel"),
              "LlamaRMSNorm", False, "LlamaMLP", None, "LlamaDecoderLayer"),
}
SUPPORTED = tuple(name for family in _FAMILIES.values() for name in family[1])
"""The HF classes :func:`patch_hf` accepts (transformers 5.x)."""


def _modeling(family: str):
    """The family's HF modeling module, or None when this transformers lacks it."""
    try:
        return importlib.import_module(_FAMILIES[family][0])
    except ImportError:
        return None


def _family_of(model) -> str | None:
    for family, (_, classes, *_rest) in _FAMILIES.items():
        modeling = _modeling(family)
        if modeling is None:
            continue
        if isinstance(model, tuple(getattr(modeling, name) for name in classes if hasattr(modeling, name))):
            return family
    return None


def _unsupported(model) -> ValueError:
    return ValueError(f"fuselm.patch_hf: {type(model).__module__}.{type(model).__name__} is not supported; "
                      f"supported HF classes: {', '.join(SUPPORTED)}")


def _kernel_dtype(*tensors: torch.Tensor) -> bool:
    return all(t.dtype in KERNEL_DTYPES for t in tensors)


def _patch(module: nn.Module, part: str, forward) -> bool:
    """Bind ``forward`` as ``module``'s forward (instance attribute), keeping the previous one for
    the fallbacks; False (nothing done) when the module is already patched."""
    if getattr(module, _MARK, None) is not None:
        return False
    object.__setattr__(module, _ORIGINAL, module.forward)
    object.__setattr__(module, "forward", types.MethodType(forward, module))
    object.__setattr__(module, _MARK, part)
    return True


def patched_parts(model: nn.Module) -> dict[str, int]:
    """How many of ``model``'s modules each part patched, e.g. ``{"rms_norm": 9, "swiglu": 2, ...}``."""
    counts: dict[str, int] = {}
    for module in model.modules():
        part = getattr(module, _MARK, None)
        if part is not None:
            counts[part] = counts.get(part, 0) + 1
    return counts


# ----------------------------------------------------------------------------- rms_norm
def _zero_centered_rms_norm_forward(self, x):
    """Qwen3.5's RMSNorm: ``(x_normed * (1 + w.float())).type_as(x)`` = ``rms_norm(offset=1)``."""
    if not _kernel_dtype(x, self.weight):
        return getattr(self, _ORIGINAL)(x)
    from fuselm.ops.rms_norm import rms_norm

    return rms_norm(x, self.weight, self.eps, 1.0)


def _rms_norm_forward(self, x):
    """Llama / Qwen3 RMSNorm: ``w * x_normed.to(dtype)`` = ``rms_norm(offset=0)``."""
    if not _kernel_dtype(x, self.weight) or torch.promote_types(self.weight.dtype, x.dtype) != x.dtype:
        return getattr(self, _ORIGINAL)(x)  # HF's output would be the promoted dtype
    from fuselm.ops.rms_norm import rms_norm

    return rms_norm(x, self.weight, self.variance_epsilon, 0.0)


def _gated_rms_norm_forward(self, hidden_states, gate):
    """Qwen3.5's ``RMSNormGated`` (after the GDN recurrence): ``w * norm(x).to(dtype) * silu(gate)``
    = :func:`fuselm.ops.gated_rms_norm.gated_rms_norm`, HF's roundings forward, an fp32 backward."""
    if not _kernel_dtype(hidden_states, gate, self.weight) or gate.dtype != hidden_states.dtype \
            or gate.shape != hidden_states.shape:
        return getattr(self, _ORIGINAL)(hidden_states, gate)
    from fuselm.ops.gated_rms_norm import gated_rms_norm

    return gated_rms_norm(hidden_states, gate, self.weight, self.variance_epsilon)


# ----------------------------------------------------------------------------- swiglu
def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act, (nn.SiLU, SiLUActivation))


def _swiglu_mlp_forward(self, x):
    """``down(silu_mul(gate(x), up(x)))``: HF's projections, fuselm's SwiGLU."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not _kernel_dtype(gate) or gate.dtype != up.dtype or gate.shape != up.shape:
        return self.down_proj(self.act_fn(gate) * up)
    from fuselm.ops.silu_mul import silu_mul

    return self.down_proj(silu_mul(gate, up))


# ----------------------------------------------------------------------------- gated_delta_net
_GDN_ATTRS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj",
              "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_kernel_size", "activation", "layer_idx")


def _gated_delta_net_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Dispatch: HF's forward where a cache holds this layer's state (decode, continued prefill)
    or the dtype is not a kernel dtype; the fuselm path otherwise."""
    if (cache_params is not None and cache_params.has_previous_state(self.layer_idx, state_idx=0)) \
            or not _kernel_dtype(hidden_states):
        return getattr(self, _ORIGINAL)(hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                                        **kwargs)
    return _gdn_fuselm_forward(self, hidden_states, cache_params, attention_mask, **kwargs)


def _gdn_fuselm_forward_body(self, hidden_states, cache_params, attention_mask, **kwargs):
    """HF's ``Qwen3_5GatedDeltaNet.forward`` (transformers 5.17) for a prefill from the zero state,
    with fuselm's chunked gated delta rule as the core."""
    from fuselm.ops.causal_conv1d import short_conv_silu
    from fuselm.ops.gated_delta_rule import chunk_gated_delta_rule

    hf = sys.modules[type(self).__module__]  # HF's helpers, as the class's own forward calls them
    hidden_states = hf.apply_mask_to_padding_states(hidden_states, attention_mask)
    batch_size, seq_len, _ = hidden_states.shape

    mixed_qkv = self.in_proj_qkv(hidden_states)  # [B, T, conv_dim]
    z = self.in_proj_z(hidden_states).reshape(batch_size, seq_len, -1, self.head_v_dim)
    b = self.in_proj_b(hidden_states)
    a = self.in_proj_a(hidden_states)

    if kwargs.get("cu_seq_lens_q") is None and self.conv1d.bias is None and self.activation in ("silu", "swish"):
        # whole sequences from zero history (a cache here is empty for this layer: the dispatcher
        # sends the others to HF's forward): the conv + SiLU on [B, T, C], no transposes; the
        # cache keeps the last inputs as HF's update_conv_state keeps them (its return unused)
        if cache_params is not None:
            cache_params.update_conv_state(mixed_qkv.transpose(1, 2), self.layer_idx,
                                           conv_kernel_size=self.conv_kernel_size)
        mixed_qkv = short_conv_silu(mixed_qkv, self.conv1d.weight)
    else:  # packed sequences or a conv bias: HF's conv
        mixed_qkv = mixed_qkv.transpose(1, 2)
        if cache_params is not None:
            mixed_qkv = cache_params.update_conv_state(mixed_qkv, self.layer_idx,
                                                       conv_kernel_size=self.conv_kernel_size)
        mixed_qkv = hf.causal_conv1d_fn(mixed_qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                        activation=self.activation, **kwargs)
        if cache_params is not None:
            mixed_qkv = mixed_qkv[:, :, -seq_len:]  # drop the (zero) previous states
        mixed_qkv = mixed_qkv.transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(batch_size, seq_len, -1, self.head_k_dim)
    key = key.reshape(batch_size, seq_len, -1, self.head_k_dim)
    value = value.reshape(batch_size, seq_len, -1, self.head_v_dim)

    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    # No repeat_interleave of q/k to the value heads: the kernel maps value head hv to key head
    # hv // (HV // H), repeat_interleave's order, without the copies.
    core_attn_out, last_recurrent_state = chunk_gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=None, output_final_state=cache_params is not None,
        use_qk_l2norm_in_kernel=True, cu_seqlens=kwargs.get("cu_seq_lens_q"),
    )
    if cache_params is not None:
        cache_params.update_recurrent_state(last_recurrent_state, self.layer_idx)

    core_attn_out = core_attn_out.reshape(-1, self.head_v_dim)
    z = z.reshape(-1, self.head_v_dim)
    core_attn_out = self.norm(core_attn_out, z)
    core_attn_out = core_attn_out.reshape(batch_size, seq_len, -1)
    return self.out_proj(core_attn_out)


def _with_conv_hooks(body):
    """HF decorates the GDN forward with accelerate's ``force_accelerate_hooks("conv1d")`` (the
    conv weight is read directly, not through conv1d's forward): so is this one."""
    try:
        from transformers.integrations.accelerate import force_accelerate_hooks
    except ImportError:  # pragma: no cover
        return body
    return force_accelerate_hooks("conv1d")(body)


_gdn_fuselm_forward = _with_conv_hooks(_gdn_fuselm_forward_body)


# ----------------------------------------------------------------------------- cross_entropy
def _lm_head_forward(self, hidden_states):
    """The lm_head: its own forward, or (during a patched loss forward) the hidden states."""
    if getattr(self, _PASS_HIDDEN, False):
        return hidden_states
    return getattr(self, _ORIGINAL)(hidden_states)


def _fused_causal_lm_loss(head: nn.Module, logits, labels, vocab_size=None, num_items_in_batch=None,
                          ignore_index: int = -100, shift_labels=None, **kwargs):
    """HF's ``ForCausalLMLoss`` with ``logits`` = the hidden states the lm_head was given: the
    loss of ``lm_head(hidden)`` by :func:`fuselm.linear_cross_entropy`, no logits materialised."""
    from fuselm.ops.linear_cross_entropy import linear_cross_entropy

    hidden = logits
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)  # tokens < n predict n
        shift_labels = labels[..., 1:]
    shift_labels = shift_labels.to(hidden.device).reshape(-1)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if shift_labels.numel() != hidden.shape[0]:
        raise ValueError(f"fuselm.patch_hf cross_entropy: {shift_labels.numel()} labels for {hidden.shape[0]} "
                         "positions (with logits_to_keep, pass labels of the kept positions, as HF's loss needs)")
    weight, bias = head.weight, head.bias
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device_type, enabled=False):
        if num_items_in_batch is None:
            return linear_cross_entropy(hidden, weight, shift_labels, bias, ignore_index=ignore_index, reduction="mean")
        loss = linear_cross_entropy(hidden, weight, shift_labels, bias, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _labels_position(forward) -> int | None:
    try:
        parameters = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):  # pragma: no cover
        return None
    return parameters.index("labels") if "labels" in parameters else None


def _causal_lm_forward(self, *args, **kwargs):
    """HF's forward; in training with labels and HF's causal-LM loss, the fused loss and no logits."""
    original = getattr(self, _ORIGINAL)
    position = self._fuselm_labels_position
    labels = kwargs.get("labels")
    if labels is None and position is not None and len(args) > position:
        labels = args[position]
    head = self.get_output_embeddings()
    if labels is None or not self.training or getattr(head, _MARK, None) != "cross_entropy" \
            or getattr(head, _PASS_HIDDEN, False) or not _uses_causal_lm_loss(self):
        return original(*args, **kwargs)

    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    object.__setattr__(self, "_loss_function", functools.partial(_fused_causal_lm_loss, head))
    object.__setattr__(head, _PASS_HIDDEN, True)
    try:
        output = original(*args, return_dict=True, **kwargs)
    finally:
        object.__setattr__(head, _PASS_HIDDEN, False)
        object.__delattr__(self, "_loss_function")
    # The "logits" field holds the hidden states the lm_head passed through: drop it.
    output = type(output)(**{key: value for key, value in output.items() if key != "logits"})
    return output if return_dict else output.to_tuple()


def _uses_causal_lm_loss(model) -> bool:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return "_loss_function" not in model.__dict__ and model.loss_function is ForCausalLMLoss


def _patch_cross_entropy(model: nn.Module) -> None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return  # a base model (no lm_head): nothing to fuse
    _patch(head, "cross_entropy", _lm_head_forward)
    # The patched forward shows HF's signature (HF Trainer reads it: remove_unused_columns, loss kwargs).
    if _patch(model, "cross_entropy", _with_signature(_causal_lm_forward, type(model).forward)):
        object.__setattr__(model, "_fuselm_labels_position",
                           _labels_position(types.MethodType(type(model).forward, model)))


def _with_signature(fn, like):
    """A copy of the function ``fn`` whose ``inspect.signature`` is ``like``'s (a module-level
    function, not a closure: a bound method of it deep-copies with its model)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__doc__ = fn.__kwdefaults__, like.__doc__
    copy.__signature__ = inspect.signature(like)
    return copy


# ----------------------------------------------------------------------------- add_rms_norm
_LAYER_ATTRS = ("input_layernorm", "post_attention_layernorm", "mlp")


def _add_post_attention_norm(self, mixed, residual):
    """(post_attention_layernorm(residual + mixed), residual + mixed) in one :func:`fuselm.add_rms_norm`
    (the sum rounded to the dtype, then normalised, as HF's two steps); the add, then the norm
    module called, where that norm is not fuselm's (``rms_norm=False``), carries hooks (accelerate's
    offload, user hooks: the weight is read only through its forward) or would run HF's own forward
    (``_rms_norm_forward``'s dtype rules)."""
    norm = self.post_attention_layernorm
    offset = self._fuselm_norm_offset
    hooked = hasattr(norm, "_hf_hook") or norm._forward_hooks or norm._forward_pre_hooks  # accelerate, user hooks
    if hooked or getattr(norm, _MARK, None) != "rms_norm" or not _kernel_dtype(mixed, residual, norm.weight) \
            or mixed.dtype != residual.dtype or mixed.shape != residual.shape \
            or (offset == 0.0 and torch.promote_types(norm.weight.dtype, mixed.dtype) != mixed.dtype):
        total = residual + mixed
        return norm(total), total
    from fuselm.ops.rms_norm import add_rms_norm

    eps = norm.eps if offset == 1.0 else norm.variance_epsilon
    return add_rms_norm(mixed, residual, norm.weight, eps, offset)


def _qwen3_5_decoder_layer_forward(self, hidden_states, position_embeddings, attention_mask=None, position_ids=None,
                                   past_key_values=None, **kwargs):
    """HF's Qwen3.5 (and -MoE) decoder layer with the residual add and the post-attention norm fused."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    if self.block_type == "linear_attention":
        hidden_states = self.linear_attn(hidden_states=hidden_states, cache_params=past_key_values,
                                         attention_mask=attention_mask, **kwargs)
    elif self.block_type == "full_attention":
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, past_key_values=past_key_values,
                                          position_embeddings=position_embeddings, **kwargs)
    hidden_states, residual = _add_post_attention_norm(self, hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    if isinstance(hidden_states, tuple):  # the MoE block (HF unpacks it the same way)
        hidden_states, _ = hidden_states
    return residual + hidden_states


def _decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                           use_cache=False, position_embeddings=None, **kwargs):
    """HF's Llama / Qwen3 decoder layer with the residual add and the post-attention norm fused."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                                      position_embeddings=position_embeddings, **kwargs)
    hidden_states, residual = _add_post_attention_norm(self, hidden_states, residual)
    return residual + self.mlp(hidden_states)


def _patch_decoder_layer(layer: nn.Module, zero_centered: bool) -> None:
    forward = _qwen3_5_decoder_layer_forward if zero_centered else _decoder_layer_forward
    # The patched forward shows HF's signature (gradient checkpointing and HF's kwargs checks read it).
    if _patch(layer, "add_rms_norm", _with_signature(forward, type(layer).forward)):
        object.__setattr__(layer, "_fuselm_norm_offset", 1.0 if zero_centered else 0.0)


# ----------------------------------------------------------------------------- per family
def _text_model(model: nn.Module) -> nn.Module:
    """The language model of a (vision-)language wrapper, else the model itself."""
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "language_model", None), nn.Module):
        return inner.language_model
    if isinstance(getattr(model, "language_model", None), nn.Module):
        return model.language_model
    return model


def _patch_family(family: str, model: nn.Module, rms_norm: bool, swiglu: bool, gated_delta_net: bool,
                  cross_entropy: bool, add_rms_norm: bool) -> nn.Module:
    if _family_of(model) != family:
        raise _unsupported(model) if _family_of(model) is None else ValueError(
            f"fuselm: {type(model).__name__} is a {_family_of(model)} model, not {family}: use fuselm.patch_hf")
    _, _, norm_name, zero_centered, mlp_name, gdn_name, layer_name = _FAMILIES[family]
    modeling = _modeling(family)
    norm_class, mlp_class = getattr(modeling, norm_name), getattr(modeling, mlp_name)
    gdn_class = getattr(modeling, gdn_name) if gdn_name else None
    layer_class = getattr(modeling, layer_name)
    text = _text_model(model)
    if add_rms_norm:
        for module in text.modules():
            if isinstance(module, layer_class):
                wanted = _LAYER_ATTRS + (("block_type",) if zero_centered else ())
                missing = [name for name in wanted if not hasattr(module, name)]
                if not (hasattr(module, "self_attn") or zero_centered and hasattr(module, "linear_attn")):
                    missing.append("self_attn")
                if missing:
                    raise ValueError(f"fuselm.patch_hf: this transformers' {layer_name} lacks {missing} (written for "
                                     "transformers 5.17); pass add_rms_norm=False")
    if gated_delta_net and gdn_class is not None:
        for module in text.modules():
            if isinstance(module, gdn_class):
                missing = [name for name in _GDN_ATTRS if not hasattr(module, name)]
                if missing:
                    raise ValueError(f"fuselm.patch_hf: this transformers' {gdn_name} lacks {missing} (written for "
                                     "transformers 5.17); pass gated_delta_net=False")
    gated_norm_class = getattr(modeling, norm_name + "Gated", None)  # the GDN layers' gated norm
    for module in text.modules():
        if rms_norm and isinstance(module, norm_class):
            _patch(module, "rms_norm", _zero_centered_rms_norm_forward if zero_centered else _rms_norm_forward)
        elif rms_norm and gated_norm_class is not None and isinstance(module, gated_norm_class) \
                and getattr(module, "activation", None) in ("silu", "swish"):
            _patch(module, "rms_norm", _gated_rms_norm_forward)
        elif swiglu and isinstance(module, mlp_class) and _is_silu(module.act_fn):
            _patch(module, "swiglu", _swiglu_mlp_forward)
        elif gated_delta_net and gdn_class is not None and isinstance(module, gdn_class):
            _patch(module, "gated_delta_net", _gated_delta_net_forward)
        elif add_rms_norm and isinstance(module, layer_class):
            _patch_decoder_layer(module, zero_centered)
    if cross_entropy:
        _patch_cross_entropy(model)
    return model


def patch_qwen3_5(model, *, rms_norm: bool = True, swiglu: bool = True, gated_delta_net: bool = True,
                  cross_entropy: bool = True, add_rms_norm: bool = True):
    """Patch an HF Qwen3.5 dense model (``Qwen3_5ForCausalLM``, ``Qwen3_5ForConditionalGeneration``:
    its language model, ``Qwen3_5TextModel``, ``Qwen3_5Model``): zero-centered RMSNorms (offset 1),
    the MLPs' SwiGLU, the Gated DeltaNet core, the fused cross-entropy. See the module docstring."""
    return _patch_family("qwen3_5", model, rms_norm, swiglu, gated_delta_net, cross_entropy, add_rms_norm)


def patch_qwen3_5_moe(model, *, rms_norm: bool = True, swiglu: bool = True, gated_delta_net: bool = True,
                      cross_entropy: bool = True, add_rms_norm: bool = True):
    """Patch an HF Qwen3.5-MoE model (``Qwen3_5MoeForCausalLM`` and the wrapper / base classes): the
    norms, the Gated DeltaNet core, the fused cross-entropy, and ``swiglu`` on the shared expert
    (a plain gated MLP). The router and the routed experts stay HF's."""
    return _patch_family("qwen3_5_moe", model, rms_norm, swiglu, gated_delta_net, cross_entropy, add_rms_norm)


def patch_qwen3(model, *, rms_norm: bool = True, swiglu: bool = True, cross_entropy: bool = True,
                add_rms_norm: bool = True):
    """Patch an HF Qwen3 dense model (``Qwen3ForCausalLM``, ``Qwen3Model``): RMSNorms (offset 0,
    q_norm / k_norm included), the MLPs' SwiGLU, the fused cross-entropy."""
    return _patch_family("qwen3", model, rms_norm, swiglu, False, cross_entropy, add_rms_norm)


def patch_llama(model, *, rms_norm: bool = True, swiglu: bool = True, cross_entropy: bool = True,
                add_rms_norm: bool = True):
    """Patch an HF Llama model (``LlamaForCausalLM``, ``LlamaModel``): RMSNorms (offset 0), the MLPs'
    SwiGLU (biases, ``mlp_bias``, stay in the projections), the fused cross-entropy."""
    return _patch_family("llama", model, rms_norm, swiglu, False, cross_entropy, add_rms_norm)


def patch_hf(model, *, rms_norm: bool = True, swiglu: bool = True, gated_delta_net: bool = True,
             cross_entropy: bool = True, add_rms_norm: bool = True):
    """Swap the forwards of an HF model instance's modules for fuselm's ops, in place; returns it.

    Args:
        model: an HF transformers 5.x model instance, one of :data:`SUPPORTED` (Qwen3.5 dense and
            MoE, including the vision-language wrapper, whose language model is patched; Qwen3;
            Llama). Any other raises ValueError naming them.
        rms_norm: the RMSNorm modules -> :func:`fuselm.rms_norm`.
        swiglu: ``act(gate(x)) * up(x)`` in the gated MLPs (MoE: the shared expert) ->
            :func:`fuselm.silu_mul`.
        gated_delta_net: the Gated DeltaNet core (Qwen3.5 families; ignored for the others) ->
            :func:`fuselm.chunk_gated_delta_rule`.
        cross_entropy: the loss of a training forward with labels -> :func:`fuselm.linear_cross_entropy`
            (the output's logits are then None).
        add_rms_norm: each decoder layer's residual add and post-attention norm ->
            :func:`fuselm.add_rms_norm` (one kernel forward and backward for the two).
    Patching again is harmless (patched modules are skipped); a part switched off stays HF's.
    What each part replaces, its numerics and what stays HF's: this module's docstring.
    """
    family = _family_of(model)
    if family is None:
        raise _unsupported(model)
    if family in ("qwen3", "llama"):
        gated_delta_net = False  # no Gated DeltaNet layers
    return _patch_family(family, model, rms_norm, swiglu, gated_delta_net, cross_entropy, add_rms_norm)
