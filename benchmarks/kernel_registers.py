"""Registers and spills of the hot training kernels, from an sm_90 build on a machine without a GPU.

    pip install --target /tmp/t36 --no-deps triton==3.6.0        # the lent GPU's triton
    PYTHONPATH=/tmp/t36 python benchmarks/kernel_registers.py [--mixed]

``--mixed``: instead, the kernels of a mixed step's token mixing at the 9B serving shape (the
decode rows' Gated DeltaNet step kernel beside the prompt chunk's conv, prepare, recurrence and
output kernels; NOTES.md 92), with their shared memory and how many programs of each one H100
multiprocessor holds (65,536 registers, 227 KB of shared memory, 64 warps, 32 programs): what a
chunk kernel's program takes from the decode kernel's on the multiprocessor it lands on.

Each kernel is compiled by ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` with the
launch's 16-byte divisibility of pointers and of the sizes and strides that have it (without
those hints the build spends registers on address arithmetic the GPU's does not, and shows KBs of
spill that are not there), then its PTX goes through that triton's own ``ptxas -v``. Shapes: the
Qwen3.5 0.8b training step's (bf16, GDN K = V = 128, conv width 4, hidden 1024).

What it is good for: seeing a spill. What it is not: a predictor of time. Of five changes made
from its counts in session 16 (fewer registers, less spill), the H200 measured three slower, one
no faster and one 6% faster (NOTES.md 41, 43): time them before keeping them.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fuselm.ops.causal_conv1d import training as conv
from fuselm.ops.gated_delta_rule import chunk, chunk_backward
from fuselm.ops.rms_norm import kernels as rms

DIV16 = {"seq_len", "T_total", "T", "C", "stride_q", "stride_k", "stride_v", "stride_xb", "stride_xt", "n_cols",
         "stride_dy", "stride_x", "stride_dres", "stride_dx"}  # int arguments that are multiples of 16 at these shapes


def usage(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
          occupancy: bool = False) -> str:
    """ptxas's register, stack and spill line for ``fn`` built for sm_90 (with ``occupancy``, also
    its shared memory and the programs one multiprocessor holds)."""
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
             if t.startswith("*") or (t == "i32" and n in DIV16)}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    lines = [line.split("info    : ")[-1].strip() for line in out.stderr.splitlines()
             if "spill" in line or "Used" in line]
    if occupancy:
        registers = int(next(line for line in lines if line.startswith("Used")).split()[1])
        shared = kernel.metadata.shared
        # registers go out per warp in units of 256 (so a thread's count rounds up to a multiple of 8)
        per_warp = -(-registers * 32 // 256) * 256
        fits = min(65536 // (per_warp * num_warps), (227 * 1024) // max(shared, 1), 64 // num_warps, 32)
        lines.append(f"{shared / 1024:.1f} KB shared, {num_warps} warps: {fits} programs a multiprocessor")
    return " | ".join(lines) if lines else out.stderr.strip()[-300:]


def constexpr(*names):
    return {name: "constexpr" for name in names}


def prepare_signature() -> dict:
    """``_chunk_prepare_kernel``'s arguments and their types (bf16 inputs, fp32 g and G)."""
    names = ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "G_ptr", "u_ptr", "w_ptr", "kn_ptr", "kd_ptr", "aqk_ptr",
             "t_ptr", "h_ptr", "chunk_start_ptr", "chunk_len_ptr")
    types = ("*bf16", "*bf16", "*bf16", "*fp32", "*bf16", "*fp32", "*bf16", "*bf16", "*bf16", "*bf16", "*bf16", "*bf16",
             "*bf16", "*i64", "*i32")
    return dict(zip(names, types)) | {"seq_len": "i32", "scale": "fp32", "stride_q": "i32", "stride_k": "i32",
                                      "stride_v": "i32"} | constexpr(
        "H", "HV", "K", "V", "BT", "SUB", "BK", "BV", "L2NORM", "P", "EQUAL", "STORE_T", "LOAD_T")


