"""prefill_attention (paged causal attention of a prompt chunk) against its float64 reference and
the model's PyTorch path (gather_pages + masked SDPA): fresh and continued chunks, mixed rows with
right padding, GQA groups 1, 2, 3 and 4, page sizes 16, 32 and 128 (two column steps a page),
shuffled pages, strided q. Every column at or past a row's last real position is NaN, and so is
every page the block table points at past it: the kernel must never read them."""

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from fuselm.ops.attention_decode import gather_pages
from fuselm.ops.attention_prefill import prefill_attention, prefill_attention_ref
from fuselm.ops.attention_prefill import op as prefill_op
from fuselm.ops.attention_prefill.kernels import prefill_attention_kernel

DTYPES = [torch.float32, torch.float16]
ATTENTION_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_case(starts, lengths, T, num_heads, num_kv_heads, head_dim, page, dtype, *, seed=0, poison=True,
              spare_pages=1):
    """(q, key_pages, value_pages, block_table, starts, lengths): each row's columns scattered
    over shuffled pages; with ``poison`` every column at or past starts + lengths is NaN and the
    table entries past them point at an all-NaN page (the last one, the scratch page)."""
    g = torch.Generator().manual_seed(seed)
    B = len(starts)
    ends = [s + n for s, n in zip(starts, lengths)]
    pages_per_row = max(-(-e // page) for e in ends) + spare_pages
    columns = pages_per_row * page
    rows_k = torch.randn(B, num_kv_heads, columns, head_dim, generator=g)
    rows_v = torch.randn(B, num_kv_heads, columns, head_dim, generator=g)
    n_pages = B * pages_per_row + 1
    scratch = n_pages - 1
    table = torch.randperm(B * pages_per_row, generator=g).view(B, pages_per_row)
    fill = float("nan") if poison else 0.0
    key_pages = torch.full((n_pages, num_kv_heads, page, head_dim), fill)
    value_pages = torch.full((n_pages, num_kv_heads, page, head_dim), fill)
    for b in range(B):
        if poison:
            rows_k[b, :, ends[b]:] = float("nan")
            rows_v[b, :, ends[b]:] = float("nan")
        for j in range(pages_per_row):
            if poison and j * page >= ends[b]:
                table[b, j] = scratch  # holds no real column: never read
            else:
                key_pages[table[b, j]] = rows_k[b, :, j * page:(j + 1) * page]
                value_pages[table[b, j]] = rows_v[b, :, j * page:(j + 1) * page]
    q = torch.randn(B, T, num_heads, head_dim, generator=g).transpose(1, 2)  # GatedAttention._project's layout
    to = dict(device=DEVICE, dtype=dtype)
    return (q.to(**to), key_pages.to(**to), value_pages.to(**to), table.to(DEVICE),
            torch.tensor(starts, device=DEVICE), torch.tensor(lengths, device=DEVICE))


def check_against_reference(out, case, scale, dtype):
    q, key_pages, value_pages, table, starts, lengths = case
    B, num_heads, T, head_dim = q.shape
    assert out.shape == (B, num_heads, T, head_dim) and out.dtype == dtype
    assert out.transpose(1, 2).is_contiguous()  # the caller's transpose + flatten is free
    ref = prefill_attention_ref(q.double(), key_pages.double(), value_pages.double(), table, starts, lengths, scale)
    real = (torch.arange(T, device=DEVICE)[None, :] < lengths[:, None])[:, None, :, None].expand_as(out)
    assert torch.isfinite(out).all()
    assert (out.double() - ref)[real].abs().max() <= ATTENTION_TOL[dtype]
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))  # padding queries: zeros


CASES = {  # starts, lengths, T, nH, nKV, hd, P
    "fresh-mha": ([0, 0], [37, 7], 37, 2, 2, 16, 16),
    "fresh-gqa4": ([0], [29], 29, 8, 2, 32, 32),
    "continued-gqa4": ([40, 17], [23, 23], 23, 8, 2, 32, 16),
    "continued-page32": ([70, 5], [33, 30], 33, 4, 1, 16, 32),
    "mixed-gqa3": ([0, 45, 3, 16], [19, 6, 1, 0], 19, 6, 2, 16, 16),
    "continued-page128": ([70, 150], [37, 45], 45, 4, 2, 16, 128),  # 64-column steps inside 128-column pages
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, dtype):
    starts, lengths, T, nH, nKV, hd, P = CASES[name]
    case = make_case(starts, lengths, T, nH, nKV, hd, P, dtype, seed=len(name))
    scale = hd ** -0.5
    out = prefill_attention(*case, scale)
    check_against_reference(out, case, scale, dtype)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("name", ["continued-gqa4", "mixed-gqa3", "fresh-mha"])
