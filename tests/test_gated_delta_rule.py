"""Gated delta rule: the fused recurrent (decode) kernel against the fp32 recurrent reference."""

import pytest
import torch

from conftest import DEVICE, ON_GPU
from fuselm.ops.gated_delta_rule import (
    chunk_gated_delta_rule, chunk_gated_delta_rule_ref, fused_recurrent_gated_delta_rule, gates_from_projections,
    recurrent_gated_delta_rule_ref,
)
from fuselm.ops.decode_linear import gated_rms_norm_ref, linear_prologue
from fuselm.runtime import use_triton
from fuselm.testing import assert_close, rel_err
from helpers import TOL_VS_CONTRACT

# RMSE(out - ref) / RMS(ref), the measure: rel_err's ||out - ref|| / ||ref||.
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 5e-3}
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if ON_GPU else [])
POOL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # a state pool's: read into fp32, rounded once


def inputs(B, T, H, HV, K, V, dtype=torch.float32, decay="mixed"):
    q, k = (torch.randn(B, T, H, K, device=DEVICE).to(dtype) for _ in range(2))
    v = torch.randn(B, T, HV, V, device=DEVICE).to(dtype)
    g = {"mixed": -torch.rand(B, T, HV, device=DEVICE) * 2, "strong": -10 + torch.rand(B, T, HV, device=DEVICE) * 0.5,
         "none": torch.zeros(B, T, HV, device=DEVICE)}[decay]
    beta = torch.rand(B, T, HV, device=DEVICE)
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, H, HV, K, V", [(1, 1, 1, 64, 64), (15, 2, 4, 100, 64), (65, 1, 2, 128, 100), (64, 4, 4, 64, 128)])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_recurrent_reference(T, H, HV, K, V, with_state, dtype):
    q, k, v, g, beta = inputs(2, T, H, HV, K, V, dtype)
    h0 = torch.randn(2, HV, K, V, device=DEVICE) if with_state else None
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
    o_ref, ht_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    assert rel_err(o, o_ref) <= TOL[dtype] and rel_err(ht, ht_ref) <= TOL[dtype]


@pytest.mark.parametrize("decay", ["strong", "none"])
def test_strong_and_no_decay(decay):
    q, k, v, g, beta = inputs(1, 20, 2, 2, 64, 64, decay=decay)
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.3, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
    o_ref, ht_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale=0.3, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all() and rel_err(o, o_ref) <= 1e-4 and rel_err(ht, ht_ref) <= 1e-4


def test_varlen_equals_separate_sequences():
    lengths = [5, 0, 1, 12]  # an empty sequence keeps its state and writes no output
    cu = torch.tensor([0, 5, 5, 6, 18], device=DEVICE, dtype=torch.int32)
    q, k, v, g, beta = inputs(1, sum(lengths), 2, 4, 64, 64)
    h0 = torch.randn(4, 4, 64, 64, device=DEVICE)
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_n, ht_n = recurrent_gated_delta_rule_ref(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                                                   beta[:, start:end], initial_state=h0[n:n + 1], output_final_state=True)
        assert rel_err(o[:, start:end], o_n) <= 1e-4 and rel_err(ht[n:n + 1], ht_n) <= 1e-4


def test_raw_projection_gates_equal_precomputed_gates():
    q, k, v, _, _ = inputs(2, 3, 1, 2, 64, 64)
    A_log, dt_bias = torch.randn(2, device=DEVICE), torch.randn(2, device=DEVICE)
    a, b = torch.randn(2, 3, 2, device=DEVICE) * 5, torch.randn(2, 3, 2, device=DEVICE)
    a[0, 0, 0] = 30.0  # softplus's linear branch
    g, beta = gates_from_projections(A_log, a, dt_bias, b)
    o_raw, _ = fused_recurrent_gated_delta_rule(q, k, v, A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    o, _ = fused_recurrent_gated_delta_rule(q, k, v, g, beta)
    assert rel_err(o_raw, o) <= 1e-5


def assert_pool_row(row, ref, tol=1e-4):
    """A pool row against an fp32 reference state: within ``tol`` for an fp32 pool; a 16-bit pool's
    row is the reference rounded once into its dtype: within one unit in the last place (the GPU
    rounds to nearest, the interpreter's casts truncate)."""
    if row.dtype == torch.float32:
        assert rel_err(row, ref) <= tol
    else:
        ulp = ref.abs() * 2.0 ** (-7 if row.dtype == torch.bfloat16 else -10)
        assert ((row.float() - ref).abs() <= ulp + tol * ref.abs().max()).all()


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_state_pool_in_place_and_padded_rows(pool_dtype):
    """Decode from a state pool: slots 3 and 0 are read and written in place (a 16-bit pool read
    into fp32, the new state rounded once into it); the padded row (slot -1) starts from zero and
    writes nothing; other slots are untouched."""
    q, k, v, g, beta = inputs(3, 1, 2, 2, 64, 64)
    pool = torch.randn(5, 2, 64, 64, device=DEVICE).to(pool_dtype)
    before = pool.clone()
    slots = torch.tensor([3, -1, 0], device=DEVICE, dtype=torch.int32)
    o, final = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool, state_indices=slots)
    assert final is pool and pool.dtype == pool_dtype
    h0 = torch.stack([before[3], torch.zeros_like(before[0]), before[0]]).float()
    o_ref, ht_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) <= 1e-4
    assert_pool_row(pool[3], ht_ref[0])
    assert_pool_row(pool[0], ht_ref[2])
    for untouched in (1, 2, 4):
        assert torch.equal(pool[untouched], before[untouched])