def mixed() -> None:
    """The mixed step's token-mixing kernels at the 9B serving shape (H 16, HV 32, K = V = 128, conv
    width 4, 8192 conv channels; bf16, fp32 states; one 256-token chunk, 32 decode rows), with the
    launch geometry the model uses."""
    from fuselm.ops.causal_conv1d import kernels as conv_kernels
    from fuselm.ops.gated_delta_rule import decode_step, fused_recurrent

    print(f"triton {triton.__version__}, sm_90: a mixed step's token mixing, 9B")
    gdn = dict(H=16, HV=32, K=128, V=128, BT=chunk.CHUNK)
    block_v = 32  # fused_recurrent.decode_block_v at 32 rows: 4,096 programs
    warps = max(decode_step.MIN_NUM_WARPS, fused_recurrent.decode_num_warps(128, block_v))
    sig = {"proj_ptr": "*bf16", "conv_ptr": "*bf16", "conv_w_ptr": "*bf16", "A_log_ptr": "*bf16",
           "dt_bias_ptr": "*bf16", "state_ptr": "*fp32", "slots_ptr": "*i32", "positions_ptr": "*i64",
           "norm_w_ptr": "*bf16", "o_ptr": "*bf16",
           "stride_proj": "i32", "stride_conv": "i32", "scale": "fp32", "eps": "fp32"}
    sig |= constexpr("H", "HV", "K", "V", "KW", "BLOCK_K", "BLOCK_V", "PROLOGUE", "USE_PDL")
    print(f"decode half: GDN _decode_step_kernel (4,096 programs of {block_v} columns):", usage(
        decode_step._decode_step_kernel, sig,
        dict(H=16, HV=32, K=128, V=128, KW=4, BLOCK_K=128, BLOCK_V=block_v, PROLOGUE=0, USE_PDL=True),
        num_warps=warps, occupancy=True))
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "state_ptr": "*bf16", "slots_ptr": "*i64", "starts_ptr": "*i64",
           "out_ptr": "*bf16", "T": "i32", "C": "i32", "stride_xb": "i32", "stride_xt": "i32"}
    print("chunk: _conv_kernel:", usage(
        conv_kernels._conv_kernel, sig | constexpr("K", "BLOCK_T", "BLOCK_C"),
        dict(K=4, BLOCK_T=conv_kernels.CONV_BLOCK_T, BLOCK_C=conv_kernels.CONV_BLOCK_C),
        num_warps=conv_kernels.CONV_WARPS, occupancy=True))
    print("chunk: _chunk_prepare_kernel (160 programs):", usage(
        chunk._chunk_prepare_kernel, prepare_signature(),
        gdn | dict(SUB=chunk.SUB, BK=128, BV=128, L2NORM=True, P="tf32", EQUAL=True, STORE_T=False, LOAD_T=False),
        num_warps=chunk.PREPARE_WARPS, occupancy=True))
    sig = {"u_ptr": "*bf16", "w_ptr": "*bf16", "k_ptr": "*bf16", "G_ptr": "*fp32", "h_ptr": "*bf16",
           "new_v_ptr": "*bf16", "h0_ptr": "*fp32", "ht_ptr": "*fp32", "cu_seqlens_ptr": "*bf16",
           "first_chunk_ptr": "*bf16", "seq_len": "i32", "state_indices_ptr": "*i64", "has_h0_ptr": "*i1",
           "stride_k": "i32"}
    sig |= constexpr("H", "HV", "K", "V", "BT", "BK", "BV", "HAS_H0", "STORE_HT", "P", "EQUAL", "INDEXED",
                     "HAS_H0_FLAGS")
    # chunk.recurrence_geometry on an H100 (132 SMs) for 32 value heads: 32 columns, 128 programs, one wave
    recurrence_v, stages = 32, chunk.RECURRENCE_STAGES
    print(f"chunk: _chunk_recurrence_kernel (128 programs of {recurrence_v} columns):", usage(
        chunk._chunk_recurrence_kernel, sig,
        gdn | dict(BK=128, BV=recurrence_v, HAS_H0=False, STORE_HT=True, P="tf32", EQUAL=True, INDEXED=True,
                   HAS_H0_FLAGS=True), num_warps=chunk.RECURRENCE_WARPS, num_stages=stages, occupancy=True))
    sig = {"q_ptr": "*bf16", "G_ptr": "*fp32", "aqk_ptr": "*bf16", "h_ptr": "*bf16", "new_v_ptr": "*bf16",
           "o_ptr": "*bf16", "z_ptr": "*bf16", "norm_w_ptr": "*bf16", "chunk_start_ptr": "*bf16",
           "chunk_len_ptr": "*bf16", "seq_len": "i32", "scale": "fp32", "stride_q": "i32", "stride_z": "i32",
           "eps": "fp32"}
    sig |= constexpr("H", "HV", "K", "V", "BT", "BK", "BV", "L2NORM", "P", "EQUAL", "PROLOGUE")
    print("chunk: _chunk_output_kernel with the gated RMSNorm (160 programs):", usage(
        chunk._chunk_output_kernel, sig,
        gdn | dict(BK=128, BV=chunk.OUTPUT_BLOCK_V, L2NORM=True, P="tf32", EQUAL=True, PROLOGUE=2),
        num_warps=chunk.OUTPUT_WARPS, occupancy=True))


