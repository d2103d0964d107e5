"""Models built on fuselm kernels."""

from fuselm.models.qwen35 import Qwen35, Qwen35Cache, Qwen35Config

__all__ = ["Qwen35", "Qwen35Cache", "Qwen35Config"]