def test_decode_after_prefill_equals_one_long_run():
    q, k, v, g, beta = inputs(1, 10, 2, 2, 64, 64)
    _, h = fused_recurrent_gated_delta_rule(q[:, :7], k[:, :7], v[:, :7], g[:, :7], beta[:, :7], output_final_state=True)
    outs = []
    for t in range(7, 10):
        o_t, h = fused_recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                                  beta[:, t:t + 1], initial_state=h, output_final_state=True)
        outs.append(o_t)
    o_all, h_all = fused_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    assert rel_err(torch.cat(outs, 1), o_all[:, 7:]) <= 1e-5 and rel_err(h, h_all) <= 1e-5


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {**a, "v": a["v"][:, :, :3]}, ValueError, "not a multiple"),
    (lambda a: {**a, "g": a["g"][..., :1]}, ValueError, r"g: expected \[B, T, HV\]"),
    (lambda a: {**a, "beta": a["beta"][:, :1]}, ValueError, r"beta: expected \[B, T, HV\]"),
    (lambda a: {**a, "cu_seqlens": torch.tensor([0, 2, 4], device=DEVICE)}, ValueError, "B = 1"),
    (lambda a: {**{n: t[:1] if isinstance(t, torch.Tensor) else t for n, t in a.items()},
                "cu_seqlens": torch.tensor([0, 3, 1, 4], device=DEVICE)}, ValueError, "never decrease"),
    (lambda a: {**a, "initial_state": torch.zeros(2, 4, 64, 64, device=DEVICE, dtype=torch.int32)}, TypeError, "fp32"),
    (lambda a: {**a, "initial_state": torch.zeros(3, 4, 64, 64, device=DEVICE)}, ValueError, "initial_state: expected"),
    (lambda a: {**a, "state_indices": torch.tensor([0, 1], device=DEVICE)}, ValueError, "needs initial_state"),
    (lambda a: {**a, "A_log": torch.zeros(4, device=DEVICE)}, ValueError, "either g and beta"),
    (lambda a: {**a, "k": a["k"][..., :32]}, ValueError, "k: shape"),
    (lambda a: {n: t for n, t in a.items() if n not in ("g", "beta")} | {
        "A_log": torch.zeros(4, device="meta"), "dt_bias": torch.zeros(4, device=DEVICE),
        "a": torch.zeros(2, 4, 4, device=DEVICE), "b": torch.zeros(2, 4, 4, device=DEVICE)}, ValueError, "A_log on meta"),
])
def test_bad_input(change, error, match):
    q, k, v, g, beta = inputs(2, 4, 2, 4, 64, 64)
    args = change({"q": q, "k": k, "v": v, "g": g, "beta": beta})
    with pytest.raises(error, match=match):
        fused_recurrent_gated_delta_rule(**args)


def test_cpu_without_interpreter_uses_reference(monkeypatch):
    import fuselm.ops.gated_delta_rule.fused_recurrent as fr

    monkeypatch.setattr(fr, "use_triton", lambda t: False)
    q, k, v, g, beta = (t.cpu() for t in inputs(2, 3, 1, 2, 64, 64))
    pool = torch.randn(4, 2, 64, 64)
    expected_pool = pool.clone()
    slots = torch.tensor([2, -1])
    o, _ = fr.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool, state_indices=slots)
    h0 = torch.stack([expected_pool[2], torch.zeros(2, 64, 64)])
    o_ref, ht_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.allclose(o, o_ref) and torch.allclose(pool[2], ht_ref[0]) and torch.equal(pool[3], expected_pool[3])


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["fused_recurrent", "chunk"])
def test_long_sequence_half_precision(kernel, dtype):
    """T = 500, two sequences, GQA, against the fp32 recurrence."""
    fn = {"fused_recurrent": fused_recurrent_gated_delta_rule, "chunk": chunk_gated_delta_rule}[kernel]
    q, k, v, g, beta = inputs(2, 500, 4, 8, 128, 128, dtype)
    o, ht = fn(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, ht_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, o_ref) <= 5e-3 and rel_err(ht, ht_ref) <= 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_from_a_state_pool_in_a_cuda_graph(dtype):
    """B=1 HV=32 K=V=128 decode captured in a CUDA graph, state read and written in its pool slot."""
    q, k, v, g, beta = inputs(1, 1, 16, 32, 128, 128, dtype)
    pool = torch.randn(4, 32, 128, 128, device=DEVICE)
    slots = torch.tensor([2], device=DEVICE, dtype=torch.int32)
    expected = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=pool[2:3].clone(), output_final_state=True)
    fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool.clone(), state_indices=slots)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, _ = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool, state_indices=slots)
    graph.replay()
    assert rel_err(o, expected[0]) <= 5e-3 and rel_err(pool[2], expected[1][0]) <= 5e-3


@pytest.mark.gpu
def test_decode_steps_chained_in_one_cuda_graph():
    """Eight decode steps back to back in one graph, each reading the pool slot the step before
    wrote (on Hopper their launches overlap: programmatic dependent launch): the recurrence."""
    q, k, v, g, beta = inputs(1, 8, 16, 32, 128, 128, torch.bfloat16)
    pool = torch.randn(2, 32, 128, 128, device=DEVICE)
    slots = torch.tensor([1], device=DEVICE, dtype=torch.int32)
    o_ref, h_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=pool[1:2].clone(),
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    start = pool.clone()

    def step(t):
        return fused_recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                                beta[:, t:t + 1], initial_state=pool, state_indices=slots,
                                                use_qk_l2norm_in_kernel=True)[0]

    step(0)  # compile
    pool.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [step(t) for t in range(8)]
    graph.replay()
    assert rel_err(torch.cat(outs, 1), o_ref) <= 5e-3 and rel_err(pool[1], h_ref[0]) <= 5e-3
    assert torch.equal(pool[0], start[0])


