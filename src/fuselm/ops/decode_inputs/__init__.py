from fuselm.ops.decode_inputs.naive import decode_inputs_ref, kv_write_targets, rotary_cos_sin, rotary_table
from fuselm.ops.decode_inputs.op import decode_inputs

__all__ = ["decode_inputs", "decode_inputs_ref", "kv_write_targets", "rotary_cos_sin", "rotary_table"]
