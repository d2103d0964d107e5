from fuselm.ops.silu_mul.naive import silu_mul_backward_ref, silu_mul_ref
from fuselm.ops.silu_mul.op import SiLUMul, silu_mul, silu_mul_backward, silu_mul_forward

__all__ = ["SiLUMul", "silu_mul", "silu_mul_forward", "silu_mul_backward", "silu_mul_ref", "silu_mul_backward_ref"]