# ----------------------------------------------------------------------------- chunked reference
def test_chunked_reference_varlen():
    cu = torch.tensor([0, 70, 71, 130])
    q, k, v, g, beta = (t.cpu() for t in inputs(1, 130, 1, 2, 64, 64))
    o_c, ht_c = chunk_gated_delta_rule_ref(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    o_r, ht_r = recurrent_gated_delta_rule_ref(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    assert rel_err(o_c, o_r) <= 1e-4 and rel_err(ht_c, ht_r) <= 1e-4


def test_backward_raises_a_clear_error():
    q, k, v, g, beta = inputs(1, 3, 1, 1, 64, 64)
    q.requires_grad_(True)
    o, _ = fused_recurrent_gated_delta_rule(q, k, v, g, beta)
    with pytest.raises(NotImplementedError, match="no backward"):
        o.sum().backward()


# ----------------------------------------------------------------------------- chunked kernels
@pytest.mark.parametrize("T, H, HV, K, V", [
    (1, 1, 1, 64, 64), (15, 2, 4, 100, 64), (63, 1, 2, 64, 128), (64, 2, 2, 128, 100), (65, 1, 2, 64, 64),
    (200, 2, 4, 64, 100),
])
@pytest.mark.parametrize("decay", ["mixed", "strong", "none"])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("impl", ["reference", "kernels"])
def test_chunked_matches_recurrence(impl, T, H, HV, K, V, decay, with_state):
    """The chunk algorithm, as the fp32 reference (CPU) and as the kernels, against the token
    recurrence: chunk boundaries (63, 64, 65), strong decay (g near -10), no decay, GQA, K/V not
    powers of two."""
    if impl == "kernels" and T == 200 and not ON_GPU:
        pytest.skip("long interpreter run; T=200 is covered by the reference and by the GPU")
    fn, device = (chunk_gated_delta_rule_ref, "cpu") if impl == "reference" else (chunk_gated_delta_rule, DEVICE)
    q, k, v, g, beta = (t.to(device) for t in inputs(2, T, H, HV, K, V, decay=decay))
    h0 = torch.randn(2, HV, K, V, device=device) if with_state else None
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, ht = fn(q, k, v, g, beta, **args)
    o_ref, ht_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, **args)
    assert torch.isfinite(o).all()
    assert rel_err(o, o_ref) <= 1e-4 and rel_err(ht, ht_ref) <= 1e-4


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.bfloat16])
def test_chunked_kernels_repeated_keys(dtype):
    """The worst case for the chunk inverse: every key the same (or alternating in sign), beta = 1,
    no decay, so (I + A) has unit entries below the diagonal and its inverse's Neumann terms grow
    combinatorially; the kernels must still match the recurrence. fp32: 1e-3 (the interpreter with
    numpy 2.4.6: 1.2e-4 on the output, 5.7e-4 on the state, against the float64 recurrence; within
    the usual 1e-4 before; a wrong kernel is off by O(1)). fp16:
    1e-2, twice the issue's bar for random inputs; W, U and N rounded to 16 bits, with every
    key alike, put the state at 0.57% on the H100 (0.25% in the interpreter). bf16 (8-bit
    mantissa) exceeded 1% on the H100 here: an open accuracy item of the chunk path, not tested."""
    q, k, v, g, beta = inputs(1, 64, 1, 1, 64, 64, dtype, decay="none")
    beta = torch.ones_like(beta)
    for keys in (k[:, :1].expand_as(k).contiguous(), torch.cat([k[:, ::2], -k[:, ::2]], 1)):
        args = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
        o, ht = chunk_gated_delta_rule(q, keys, v, g, beta, **args)
        o_ref, ht_ref = recurrent_gated_delta_rule_ref(q, keys, v, g, beta, **args)
        tol = 1e-3 if dtype == torch.float32 else 1e-2
        assert rel_err(o, o_ref) <= tol and rel_err(ht, ht_ref) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_one_token_after_a_long_prompt_on_poisoned_memory(dtype):
    """The Qwen3.5-9B head shapes, a 64-token call and then 1-token calls, with the allocator's
    free memory filled with NaN before each: every buffer the kernels read must have been written.
    (Regression: triton 3.6 specialised seq_len == 1 into a recurrence build that read
    uninitialised memory: NaN final states, or an illegal address in the engine.)"""
    for B, T in ((1, 64), (1, 1), (3, 1), (2, 2)):
        q, k, v, g, beta = inputs(B, T, 16, 32, 128, 128, dtype)
        # NaN in the allocator's large pool (256 MB) and small pool (blocks of <= 1 MB), then freed
        poison = [torch.full((64 << 20,), float("nan"), device=DEVICE)]
        poison += [torch.full((1 << 18,), float("nan"), device=DEVICE) for _ in range(64)]
        del poison
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        o_ref, ht_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True)
        assert rel_err(o, o_ref) <= 5e-3 and rel_err(ht, ht_ref) <= 5e-3, (B, T)


def test_chunked_kernels_varlen_and_prefill_then_decode():
    cu = torch.tensor([0, 70, 71, 100], device=DEVICE, dtype=torch.int32)
    q, k, v, g, beta = inputs(1, 100, 2, 2, 64, 64)
    h0 = torch.randn(3, 2, 64, 64, device=DEVICE)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_ref, ht_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   cu_seqlens=cu)
    assert rel_err(o, o_ref) <= 1e-4 and rel_err(ht, ht_ref) <= 1e-4
    # prefill 68 tokens of the first sequence, then decode 2: equals one prefill of 70
    s = slice(0, 68)
    _, h = chunk_gated_delta_rule(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], initial_state=h0[:1],
                                  output_final_state=True)
    o_dec, h = fused_recurrent_gated_delta_rule(q[:, 68:70], k[:, 68:70], v[:, 68:70], g[:, 68:70], beta[:, 68:70],
                                                initial_state=h, output_final_state=True)
    assert rel_err(o_dec, o_ref[:, 68:70]) <= 1e-4 and rel_err(h, ht_ref[:1]) <= 1e-4


@pytest.mark.parametrize("impl", ["reference", "kernels"])
@pytest.mark.parametrize("B, T, H, HV, K, V, pool_dtype", [(3, 37, 2, 4, 64, 48, torch.float32),
                                                           (2, 70, 1, 2, 64, 64, torch.float32),
                                                           (3, 37, 2, 4, 64, 48, torch.bfloat16),
                                                           (2, 70, 1, 2, 64, 64, torch.float16)])
