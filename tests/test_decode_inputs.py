"""decode_inputs (a decode step's per-row inputs in one launch, each row through the row -> slot
table) against its reference, equal bit for bit (copies and integer arithmetic only): odd hidden
sizes over several column programs, rows in another order than their slots, inactive rows with any
token and position, positions across pages and past the block table; bad input."""

import pytest
import torch

from conftest import DEVICE
from fuselm.ops.decode_inputs import decode_inputs, decode_inputs_ref, rotary_cos_sin, rotary_table
from fuselm.ops.decode_inputs import op as decode_inputs_op
from fuselm.runtime import use_triton

VOCAB, D, R, L, S, PAGES = 50, 37, 6, 70, 16, 3


def make_inputs(dtype, seed=0):
    """Per slot (C = 7): ids, lengths, flags, block table; the rows' slots (B = 6, not in order, slot
    2 on no row)."""
    g = torch.Generator().manual_seed(seed)
    C = 7
    token_ids = torch.randint(0, VOCAB, (C,), generator=g)
    lengths = torch.tensor([0, 15, 33, 16, 47, L + 5, 69])  # page edges; slot 5 inactive past the table
    active = torch.tensor([True, True, True, True, True, False, True])
    slots = torch.tensor([6, 0, 3, 4, 5, 1])
    token_ids[5] = 10**9  # inactive: any id
    block_table = torch.randperm(C * PAGES, generator=g).view(C, PAGES)
    embed = torch.randn(VOCAB, D, generator=g).to(dtype)
    tensors = tuple(t.to(DEVICE) for t in (token_ids, lengths, active, slots, block_table, embed))
    return tensors + (rotary_table(L, inv_freq(), dtype),)  # on the device, as the model makes it


def inv_freq():
    return 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float32, device=DEVICE) / R))


NAMES = ("x", "cos", "sin", "write_page", "write_column", "kv_lengths", "state_slots", "positions", "pages")


def assert_equal(got, want):
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_d, block_pages", [(16, 2), (1024, 1024)])
def test_decode_inputs_equal_the_reference(monkeypatch, block_d, block_pages, dtype):
    """Three column programs a row (block_d 16) or one, the block-table row in two pieces or one;
    every output equals the reference's; each row reads its slot's (rows in another order)."""
    monkeypatch.setattr(decode_inputs_op, "BLOCK_D", block_d)
    monkeypatch.setattr(decode_inputs_op, "BLOCK_PAGES", block_pages)
    inputs = make_inputs(dtype)
    kwargs = dict(page_size=S, scratch_page=PAGES * 7)
    got = decode_inputs(*inputs, **kwargs)
    inputs_ref = list(inputs)
    inputs_ref[0] = torch.where(inputs[2], inputs[0], 0)  # the reference's embedding raises on a bad id
    assert_equal(got, decode_inputs_ref(*inputs_ref, **kwargs))
    x, cos, sin, page, column, kv_lengths, state_slots, positions, pages = got
    token_ids, lengths, _, slots, table, embed, _ = inputs
    # spelled out: row 3 (slot 4, position 47) writes page 2 of its slot's row, column 15; row 4 (slot 5) is inactive
    assert page[3] == table[4, 2] and column[3] == 15 and kv_lengths[3] == 48 and state_slots[3] == 4
    assert positions[3] == 47 and torch.equal(pages[3], table[4])
    assert page[4] == PAGES * 7 and column[4] == 0 and kv_lengths[4] == 0 and state_slots[4] == -1
    assert positions[4] == L + 5 and (pages[4] == PAGES * 7).all()
    assert torch.equal(x[4], embed[0]) and not cos[4].any() and not sin[4].any()
    assert torch.equal(x[2], embed[token_ids[3]])
    live = [0, 1, 2, 3, 5]
    want_cos, want_sin = rotary_cos_sin(lengths[slots[live]], inv_freq(), dtype)  # the prefill's values
    assert torch.equal(cos[live], want_cos) and torch.equal(sin[live], want_sin)


