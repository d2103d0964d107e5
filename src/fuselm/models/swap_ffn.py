"""Swap-FFN: a recurrent-memory FFN block run by C cores on every token.

Per token, each of the C cores takes its own affine view of the token, then n_events times:
a router decides (hard) whether to swap the core's activation with one of its 4 memory banks
and which one; then k_ffn FFN steps (RMSNorm, SwiGLU MLP; the weights are shared by all
cores). A learned pooling over cores, a low-rank collapse and a decoder give the token's delta.

Two paths compute it:
- ``reference_step``: plain PyTorch, the definition, differentiable through the values (the
  swap and bank decisions are hard). Every op in the model dtype as eager PyTorch would run it;
  the norms and the softmax reduce in fp32 (RMSNorm rounds like HF Llama).
- ``FusedSwapFFN`` (inference, Triton): the cores are the M dimension of every matrix product,
  so each weight tile is read once per tile of cores. The cores' x comes from one core_x kernel
  (rounded as the reference rounds it). Per event: one router kernel (router GEMM,
  decisions, bank swap, write-back, lane update, in place; it also leaves the new x's row sums
  of squares), then per FFN step the persistent TMA gate/up GEMM with SwiGLU and the RMSNorm
  folded in (ops/swap_ffn/kernels.py), and cuBLAS's down GEMM into x. The collapse pools over
  cores first. ``SwapFFNDecoder`` captures a whole token step in one CUDA graph.
Parameter and state names are those of the block's design (router, banks, stream map, lanes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fuselm.ops.rms_norm.naive import rms_norm_ref
from fuselm.ops.swap_ffn.kernels import FFNStep, core_x, swap_router
from fuselm.ops.swiglu_mlp.op import interleave_gate_up
from fuselm.runtime import capture_graph, needs_autograd, use_triton

N_BANKS = 4  # fixed: the stream map packs 4 lanes x 2 bits into a uint8
IDENTITY_STREAM_MAP = 0xE4  # lanes (0, 1, 2, 3)
IMPLS = ("reference", "fused", "auto")


@dataclass(frozen=True)
class SwapFFNConfig:
    """Swap-FFN sizes; the defaults are the seed config."""

    d_model: int = 1024
    d_ff: int = 4096
    n_cores: int = 512
    n_events: int = 8
    k_ffn: int = 2
    d_router: int = 64
    n_banks: int = N_BANKS
    d_core_embed: int = 32
    collapse_k: int = 8
    collapse_r: int = 224
    collapse_silu: bool = True
    ffn_residual: bool = False
    eps: float = 1e-6

    def __post_init__(self):
        if self.n_banks != N_BANKS:
            raise ValueError(f"n_banks: fixed at {N_BANKS} (the stream map packs 4 lanes in a uint8), got {self.n_banks}")
        for name in ("d_model", "d_ff", "n_cores", "n_events", "k_ffn", "d_router", "d_core_embed", "collapse_k", "collapse_r"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name in ("n_events", "k_ffn") else 1):
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")

    def flops_per_token(self) -> int:
        """Matrix FLOPs of one token step: router and FFN GEMMs over all cores."""
        c, d = self.n_cores, self.d_model
        return self.n_events * (2 * c * d * self.d_router + self.k_ffn * c * 3 * 2 * d * self.d_ff)


@dataclass
class SwapFFNState:
    """Carried across tokens, per batch row: ``ram`` [B, C, 4, D] (model dtype) and
    ``stream_map`` [B, C] uint8 (lane i = (stream_map >> 2i) & 3 is the physical bank logical
    bank i names; logical 0 is the most recently used)."""

    ram: torch.Tensor
    stream_map: torch.Tensor

    def clone(self) -> "SwapFFNState":
        return SwapFFNState(self.ram.clone(), self.stream_map.clone())


# ----------------------------------------------------------------------------- stream map lanes
def unpack_lanes(stream_map: torch.Tensor) -> torch.Tensor:
    """[..., 4] int64 physical bank per logical bank, from the packed uint8 map."""
    shifts = torch.arange(0, 2 * N_BANKS, 2, device=stream_map.device)
    return (stream_map[..., None].long() >> shifts) & 3


def pack_lanes(lanes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_lanes`: [..., 4] lanes -> uint8 map."""
    shifts = torch.arange(0, 2 * N_BANKS, 2, device=lanes.device)
    return (lanes.long() << shifts).sum(-1).to(torch.uint8)


