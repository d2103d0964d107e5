from fuselm.ops.gated_rms_norm.naive import gated_rms_norm_ref
from fuselm.ops.gated_rms_norm.op import gated_rms_norm

__all__ = ["gated_rms_norm", "gated_rms_norm_ref"]
