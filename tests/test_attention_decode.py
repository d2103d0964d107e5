"""qk_norm_rope_kv_write (gated-attention decode prep) against the PyTorch composition the model
runs: bit-exact (torch.equal) in fp32, fp16 and bf16 (no tl.dot, so bf16 is exact in the
interpreter too), caches written only at each row's write column."""

import pytest
import torch

from conftest import DEVICE
from fuselm.ops.attention_decode import qk_norm_rope_kv_write, qk_norm_rope_kv_write_ref
from fuselm.ops.decode_inputs import rotary_cos_sin
from helpers import ELEMENTWISE_DTYPES

EPS = 1e-6


def make_inputs(B, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, *, max_batch, L, qkv_layout="3d",
                cos_layout="2d", seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)

    P = 2 * num_heads * head_dim + 2 * num_kv_heads * head_dim
    if qkv_layout == "3d":
        qkv = rand(B, 1, P, scale=2.0)
    else:  # [B, P] with a row stride: a column slice of a wider buffer
        qkv = rand(B, P + 24, scale=2.0)[:, 8:8 + P]
    positions = torch.randint(0, 5000, (B,), generator=g).to(DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)).to(DEVICE)
    cos, sin = rotary_cos_sin(positions, inv_freq, dtype)  # [B, rotary_dim], the model's rounding
    if cos_layout == "4d":  # the model's _DecodeStep layout [B, 1, 1, rotary_dim]
        cos, sin = cos[:, None, None], sin[:, None, None]
    elif cos_layout == "strided":  # [B, rotary_dim] with a row stride
        cos = torch.cat([cos, cos], -1)[:, :rotary_dim]
        sin = torch.cat([sin, sin], -1)[:, rotary_dim:]
    key_cache = rand(max_batch, num_kv_heads, L, head_dim)
    value_cache = rand(max_batch, num_kv_heads, L, head_dim)
    write_column = torch.randperm(L, generator=g)[:B].to(DEVICE)
    return dict(qkv=qkv, q_norm_weight=rand(head_dim, scale=0.3), k_norm_weight=rand(head_dim, scale=0.3),
                cos=cos, sin=sin, key_cache=key_cache, value_cache=value_cache, write_column=write_column)


def run_both(inputs, num_heads, num_kv_heads, head_dim, q_out=None):
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, eps=EPS)
    ref_in = dict(inputs, key_cache=inputs["key_cache"].clone(), value_cache=inputs["value_cache"].clone())
    out_in = dict(inputs, key_cache=inputs["key_cache"].clone(), value_cache=inputs["value_cache"].clone())
    q_ref = qk_norm_rope_kv_write_ref(**ref_in, **kw)
    q = qk_norm_rope_kv_write(**out_in, **kw, q_out=q_out)
    return q, q_ref, out_in, ref_in


CONFIGS = [  # B, num_heads, num_kv_heads, head_dim, rotary_dim
    (3, 4, 2, 16, 4),
    (1, 4, 1, 32, 8),
    (3, 4, 1, 32, 8),
    (3, 4, 2, 24, 6),  # head_dim not a power of two (masked columns), odd half
    (1, 4, 2, 16, 16),  # full rotary
    (3, 16, 4, 256, 64),  # Qwen3.5 9B attention (partial_rotary_factor 0.25)
]


def assert_same(out, ref, dtype, head_dim):
    """Bit-exact, except on a GPU for a head_dim that is not a power of two: the kernel's masked
    sum of squares reduces in another order than the rms_norm kernel the reference runs (seen on
    the H100: fp32, 2 of 288 values 2 ulp apart at head_dim 24); there within 4 ulp of the dtype."""
    if DEVICE == "cuda" and head_dim & (head_dim - 1):
        torch.testing.assert_close(out, ref, rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES, ids=str)
