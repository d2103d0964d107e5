"""Host-side helpers of fuselm.runtime."""

import pytest
import torch
import triton

from fuselm.runtime import PinnedStaging, cdiv, cublaslt_preferred, next_power_of_2


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


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_pinned_staging_copies_host_tensors_to_the_device(device):
    """``to_device`` and ``copy_`` give the host tensors' values on the device, in consecutive
    slices of a step's buffer (and in fresh pinned memory past its end); ``host`` hands out
    tensors of the asked shape and dtype; bad arguments are named."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    staging = PinnedStaging(device, depth=2, nbytes=256)
    generator = torch.Generator().manual_seed(7)
    for step in range(5):
        staging.next_step()
        values = [torch.randn(3, 5, generator=generator), torch.randint(-9, 9, (7,), generator=generator),
                  torch.randn(40, generator=generator).double()]  # the last one past the 256 bytes
        moved = [staging.to_device(v) for v in values]
        target = torch.full((2, 3), -1, dtype=torch.int32, device=device)
        staging.copy_(target, torch.arange(6, dtype=torch.int32).view(2, 3) + step)
        for v, m in zip(values, moved):
            assert m.device.type == device and m.dtype == v.dtype
            torch.testing.assert_close(m.cpu(), v, rtol=0, atol=0)
        assert target.cpu().tolist() == [[step, step + 1, step + 2], [step + 3, step + 4, step + 5]]
    host = staging.host((4, 2), torch.float16)
    assert host.shape == (4, 2) and host.dtype == torch.float16 and host.device.type == "cpu"
    assert staging.steps == 5
    with pytest.raises(ValueError, match="depth"):
        PinnedStaging(device, depth=0)
    with pytest.raises(ValueError, match="nbytes"):
        PinnedStaging(device, nbytes=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_staging_reuses_a_buffer_only_after_its_copies_ran():
    """A buffer comes back ``depth`` steps later (the same host memory); a copy still queued
    behind slow work when its buffer comes back is waited for, not overwritten."""
    staging = PinnedStaging("cuda", depth=3, nbytes=1024)
    staging.next_step()
    first = staging.host((4,), torch.int64).data_ptr()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the copy
    moved = staging.to_device(torch.arange(16))
    pointers = []
    for _ in range(3):
        staging.next_step()
        pointers.append(staging.host((4,), torch.int64).data_ptr())
        staging.to_device(torch.full((16,), -1))  # the slices after host()'s: the first step's copy's place
    assert pointers[-1] == first and len(set(pointers)) == 3
    assert moved.cpu().tolist() == list(range(16))