def test_chunked_reads_projection_slices_and_a_state_pool(impl, B, T, H, HV, K, V, pool_dtype, monkeypatch):
    """The model's prefill call: q, k, v are slices of one wider [B, T, C] tensor (read in place
    by the kernels), the states live in a pool (rows 4, -1 = a padding row, 1; the first reads
    its row, the third starts from zeros, has_initial_state False), o goes into a poisoned ``out``
    buffer. Against the recurrence from the gathered states; untouched pool rows keep their bits.
    A 16-bit pool is read into fp32 and each final state rounded once into it."""
    device = "cpu" if impl == "reference" else DEVICE
    if impl == "reference" and ON_GPU:
        pytest.skip("the plain-PyTorch path is the CPU's")
    q, k, v, g, beta = (t.to(device) for t in inputs(B, T, H, HV, K, V))
    wide = torch.randn(B, T, 2 * H * K + HV * V + 7, device=device)
    wide[..., :H * K], wide[..., H * K:2 * H * K] = q.flatten(2), k.flatten(2)
    wide[..., 2 * H * K:2 * H * K + HV * V] = v.flatten(2)
    qs, ks = wide[..., :H * K].unflatten(-1, (H, K)), wide[..., H * K:2 * H * K].unflatten(-1, (H, K))
    vs = wide[..., 2 * H * K:2 * H * K + HV * V].unflatten(-1, (HV, V))
    pool = torch.randn(6, HV, K, V, device=device).to(pool_dtype)
    before = pool.clone()
    slots = torch.tensor([4, -1, 1][:B], device=device)
    has_state = torch.tensor([True, True, False][:B], device=device)
    out = torch.full_like(v, float("nan"))
    if impl == "reference":
        import fuselm.ops.gated_delta_rule.chunk as chunk_module

        monkeypatch.setattr(chunk_module, "use_triton", lambda t: False)
    o, final = chunk_gated_delta_rule(qs, ks, vs, g, beta, initial_state=pool, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, state_indices=slots, has_initial_state=has_state,
                                      out=out)
    assert o is out and final is pool and pool.dtype == pool_dtype
    h0 = torch.stack([before[4], torch.zeros_like(before[0]), torch.zeros_like(before[0])][:B]).float()
    o_ref, ht_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    assert rel_err(o, o_ref) <= 1e-4
    assert_pool_row(pool[4], ht_ref[0])
    if B > 2:
        assert_pool_row(pool[1], ht_ref[2])
    for untouched in ([0, 2, 3, 5] + ([1] if B <= 2 else [])):
        assert torch.equal(pool[untouched], before[untouched])


def test_chunked_state_pool_with_packed_sequences_and_rows_apart():
    """The pool with varlen sequences (cu_seqlens: pool rows 2 and 0, the second starting from
    zeros), and a batch whose rows are not one token stride apart (a copy, same result)."""
    q, k, v, g, beta = inputs(1, 70, 1, 2, 64, 64)
    cu = torch.tensor([0, 66, 70], device=DEVICE, dtype=torch.int32)
    pool = torch.randn(3, 2, 64, 64, device=DEVICE)
    before = pool.clone()
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu,
                                  state_indices=torch.tensor([2, 0], device=DEVICE),
                                  has_initial_state=torch.tensor([True, False], device=DEVICE))
    h0 = torch.stack([before[2], torch.zeros_like(before[0])])
    o_ref, ht_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   cu_seqlens=cu)
    assert rel_err(o, o_ref) <= 1e-4 and rel_err(pool[[2, 0]], ht_ref) <= 1e-4
    assert torch.equal(pool[1], before[1])
    # rows 3 tokens apart in a [2, 5 + 3] buffer: not one token stride apart across rows
    qw, kw, vw, gw, bw = inputs(2, 8, 1, 2, 64, 64)
    o, ht = chunk_gated_delta_rule(qw[:, :5], kw[:, :5], vw[:, :5], gw[:, :5], bw[:, :5], output_final_state=True)
    o_ref, ht_ref = recurrent_gated_delta_rule_ref(qw[:, :5], kw[:, :5], vw[:, :5], gw[:, :5], bw[:, :5],
                                                   output_final_state=True)
    assert rel_err(o, o_ref) <= 1e-4 and rel_err(ht, ht_ref) <= 1e-4


@pytest.mark.parametrize("change, match", [
    (dict(has_initial_state=torch.ones(2, dtype=torch.bool)), "has_initial_state: only used with state_indices"),
    (dict(state_indices=torch.tensor([0, 1]), initial_state=torch.zeros(3, 2, 64, 64),
          has_initial_state=torch.ones(3, dtype=torch.bool)), "has_initial_state: expected a bool tensor"),
    (dict(state_indices=torch.tensor([0, 1]), initial_state=torch.zeros(3, 2, 64, 64),
          has_initial_state=torch.ones(2, dtype=torch.int64)), "has_initial_state: expected a bool tensor"),
    (dict(out=torch.empty(2, 5, 2, 63)), "out: expected a contiguous"),
    (dict(out=torch.empty(2, 5, 64, 2).transpose(-1, -2)), "out: expected a contiguous"),
    (dict(out=torch.empty(2, 5, 2, 64, dtype=torch.float16)), "out: expected a contiguous"),
    (dict(state_indices=torch.tensor([0, 1]), initial_state=torch.zeros(3, 2, 64, 64), state_v_first=True),
     "state_indices: the pool is updated in place"),
    (dict(state_indices=torch.tensor([0, 1]), initial_state=torch.zeros(3, 2, 64, 64, dtype=torch.float64)),
     "initial_state: expected an fp32 tensor"),
])
def test_chunked_pool_and_out_bad_input(change, match):
    q, k, v, g, beta = inputs(2, 5, 1, 2, 64, 64)
    args = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in change.items()}
    with pytest.raises((ValueError, TypeError), match=match):
        chunk_gated_delta_rule(q, k, v, g, beta, **args)


