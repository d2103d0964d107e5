from fuselm.ops.moe.naive import route_ref, swiglu_moe_ref
from fuselm.ops.moe.op import SwiGLUMoE

__all__ = ["SwiGLUMoE", "route_ref", "swiglu_moe_ref"]
