from fuselm.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
from fuselm.ops.gated_delta_rule.decode_step import gated_delta_rule_decode_step
from fuselm.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule
from fuselm.ops.gated_delta_rule.gates import gated_delta_gates
from fuselm.ops.gated_delta_rule.naive import (
    chunk_gated_delta_rule_ref, gated_delta_gates_ref, gated_delta_rule_decode_step_ref, gates_from_projections, l2norm,
    recurrent_gated_delta_rule_ref,
)

__all__ = [
    "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "recurrent_gated_delta_rule_ref", "chunk_gated_delta_rule_ref",
    "gates_from_projections", "gated_delta_gates", "gated_delta_gates_ref", "l2norm", "gated_delta_rule_decode_step", "gated_delta_rule_decode_step_ref",
]