def test_small_tiles(name, block_m):
    """Many tiles per row: T not a multiple of the tile, a group of 3 straddling tiles, tiles
    wholly in the padding, tiles whose first query starts mid-page."""
    starts, lengths, T, nH, nKV, hd, P = CASES[name]
    case = make_case(starts, lengths, T, nH, nKV, hd, P, torch.float32, seed=block_m)
    out = prefill_attention_kernel(*case, 0.3, block_m=block_m)
    check_against_reference(out, case, 0.3, torch.float32)
    # Rows are independent of the tiling up to the softmax sums' order (a tile shape's own on a GPU).
    default = prefill_attention(*case, 0.3)
    assert ((out - default).abs() <= 2e-6 * default.abs().clamp(min=1)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_qwen35_shape_on_the_gpu(dtype):
    """Qwen3.5's attention shape (16 query heads, 4 KV heads, head dim 256, pages of 64): the
    largest tiles the kernel builds (shared memory at hd 256), a continued and a fresh row."""
    case = make_case([300, 0], [200, 120], 200, 16, 4, 256, 64, dtype, seed=7)
    check_against_reference(prefill_attention(*case, 256 ** -0.5), case, 256 ** -0.5, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_bf16(name):
    starts, lengths, T, nH, nKV, hd, P = CASES[name]
    case = make_case(starts, lengths, T, nH, nKV, hd, P, torch.bfloat16, seed=3)
    out = prefill_attention(*case, hd ** -0.5)
    check_against_reference(out, case, hd ** -0.5, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_layouts_and_index_dtypes_give_the_same_result(dtype):
    """q read in place through its strides; int32 indices; a strided block table."""
    q, key_pages, value_pages, table, starts, lengths = make_case([24, 0], [18, 11], 18, 4, 2, 16, 16, dtype, seed=5)
    base = prefill_attention(q, key_pages, value_pages, table, starts, lengths, 0.25)
    rows = q.transpose(1, 2)  # [B, T, nH, hd]
    gate_half = torch.cat([rows, torch.full_like(rows, float("nan"))], -1)[..., :16].transpose(1, 2)  # q of q_gate
    for layout_q in (q.contiguous(), gate_half):
        assert torch.equal(prefill_attention(layout_q, key_pages, value_pages, table, starts, lengths, 0.25), base)
    out = prefill_attention(q, key_pages, value_pages, table.int(), starts.int(), lengths.int(), 0.25)
    assert torch.equal(out, base)
    wide = torch.cat([table, table], 1)[:, :table.shape[1]]  # row stride wider than the row
    assert torch.equal(prefill_attention(q, key_pages, value_pages, wide, starts, lengths, 0.25), base)


def _model_path(q, key_pages, value_pages, pages, starts, T, scale, fresh_kv=None):
    """GatedAttention.prefill's attention: the fresh path (SDPA causal over the chunk's own K/V),
    or the continued path (gather the block-table row, SDPA with the [B, 1, T, pages * P] mask)."""
    if fresh_kv is not None:
        return F.scaled_dot_product_attention(q, *fresh_kv, is_causal=True, scale=scale, enable_gqa=True)
    positions = starts[:, None] + torch.arange(T, device=q.device)
    keys, values = gather_pages(key_pages, pages), gather_pages(value_pages, pages)
    columns = torch.arange(keys.shape[2], device=q.device)
    visible = (columns[None, None, :] <= positions[:, :, None])[:, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale, enable_gqa=True)


def test_equals_the_models_continued_chunk_path():
    """fp32, finite caches (the model's pages hold finite stale values past a row's length)."""
    starts, lengths, T = [37, 70, 5], [21, 21, 9], 21
    case = make_case(starts, lengths, T, 8, 2, 32, 16, torch.float32, seed=11, poison=False)
    q, key_pages, value_pages, table, starts_t, lengths_t = case
    model = _model_path(q, key_pages, value_pages, table, starts_t, T, 0.2)
    out = prefill_attention(*case, 0.2)
    real = (torch.arange(T, device=DEVICE)[None, :] < lengths_t[:, None])[:, None, :, None].expand_as(out)
    assert (out - model)[real].abs().max() <= 2e-5


def test_equals_the_models_fresh_chunk_path():
    """A fresh chunk whose K/V were written into its pages: the same as SDPA over the chunk."""
    T, nH, nKV, hd, P = 27, 4, 2, 16, 16
    case = make_case([0, 0], [T, T], T, nH, nKV, hd, P, torch.float32, seed=12, poison=False)
    q, key_pages, value_pages, table, starts, lengths = case
    k, v = gather_pages(key_pages, table)[:, :, :T], gather_pages(value_pages, table)[:, :, :T]
    model = _model_path(q, key_pages, value_pages, table, starts, T, 0.25, fresh_kv=(k, v))
    assert (prefill_attention(*case, 0.25) - model).abs().max() <= 2e-5


def test_cpu_fallback_is_the_reference_in_the_same_layout(monkeypatch):
    case = make_case([9, 0], [12, 5], 12, 4, 2, 16, 16, torch.float32, seed=13)
    monkeypatch.setattr(prefill_op, "use_triton", lambda t: False)
    out = prefill_attention(*case, 0.25)
    assert out.transpose(1, 2).is_contiguous()
    check_against_reference(out, case, 0.25, torch.float32)


def test_empty_batch():
    q, key_pages, value_pages, table, starts, lengths = make_case([0], [4], 4, 4, 2, 16, 16, torch.float32)
    out = prefill_attention(q[:0], key_pages, value_pages, table[:0], starts[:0], lengths[:0], 0.25)
    assert out.shape == (0, 4, 4, 16)


ON_THE_HOST_ONLY = pytest.mark.skipif(DEVICE != "cpu", reason="index values are checked on the host for CPU tensors "
                                      "only (a GPU call does not sync): test_bad_values_read_nothing_out_of_bounds")


def _arguments():
    q, key_pages, value_pages, table, starts, lengths = make_case([3, 0], [6, 4], 6, 4, 2, 16, 16, torch.float32)
    return {"q": q, "key_pages": key_pages, "value_pages": value_pages, "block_table": table, "starts": starts,
            "lengths": lengths, "scale": 0.25}


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {**a, "q": a["q"].half()}, TypeError, "key_pages: dtype"),
    (lambda a: {**a, "q": a["q"].double()}, TypeError, "q: dtype float64"),
    (lambda a: {**a, "q": [1.0]}, TypeError, "q: expected a torch.Tensor"),
    (lambda a: {**a, "q": a["q"][:, :3]}, ValueError, "q: 3 heads"),
    (lambda a: {**a, "q": a["q"][0]}, ValueError, r"q: expected \[B, nH, T, hd\]"),
    (lambda a: {**a, "q": a["q"].transpose(-1, -2)}, ValueError, "key_pages: expected"),
    (lambda a: {**a, "q": torch.stack([a["q"], a["q"]], -1)[..., 0]}, ValueError, "q: the last dim"),
    (lambda a: {**a, "key_pages": a["key_pages"][..., :8]}, ValueError, "key_pages: expected"),
    (lambda a: {**a, "value_pages": a["value_pages"][:, :, :8]}, ValueError, "value_pages: shape"),
    (lambda a: {**a, "value_pages": a["value_pages"].half()}, TypeError, "value_pages: dtype"),
    (lambda a: {**a, "key_pages": a["key_pages"][:, :, :12], "value_pages": a["value_pages"][:, :, :12]},
     ValueError, "power of two"),
    (lambda a: {**a, "key_pages": a["key_pages"].transpose(2, 3).contiguous().transpose(2, 3)},
     ValueError, "key_pages: the last dim"),
    (lambda a: {**a, "block_table": a["block_table"].float()}, TypeError, "block_table"),
    (lambda a: {**a, "block_table": a["block_table"][:1]}, ValueError, "block_table: expected"),
    (lambda a: {**a, "block_table": a["block_table"][0]}, ValueError, "block_table: expected"),
    (lambda a: {**a, "starts": a["starts"].float()}, TypeError, "starts"),
    (lambda a: {**a, "starts": a["starts"][:1]}, ValueError, "starts: expected"),
    (lambda a: {**a, "lengths": a["lengths"][:, None]}, ValueError, "lengths: expected"),
    pytest.param(lambda a: {**a, "lengths": a["lengths"] + 1}, ValueError, r"lengths: values must be in \[0, T = 6\]",
                 marks=ON_THE_HOST_ONLY),
    pytest.param(lambda a: {**a, "starts": a["starts"] + 30}, ValueError, "starts: values must be", marks=ON_THE_HOST_ONLY),
    pytest.param(lambda a: {**a, "starts": a["starts"] - 4}, ValueError, "starts: values must be", marks=ON_THE_HOST_ONLY),
    (lambda a: {**a, "scale": float("nan")}, ValueError, "scale"),
    (lambda a: {**a, "lengths": a["lengths"].to("meta")}, ValueError, "one device"),
])
def test_bad_input_names_the_argument(change, error, match):
    with pytest.raises(error, match=match):
        prefill_attention(**change(_arguments()))


