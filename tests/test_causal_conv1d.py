"""causal_conv1d_silu (Gated DeltaNet prefill's short convolution) against its PyTorch reference:
fresh and continued chunks, padded rows, a repeated slot, odd channel counts, kernel sizes 2-4,
outputs and the conv state it leaves; the state of other slots untouched."""

import pytest
import torch

from conftest import DEVICE
from fuselm.ops.causal_conv1d import causal_conv1d_silu, causal_conv1d_silu_ref

TOL = {torch.float32: 1e-6, torch.float16: 2e-3}


def inputs(B, T, C, K, S, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(B, T, C + 10, generator=g).to(DEVICE, dtype)
    x = wide[:, :, 3:3 + C]  # a strided view, as the conv slice of the in_proj output
    weight = (torch.randn(C, 1, K, generator=g) * 0.5).to(DEVICE, dtype)
    state = torch.randn(S, C, K, generator=g).to(DEVICE, dtype)
    return x, weight, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("B, T, C, K, starts, lengths", [
    (2, 5, 7, 4, [0, 0], [5, 3]),          # fresh rows, one padded
    (3, 37, 130, 4, [9, 2, 0], [37, 1, 20]),  # continued rows (one shorter than K), a block edge
    (2, 3, 16, 2, [1, 5], [3, 2]),        # kernel 2
    (2, 6, 24, 3, [4, 0], [6, 6]),        # kernel 3 (odd circular columns)
])
def test_matches_reference_and_writes_the_state(B, T, C, K, starts, lengths, dtype):
    S = B + 2
    x, weight, state = inputs(B, T, C, K, S, dtype)
    # slots, starts, lengths as strided columns of one packed tensor, as the engine's prefill passes them
    packed = torch.tensor([[S - 1 - i, start, length, 7] for i, (start, length) in enumerate(zip(starts, lengths))],
                          device=DEVICE)
    slots, starts, lengths = packed[:, 0], packed[:, 1], packed[:, 2]
    ref_state, out_state = state.clone(), state.clone()
    expected = causal_conv1d_silu_ref(x, weight, ref_state, slots, starts, lengths)
    out = causal_conv1d_silu(x, weight, out_state, slots, starts, lengths)
    real = torch.arange(T, device=DEVICE)[None, :] < lengths[:, None]
    assert out.shape == (B, T, C) and out.dtype == dtype
    assert (out[real].double() - expected[real].double()).abs().max() <= TOL[dtype]
    assert torch.equal(out_state, ref_state)  # the state is copied inputs: exact
    untouched = [s for s in range(S) if s not in slots.tolist()]
    assert torch.equal(out_state[untouched], state[untouched])


def test_repeated_slot_with_identical_rows_and_a_fresh_row_ignores_stale_state():
    """The engine's padding rows repeat row 0 (same slot, same inputs); a fresh row (start 0)
    reads zeros, whatever its slot held before."""
    x, weight, state = inputs(1, 9, 12, 4, 3, torch.float32, seed=3)
    x = torch.cat([x, x])
    slots, starts, lengths = (torch.tensor(v, device=DEVICE) for v in ([1, 1], [0, 0], [9, 9]))
    ref_state = state.clone()
    zeros = torch.zeros_like(state)
    expected = causal_conv1d_silu_ref(x[:1], weight, zeros, slots[:1], starts[:1], lengths[:1])
    out = causal_conv1d_silu(x, weight, ref_state, slots, starts, lengths)
    assert (out[0] - expected[0]).abs().max() <= 1e-6 and torch.equal(out[0], out[1])
    assert torch.equal(ref_state[1], zeros[1]) and torch.equal(ref_state[[0, 2]], state[[0, 2]])


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {**a, "x": a["x"][..., 0]}, ValueError, "x: expected"),
    (lambda a: {**a, "weight": a["weight"][:5]}, ValueError, "weight: expected"),
    (lambda a: {**a, "conv_state": a["conv_state"][:, :, :3]}, ValueError, "conv_state"),
    (lambda a: {**a, "weight": a["weight"].half()}, TypeError, "weight: dtype"),
    (lambda a: {**a, "slots": a["slots"].int()}, ValueError, "slots"),
    (lambda a: {**a, "lengths": a["lengths"][:1]}, ValueError, "lengths"),
])
def test_bad_input_names_the_argument(change, error, match):
    x, weight, state = inputs(2, 4, 8, 4, 3, torch.float32)
    arguments = dict(x=x, weight=weight, conv_state=state, slots=torch.tensor([0, 1], device=DEVICE),
                     starts=torch.tensor([0, 2], device=DEVICE), lengths=torch.tensor([4, 2], device=DEVICE))
    with pytest.raises(error, match=match):
        causal_conv1d_silu(**change(arguments))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="lengths"):
            causal_conv1d_silu(**dict(arguments, lengths=torch.tensor([5, 2])))