def move_to_front(lanes: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Lanes after using logical bank ``s``: new lane 0 is lanes[s], lanes 1..s are the old lanes
    0..s-1 (shifted down by one), lanes past s are unchanged. lanes [..., 4], s [...]."""
    i = torch.arange(N_BANKS, device=lanes.device)
    s = s[..., None]
    source = torch.where(i == 0, s, torch.where(i <= s, i - 1, i))  # which old lane lands in lane i
    return torch.gather(lanes, -1, source)


# ----------------------------------------------------------------------------- the module
class SwapFFN(nn.Module):
    """Swap-FFN block. ``forward(x, state=None, impl="auto", inplace=False)`` -> ``(y, state)``.

    x: [B, T, D] or [B, D] (one token); y has x's shape. ``state`` None starts from
    ``init_state(B)``. The state passed in is left as it was unless ``inplace=True`` (decode
    engines update it in place to stay allocation-free); the returned state is the new one.
    impl: "reference" (plain PyTorch, differentiable), "fused" (Triton, inference: CUDA, or the
    CPU interpreter), "auto" (fused on CUDA when autograd need not record, e.g. under
    ``torch.no_grad()``, and ``fused_unsupported`` has no objection to the sizes; otherwise the
    reference). For decode loops use ``SwapFFNDecoder``.
    """

    def __init__(self, config: SwapFFNConfig = SwapFFNConfig(), device=None, dtype=None):
        super().__init__()
        self.config = cfg = config
        kw = {"device": device, "dtype": dtype}
        e, d, r = cfg.d_core_embed, cfg.d_model, cfg.d_router
        self.core_embed = nn.Embedding(cfg.n_cores, e, **kw)
        self.core_scale = nn.Linear(e, d, **kw)
        self.core_shift = nn.Linear(e, d, **kw)
        self.core_alpha = nn.Linear(e, cfg.collapse_k, **kw)
        self.router_norm = _Weight(d, **kw)
        self.router_w = nn.Parameter(torch.randn(r, d, **kw) * d**-0.5)
        self.router_swap_w = nn.Parameter(torch.randn(r, **kw) * r**-0.5)
        self.router_swap_b = nn.Parameter(torch.zeros(1, **kw))
        self.bank_w = nn.Parameter(torch.randn(r, N_BANKS, **kw) * r**-0.5)
        self.bank_b = nn.Parameter(torch.zeros(N_BANKS, **kw))
        self.norm = _Weight(d, **kw)
        self.w1 = nn.Linear(d, cfg.d_ff, bias=False, **kw)
        self.w3 = nn.Linear(d, cfg.d_ff, bias=False, **kw)
        self.w2 = nn.Linear(cfg.d_ff, d, bias=False, **kw)
        self.collapse_basis = nn.Parameter(torch.randn(cfg.collapse_k, cfg.collapse_r, d, **kw) * d**-0.5)
        self.collapse_decoder = nn.Parameter(torch.randn(d, cfg.collapse_r, **kw) * cfg.collapse_r**-0.5)

    # ------------------------------------------------------------------ state
    def init_state(self, batch: int) -> SwapFFNState:
        """Zero banks and identity stream maps for ``batch`` rows."""
        cfg, p = self.config, self.w1.weight
        return SwapFFNState(
            ram=torch.zeros(batch, cfg.n_cores, N_BANKS, cfg.d_model, device=p.device, dtype=p.dtype),
            stream_map=torch.full((batch, cfg.n_cores), IDENTITY_STREAM_MAP, device=p.device, dtype=torch.uint8),
        )

    def check_state(self, state: SwapFFNState, batch: int) -> None:
        """ValueError/TypeError for a state of the wrong shape, dtype or device, or a stream map
        whose lanes are not a permutation of the 4 banks (reads the map: one host sync)."""
        cfg, p = self.config, self.w1.weight
        if not isinstance(state, SwapFFNState):
            raise TypeError(f"state: expected a SwapFFNState (from init_state), got {type(state).__name__}")
        expected = {"ram": ((batch, cfg.n_cores, N_BANKS, cfg.d_model), p.dtype),
                    "stream_map": ((batch, cfg.n_cores), torch.uint8)}
        for name, (shape, dtype) in expected.items():
            t = getattr(state, name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                raise ValueError(f"state.{name}: expected shape {shape}, got {tuple(getattr(t, 'shape', ()))}")
            if t.dtype != dtype:
                raise TypeError(f"state.{name}: expected dtype {dtype}, got {t.dtype}")
            if t.device != p.device:
                raise ValueError(f"state.{name}: on {t.device}, the module is on {p.device}")
        lanes = unpack_lanes(state.stream_map)
        if not bool((lanes.sort(-1).values == torch.arange(N_BANKS, device=lanes.device)).all()):
            raise ValueError("state.stream_map: lanes are not a permutation of the 4 banks")

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, state: SwapFFNState | None = None, impl: str = "auto", inplace: bool = False):
        if impl not in IMPLS:
            raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
        cfg, p = self.config, self.w1.weight
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
            raise ValueError(f"x: expected [B, T, D] or [B, D], got {getattr(x, 'shape', type(x).__name__)}")
        if x.shape[-1] != cfg.d_model:
            raise ValueError(f"x: last dim {x.shape[-1]} does not match d_model {cfg.d_model}")
        if x.dtype != p.dtype:
            raise TypeError(f"x: dtype {x.dtype} does not match the module's {p.dtype}")
        if x.device != p.device:
            raise ValueError(f"x: on {x.device}, the module is on {p.device}")
        # auto: the fused path for inference on the GPU; the reference when autograd must record.
        fused = impl == "fused" or (impl == "auto" and x.is_cuda and not needs_autograd(x, *self.parameters())
                                    and fused_unsupported(cfg, p.dtype) is None)
        if fused and not use_triton(x):
            raise ValueError("impl='fused' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)")
        tokens = x if x.dim() == 3 else x[:, None, :]
        batch = tokens.shape[0]
        if state is None:
            state = self.init_state(batch)
        else:
            self.check_state(state, batch)
        outputs = []
        if fused:
            with torch.no_grad():
                ram, stream_map = state.ram.clone(), state.stream_map.clone()
                runner = FusedSwapFFN(self, batch)
                tokens = tokens.contiguous()  # core_x reads each token with unit column stride
                for t in range(tokens.shape[1]):
                    outputs.append(runner.step(tokens[:, t], ram, stream_map).clone())
        else:
            ram, stream_map = state.ram, state.stream_map
            for t in range(tokens.shape[1]):
                y, ram, stream_map = self.reference_step(tokens[:, t], ram, stream_map)
                outputs.append(y)
        y = torch.stack(outputs, dim=1)
        if inplace:
            with torch.no_grad():
                state.ram.copy_(ram)
                state.stream_map.copy_(stream_map)
            new_state = state
        else:
            new_state = SwapFFNState(ram, stream_map)
        return (y if x.dim() == 3 else y[:, 0]), new_state

    def core_params(self):
        """(core_scale [C, D], core_shift [C, D], core_alpha [C, K] fp32): per-core tables."""
        emb = self.core_embed.weight
        core_alpha = torch.softmax(self.core_alpha(emb).float(), dim=-1)
        return 1.0 + self.core_scale(emb), self.core_shift(emb), core_alpha

    def reference_step(self, x_tok: torch.Tensor, ram: torch.Tensor, stream_map: torch.Tensor):
        """One token, x_tok [B, D] -> (y [B, D], ram, stream_map), new tensors (inputs untouched)."""
        cfg = self.config
        core_scale, core_shift, core_alpha = self.core_params()
        x = x_tok[:, None, :] * core_scale + core_shift  # [B, C, D]
        lanes = unpack_lanes(stream_map)  # [B, C, 4]
        for _ in range(cfg.n_events):
            x, ram, lanes = self.reference_swap(x, ram, lanes)
            x = self.reference_ffn(x)
        return self.collapse(x_tok, x, core_alpha), ram, pack_lanes(lanes)

    def reference_swap(self, x, ram, lanes):
        """The swap of one event: router, hard decisions, bank swap, lane update."""
        cfg = self.config
        z = rms_norm_ref(x, self.router_norm.weight, cfg.eps) @ self.router_w.T  # [B, C, R]
        gate = torch.sigmoid(z @ self.router_swap_w + self.router_swap_b) > 0.5  # [B, C]
        s = torch.argmax(z @ self.bank_w + self.bank_b, dim=-1)  # logical bank, first max wins
        p = torch.gather(lanes, -1, s[..., None])  # physical bank [B, C, 1]
        bank = torch.gather(ram, 2, p[..., None].expand(-1, -1, 1, cfg.d_model)).squeeze(2)
        written = (F.one_hot(p.squeeze(-1), N_BANKS).bool() & gate[..., None])[..., None]  # [B, C, 4, 1]
        ram = torch.where(written, x[:, :, None, :], ram)
        x = torch.where(gate[..., None], bank, x)
        return x, ram, torch.where(gate[..., None], move_to_front(lanes, s), lanes)

    def reference_ffn(self, x):
        """The k_ffn FFN steps of one event."""
        for _ in range(self.config.k_ffn):
            h = rms_norm_ref(x, self.norm.weight, self.config.eps)
            f = self.w2(F.silu(self.w1(h)) * self.w3(h))
            x = x + f if self.config.ffn_residual else f
        return x

    @torch.no_grad()
    def router_agreement(self, x_tok: torch.Tensor, ram: torch.Tensor, stream_map: torch.Tensor) -> float:
        """Fraction of (row, event) swap decisions in which the fused router kernel, run on the
        reference's own state before each event, decides as the reference does (gate, and the
        bank where it swaps). Free-running paths diverge after any flip, so this is the measure
        of the kernel itself. Returns the fraction over one token."""
        cfg = self.config
        core_scale, core_shift, _ = self.core_params()
        x = x_tok[:, None, :] * core_scale + core_shift
        lanes = unpack_lanes(stream_map)
        router = (self.router_norm.weight, self.router_w, self.router_swap_w, self.router_swap_b, self.bank_w, self.bank_b)
        agree = total = 0
        for _ in range(cfg.n_events):
            xk, ramk, mapk = x.contiguous().clone(), ram.contiguous().clone(), pack_lanes(lanes).contiguous()
            ss = torch.empty(xk.numel() // cfg.d_model, device=x.device, dtype=torch.float32)
            swap_router(xk.view(-1, cfg.d_model), ramk.view(-1, N_BANKS, cfg.d_model), mapk.view(-1), ss, *router, cfg.eps)
            x_next, ram, lanes_next = self.reference_swap(x, ram, lanes)
            same = (mapk == pack_lanes(lanes_next)) & torch.eq(xk, x_next).all(-1)
            agree += int(same.sum())
            total += same.numel()
            x, lanes = self.reference_ffn(x_next), lanes_next
        return agree / total

    def collapse(self, x_tok: torch.Tensor, x: torch.Tensor, core_alpha: torch.Tensor) -> torch.Tensor:
        """y = x_tok + decoder(silu?(basis(pool over cores of x))); x [B, C, D] after the last event."""
        pooled = torch.einsum("bcd,ck->bkd", x, core_alpha.to(x.dtype))  # [B, K, D]
        code = torch.einsum("bkd,krd->br", pooled, self.collapse_basis)  # [B, Rc]
        if self.config.collapse_silu:
            code = F.silu(code)
        return x_tok + code @ self.collapse_decoder.T


def fused_unsupported(config: SwapFFNConfig, dtype: torch.dtype) -> str | None:
    """Why the fused path cannot run ``config`` in ``dtype``, or None. Its GEMM operands arrive by
    TMA, whose rows must be whole 16-byte units."""
    per_16_bytes = 16 // dtype.itemsize
    bad = [name for name in ("d_model", "d_ff") if getattr(config, name) % per_16_bytes]
    if bad:
        return (f"{' and '.join(bad)}: the fused path needs multiples of {per_16_bytes} in {dtype} "
                f"(TMA rows of 16-byte units); use impl='reference'")
    return None


class FusedSwapFFN:
    """The fused inference path for one batch size: weights re-laid once, work buffers owned.

    ``step(x_tok, ram, stream_map)`` runs one token, updating ``ram``/``stream_map`` in place,
    and returns y [B, D] in an owned buffer (overwritten by the next step). No allocation and no
    host sync inside a step, so it can be captured in a CUDA graph. Re-create it after the
    module's weights change.
    """

    def __init__(self, module: SwapFFN, batch: int):
        cfg = self.config = module.config
        reason = fused_unsupported(cfg, module.w1.weight.dtype)
        if reason:
            raise ValueError(reason)
        with torch.no_grad():
            core_scale, core_shift, core_alpha = module.core_params()
            dtype = core_scale.dtype
            self.core_scale, self.core_shift = core_scale.contiguous(), core_shift.contiguous()
            self.core_alpha_t = core_alpha.to(dtype).T.contiguous()  # [K, C]
            norm_w = module.norm.weight
            # RMSNorm weight folded into the gate/up columns: rms(x) @ W.T = rstd * (x @ (W * w).T).
            self.w13 = interleave_gate_up(module.w1.weight * norm_w, module.w3.weight * norm_w).contiguous()
            self.router = tuple(t.detach().contiguous() for t in (
                module.router_norm.weight, module.router_w, module.router_swap_w, module.router_swap_b,
                module.bank_w, module.bank_b))
            # collapse: code = pooled [B, K*D] @ basis [K*D, Rc]
            self.basis = module.collapse_basis.detach().permute(0, 2, 1).reshape(-1, cfg.collapse_r).contiguous()
            self.decoder_t = module.collapse_decoder.detach().T  # [Rc, D]
        device = core_scale.device
        rows = batch * cfg.n_cores
        self.x = torch.empty(rows, cfg.d_model, device=device, dtype=dtype)
        self.h = torch.empty(rows, cfg.d_ff, device=device, dtype=dtype)
        self.ss = torch.empty(rows, device=device, dtype=torch.float32)  # x's row sums of squares after a swap
        self.pooled = torch.empty(batch, cfg.collapse_k, cfg.d_model, device=device, dtype=dtype)
        self.code = torch.empty(batch, cfg.collapse_r, device=device, dtype=dtype)
        self.y = torch.empty(batch, cfg.d_model, device=device, dtype=dtype)
        self.batch = batch
        self.ffn = FFNStep(self.x, self.w13, self.h, module.w2.weight.detach(), cfg.eps, cfg.ffn_residual)

    def step(self, x_tok: torch.Tensor, ram: torch.Tensor, stream_map: torch.Tensor) -> torch.Tensor:
        cfg, x = self.config, self.x
        C, D = cfg.n_cores, cfg.d_model
        if x_tok.shape != (self.batch, D) or x_tok.stride(1) != 1:
            raise ValueError(f"x_tok: expected [{self.batch}, {D}] with unit column stride, got "
                             f"{tuple(x_tok.shape)} strides {x_tok.stride()}")
        ram_rows, map_rows = ram.view(-1, 4, D), stream_map.view(-1)
        core_x(x, x_tok, self.core_scale, self.core_shift)
        for _ in range(cfg.n_events):
            swap_router(x, ram_rows, map_rows, self.ss, *self.router, cfg.eps)
            for i in range(cfg.k_ffn):
                self.ffn.step(self.ss if i == 0 else None)  # the router's sums of squares serve the first
        torch.matmul(self.core_alpha_t, x.view(self.batch, C, D), out=self.pooled)  # pool over cores first
        torch.mm(self.pooled.view(self.batch, -1), self.basis, out=self.code)
        code = torch.nn.functional.silu(self.code, inplace=True) if cfg.collapse_silu else self.code
        return torch.addmm(x_tok, code, self.decoder_t, out=self.y)


class SwapFFNDecoder:
    """Decode with the fused path, one CUDA graph launch per token step.

    Owns the state (``self.state``, updated in place; ``module.init_state`` unless one is given)
    and static buffers; ``step(x_tok [B, D])`` returns y [B, D] in a static buffer that the next
    step overwrites. Without CUDA (the interpreter) it runs the same step without a graph.
    """

    def __init__(self, module: SwapFFN, batch: int, state: SwapFFNState | None = None):
        self.module = module
        if state is not None:
            module.check_state(state, batch)
        self.state = state if state is not None else module.init_state(batch)
        self.runner = FusedSwapFFN(module, batch)
        self.x_tok = torch.zeros(batch, module.config.d_model, device=self.runner.x.device, dtype=self.runner.x.dtype)
        self.graph = None
        if self.x_tok.is_cuda:
            saved = self.state.clone()  # warm-up and capture each run a step on the state
            self.graph, self.y = capture_graph(lambda: self.runner.step(self.x_tok, self.state.ram, self.state.stream_map))
            self.state.ram.copy_(saved.ram)
            self.state.stream_map.copy_(saved.stream_map)

    @torch.no_grad()
    def step(self, x_tok: torch.Tensor) -> torch.Tensor:
        if x_tok.shape != self.x_tok.shape or x_tok.dtype != self.x_tok.dtype:
            raise ValueError(f"x_tok: expected {tuple(self.x_tok.shape)} {self.x_tok.dtype}, got "
                             f"{tuple(x_tok.shape)} {x_tok.dtype}")
        self.x_tok.copy_(x_tok)
        if self.graph is None:
            return self.runner.step(self.x_tok, self.state.ram, self.state.stream_map)
        self.graph.replay()
        return self.y


class _Weight(nn.Module):
    """A bare ``weight`` parameter (ones), so state_dict names read ``router_norm.weight``."""

    def __init__(self, size: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