def test_chunked_pool_refuses_autograd():
    q, k, v, g, beta = inputs(1, 5, 1, 2, 64, 64)
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="state_indices, out, norm_weight: inference only"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 64, 64, device=DEVICE),
                               state_indices=torch.tensor([1], device=DEVICE))


@pytest.mark.parametrize("impl", ["reference", "kernels"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else []))
@pytest.mark.parametrize("B, T, HV, V, norm_dtype", [(2, 37, 4, 64, "model"), (1, 70, 2, 64, "fp32"),
                                                     (1, 65, 2, 128, "model"), (2, 9, 1, 256, "model"),
                                                     (2, 9, 2, 48, "model")])
def test_chunked_output_norm_is_decode_linears_prologue(impl, B, T, HV, V, norm_dtype, dtype, monkeypatch):
    """With norm_weight / norm_gate, o is the plain call's o through the prologue ``decode_linear``
    applies (``linear_prologue``: HF's ``Qwen3_5RMSNormGated``, the roundings of
    ``gated_rms_norm_ref``), bit for bit where the operations run in one order (the interpreter,
    PyTorch), within the contract's rounding on a GPU (another reduction order): applied by the
    output kernel as it stores (power-of-two V <= 128), else by ``linear_prologue`` after the
    kernels (V 256, 48), into a poisoned out; z a strided slice of a wider projection."""
    device = "cpu" if impl == "reference" else DEVICE
    if impl == "reference" and ON_GPU:
        pytest.skip("the plain-PyTorch path is the CPU's")
    if impl == "reference":
        import fuselm.ops.gated_delta_rule.chunk as chunk_module

        monkeypatch.setattr(chunk_module, "use_triton", lambda t: False)
    q, k, v, g, beta = (t.to(device=device, dtype=dtype) if t.is_floating_point() else t
                        for t in inputs(B, T, 1, HV, 64, V))
    g, beta = g.float(), beta.float()
    wide = torch.randn(B, T, HV * V + 5, device=device).to(dtype)
    z = wide[..., 3:3 + HV * V]
    norm_weight = (torch.randn(V, device=device) * 0.3 + 1).to(dtype if norm_dtype == "model" else torch.float32)
    plain, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    out = torch.full_like(v, float("nan"))
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, out=out, norm_weight=norm_weight,
                                  norm_gate=z, norm_eps=1e-6)
    assert o is out and not o.isnan().any()
    expect = linear_prologue(plain.flatten(-2), "gated_rms_norm", z, norm_weight=norm_weight, eps=1e-6,
                             head_dim=V).view(o.shape)
    if ON_GPU:
        assert_close(o, expect, TOL_VS_CONTRACT[dtype], "o")
    elif impl == "kernels":
        assert torch.equal(o, expect)
    else:
        # The PyTorch reference is not bit-reproducible from call to call here: its first call in a
        # process and the later ones differed by 1.7e-5 relative in fp32 (CPU BLAS). So the two
        # calls (plain, o) are held to the file's tolerance; the kernel path above to the bit.
        assert rel_err(o, expect) <= TOL[dtype]
    assert rel_err(o, gated_rms_norm_ref(plain.flatten(-2), z, norm_weight, 1e-6, V).view(o.shape)) <= (
        TOL[dtype] if impl == "reference" else 1e-5 if dtype == torch.float32 else 2e-3)
    o4, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, norm_weight=norm_weight,
                                   norm_gate=z.unflatten(-1, (HV, V)))  # z as [B, T, HV, V]
    assert torch.equal(o4, o)


@pytest.mark.parametrize("change, match", [
    (dict(norm_weight=torch.ones(64)), "norm_weight, norm_gate: the output norm needs both"),
    (dict(norm_gate=torch.ones(2, 5, 128)), "norm_weight, norm_gate: the output norm needs both"),
    (dict(norm_weight=torch.ones(63), norm_gate=torch.ones(2, 5, 128)), "norm_weight: expected"),
    (dict(norm_weight=torch.ones(64, dtype=torch.float64), norm_gate=torch.ones(2, 5, 128)), "norm_weight"),
    (dict(norm_weight=torch.ones(64), norm_gate=torch.ones(2, 5, 127)), "norm_gate: expected"),
    (dict(norm_weight=torch.ones(64), norm_gate=torch.ones(2, 5, 4, 32)), "norm_gate: expected"),
    (dict(norm_weight=torch.ones(64), norm_gate=torch.ones(2, 5, 128, dtype=torch.float16)), "norm_gate: expected"),
    (dict(norm_weight=torch.ones(64), norm_gate=torch.ones(2, 5, 128), norm_eps=-1.0), "norm_eps"),
    (dict(norm_weight=torch.ones(64, requires_grad=True), norm_gate=torch.ones(2, 5, 128)), "inference only"),
])
def test_chunked_output_norm_bad_input(change, match):
    q, k, v, g, beta = inputs(2, 5, 1, 2, 64, 64)
    args = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in change.items()}
    with pytest.raises((ValueError, TypeError), match=match):
        chunk_gated_delta_rule(q, k, v, g, beta, **args)


# ----------------------------------------------------------------------------- the model's decode step
def decode_step_inputs(N, H, HV, K, V, KW, pool, dtype, seed=0, pool_dtype=torch.float32):
    torch.manual_seed(seed)
    conv_dim = 2 * H * K + HV * V
    proj = torch.randn(N, conv_dim + HV * V + 2 * HV + 5, device=DEVICE).to(dtype)[:, 3:-2]  # strided rows
    conv_state = torch.randn(pool, conv_dim, KW, device=DEVICE).to(dtype)  # a pool, as the state
    conv_weight = (torch.randn(conv_dim, 1, KW, device=DEVICE) * 0.5).to(dtype)
    A_log, dt_bias = torch.randn(HV, device=DEVICE).to(dtype), torch.randn(HV, device=DEVICE).to(dtype)
    state = torch.randn(pool, HV, K, V, device=DEVICE).to(pool_dtype)
    return proj, conv_state, conv_weight, A_log, dt_bias, state


