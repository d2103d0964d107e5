from fuselm.ops.swap_ffn.kernels import FFNStep, swap_router

__all__ = ["FFNStep", "swap_router"]
