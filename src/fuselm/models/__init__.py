"""Models built on fuselm kernels."""