@pytest.mark.parametrize("dtype, pool_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                               (torch.float32, torch.bfloat16), (torch.float16, torch.float16)]
                         + ([(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)] if ON_GPU else []))
@pytest.mark.parametrize("H, HV, K, V", [(2, 4, 16, 32), (1, 2, 24, 40)])
def test_decode_step_matches_reference_over_steps(H, HV, K, V, dtype, pool_dtype):
    """Conv (circular state) + gates + l2-norm + recurrence, three tokens: o, the state pool and the
    conv state pool equal the reference's; each row reads and writes both pools at its slot (rows
    in another order than the slots), the inactive row (slot -1) and the unused slots are left as
    they were. A 16-bit pool is read into fp32 and each new state rounded once into it, by the
    kernel as by the reference."""
    from fuselm.ops.gated_delta_rule import gated_delta_rule_decode_step, gated_delta_rule_decode_step_ref
    proj, conv_state, conv_weight, A_log, dt_bias, state = decode_step_inputs(3, H, HV, K, V, 4, 5, dtype,
                                                                              pool_dtype=pool_dtype)
    slots = torch.tensor([3, -1, 0], device=DEVICE, dtype=torch.int32)
    positions = torch.tensor([0, 5, 2], device=DEVICE)
    ref_conv, ref_state = conv_state.clone(), state.clone()
    untouched_conv, untouched_pool = conv_state[[1, 2, 4]].clone(), state[[1, 2, 4]].clone()
    out = torch.full((3, HV, V), float("nan"), device=DEVICE, dtype=dtype)
    # 16 bits anywhere: roundings that may fall to neighbours (a pool's state then one ulp apart; the
    # interpreter's casts to bf16 truncate, the reference's round to nearest: 2^-7 a step at worst)
    tol = 1e-5 if dtype == pool_dtype == torch.float32 else 1e-2 if pool_dtype == torch.bfloat16 else 5e-3
    for step in range(3):
        proj.normal_()
        heads = dict(num_k_heads=H, head_k_dim=K, num_v_heads=HV, head_v_dim=V)
        o = gated_delta_rule_decode_step(proj, conv_state, conv_weight, A_log, dt_bias, state, slots, positions,
                                         out=out, **heads)
        o_ref = gated_delta_rule_decode_step_ref(proj, ref_conv, conv_weight, A_log, dt_bias, ref_state, slots,
                                                 positions, H, K, HV, V)
        assert o is out
        assert rel_err(o[[0, 2]], o_ref[[0, 2]]) <= tol, step
        assert state.dtype == pool_dtype and rel_err(state, ref_state) <= tol, step
        assert torch.equal(conv_state, ref_conv), step
        positions += 1
    assert torch.equal(conv_state[[1, 2, 4]], untouched_conv) and torch.equal(state[[1, 2, 4]], untouched_pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else []))
@pytest.mark.parametrize("norm_dtype", ["model", "fp32"])
def test_decode_step_with_the_gated_norm_is_decode_linears_prologue(monkeypatch, norm_dtype, dtype):
    """With ``norm_weight`` the step's output is HF's gated RMSNorm of o with z (one program a
    head): decode_linear's gated_rms_norm prologue kernel on the plain step's o (run on whole heads
    too), bit for bit (the same tile function), the reference's within tolerance; conv state as the
    plain step's, the state too. On the GPU the two builds of the kernel (with and without the norm)
    may compile the fp32 state update differently: there the state, and in fp32 the output, agree
    within fp32 rounding (16-bit outputs still bit for bit)."""
    from fuselm.ops.decode_linear import gated_rms_norm_ref
    from fuselm.ops.decode_linear.kernels import prologue_kernel
    from fuselm.ops.gated_delta_rule import fused_recurrent, gated_delta_rule_decode_step

    H, HV, K, V, N = 1, 4, 24, 32, 3
    monkeypatch.setattr(fused_recurrent, "BLOCK_V", V)
    proj, conv_state, conv_weight, A_log, dt_bias, state = decode_step_inputs(N, H, HV, K, V, 4, 4, dtype, seed=3)
    norm_weight = (torch.rand(V, device=DEVICE) + 0.5).to(dtype if norm_dtype == "model" else torch.float32)
    slots = torch.tensor([2, -1, 0], device=DEVICE, dtype=torch.int32)
    positions = torch.tensor([0, 5, 7], device=DEVICE)
    heads = dict(num_k_heads=H, head_k_dim=K, num_v_heads=HV, head_v_dim=V)
    plain_conv, plain_state = conv_state.clone(), state.clone()
    o = gated_delta_rule_decode_step(proj, plain_conv, conv_weight, A_log, dt_bias, plain_state, slots, positions,
                                     **heads)
    normed = gated_delta_rule_decode_step(proj, conv_state, conv_weight, A_log, dt_bias, state, slots, positions,
                                          norm_weight=norm_weight, eps=1e-5, out=torch.full_like(o, float("nan")),
                                          **heads)
    assert torch.equal(conv_state, plain_conv)
    assert rel_err(state, plain_state) <= 1e-6 if ON_GPU else torch.equal(state, plain_state)
    z = proj[:, 2 * H * K + HV * V:2 * H * K + 2 * HV * V]
    rows = (N, HV * V)
    if use_triton(proj):
        fused = prologue_kernel(o.reshape(rows), "gated_rms_norm", z, norm_weight, 1e-5, V)
        if ON_GPU and dtype == torch.float32:  # o's fp32 bits are the two builds' (see the state)
            assert rel_err(normed.reshape(rows), fused) <= 1e-6
        else:
            assert torch.equal(normed.reshape(rows), fused)
    ref = gated_rms_norm_ref(o.reshape(rows).double(), z.double(), norm_weight.double(), 1e-5, V)
    assert rel_err(normed.reshape(rows), ref) <= (1e-5 if dtype == torch.float32 else 5e-3)


