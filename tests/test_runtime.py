"""Host-side helpers of fuselm.runtime."""

import pytest
import torch
import triton

from fuselm.runtime import cdiv, cublaslt_preferred, next_power_of_2


def test_launch_arithmetic_matches_triton():
    for n in range(0, 1100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_cublaslt_preferred_is_scoped():
    """Inside the block cuBLASLt is preferred on CUDA (nothing changes on a CPU device); on exit,
    an exception included, the process's previous preference is back."""
    before = torch.backends.cuda.preferred_blas_library()
    with cublaslt_preferred(torch.device("cpu")):
        assert torch.backends.cuda.preferred_blas_library() == before
    if not torch.cuda.is_available():
        return
    with pytest.raises(KeyError):
        with cublaslt_preferred(torch.device("cuda")):
            assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
            raise KeyError("leaves the block")
    assert torch.backends.cuda.preferred_blas_library() == before
