"""fuselm ops: one folder per op, ``naive.py`` (the plain-PyTorch reference) beside ``kernels.py``
(Triton kernels and host launchers) and ``op.py`` (argument checks, torch.library registration,
autograd, public function, nn.Module)."""
