"""Pieces that several ops share (an op's own helpers stay in its folder). Import them from
their module; this package re-exports nothing.

- ``activation.py``: the SwiGLU activation spec (``Activation``; kinds silu, swiglu_limit,
  swiglu_oai) and its numerics contract: fp32 references (``gate_factor_ref``, ``up_factor_ref``)
  and the Triton pieces (``gate_factor``, ``up_factor`` and their derivatives, the kind
  constexprs ``SILU``, ``SWIGLU_LIMIT``, ``SWIGLU_OAI``). Used by silu_mul, swiglu_mlp, swap_ffn.
- ``matmul.py``: ``dot_acc`` (the fp32-accumulating ``tl.dot``, ieee for fp32 operands),
  ``grouped_tile`` (the GEMM grid's grouped tile order) and ``DECODE_MAX_M`` / ``decode_block_m`` (the
  decode GEMVs' token padding). Used by swiglu_mlp, decode_linear, swap_ffn.
- ``prologue.py``: ``prologue_tile``, the output projections' elementwise prologues (Qwen3.5
  attention's sigmoid gate, the Gated DeltaNet's gated RMSNorm) on a tile, with their codes. Used by
  decode_linear (on its input tiles), attention_decode and gated_delta_rule (on their outputs).
- ``rows.py``: ``MAX_COLS`` and ``row_block_geometry``, the tile of the kernels that hold whole
  rows in registers. Used by rms_norm and attention_decode (whose q/k norm must reduce a head in
  rms_norm's order).
- ``precision.py``: ``work_dtype``, the dtype the plain-PyTorch references compute in. Used by
  the ``naive.py`` of rms_norm, silu_mul, swiglu_mlp, decode_linear.
"""
