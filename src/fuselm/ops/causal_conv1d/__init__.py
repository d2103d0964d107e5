from fuselm.ops.causal_conv1d.naive import causal_conv1d_silu_ref, conv_history_ref
from fuselm.ops.causal_conv1d.op import causal_conv1d_silu

__all__ = ["causal_conv1d_silu", "causal_conv1d_silu_ref", "conv_history_ref"]
