from fuselm.ops.swiglu_mlp.naive import gemm_swiglu_backward_ref, gemm_swiglu_ref, swiglu_mlp_ref
from fuselm.ops.swiglu_mlp.op import (
    SwiGLUMLP, gemm_swiglu, gemm_swiglu_forward, interleave_gate_up, swiglu_mlp, swiglu_mlp_forward, deinterleave_gate_up,
)

__all__ = [
    "SwiGLUMLP", "gemm_swiglu", "swiglu_mlp", "gemm_swiglu_forward", "swiglu_mlp_forward", "interleave_gate_up", "deinterleave_gate_up",
    "gemm_swiglu_ref", "swiglu_mlp_ref", "gemm_swiglu_backward_ref",
]