def main() -> None:
    import sys

    if "--mixed" in sys.argv[1:]:
        return mixed()
    print(f"triton {triton.__version__}, sm_90")
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "dy_ptr": "*bf16", "dconv_ptr": "*fp32", "dw_part_ptr": "*fp32",
           "T": "i32", "C": "i32", "stride_xb": "i32", "stride_xt": "i32", "n_t_blocks": "i32"}
    tiles = dict(K=4, BLOCK_T=conv.BLOCK_T, BLOCK_C=128)
    print("short_conv_silu _dconv_kernel:", usage(
        conv._dconv_kernel, sig | constexpr("K", "BLOCK_T", "BLOCK_C"), tiles, num_warps=conv.WARPS))
    sig = {"dconv_ptr": "*fp32", "w_ptr": "*bf16", "dx_ptr": "*bf16", "T": "i32", "C": "i32"}
    print("short_conv_silu _dx_kernel:", usage(conv._dx_kernel, sig | constexpr("K", "BLOCK_T", "BLOCK_C"), tiles,
                                               num_warps=conv.WARPS))
    sig = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "dres_ptr": "*bf16", "dx_ptr": "*bf16",
           "dw_partial_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32", "rows_per_program": "i32", "stride_dy": "i32",
           "stride_x": "i32", "stride_dres": "i32", "stride_dx": "i32", "eps": "fp32", "offset": "fp32"}
    print("rms_norm _rms_norm_bwd_kernel:", usage(
        rms._rms_norm_bwd_kernel, sig | constexpr("HAS_DRES", "ZERO_CENTERED", "BLOCK_N"),
        dict(HAS_DRES=True, ZERO_CENTERED=True, BLOCK_N=1024), num_warps=4))
    gdn = dict(H=16, HV=32, K=128, V=128, BT=chunk.CHUNK)
    sig = prepare_signature()
    for store, load in ((True, False), (False, True)):
        tiles = dict(SUB=chunk.SUB, BK=128, BV=128, L2NORM=True, P="tf32", EQUAL=True)
        print(f"GDN _chunk_prepare_kernel {'forward (STORE_T)' if store else 'backward (LOAD_T)'}:", usage(
            chunk._chunk_prepare_kernel, sig, gdn | tiles | dict(STORE_T=store, LOAD_T=load),
            num_warps=chunk.PREPARE_WARPS))
    sig = {"k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16", "t_ptr": "*bf16", "dn_ptr": "*bf16",
           "dw_ptr": "*bf16", "dk_ptr": "*fp32", "dv_ptr": "*bf16", "dgp_ptr": "*fp32", "dg_ptr": "*fp32",
           "dbeta_ptr": "*bf16", "chunk_start_ptr": "*i64", "chunk_len_ptr": "*i32", "seq_len": "i32", "T_total": "i32"}
    sig |= constexpr("H", "HV", "K", "V", "BT", "BK", "BV", "NKP", "L2NORM", "P", "EQUAL")
    print("GDN _chunk_bwd_wy_kernel:", usage(
        chunk_backward._chunk_bwd_wy_kernel, sig,
        gdn | dict(BK=chunk_backward.WY_BLOCK_K, BV=64, NKP=2, L2NORM=True, P="tf32", EQUAL=True),
        num_warps=chunk_backward.WY_WARPS))
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "g_ptr": "*fp32", "h_ptr": "*bf16", "dh_ptr": "*bf16", "new_v_ptr": "*bf16",
           "dn_ptr": "*bf16", "do_ptr": "*bf16", "dq_ptr": "*fp32", "dk_ptr": "*fp32", "dw_ptr": "*bf16", "dgp_ptr": "*fp32",
           "chunk_start_ptr": "*i64", "chunk_len_ptr": "*i32", "seq_len": "i32", "scale": "fp32", "T_total": "i32"}
    sig |= constexpr("H", "HV", "K", "V", "BT", "BK", "BV", "NK", "L2NORM", "P", "EQUAL")
    print("GDN _chunk_bwd_dqkw_kernel:", usage(
        chunk_backward._chunk_bwd_dqkw_kernel, sig,
        gdn | dict(BK=chunk_backward.DQKW_BLOCK_K, BV=64, NK=2, L2NORM=True, P="tf32", EQUAL=True),
        num_warps=chunk_backward.DQKW_WARPS, num_stages=chunk_backward.DQKW_STAGES))


if __name__ == "__main__":
    main()
