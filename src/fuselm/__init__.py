"""fuselm: fused Triton kernels for gated-MLP language models."""

from fuselm.engine import Engine, RequestOutput, SamplingParams
from fuselm.engine.llm import LLM
from fuselm.models.qwen35 import Qwen35, Qwen35Cache, Qwen35Config, Qwen35Moe
from fuselm.models.swap_ffn import SwapFFN, SwapFFNConfig, SwapFFNDecoder, SwapFFNState
from fuselm.ops.common.activation import Activation
from fuselm.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from fuselm.ops.linear_cross_entropy import LinearCrossEntropy, linear_cross_entropy
from fuselm.ops.moe import SwiGLUMoE
from fuselm.ops.rms_norm import RMSNorm, add_rms_norm, rms_norm
from fuselm.ops.silu_mul import SiLUMul, silu_mul
from fuselm.ops.swiglu_mlp import SwiGLUMLP, gemm_swiglu, interleave_gate_up, swiglu_mlp, deinterleave_gate_up
from fuselm.patch import patch_hf

__version__ = "0.1.0"
__all__ = [
    "Activation", "SiLUMul", "silu_mul", "RMSNorm", "rms_norm", "add_rms_norm",
    "SwiGLUMLP", "SwiGLUMoE", "gemm_swiglu", "swiglu_mlp", "interleave_gate_up", "deinterleave_gate_up",
    "SwapFFN", "SwapFFNConfig", "SwapFFNState", "SwapFFNDecoder",
    "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "LinearCrossEntropy", "linear_cross_entropy",
    "Qwen35", "Qwen35Config", "Qwen35Cache", "Qwen35Moe",
    "LLM", "SamplingParams", "RequestOutput", "Engine", "patch_hf",
]
