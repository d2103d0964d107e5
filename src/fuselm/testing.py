"""Comparison helpers every kernel test uses."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 over the finite entries of ``ref`` (0 when ref is 0)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    finite = torch.isfinite(ref)
    diff = torch.linalg.vector_norm((out - ref)[finite]).item()
    norm = torch.linalg.vector_norm(ref[finite]).item()
    return diff / norm if norm > 0 else diff


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, name: str = "out") -> None:
    """Same shape, NaN/inf in the same places (with the same sign for inf), and rel_err <= tol."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.detach().cpu(), ref.detach().cpu()
    nan_o, nan_r = torch.isnan(o), torch.isnan(r)
    assert torch.equal(nan_o, nan_r), f"{name}: NaN in {int(nan_o.sum())} places, reference in {int(nan_r.sum())}"
    inf_o, inf_r = torch.isinf(o), torch.isinf(r)
    assert torch.equal(inf_o, inf_r) and torch.equal(o[inf_o], r[inf_r]), f"{name}: inf placement differs"
    err = rel_err(out, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer shaped like ``t`` filled with NaN, so an unwritten element shows."""
    return torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device)