@pytest.mark.parametrize("B, num_heads, num_kv_heads, head_dim, rotary_dim", CONFIGS)
def test_bit_exact_against_reference(B, num_heads, num_kv_heads, head_dim, rotary_dim, dtype):
    max_batch, L = B + 2, 9
    inputs = make_inputs(B, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, max_batch=max_batch, L=L)
    key_before, value_before = inputs["key_cache"].clone(), inputs["value_cache"].clone()
    qkv_before = inputs["qkv"].clone()
    q_out = torch.full((B, num_heads, 1, head_dim), float("nan"), device=DEVICE, dtype=dtype)
    q, q_ref, out, ref = run_both(inputs, num_heads, num_kv_heads, head_dim, q_out=q_out)
    assert q is q_out and q.shape == (B, num_heads, 1, head_dim) and q.is_contiguous()
    assert_same(q, q_ref, dtype, head_dim)
    assert torch.equal(inputs["qkv"], qkv_before)  # nothing written to the projection (the gate half is a view of it)
    assert_same(out["key_cache"], ref["key_cache"], dtype, head_dim)
    assert torch.equal(out["value_cache"], ref["value_cache"])
    # Only (row r, column write_column[r]) changed; rows >= B and other columns are untouched.
    written = torch.zeros(max_batch, L, dtype=torch.bool, device=DEVICE)
    written[torch.arange(B, device=DEVICE), inputs["write_column"]] = True
    for cache, before in ((out["key_cache"], key_before), (out["value_cache"], value_before)):
        untouched = ~written[:, None, :, None].expand_as(cache)
        assert torch.equal(cache[untouched], before[untouched])
    # v is copied unchanged; k is not the raw projection (normed and rotated).
    rows = torch.arange(B, device=DEVICE)
    P_kv = num_kv_heads * head_dim
    v_raw = inputs["qkv"].reshape(B, -1)[:, -P_kv:].reshape(B, num_kv_heads, head_dim)
    assert torch.equal(out["value_cache"][rows, :, inputs["write_column"]], v_raw)


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES, ids=str)
def test_write_row_writes_into_the_given_cache_rows(dtype):
    """A paged cache: batch row b writes into cache row (page) write_row[b]; two pages fewer than
    rows would be needed without it, nothing else is touched, q is unchanged."""
    B, num_heads, num_kv_heads, head_dim, rotary_dim = 3, 4, 2, 16, 4
    inputs = make_inputs(B, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, max_batch=7, L=16)
    write_row = torch.tensor([6, 0, 3], device=DEVICE)
    before = inputs["key_cache"].clone(), inputs["value_cache"].clone()
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, eps=EPS)
    ref_in = dict(inputs, key_cache=before[0].clone(), value_cache=before[1].clone())
    q_ref = qk_norm_rope_kv_write_ref(**ref_in, **kw, write_row=write_row)
    q = qk_norm_rope_kv_write(**inputs, **kw, write_row=write_row)
    assert torch.equal(q, q_ref) and torch.equal(q, qk_norm_rope_kv_write_ref(**dict(
        inputs, key_cache=before[0].clone(), value_cache=before[1].clone()), **kw))
    assert torch.equal(inputs["key_cache"], ref_in["key_cache"]) and torch.equal(inputs["value_cache"], ref_in["value_cache"])
    written = torch.zeros(7, 16, dtype=torch.bool, device=DEVICE)
    written[write_row, inputs["write_column"]] = True
    for cache, old in zip((inputs["key_cache"], inputs["value_cache"]), before):
        assert not torch.equal(cache, old)
        untouched = ~written[:, None, :, None].expand_as(cache)
        assert torch.equal(cache[untouched], old[untouched])
    with pytest.raises(ValueError, match="write_row"):
        qk_norm_rope_kv_write(**inputs, **kw, write_row=write_row[:2])
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"write_row: every row must be in \[0, 7\)"):
            qk_norm_rope_kv_write(**inputs, **kw, write_row=write_row + 5)


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES, ids=str)
@pytest.mark.parametrize("qkv_layout, cos_layout", [("2d", "4d"), ("2d", "strided"), ("3d", "strided")])
def test_strided_layouts(qkv_layout, cos_layout, dtype):
    B, nH, nKV, hd, rot = 3, 4, 2, 16, 4
    inputs = make_inputs(B, nH, nKV, hd, rot, dtype, max_batch=4, L=6, qkv_layout=qkv_layout, cos_layout=cos_layout,
                         seed=1)
    # A cache that is a leading-rows view of a bigger one with a padded L.
    inputs["key_cache"] = torch.randn(6, nKV, 8, hd, device=DEVICE).to(dtype)[:4, :, 1:7]
    inputs["value_cache"] = torch.randn(6, nKV, 8, hd, device=DEVICE).to(dtype)[:4, :, 1:7]
    q, q_ref, out, ref = run_both(inputs, nH, nKV, hd)
    assert q.is_contiguous() and torch.equal(q, q_ref)
    assert torch.equal(out["key_cache"], ref["key_cache"]) and torch.equal(out["value_cache"], ref["value_cache"])


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES, ids=str)
def test_k_out_gets_every_rows_normed_rotated_k(dtype):
    """``k_out`` (the prefill path's keys for attention within a chunk): every row's k as the
    reference computes it, beside the cache writes; a poisoned buffer is overwritten whole."""
    B, nH, nKV, hd, rot = 5, 4, 2, 32, 8
    inputs = make_inputs(B, nH, nKV, hd, rot, dtype, max_batch=B + 1, L=7, seed=3)
    kw = dict(num_heads=nH, num_kv_heads=nKV, head_dim=hd, eps=EPS)
    k_ref = torch.empty(B, nKV, hd, device=DEVICE, dtype=dtype)
    ref_in = dict(inputs, key_cache=inputs["key_cache"].clone(), value_cache=inputs["value_cache"].clone())
    q_ref = qk_norm_rope_kv_write_ref(**ref_in, **kw, k_out=k_ref)
    k_out = torch.full((B, nKV, hd), float("nan"), device=DEVICE, dtype=dtype)
    q = qk_norm_rope_kv_write(**inputs, **kw, k_out=k_out)
    assert_same(q, q_ref, dtype, hd)
    assert_same(k_out, k_ref, dtype, hd)
    assert torch.equal(inputs["key_cache"], ref_in["key_cache"]) and torch.equal(inputs["value_cache"],
                                                                                 ref_in["value_cache"])
    with pytest.raises(ValueError, match="k_out: expected a contiguous"):
        qk_norm_rope_kv_write(**inputs, **kw, k_out=k_out[:, :1])


