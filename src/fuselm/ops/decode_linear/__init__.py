from fuselm.ops.common.matmul import DECODE_MAX_M
from fuselm.ops.decode_linear.kernels import (
    DecodeLinearConfig, DecodeVectorConfig, decode_linear_config, decode_vector_config,
)
from fuselm.ops.decode_linear.naive import decode_linear_ref, gated_rms_norm_ref, prologue_ref, sigmoid_gate_ref
from fuselm.ops.decode_linear.op import decode_linear, linear_prologue

__all__ = [
    "decode_linear", "linear_prologue", "DecodeLinearConfig", "decode_linear_config", "DecodeVectorConfig",
    "decode_vector_config",
    "DECODE_MAX_M",
    "decode_linear_ref", "prologue_ref", "sigmoid_gate_ref", "gated_rms_norm_ref",
]