@pytest.mark.parametrize("bad", ["lengths past T", "starts past the table", "negative starts"])
def test_bad_values_read_nothing_out_of_bounds(bad):
    """Values a GPU call cannot check without a sync reach the kernel: it must not read past the
    block table (memcheck in scripts/gpu_serve.sh's sanitizer stage); the result is not defined."""
    args = _arguments()
    change = {"lengths past T": ("lengths", args["lengths"] + 1), "starts past the table": ("starts", args["starts"] + 30),
              "negative starts": ("starts", args["starts"] - 4)}[bad]
    args[change[0]] = change[1]
    out = prefill_attention_kernel(*(args[k] for k in ("q", "key_pages", "value_pages", "block_table", "starts",
                                                      "lengths", "scale")))
    assert out.shape == args["q"].shape
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def test_index_columns_of_a_packed_tensor():
    """starts and lengths as the engine passes them: strided columns of one packed int64 tensor."""
    case = make_case([24, 0, 40], [18, 11, 5], 18, 4, 2, 16, 16, torch.float32, seed=9)
    q, key_pages, value_pages, table, starts, lengths = case
    packed = torch.stack([torch.full_like(starts, 10 ** 6), starts, lengths, torch.full_like(starts, -7)], 1)
    out = prefill_attention(q, key_pages, value_pages, table, packed[:, 1], packed[:, 2], 0.25)
    assert not packed[:, 1].is_contiguous()
    assert torch.equal(out, prefill_attention(*case, 0.25))