def test_batch_of_zero_rows():
    inputs = make_inputs(1, 4, 2, 16, 4, torch.float32, max_batch=2, L=3)
    inputs["qkv"], inputs["cos"], inputs["sin"] = inputs["qkv"][:0], inputs["cos"][:0], inputs["sin"][:0]
    inputs["write_column"] = inputs["write_column"][:0]
    before = inputs["key_cache"].clone()
    q = qk_norm_rope_kv_write(**inputs, num_heads=4, num_kv_heads=2, head_dim=16, eps=EPS)
    assert q.shape == (0, 4, 1, 16) and torch.equal(inputs["key_cache"], before)


def _bad(**changes):
    B, nH, nKV, hd = 2, 4, 2, 16
    inputs = make_inputs(B, nH, nKV, hd, 4, torch.float32, max_batch=3, L=5)
    kw = dict(num_heads=nH, num_kv_heads=nKV, head_dim=hd, eps=EPS)
    for name, value in changes.items():
        (kw if name in kw or name == "q_out" else inputs)[name] = value(inputs) if callable(value) else value
    return lambda: qk_norm_rope_kv_write(**inputs, **kw)


f32 = dict(device=DEVICE, dtype=torch.float32)


@pytest.mark.parametrize("call, error, match", [
    (_bad(qkv=lambda i: i["qkv"][..., :-1]), ValueError, "qkv: expected"),
    (_bad(qkv=lambda i: i["qkv"].expand(2, 2, -1)), ValueError, "qkv: expected"),
    (_bad(qkv=lambda i: i["qkv"].to(torch.float16)), TypeError, "cos: dtype"),
    (_bad(qkv=lambda i: i["qkv"].to(torch.float64)), TypeError, "qkv: dtype float64"),
    (_bad(qkv=[1.0]), TypeError, "qkv: expected a torch.Tensor"),
    (_bad(q_norm_weight=torch.zeros(15, **f32)), ValueError, "q_norm_weight: expected"),
    (_bad(k_norm_weight=torch.zeros(1, 16, **f32)), ValueError, "k_norm_weight: expected"),
    (_bad(cos=lambda i: i["cos"][:1]), ValueError, "cos: expected"),
    (_bad(sin=lambda i: i["sin"][:, :2]), ValueError, "sin: shape"),
    (_bad(cos=lambda i: i["cos"].to(torch.float16)), TypeError, "cos: dtype"),
    (_bad(cos=torch.zeros(2, 3, **f32), sin=torch.zeros(2, 3, **f32)), ValueError, "cos: rotary_dim .* even"),
    (_bad(cos=torch.zeros(2, 18, **f32), sin=torch.zeros(2, 18, **f32)), ValueError, "cos: rotary_dim 18 exceeds"),
    (_bad(key_cache=torch.zeros(1, 2, 5, 16, **f32)), ValueError, "key_cache: expected"),
    (_bad(key_cache=torch.zeros(3, 1, 5, 16, **f32)), ValueError, "key_cache: expected"),
    (_bad(value_cache=torch.zeros(3, 2, 4, 16, **f32)), ValueError, "value_cache: shape"),
    (_bad(value_cache=torch.zeros(3, 2, 5, 16, device=DEVICE, dtype=torch.float16)), TypeError, "value_cache: dtype"),
    (_bad(key_cache=torch.zeros(3, 2, 16, 5, **f32).transpose(-1, -2)), ValueError, "key_cache: the last dim"),
    (_bad(write_column=torch.zeros(2, device=DEVICE, dtype=torch.float32)), ValueError, "write_column: expected"),
    (_bad(write_column=torch.zeros(3, device=DEVICE, dtype=torch.int64)), ValueError, "write_column: expected"),
    (_bad(write_column=[0, 1]), TypeError, "write_column: expected a torch.Tensor"),
    pytest.param(_bad(write_column=torch.tensor([0, 5], device=DEVICE)), ValueError,
                 r"write_column: every column must be in \[0", marks=pytest.mark.skipif(
                     DEVICE == "cuda", reason="range checked on the host for CPU tensors only (no sync); "
                     "the kernel writes nothing for such a column (test_failed_call_writes_nothing)")),
    (_bad(num_heads=0), ValueError, "num_heads"),
    (_bad(num_kv_heads=2.0), ValueError, "num_kv_heads"),
    (_bad(head_dim=8), ValueError, "qkv: expected"),
    (_bad(eps=-1.0), ValueError, "eps"),
    (_bad(q_out=torch.zeros(2, 4, 16, 1, **f32)), ValueError, "q_out: expected"),
    (_bad(q_out=torch.zeros(2, 4, 1, 16, device=DEVICE, dtype=torch.float16)), TypeError, "q_out: dtype"),
    (_bad(q_out=torch.zeros(4, 2, 1, 16, **f32).transpose(0, 1)), ValueError, "q_out: must be contiguous"),
    (_bad(q_out=torch.zeros(2, 4, 1, 16, device="meta")), ValueError, "one device"),
])
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_failed_call_writes_nothing():
    inputs = make_inputs(2, 4, 2, 16, 4, torch.float32, max_batch=3, L=5)
    before = inputs["key_cache"].clone()
    q_out = torch.full((2, 4, 1, 16), 7.0, **f32)
    call = lambda: qk_norm_rope_kv_write(**dict(inputs, write_column=torch.tensor([0, 9], device=DEVICE)),  # noqa: E731
                                         num_heads=4, num_kv_heads=2, head_dim=16, eps=EPS, q_out=q_out)
    if DEVICE == "cuda":  # no host check (it would sync): the out-of-range row writes nothing
        call()
        assert torch.equal(inputs["key_cache"][:, :, 1:], before[:, :, 1:])
    else:
        with pytest.raises(ValueError):
            call()
        assert torch.equal(inputs["key_cache"], before) and bool((q_out == 7.0).all())


