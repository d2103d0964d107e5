"""Paged causal attention of a prompt chunk (Qwen3.5 gated attention's prefill): ``op.py`` (the
public function and its checks), ``kernels.py`` (the Triton kernel), ``naive.py`` (the fp32
reference, the CPU fallback)."""

from fuselm.ops.attention_prefill.naive import prefill_attention_ref
from fuselm.ops.attention_prefill.op import prefill_attention

__all__ = ["prefill_attention", "prefill_attention_ref"]