def test_decode_step_norm_weight_is_checked():
    from fuselm.ops.gated_delta_rule import gated_delta_rule_decode_step

    heads = dict(num_k_heads=1, head_k_dim=16, num_v_heads=2, head_v_dim=24)
    proj, conv_state, conv_weight, A_log, dt_bias, state = decode_step_inputs(2, 1, 2, 16, 24, 4, 2, torch.float32)
    args = (proj, conv_state, conv_weight, A_log, dt_bias, state, torch.tensor([0, 1], device=DEVICE),
            torch.zeros(2, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="norm_weight: .*power-of-two head_v_dim"):
        gated_delta_rule_decode_step(*args, norm_weight=torch.ones(24, device=DEVICE), **heads)
    heads["head_v_dim"] = 32
    proj, conv_state, conv_weight, A_log, dt_bias, state = decode_step_inputs(2, 1, 2, 16, 32, 4, 2, torch.float32)
    args = (proj, conv_state, conv_weight, A_log, dt_bias, state, *args[6:])
    with pytest.raises(ValueError, match="norm_weight: expected"):
        gated_delta_rule_decode_step(*args, norm_weight=torch.ones(16, device=DEVICE), **heads)
    with pytest.raises(ValueError, match="eps"):
        gated_delta_rule_decode_step(*args, norm_weight=torch.ones(32, device=DEVICE), eps=float("nan"), **heads)


@pytest.mark.gpu
def test_decode_step_dependent_launches_equal_plain_launches_in_a_graph(monkeypatch):
    """Three tokens through two layers of add_rms_norm -> in_proj (decode_linear, one row) -> the
    decode step -> out_proj (gated RMSNorm prologue), the model's chain, in one CUDA graph: on Hopper
    the step loads its state slice and conv history while the projection ahead still runs, and the
    norms and projections load their weights early (programmatic dependent launch). The output, the
    state pools and the conv states are bit for bit the plain launches' (eager)."""
    from fuselm import runtime
    from fuselm.ops.decode_linear import decode_linear
    from fuselm.ops.gated_delta_rule import gated_delta_rule_decode_step
    from fuselm.ops.rms_norm import add_rms_norm
    H, HV, K, V, KW, D = 2, 4, 128, 128, 4, 256
    conv_dim = 2 * H * K + HV * V
    heads = dict(num_k_heads=H, head_k_dim=K, num_v_heads=HV, head_v_dim=V)
    layers = []
    for seed in range(2):
        proj, conv, conv_w, A_log, dt_bias, state = decode_step_inputs(1, H, HV, K, V, KW, 3, torch.bfloat16, seed)
        layers.append(dict(conv=conv, conv_w=conv_w, A_log=A_log, dt_bias=dt_bias, state=state,
                           in_proj=(torch.randn(proj.shape[1], D, device=DEVICE) * D ** -0.5).bfloat16(),
                           out_proj=(torch.randn(D, HV * V, device=DEVICE) * (HV * V) ** -0.5).bfloat16(),
                           norm=(torch.randn(D, device=DEVICE) * 0.1).bfloat16(),
                           head_norm=(torch.randn(V, device=DEVICE) * 0.3 + 1).bfloat16()))
    slots = torch.tensor([2], device=DEVICE, dtype=torch.int32)
    positions = torch.tensor([5], device=DEVICE)
    x0, r0 = torch.randn(2, 1, D, device=DEVICE).bfloat16()

    def tokens():
        x, residual = x0, r0
        for _ in range(3):
            for layer in layers:
                normed, residual = add_rms_norm(x, residual, layer["norm"], 1e-6, 1.0)
                proj = decode_linear(normed, layer["in_proj"])
                o = gated_delta_rule_decode_step(proj, layer["conv"], layer["conv_w"], layer["A_log"],
                                                 layer["dt_bias"], layer["state"], slots, positions, **heads)
                x = decode_linear(o.flatten(1), layer["out_proj"], prologue="gated_rms_norm",
                                  gate=proj[:, conv_dim:conv_dim + HV * V], norm_weight=layer["head_norm"], head_dim=V)
            positions.add_(1)
        return x, residual

    states = [(layer["state"], layer["conv"]) for layer in layers] + [(positions,)]
    start = [[t.clone() for t in group] for group in states]

    def restore():
        for group, saved in zip(states, start):
            for t, s in zip(group, saved):
                t.copy_(s)

    assert runtime.use_pdl(x0.device) == (torch.cuda.get_device_capability()[0] >= 9)
    tokens()  # compile
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tokens()
    graph.replay()
    replayed = [t.clone() for t in out] + [t.clone() for group in states for t in group]
    restore()
    monkeypatch.setattr(runtime, "PDL", False)
    plain = list(tokens()) + [t for group in states for t in group]
    assert all(torch.equal(a, b) for a, b in zip(replayed, plain))
    assert not torch.equal(plain[2], start[0][0])  # the steps did write the state


@pytest.mark.parametrize("change, error, match", [
    (lambda a: a.update(proj=a["proj"][:, :-1]), ValueError, "proj"),
    (lambda a: a.update(conv_state=a["conv_state"][..., :3]), ValueError, "conv_state"),
    (lambda a: a.update(conv_state=a["conv_state"][:4]), ValueError, "conv_state: expected a pool of state's slots"),
    (lambda a: a.update(state=a["state"].double()), TypeError, "state"),
    (lambda a: a.update(state=a["state"][..., :-1]), ValueError, "state"),
    (lambda a: a.update(positions=a["positions"].float()), TypeError, "positions"),
    (lambda a: a.update(state_slots=a["state_slots"][:2]), ValueError, "state_slots"),
    (lambda a: a.update(A_log=a["A_log"][:1]), ValueError, "A_log"),
])
def test_decode_step_bad_input(change, error, match):
    from fuselm.ops.gated_delta_rule import gated_delta_rule_decode_step
    proj, conv_state, conv_weight, A_log, dt_bias, state = decode_step_inputs(3, 2, 4, 16, 32, 4, 5, torch.float32)
    args = dict(proj=proj, conv_state=conv_state, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias, state=state,
                state_slots=torch.tensor([0, 1, 2], device=DEVICE), positions=torch.zeros(3, dtype=torch.long,
                                                                                             device=DEVICE))
    change(args)
    before = state.clone()
    with pytest.raises(error, match=match):
        gated_delta_rule_decode_step(**args, num_k_heads=2, head_k_dim=16, num_v_heads=4, head_v_dim=32)
    assert torch.equal(state, before)


GATE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # elementwise: bf16 is right in the interpreter


@pytest.mark.parametrize("dtype", GATE_DTYPES)
@pytest.mark.parametrize("B, T, HV", [(1, 1, 1), (3, 17, 6), (2, 40, 32)])
@pytest.mark.parametrize("masked", [False, True])
def test_gated_delta_gates_match_the_reference(B, T, HV, masked, dtype):
    """The fused gates on strided views of a projection (a, b beside other columns), in float64
    against the reference's math; masked tokens exactly 0, the mask's zeros nowhere else."""
    from fuselm.ops.gated_delta_rule import gated_delta_gates, gated_delta_gates_ref

    projected = (torch.randn(B, T, 5 + 2 * HV, device=DEVICE) * 4).to(dtype)  # wide a, b: softplus's both arms
    projected[0, 0, 5] = 30.0  # past softplus's threshold
    b, a = projected[..., 5:5 + HV], projected[..., 5 + HV:]
    A_log, dt_bias = torch.randn(HV, device=DEVICE).to(dtype), torch.randn(HV, device=DEVICE).to(dtype)
    mask = (torch.rand(B, T, device=DEVICE) < 0.7) if masked else None
    g, beta = gated_delta_gates(A_log, a, dt_bias, b, mask)
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.shape == beta.shape == (B, T, HV)
    g_ref, beta_ref = gated_delta_gates_ref(A_log, a, dt_bias, b, mask)
    g64 = -A_log.double().exp() * torch.nn.functional.softplus(a.double() + dt_bias.double())
    torch.testing.assert_close(g.double(), g64.masked_fill(~mask[..., None], 0) if masked else g64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]  # one rounding of beta
    torch.testing.assert_close(beta.float(), beta_ref.float(), rtol=ulp, atol=ulp)
    if masked:
        assert (g[~mask] == 0).all() and (beta[~mask] == 0).all()
        assert (beta[mask] > 0).all()


@pytest.mark.parametrize("bad, error, match", [
    (lambda A, a, d, b, m: (A, a[0], d, b, m), ValueError, r"a: expected \[B, T, HV\]"),
    (lambda A, a, d, b, m: (A, a, d, b[:, :2], m), ValueError, "b: shape"),
    (lambda A, a, d, b, m: (A, a, d, b.half(), m), TypeError, "b: dtype"),
    (lambda A, a, d, b, m: (A[:3], a, d, b, m), ValueError, r"A_log: expected \[HV\]"),
    (lambda A, a, d, b, m: (A, a, d[:3], b, m), ValueError, r"dt_bias: expected \[HV\]"),
    (lambda A, a, d, b, m: (A, a, d, b, m[:, :2]), ValueError, r"token_mask: expected \[B, T\]"),
    (lambda A, a, d, b, m: (A, a, d, b, m.int()), TypeError, "token_mask"),
    (lambda A, a, d, b, m: (A, a.transpose(1, 2).contiguous().transpose(1, 2), d, b, m), ValueError, "a: the head dim"),
])
def test_gated_delta_gates_bad_input(bad, error, match):
    from fuselm.ops.gated_delta_rule import gated_delta_gates

    args = (torch.randn(4, device=DEVICE), torch.randn(2, 3, 4, device=DEVICE), torch.randn(4, device=DEVICE),
            torch.randn(2, 3, 4, device=DEVICE), torch.ones(2, 3, dtype=torch.bool, device=DEVICE))
    with pytest.raises(error, match=match):
        gated_delta_gates(*bad(*args))


@pytest.mark.parametrize("neg_eigval", [False, True])
def test_fused_recurrent_takes_fla_options(neg_eigval):
    """fused_recurrent_gated_delta_rule with FLA's keyword options (raw gate + A_log / dt_bias,
    beta logits, [V, K] fp16 states) equals the reference fed the same math; gk / gv refused."""
    B, T, H, HV, K, V = 2, 9, 1, 2, 32, 16
    q, k, v, _, _ = inputs(B, T, H, HV, K, V)
    g_raw, logits = torch.randn(B, T, HV, device=DEVICE), torch.randn(B, T, HV, device=DEVICE)
    A_log, dt_bias = torch.randn(HV, device=DEVICE) * 0.5, torch.randn(HV, device=DEVICE)
    h0_vk = torch.randn(B, HV, V, K, device=DEVICE).half()
    o, ht = fused_recurrent_gated_delta_rule(
        q, k, v, g=g_raw, beta=logits, initial_state=h0_vk, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=neg_eigval, state_v_first=True)
    g = -A_log.exp() * torch.nn.functional.softplus(g_raw + dt_bias)
    beta = logits.sigmoid() * (2.0 if neg_eigval else 1.0)
    o_ref, ht_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0_vk.float().transpose(-1, -2),
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert ht.shape == (B, HV, V, K)
    assert rel_err(o, o_ref) <= TOL[torch.float32] and rel_err(ht, ht_ref.transpose(-1, -2)) <= TOL[torch.float32]
    with pytest.raises(NotImplementedError, match="gk, gv"):
        fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, gk=g)