def test_decode_inputs_edge_rows_and_strided_inputs():
    """An active row past the rotary table gets zero rotary rows (kernel and reference); on the
    kernel path an active slot's id outside the vocabulary reads a zero row (the reference raises);
    a row whose slot is outside the cache reads as inactive; strided inputs read as their
    contiguous copies."""
    token_ids, lengths, active, slots, block_table, embed, rotary = make_inputs(torch.float32)
    lengths = lengths.clone()
    lengths[0] = L  # slot 0 (row 1): active, one past the table
    kwargs = dict(page_size=S, scratch_page=0)
    got = decode_inputs(token_ids, lengths, active, slots, block_table, embed, rotary, **kwargs)
    want = decode_inputs_ref(torch.where(active, token_ids, 0), lengths, active, slots, block_table, embed, rotary,
                             **kwargs)
    assert not got[1][1].any() and not got[2][1].any()
    assert_equal(got, want)
    strided = torch.stack([token_ids, token_ids * 0], dim=1)[:, 0]  # [C] with stride 2
    assert not strided.is_contiguous()
    assert torch.equal(decode_inputs(strided, lengths, active, slots, block_table, embed, rotary, **kwargs)[0],
                       got[0])
    outside = slots.clone()
    outside[[1, 3]] = torch.tensor([-1, 7], device=DEVICE)
    x, _, _, page, _, kv_lengths, state_slots, positions, _ = decode_inputs(
        token_ids, lengths, active, outside, block_table, embed, rotary, **kwargs)
    assert (kv_lengths[[1, 3]] == 0).all() and (state_slots[[1, 3]] == -1).all()
    assert torch.equal(x[[1, 3]], embed[[0, 0]])  # token 0, as every inactive row
    assert (positions[[1, 3]] == 0).all() and torch.equal(x[[0, 2]], got[0][[0, 2]])
    if use_triton(embed):
        bad = token_ids.clone()
        bad[0] = VOCAB  # active (row 1)
        x_bad = decode_inputs(bad, lengths, active, slots, block_table, embed, rotary, **kwargs)[0]
        assert not x_bad[1].any() and torch.equal(x_bad[[0, 2, 3, 4, 5]], got[0][[0, 2, 3, 4, 5]])


def test_decode_inputs_of_no_rows():
    inputs = list(make_inputs(torch.float32))
    inputs[3] = inputs[3][:0]
    x, cos, sin, *rest, pages = decode_inputs(*inputs, page_size=S, scratch_page=0)
    assert x.shape == (0, D) and cos.shape == sin.shape == (0, R) and all(t.shape == (0,) for t in rest)
    assert pages.shape == (0, PAGES)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: {**a, "lengths": a["lengths"].int()}, TypeError, "lengths"),
    (lambda a: {**a, "slots": a["slots"].int()}, TypeError, "slots"),
    (lambda a: {**a, "slots": a["slots"][:, None]}, ValueError, "slots: expected a \\[B\\]"),
    (lambda a: {**a, "active": a["active"][:3]}, ValueError, "active: expected a \\[C\\]"),
    (lambda a: {**a, "block_table": a["block_table"][:3]}, ValueError, "block_table: expected"),
    (lambda a: {**a, "block_table": a["block_table"][:, :0]}, ValueError, "block_table: expected"),
    (lambda a: {**a, "rotary": a["rotary"].half()}, ValueError, "rotary: expected"),
    (lambda a: {**a, "page_size": 24}, ValueError, "page_size: expected a power of two"),
    (lambda a: {**a, "scratch_page": -1}, ValueError, "scratch_page"),
])
def test_decode_inputs_bad_input(change, error, match):
    names = ("token_ids", "lengths", "active", "slots", "block_table", "embed", "rotary")
    args = change(dict(zip(names, make_inputs(torch.float32)), page_size=S, scratch_page=0))
    with pytest.raises(error, match=match):
        decode_inputs(**args)
