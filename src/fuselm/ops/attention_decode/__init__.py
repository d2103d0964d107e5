from fuselm.ops.attention_decode.naive import (apply_rotary_ref, decode_attention_ref, gather_pages,
                                               qk_norm_rope_kv_write_ref)
from fuselm.ops.attention_decode.op import qk_norm_rope_kv_write
from fuselm.ops.attention_decode.split_kv import decode_attention

__all__ = ["qk_norm_rope_kv_write", "qk_norm_rope_kv_write_ref", "apply_rotary_ref", "decode_attention",
           "decode_attention_ref", "gather_pages"]
