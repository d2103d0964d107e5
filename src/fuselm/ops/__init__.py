"""fuselm ops: one folder per op. ``naive.py`` holds the plain-PyTorch reference beside the
Triton code: ``kernels.py`` (kernels and host launchers) with ``op.py`` (argument checks, autograd,
torch.library registration, public function, nn.Module) for the single-entry ops; one file per
public entry point where an op has several (``gated_delta_rule/chunk.py``,
``gated_delta_rule/fused_recurrent.py``). ``swap_ffn/`` holds only the kernel its model
(``fuselm/models/swap_ffn.py``) launches. ``common/`` holds the pieces several ops share (the
SwiGLU activation spec, the matmul helpers, the whole-row geometry, the references' working
dtype); ops import each other's public entry points only, never each other's internals."""
