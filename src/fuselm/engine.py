"""Inference engine for ``Qwen35``: eager prefill, then decode as one CUDA graph launch per step.

One place for the decode loop and graph capture (nano-vllm / gpt-fast style):

    engine = Engine(model, max_batch=8, max_len=1024)          # captures the graphs (on CUDA)
    result = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=32, stream=print)
    result.tokens                                              # [2, n] new token ids

State: one ``Qwen35Cache`` of ``max_batch`` rows (static KV cache + DeltaNet conv/state pool),
allocated once. A batch of B requests occupies rows 0 .. B-1.

Prefill (eager, host-side lengths): ``model.prefill`` runs the chunked DeltaNet kernels and SDPA
attention over the right-padded prompts; the first new token is sampled from its logits.

Decode step (what a graph holds), for the graph of batch size b >= B, on the cache's first b
rows (``Qwen35Cache.first_rows``: views, same addresses):
    logits = model.decode_step(input_tokens[:b], cache_b)     # advances the active rows
    next   = sample(logits)  where active, else pad           # sampling params are constants
    history[:b, step_column] = next;  step_column += 1        # generated ids stay on the device
    active &= next not in eos ids                              # finished rows write no more state
    input_tokens[:b] = next                                    # the next step's input
Every input and output is a static device buffer, so a step is one ``graph.replay()`` with no
host work around it. Rows B .. b-1 are inactive from prefill on: they write no DeltaNet state and
put K/V in the cache's scratch column.

Host syncs: none inside a step. The loop reads the step's [b, 2] report (next ids, active) once
per step only when it must (a ``stream`` callback, or eos ids that may end the batch early);
otherwise it replays ``max_new_tokens - 1`` graphs back to back and reads the ids at the end.

Without CUDA (or ``use_graphs=False``) the same step runs eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from fuselm.models.qwen35 import Qwen35, _check_sampling, sample_next_tokens

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass
class GenerationResult:
    """``tokens`` [B, n] int64 (CPU): the new ids per request, ``pad`` after a row's eos;
    ``num_generated`` per row (its eos included); timings in seconds (device work included: the
    clock stops after a device sync); ``decode_steps`` = decode steps run (n - 1 at most, the
    first token comes from prefill); ``logits`` [B, n, vocab] when asked for."""

    tokens: torch.Tensor
    num_generated: list[int]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    batch_size: int  # the graph (or eager step) batch size the decode ran at
    logits: torch.Tensor | None = None


class Engine:
    """Static-cache batched generation for a ``Qwen35`` model.

    Args:
        model: a loaded ``Qwen35``.
        max_batch, max_len: cache rows and tokens per row (prompt + generated).
        graph_batch_sizes: decode graphs to capture; clipped to ``max_batch`` and completed by
            ``max_batch`` itself, so every batch of <= max_batch requests has a graph.
        temperature, top_k, top_p: sampling (``sample_next_tokens``); Python constants baked into
            the graphs, so fixed per engine.
        eos_token_id, pad_token_id: as ``Qwen35.generate`` (None: the config's; ``[]``: never stop).
        seed: seeds the engine's own sampling generator (None: torch's default generator).
        use_graphs: capture CUDA graphs (default: when the model is on CUDA).
    """

    def __init__(self, model: Qwen35, max_batch: int, max_len: int,
                 graph_batch_sizes: Sequence[int] = DEFAULT_GRAPH_BATCH_SIZES, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | Sequence[int] | None = None,
                 pad_token_id: int | None = None, seed: int | None = None, use_graphs: bool | None = None):
        if not isinstance(model, Qwen35):
            raise TypeError(f"model: expected a fuselm Qwen35, got {type(model).__name__}")
        self.model = model
        self.device = model.device
        self.cache = model.new_cache(max_batch, max_len)  # checks max_batch, max_len
        sizes = [b for b in graph_batch_sizes if isinstance(b, int) and not isinstance(b, bool) and b >= 1]
        if len(sizes) != len(graph_batch_sizes):
            raise ValueError(f"graph_batch_sizes: expected positive ints, got {tuple(graph_batch_sizes)!r}")
        self.batch_sizes = tuple(sorted({b for b in sizes if b <= max_batch} | {max_batch}))
        self.temperature, self.top_k, self.top_p = _check_sampling(temperature, top_k, top_p)
        self.stop_ids, self.pad = model._stop_and_pad_ids(eos_token_id, pad_token_id)
        self.generator = None if seed is None else torch.Generator(self.device).manual_seed(seed)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"use_graphs: CUDA graphs need the model on a CUDA device, it is on {self.device}")

        # Static device buffers (their addresses are baked into the graphs).
        device = self.device
        self.input_tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)  # each row's last token
        self.history = torch.full((max_batch, max_len), self.pad, dtype=torch.int64, device=device)
        self.step_column = torch.zeros(1, 1, dtype=torch.int64, device=device)  # next history column
        self.stop_tensor = torch.tensor(self.stop_ids, dtype=torch.int64, device=device) if self.stop_ids else None
        self._views = {b: self.cache.first_rows(b) for b in self.batch_sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.use_graphs:
            self._capture_graphs()

    @property
    def max_batch(self) -> int:
        return self.cache.max_batch

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    # ------------------------------------------------------------------------ the step
    def _sample_and_record(self, logits: torch.Tensor, active: torch.Tensor, rows: int) -> torch.Tensor:
        """Sample rows 0 .. rows-1 from logits [rows, V], record the ids, update ``active`` (a
        view of ``cache.active``) for eos, feed the ids back as the next input. Returns the step
        report [rows, 2] int64: (next id, still active). No host sync, static shapes."""
        next_ids = sample_next_tokens(logits, self.temperature, self.top_k, self.top_p, self.generator)
        next_ids = torch.where(active, next_ids, self.pad)
        self.history[:rows].scatter_(1, self.step_column.expand(rows, 1), next_ids[:, None])
        self.step_column.add_(1)
        if self.stop_tensor is not None:
            active.logical_and_(~(next_ids[:, None] == self.stop_tensor).any(dim=-1))
        self.input_tokens[:rows].copy_(next_ids)
        return torch.stack([next_ids, active.to(torch.int64)], dim=1)

    @torch.no_grad()
    def _step_body(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step at graph batch size ``batch``: (logits [batch, V], report [batch, 2])."""
        cache = self._views[batch]
        logits = self.model.decode_step(self.input_tokens[:batch], cache)
        return logits, self._sample_and_record(logits, cache.active, batch)

    def _capture_graphs(self) -> None:
        """Warm up every batch size on a side stream (Triton JIT, cuBLAS workspaces, attention
        backend choice), then capture one graph per batch size, largest first, all in one memory
        pool (their temporaries never live at the same time). The cache is idle here (no row is
        active), so warm-up writes no state; the history column counter is reset after."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for batch in self.batch_sizes:
                for _ in range(2):
                    self.step_column.zero_()  # keeps the history column in range for any max_len
                    self._step_body(batch)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = None
        for batch in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            if self.generator is not None:  # the default generator is registered by capture itself
                graph.register_generator_state(self.generator)
            with torch.cuda.graph(graph, pool=pool):
                self._graph_outputs[batch] = self._step_body(batch)
            pool = graph.pool()
            self._graphs[batch] = graph
        self.step_column.zero_()
        torch.cuda.synchronize(self.device)

    def _run_step(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: a graph replay (outputs in the graph's static buffers) or eager."""
        if self.use_graphs:
            self._graphs[batch].replay()
            return self._graph_outputs[batch]
        return self._step_body(batch)

    def step_batch_size(self, requests: int) -> int:
        """The smallest captured batch size >= ``requests``."""
        return next(b for b in self.batch_sizes if b >= requests)

    # ------------------------------------------------------------------------ requests
    def _prompt_batch(self, prompts) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Right-padded input_ids [B, T] on the device and an attention mask (None when every
        prompt has T tokens). The model checks the ids themselves (range, empty rows)."""
        if isinstance(prompts, torch.Tensor):
            if prompts.dim() == 1:
                prompts = prompts[None]
            return prompts.to(self.device), None
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts: expected a non-empty list of token-id lists or a [B, T] tensor, got {prompts!r}")
        rows = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.tolist()
            if not isinstance(prompt, (list, tuple)):
                raise TypeError(f"prompts[{i}]: expected a list of token ids, got {type(prompt).__name__}")
            if not prompt:
                raise ValueError(f"prompts[{i}]: empty prompt (0 tokens); every request needs at least one token")
            if any(not isinstance(t, int) or isinstance(t, bool) for t in prompt):
                raise TypeError(f"prompts[{i}]: token ids must be ints")
            rows.append(list(prompt))
        longest = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (longest - len(r)) for r in rows], dtype=torch.int64)
        mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in rows], dtype=torch.int64)
        uniform = all(len(r) == longest for r in rows)
        return ids.to(self.device), None if uniform else mask.to(self.device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int, stream: Callable[[int, list[int]], None] | None = None,
                 return_logits: bool = False) -> GenerationResult:
        """Generate up to ``max_new_tokens`` ids after each prompt.

        Args:
            prompts: token-id lists (any lengths) or an int tensor [B, T] (or [T]); B <= max_batch.
            max_new_tokens: >= 1; each prompt's length + max_new_tokens must fit in max_len.
            stream: called after every generated position as ``stream(index, ids)`` with one id
                per request (``pad`` for finished rows). Costs one host read per step.
            return_logits: also keep each position's logits (one device copy per step).
        Bad arguments raise before any state changes, and the engine stays usable.
        """
        input_ids, attention_mask = self._prompt_batch(prompts)
        lengths = self.model._check_prompt(input_ids, attention_mask)
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        requests = input_ids.shape[0]
        self.model._check_cache(self.cache, requests, max(lengths), max_new_tokens)
        if stream is not None and not callable(stream):
            raise TypeError(f"stream: expected a callable, got {type(stream).__name__}")
        batch = self.step_batch_size(requests)
        read_every_step = stream is not None or self.stop_tensor is not None

        start = time.perf_counter()
        self.step_column.zero_()
        # checked above: the unchecked entry (its checks read the device); rows >= requests become inactive
        logits = self.model._prefill_last_logits(input_ids, lengths, self.cache)
        report = self._sample_and_record(logits, self.cache.active[:requests], requests)
        step_logits = [logits.clone()] if return_logits else []
        self._sync()
        prefill_seconds = time.perf_counter() - start

        start = time.perf_counter()
        steps = 0
        for index in range(max_new_tokens):
            if index > 0:
                logits, report = self._run_step(batch)
                steps += 1
                if return_logits:
                    step_logits.append(logits[:requests].clone())
            if read_every_step:
                ids_and_active = report[:requests].tolist()  # the one host read of the step
                if stream is not None:
                    stream(index, [row[0] for row in ids_and_active])
                if not any(row[1] for row in ids_and_active):
                    break
        tokens = self.history[:requests, : steps + 1].cpu()  # syncs: the device work is done
        self._sync()
        decode_seconds = time.perf_counter() - start

        num_generated = []
        for row in tokens.tolist():
            stops = [i for i, t in enumerate(row) if t in self.stop_ids]
            num_generated.append(stops[0] + 1 if stops else len(row))
        logits_out = torch.stack(step_logits, dim=1) if return_logits else None
        return GenerationResult(tokens, num_generated, prefill_seconds, decode_seconds, steps, batch, logits_out)

    # ------------------------------------------------------------------------ audit
    @torch.no_grad()
    def launch_audit(self, requests: int, steps: int = 4) -> dict:
        """Count what one decode step launches, on CUDA: start ``requests`` one-token requests,
        then profile ``steps`` steps (torch.profiler, CPU + CUDA activity).

        Returns per step: ``kernels`` (GPU kernels executed, those inside the graph included),
        ``copies`` (memcpy/memset on the device), ``graph_launches`` (cudaGraphLaunch calls),
        ``kernel_launches_outside_graphs`` (cudaLaunchKernel / cuLaunchKernel calls from the
        host), ``host_syncs`` (stream/event/device synchronize or blocking memcpy calls), and
        ``sync_debug_error``: the error torch.cuda.set_sync_debug_mode("error") raised during
        the steps, or None."""
        if self.device.type != "cuda":
            raise RuntimeError("launch_audit counts CUDA activity; the model is not on a CUDA device")
        if not 1 <= steps < self.max_len - 1:
            raise ValueError(f"steps: expected 1 .. {self.max_len - 2}, got {steps}")
        batch = self.step_batch_size(requests)
        self.generate([[0]] * requests, 2)  # prefill + one step: rows active, kernels warm
        self.cache.active[:requests] = True
        self._sync()
        sync_error = None
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(steps):
                    self._run_step(batch)
            except RuntimeError as error:  # a sync inside the step
                sync_error = str(error)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize(self.device)  # ours, after the steps: not counted below
        counts = dict(kernels=0, copies=0, graph_launches=0, kernel_launches_outside_graphs=0, host_syncs=0)
        for event in prof.events():
            name = event.name
            if event.device_type == torch.autograd.DeviceType.CUDA:
                counts["copies" if name.startswith(("Memcpy", "Memset")) else "kernels"] += 1
            elif name.startswith("cudaGraphLaunch"):
                counts["graph_launches"] += 1
            elif name.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")):
                counts["kernel_launches_outside_graphs"] += 1
            elif name.startswith(("cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy ", "cudaMemcpy_")) \
                    or name == "cudaMemcpy":
                counts["host_syncs"] += 1
        result = {key: value / steps for key, value in counts.items()}
        result.update(requests=requests, batch_size=batch, steps_profiled=steps, graphs=self.use_graphs,
                      sync_debug_error=sync_error)
        return result


def decode_weight_bytes(model: Qwen35) -> int:
    """Bytes of weights one decode step reads: every parameter, except that the embedding table
    contributes one row per token (counted as zero here) unless it is also the LM head (tied).
    The weight-bandwidth floor of a step is this over the device's copy bandwidth."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        total -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    return total
