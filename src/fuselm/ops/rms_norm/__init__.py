from fuselm.ops.rms_norm.naive import add_rms_norm_ref, rms_norm_backward_ref, rms_norm_ref
from fuselm.ops.rms_norm.op import RMSNorm, add_rms_norm, add_rms_norm_forward, rms_norm, rms_norm_forward

__all__ = [
    "RMSNorm", "rms_norm", "add_rms_norm", "rms_norm_forward", "add_rms_norm_forward",
    "rms_norm_ref", "add_rms_norm_ref", "rms_norm_backward_ref",
]
