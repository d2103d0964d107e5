"""decode_inputs (a decode step's per-row inputs in one launch) against its reference, equal bit for
bit (copies and integer arithmetic only): odd hidden sizes over several column programs, inactive
rows with any token and position, positions across pages and past the block table; bad input."""

import pytest
import torch

from conftest import DEVICE
from fuselm.ops.decode_inputs import decode_inputs, decode_inputs_ref, rotary_cos_sin, rotary_table
from fuselm.ops.decode_inputs import op as decode_inputs_op
from fuselm.runtime import use_triton

VOCAB, D, R, L, S, PAGES = 50, 37, 6, 70, 16, 3


def make_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = 6
    token_ids = torch.randint(0, VOCAB, (B,), generator=g)
    token_ids[4] = 10**9  # inactive: any id
    lengths = torch.tensor([0, 15, 16, 47, L + 5, 69])  # page edges; row 4 inactive past the table
    active = torch.tensor([True, True, True, True, False, True])
    slots = torch.tensor([3, 0, 5, 1, 2, 4], dtype=torch.int32)
    block_table = torch.randperm(B * PAGES, generator=g).view(B, PAGES)
    embed = torch.randn(VOCAB, D, generator=g).to(dtype)
    tensors = tuple(t.to(DEVICE) for t in (token_ids, lengths, active, slots, block_table, embed))
    return tensors + (rotary_table(L, inv_freq(), dtype),)  # on the device, as the model makes it


def inv_freq():
    return 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float32, device=DEVICE) / R))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_d", [16, 1024])
def test_decode_inputs_equal_the_reference(monkeypatch, block_d, dtype):
    """Three column programs a row (block_d 16) or one; every output equals the reference's."""
    monkeypatch.setattr(decode_inputs_op, "BLOCK_D", block_d)
    inputs = make_inputs(dtype)
    kwargs = dict(page_size=S, scratch_page=PAGES * 6)
    got = decode_inputs(*inputs, **kwargs)
    inputs_ref = list(inputs)
    inputs_ref[0] = torch.where(inputs[2], inputs[0], 0)  # the reference's embedding raises on a bad id
    want = decode_inputs_ref(*inputs_ref, **kwargs)
    for name, a, b in zip(("x", "cos", "sin", "write_page", "write_column", "kv_lengths", "state_slots"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    x, cos, sin, page, column, kv_lengths, state_slots = got
    # spelled out: row 3 at position 47 writes page 2 of its row, column 15; row 4 is inactive
    assert page[3] == inputs[4][3, 2] and column[3] == 15 and kv_lengths[3] == 48 and state_slots[3] == 1
    assert page[4] == PAGES * 6 and column[4] == 0 and kv_lengths[4] == 0 and state_slots[4] == -1
    assert torch.equal(x[4], inputs[5][0]) and not cos[4].any() and not sin[4].any()
    want_cos, want_sin = rotary_cos_sin(inputs[1][:4], inv_freq(), dtype)  # the prefill's values
    assert torch.equal(cos[:4], want_cos) and torch.equal(sin[:4], want_sin)


def test_decode_inputs_edge_rows_and_strided_inputs():
    """An active row past the rotary table gets zero rotary rows (kernel and reference); on the
    kernel path an active row's id outside the vocabulary reads a zero row (the reference raises);
    strided [B] inputs read as their contiguous copies."""
    token_ids, lengths, active, slots, block_table, embed, rotary = make_inputs(torch.float32)
    lengths = lengths.clone()
    lengths[1] = L  # active, one past the table
    kwargs = dict(page_size=S, scratch_page=0)
    x, cos, sin, *_ = decode_inputs(token_ids, lengths, active, slots, block_table, embed, rotary, **kwargs)
    want = decode_inputs_ref(torch.where(active, token_ids, 0), lengths, active, slots, block_table, embed, rotary,
                             **kwargs)
    assert not cos[1].any() and not sin[1].any() and torch.equal(cos, want[1]) and torch.equal(x, want[0])
    strided = torch.stack([token_ids, token_ids * 0], dim=1)[:, 0]  # [B] with stride 2
    assert not strided.is_contiguous()
    assert torch.equal(decode_inputs(strided, lengths, active, slots, block_table, embed, rotary, **kwargs)[0], x)
    if use_triton(embed):
        bad = token_ids.clone()
        bad[0] = VOCAB  # active
        x_bad = decode_inputs(bad, lengths, active, slots, block_table, embed, rotary, **kwargs)[0]
        assert not x_bad[0].any() and torch.equal(x_bad[1:], x[1:])


def test_decode_inputs_of_no_rows():
    inputs = [t[:0] if i < 5 else t for i, t in enumerate(make_inputs(torch.float32))]
    x, cos, sin, *rest = decode_inputs(*inputs, page_size=S, scratch_page=0)
    assert x.shape == (0, D) and cos.shape == sin.shape == (0, R) and all(t.shape == (0,) for t in rest)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: {**a, "lengths": a["lengths"].int()}, TypeError, "lengths"),
    (lambda a: {**a, "slots": a["slots"].long()}, TypeError, "slots"),
    (lambda a: {**a, "active": a["active"][:3]}, ValueError, "active: expected a \\[B\\]"),
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
