from fuselm.ops.swap_ffn.kernels import swap_router

__all__ = ["swap_router"]
