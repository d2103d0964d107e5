from fuselm.ops.causal_conv1d.naive import causal_conv1d_silu_ref, conv_history_ref, short_conv_silu_ref
from fuselm.ops.causal_conv1d.op import causal_conv1d_silu
from fuselm.ops.causal_conv1d.training import short_conv_silu

__all__ = ["causal_conv1d_silu", "causal_conv1d_silu_ref", "conv_history_ref", "short_conv_silu", "short_conv_silu_ref"]