# ----------------------------------------------------------------------------- decode_attention
from fuselm.ops.attention_decode import decode_attention, decode_attention_ref  # noqa: E402

ATTENTION_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
ATTENTION_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def attention_inputs(B, num_heads, num_kv_heads, head_dim, L, dtype, lengths, seed=0):
    """Caches with one spare row and every column past a row's length poisoned with NaN (the
    kernel must never read them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, num_heads, head_dim, generator=g).to(DEVICE, dtype)
    caches = [torch.randn(B + 1, num_kv_heads, L, head_dim, generator=g).to(DEVICE, dtype) for _ in range(2)]
    lengths = torch.tensor(lengths, device=DEVICE)
    past = torch.arange(L, device=DEVICE)[None, :] >= lengths[:, None]  # [B, L]
    for cache in caches:
        cache[:B].masked_fill_(past[:, None, :, None], float("nan"))
    return q, *caches, lengths


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=str)
@pytest.mark.parametrize("B, num_heads, num_kv_heads, head_dim, L, lengths", [
    (1, 2, 2, 8, 5, [5]),               # MHA, one block
    (3, 4, 2, 24, 37, [37, 1, 0]),      # odd head_dim, a one-token row and an empty row
    (2, 16, 4, 64, 200, [200, 131]),    # GQA 4, several blocks and splits
    (2, 6, 2, 40, 130, [65, 64]),       # group of 3 (padded), lengths at block edges
])
def test_decode_attention_matches_reference(B, num_heads, num_kv_heads, head_dim, L, lengths, dtype):
    q, key_cache, value_cache, kv_lengths = attention_inputs(B, num_heads, num_kv_heads, head_dim, L, dtype, lengths)
    out = decode_attention(q, key_cache, value_cache, kv_lengths, head_dim ** -0.5)
    ref = decode_attention_ref(q.double(), key_cache.double(), value_cache.double(), kv_lengths, head_dim ** -0.5)
    assert out.shape == (B, num_heads, head_dim) and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() <= ATTENTION_TOL[dtype]
    assert torch.equal(out[kv_lengths == 0], torch.zeros_like(out[kv_lengths == 0]))
    # [B, nH, 1, hd] (the prep op's q layout) gives the same
    assert torch.equal(decode_attention(q[:, :, None], key_cache, value_cache, kv_lengths, head_dim ** -0.5), out)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [16, 32, 128])
def test_paged_decode_attention_equals_the_contiguous_rows(page_size, dtype):
    """Rows scattered over shuffled pages (a block table per row, unused entries pointing at a
    NaN-poisoned page) give the contiguous rows' result."""
    B, num_heads, num_kv_heads, head_dim, pages_per_row = 3, 8, 2, 32, 3
    L = pages_per_row * page_size
    q, key_rows, value_rows, kv_lengths = attention_inputs(B, num_heads, num_kv_heads, head_dim, L, dtype,
                                                           [L, page_size + 3, 1], seed=9)
    key_rows, value_rows = key_rows[:B], value_rows[:B]
    n_pages = B * pages_per_row + 2
    order = torch.randperm(n_pages - 1, generator=torch.Generator().manual_seed(2))[:B * pages_per_row]
    table = order.view(B, pages_per_row).to(DEVICE)
    table[2, 1:] = n_pages - 1  # past row 2's length: the poisoned page
    pages = []
    for rows in (key_rows, value_rows):
        paged = torch.full((n_pages, num_kv_heads, page_size, head_dim), float("nan"), device=DEVICE, dtype=dtype)
        for b in range(B):
            for j in range(pages_per_row):
                if table[b, j] != n_pages - 1:
                    paged[table[b, j]] = rows[b, :, j * page_size:(j + 1) * page_size]
        pages.append(paged)
    contiguous = decode_attention(q, key_rows, value_rows, kv_lengths, 0.2)
    for index_dtype in (torch.int32, torch.int64):
        paged_out = decode_attention(q, *pages, kv_lengths, 0.2, block_table=table.to(index_dtype))
        assert torch.isfinite(paged_out).all()
        # Pages split the columns differently from the contiguous rows (another fp32 summation
        # order): equal within one rounding of the output, and as close to the fp64 reference.
        one_rounding = torch.finfo(dtype).eps * contiguous.double().abs()
        gap = (paged_out.double() - contiguous.double()).abs()
        assert (gap <= one_rounding.clamp_min(ATTENTION_TOL[dtype] / 4)).all()
        ref = decode_attention_ref(q.double(), key_rows.double(), value_rows.double(), kv_lengths, 0.2)
        assert (paged_out.double() - ref).abs().max() <= ATTENTION_TOL[dtype]


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [24, 64])
def test_gated_decode_attention_is_the_sigmoid_gate_of_the_output(head_dim, dtype):
    """With Qwen3.5's gate (read in place: heads strided, interleaved with the query in the
    projection), the output is decode_linear's sigmoid_gate prologue kernel on the ungated output,
    bit for bit (the same tile function), and the reference's within the output tolerance; an
    empty row stays zero."""
    from fuselm.ops.decode_linear.kernels import prologue_kernel

    B, num_heads = 3, 4
    q, key_cache, value_cache, kv_lengths = attention_inputs(B, num_heads, 2, head_dim, 40, dtype, [40, 9, 0], seed=5)
    projection = torch.randn(B, num_heads, 2, head_dim, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    gate = projection[:, :, 1]  # [B, nH, hd], heads 2 hd apart
    plain = decode_attention(q, key_cache, value_cache, kv_lengths, 0.3)
    gated = decode_attention(q, key_cache, value_cache, kv_lengths, 0.3, gate=gate)
    rows = (B * num_heads, head_dim)
    assert torch.equal(gated.view(rows), prologue_kernel(plain.view(rows), "sigmoid_gate", gate.reshape(rows)))
    ref = decode_attention_ref(q.double(), key_cache.double(), value_cache.double(), kv_lengths, 0.3,
                               gate=gate.double())
    assert (gated.double() - ref).abs().max() <= ATTENTION_TOL[dtype]
    assert torch.equal(gated[2], torch.zeros_like(gated[2]))


def test_decode_attention_equals_masked_sdpa_in_the_model_layout():
    """Against the masked SDPA the model's decode step used before (fp32, GQA)."""
    q, key_cache, value_cache, kv_lengths = attention_inputs(3, 8, 2, 32, 50, torch.float32, [50, 7, 23], seed=4)
    key_cache, value_cache = key_cache.nan_to_num(0.0), value_cache.nan_to_num(0.0)
    mask = (torch.arange(50, device=DEVICE)[None, :] < kv_lengths[:, None])[:, None, None, :]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], key_cache[:3], value_cache[:3], attn_mask=mask,
                                                            scale=0.2, enable_gqa=True)[:, :, 0]
    assert (decode_attention(q, key_cache, value_cache, kv_lengths, 0.2) - sdpa).abs().max() <= 2e-5


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {**a, "q": a["q"].half()}, TypeError, "key_cache: dtype"),
    (lambda a: {**a, "kv_lengths": a["kv_lengths"].float()}, TypeError, "kv_lengths"),
    (lambda a: {**a, "kv_lengths": a["kv_lengths"][:1]}, ValueError, "kv_lengths"),
    (lambda a: {**a, "q": a["q"][:, :3]}, ValueError, "q: 3 heads"),
    (lambda a: {**a, "value_cache": a["value_cache"][:, :, :9]}, ValueError, "value_cache"),
    (lambda a: {**a, "key_cache": a["key_cache"][..., :8]}, ValueError, "key_cache"),
    (lambda a: {**a, "q": a["q"][:, :, :, None]}, ValueError, "q: expected"),
    (lambda a: {**a, "block_table": a["kv_lengths"].float()[:, None]}, TypeError, "block_table"),
    (lambda a: {**a, "block_table": a["kv_lengths"][:1, None]}, ValueError, "block_table"),
    (lambda a: {**a, "key_cache": a["key_cache"][:, :, :10], "value_cache": a["value_cache"][:, :, :10],
                "block_table": a["kv_lengths"][:, None] * 0}, ValueError, "power of two"),
    (lambda a: {**a, "gate": a["q"][:, :2]}, ValueError, "gate: expected"),
    (lambda a: {**a, "gate": a["q"].half()}, ValueError, "gate: expected"),
    (lambda a: {**a, "gate": a["q"].transpose(1, 2).contiguous().transpose(1, 2)}, ValueError, "gate: expected"),
])
def test_decode_attention_bad_input_names_the_argument(change, error, match):
    q, key_cache, value_cache, kv_lengths = attention_inputs(2, 4, 2, 16, 12, torch.float32, [12, 5])
    arguments = {"q": q, "key_cache": key_cache, "value_cache": value_cache, "kv_lengths": kv_lengths, "scale": 0.25}
    with pytest.raises(error, match=match):
        decode_attention(**change(arguments))


def test_decode_attention_lengths_past_the_cache_are_refused_on_the_cpu():
    """(On a GPU the lengths are not read on the host: no sync.)"""
    q, key_cache, value_cache, kv_lengths = attention_inputs(2, 4, 2, 16, 12, torch.float32, [12, 5])
    with pytest.raises(ValueError, match=r"kv_lengths: values must be in \[0, 12\]"):
        decode_attention(q.cpu(), key_cache.cpu(), value_cache.cpu(), kv_lengths.cpu() + 1, 0.25)
