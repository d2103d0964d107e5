"""What the engine's decode step launches, and how close the model is to Hugging Face transformers.

    decode_weight_bytes(model, batch)  bytes of weights one decode step reads (the bandwidth floor)
    launch_audit(engine, requests)  per decode step, on CUDA: kernels, device copies, graph
                                    launches, kernel launches outside graphs, host syncs
    prefill_profile(model, input_ids)  on CUDA: one prefill's kernels, GPU kernel time against wall
                                    time, and its kernel-time breakdown
    moe_layer_kernels(model, tokens)  on CUDA: the kernels one MoE layer's block runs for a decode
                                    step of ``tokens`` rows (issue 19's gate: at most MOE_MAX_KERNELS)
    parity_with_hf(hf, model, ...)  greedy HF generate vs greedy generation through the Engine,
                                    logits compared by teacher forcing
    run_audit(...)                  the body of ``fuselm audit``: both, as (results, markdown, ok)
"""

from __future__ import annotations

import gc
import itertools
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from fuselm.engine.engine import Engine
from fuselm.engine.request import Request, SamplingParams
from fuselm.engine.runner import ModelRunner
from fuselm.engine.sampling import PLAIN
from fuselm.models.qwen35 import Qwen35, Qwen35Config
from fuselm.models.qwen35.layers import MoE

# fp32 logits vs HF fp32 (summation order only): max abs difference on the CPU; a GPU adds
# Triton's approximate exp/rsqrt and other reduction orders on both sides.
FP32_MAX_ABS_CPU, FP32_MAX_ABS_GPU = 1e-3, 1e-2
# Kernels per MoE layer per decode step (seed 003's gate: routing, gate/up with the activation and the
# shared expert, down with the combine; the router GEMM one more). Today 3: the router logits, then
# gate/up and down, each routing from them (ops/moe/decode.py).
MOE_MAX_KERNELS = 4
# Rows of the kernel-time tables (launch_audit's decode step, prefill_profile).
KERNEL_TABLE_ROWS = 12
# Half precision: the teacher-forced cosine to HF fp32 may fall short of HF half precision's own by this.
HALF_COSINE_SLACK = 1e-5
# Half precision when HF fp32 does not fit beside the models: the cosine to HF in the same dtype.
HALF_SAME_DTYPE_COSINE = 0.999
# Room kept free beyond the fp32 copy and the logits when deciding whether HF fp32 fits on the GPU.
_FP32_MARGIN_BYTES = 2 << 30


def decode_weight_bytes(model: Qwen35, batch: int = 1) -> int:
    """Bytes of weights one decode step of ``batch`` tokens reads: every parameter, except that
    the embedding table contributes one row per token (counted as zero here) unless it is also the
    LM head (tied), and that an MoE layer reads only the routed experts its tokens pick: for
    uniform routing E (1 - (1 - k/E)^batch) of its E experts on average (the shared expert and the
    router always). The weight-bandwidth floor of a step is this over the device's copy bandwidth."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        total -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    if model.config.is_moe:
        E, k = model.config.num_experts, model.config.num_experts_per_tok
        untouched = (1 - k / E) ** batch  # the chance an expert gets none of the batch's tokens
        for layer in model.layers:
            routed = sum(w[:E].numel() * w.element_size() for w in (layer.mlp.w13, layer.mlp.w2))
            total -= round(routed * untouched)
    return total


# ============================================================================ launches
@torch.no_grad()
def launch_audit(engine_or_runner: Engine | ModelRunner, requests: int, steps: int = 4) -> dict:
    """Count what one decode step launches, on CUDA, with ``requests`` requests running.

    On an idle ``Engine``: ``requests`` greedy one-token-prompt requests are added and started
    (one ``step``: prefill, one decode step), with ``max_tokens`` as large as ``max_len`` allows so
    they stay active; on an idle ``ModelRunner``: the same requests are prefilled into slots
    0 .. requests-1. Then ``steps`` calls of ``runner.decode(batch, PLAIN)`` are
    profiled (torch.profiler, CPU + CUDA activity), and the requests are ended (their slots freed).

    Returns per step: ``kernels`` (GPU kernels executed, those inside the graph included),
    ``copies`` (memcpy/memset on the device), ``graph_launches`` (cudaGraphLaunch calls),
    ``kernel_launches_outside_graphs`` (cudaLaunchKernel / cuLaunchKernel calls from the host),
    ``host_syncs`` (stream/event/device synchronize or blocking memcpy calls); and
    ``sync_debug_error``: the error torch.cuda.set_sync_debug_mode("error") raised during the
    steps, or None; ``requests``, ``batch_size`` (the decode batch size), ``steps_profiled``,
    ``graphs`` (whether the runner replays CUDA graphs)."""
    engine = engine_or_runner if isinstance(engine_or_runner, Engine) else None
    runner = engine.runner if engine is not None else engine_or_runner
    if not isinstance(runner, ModelRunner):
        raise TypeError(f"engine_or_runner: expected an Engine or a ModelRunner, got {type(engine_or_runner).__name__}")
    if runner.device.type != "cuda":
        raise RuntimeError("launch_audit counts CUDA activity; the model is not on a CUDA device")
    if not 1 <= requests <= runner.max_batch:
        raise ValueError(f"requests: expected 1 .. {runner.max_batch} (max_batch), got {requests}")
    if not 1 <= steps <= runner.max_len - 3:  # prefill + the engine's step + steps stay within max_len
        raise ValueError(f"steps: expected 1 .. {runner.max_len - 3} (max_len - 3), got {steps}")
    params = SamplingParams(max_tokens=runner.max_len - 1, temperature=0.0, ignore_eos=True)
    if engine is not None:
        if engine.has_unfinished_requests():
            raise RuntimeError("launch_audit needs an idle engine (no request queued or running)")
        started = [engine.add_request([0], params) for _ in range(requests)]
        engine.step()  # prefill + one decode step: slots active, kernels warm
        batch = runner.batch_size_for(engine.scheduler.rows_in_use())
    else:
        if bool(runner.cache.active.any()):
            raise RuntimeError("launch_audit needs an idle runner (no active slot)")
        runner.set_rows(range(requests))  # rows 0 .. requests-1 decode slots 0 .. requests-1
        started = [Request(f"audit-{slot}", [0], params, seed=0, stop_ids=(), slot=slot) for slot in range(requests)]
        runner.prefill([(request, 0, 1) for request in started])
        batch = runner.batch_size_for(requests)
        runner.decode(batch, PLAIN)  # kernels warm
    torch.cuda.synchronize(runner.device)

    from torch.profiler import ProfilerActivity, profile

    sync_error = None
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(steps):
                    runner.decode(batch, PLAIN)
            except RuntimeError as error:  # a sync inside the step
                sync_error = str(error)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize(runner.device)  # ours, after the steps: not counted below
    finally:
        if engine is not None:
            for request in started:
                engine.abort(request)
            engine.run()  # drains the step still in flight
        else:
            runner.release([request.slot for request in started])
    counts = dict(kernels=0, copies=0, graph_launches=0, kernel_launches_outside_graphs=0, host_syncs=0)
    events = prof.events()
    for event in events:
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
    result.update(requests=requests, batch_size=batch, steps_profiled=steps, graphs=runner.use_graphs,
                  sync_debug_error=sync_error, kernel_ms=kernel_time_table(events, steps))
    return result


def kernel_time_table(events, calls: int = 1, top: int = KERNEL_TABLE_ROWS) -> dict[str, list]:
    """The ``top`` kernels by GPU time among profiler ``events`` (those on a CUDA device; device
    copies and memsets included), grouped by the first 60 characters of the name: {name: [ms per
    call, launches per call]}, slowest first, and "(all)" for the sum over every kernel."""
    ms, launches = defaultdict(float), defaultdict(int)
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA:
            ms[event.name[:60]] += event.device_time_total / 1e3 / calls
            launches[event.name[:60]] += 1
    table = {name: [round(ms[name], 4), launches[name] / calls]
             for name in sorted(ms, key=ms.get, reverse=True)[:top]}
    table["(all)"] = [round(sum(ms.values()), 4), sum(launches.values()) / calls]
    return table


def kernel_time_rows(tables: dict[str, dict]) -> list[str]:
    """Markdown table of ``kernel_time_table`` results side by side ({column title: table}): each
    kernel in the order first seen, ms a call (launches), "-" where a table lacks it, "(all)" last."""
    names = [*dict.fromkeys(name for table in tables.values() for name in table if name != "(all)"), "(all)"]
    lines = ["| kernel | " + " | ".join(tables) + " |", "|---" * (len(tables) + 1) + "|"]
    for name in names:
        cells = [f"{table[name][0]:.3f} ({table[name][1]:g})" if name in table else "-" for table in tables.values()]
        lines.append(f"| {name.replace('|', '/')} | " + " | ".join(cells) + " |")
    return lines


def prefill_profile(model: Qwen35, input_ids: torch.Tensor, repeats: int = 3) -> dict:
    """One ``model.prefill`` of ``input_ids`` [B, T] (on the model's CUDA device) into a fresh
    cache: ``wall_ms`` (host time of the call to the GPU's last kernel, the best of ``repeats``
    unprofiled calls after a warm-up), ``gpu_ms`` (the GPU time of its kernels, summed, from one
    profiled call: where it is well under wall_ms the GPU waits on the host), ``kernels`` and
    ``copies`` (launches), ``kernel_ms`` (``kernel_time_table``)."""
    from torch.profiler import ProfilerActivity, profile

    if model.device.type != "cuda":
        raise RuntimeError("prefill_profile times CUDA kernels; the model is not on a CUDA device")
    if input_ids.dim() != 2 or input_ids.device != model.device:
        raise ValueError(f"input_ids: expected [B, T] on {model.device}, got {tuple(input_ids.shape)} on "
                         f"{input_ids.device}")
    batch, tokens = input_ids.shape

    def call() -> float:
        cache = model.new_cache(batch, tokens + 1)
        torch.cuda.synchronize(model.device)
        start = time.perf_counter()
        model.prefill(input_ids, cache)
        torch.cuda.synchronize(model.device)
        return time.perf_counter() - start

    call()  # compiled and warm
    wall = min(call() for _ in range(repeats))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
    table = kernel_time_table(prof.events(), top=KERNEL_TABLE_ROWS)
    copies = sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA
                 and event.name.startswith(("Memcpy", "Memset")))
    total_ms, launches = table["(all)"]
    return {"batch": batch, "tokens": tokens, "wall_ms": 1e3 * wall, "gpu_ms": total_ms,
            "kernels": launches - copies, "copies": copies, "kernel_ms": table}


def moe_layer_kernels(model: Qwen35, tokens: int) -> int:
    """GPU kernels the first MoE layer's block runs on ``tokens`` rows (its share of a decode step
    at that batch: the step's graph replays the same launches), counted by torch.profiler over one
    eager call after a warm-up; device copies and memsets count too."""
    from torch.profiler import ProfilerActivity, profile

    block = next((m for m in model.modules() if isinstance(m, MoE)), None)
    if block is None:
        raise ValueError("model: has no MoE layer")
    x = torch.randn(tokens, block.hidden_size, dtype=block.w13.dtype, device=block.w13.device)
    block(x)  # compiled and warm
    torch.cuda.synchronize(x.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        block(x)
        torch.cuda.synchronize(x.device)
    return int(kernel_time_table(prof.events())["(all)"][1])


# ============================================================================ parity with HF
def _compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Max abs difference and cosine (over every element, in float64) of two logit tensors."""
    return {"max_abs": (a - b).abs().max().item(),
            "cosine": F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()}


@torch.no_grad()
def _teacher_forced_logits(model: Qwen35, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits [B, n, vocab] when fed ``tokens`` [B, n] after ``prompts`` [B, T]:
    prefill, then one decode step per token (the kernels the engine's graphs hold, run eagerly)."""
    cache = model.new_cache(prompts.shape[0], prompts.shape[1] + tokens.shape[1])
    logits = [model.prefill(prompts, cache)]
    for position in range(tokens.shape[1] - 1):
        logits.append(model.decode_step(tokens[:, position].to(prompts.device), cache))
    return torch.stack(logits, dim=1)


@torch.no_grad()
def _hf_fp32_logits(hf_model, prompts: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor | None, str]:
    """HF's fp32 logits [B, n, vocab] of ``tokens`` [B, n] after ``prompts`` (one forward over
    prompt + tokens, TF32 off), from ``hf_model`` upcast in place and cast back after (exact: a
    half-precision value round-trips through fp32). (None, why) when the fp32 copy does not fit
    in the GPU's free memory; else (logits, how)."""
    B, n = tokens.shape
    tensors = [t for t in itertools.chain(hf_model.parameters(), hf_model.buffers())
               if t.is_floating_point() and t.dtype != torch.float32]
    fp32_bytes = sum(4 * t.numel() for t in tensors)  # as if no half-precision storage were freed
    device = prompts.device
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0]
        needed = fp32_bytes + 3 * B * n * hf_model.config.vocab_size * 4 + _FP32_MARGIN_BYTES
        if free < needed:
            return None, (f"an fp32 copy of the HF model needs {needed / 1e9:.1f} GB, {free / 1e9:.1f} GB free on "
                          f"the GPU")
    dtypes = [t.dtype for t in tensors]
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for t in tensors:
            t.data = t.data.float()
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        ids = torch.cat([prompts, tokens[:, :-1].to(device)], dim=1)
        logits = hf_model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=n).logits.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        for t, dtype in zip(tensors, dtypes):
            t.data = t.data.to(dtype)
    return logits, "HF fp32: the same weights upcast, one forward over prompt + HF's tokens, TF32 off"


@torch.no_grad()
def parity_with_hf(hf_model, model: Qwen35, prompts: torch.Tensor, new_tokens: int, *,
                   engine: Engine | None = None) -> dict:
    """Greedy generation of ``new_tokens`` tokens by HF (``hf_model.generate``, its logits kept)
    and by ``model`` through an ``Engine`` (``engine``, or a new one of len(prompts) slots), from
    the same prompts [B, T] (on the model's device), eos ignored on both sides.

    Returns (json-ready):
    - free-running: ``tokens`` (the Engine's), ``hf_tokens``, ``first_divergence_per_row``,
      ``greedy_agreement`` (tokens equal up to each row's first divergence, over all tokens);
    - teacher-forced (the model fed HF's tokens: prefill + ``decode_step``, logits at every
      position vs HF's generate logits): ``teacher_forced`` (per position max_abs, cosine),
      ``teacher_forced_worst_max_abs``, ``teacher_forced_worst_cosine``, ``logit_scale``;
    - ``fp32_reference`` (half precision only): the teacher-forced cosine (all positions and rows)
      of the model and of HF in its own dtype to HF fp32 on the same weights, per position too:
      ``fuselm_cosine``, ``hf_cosine``, ``fuselm_per_position``, ``hf_per_position``, ``how``; None
      when the model runs in fp32 (HF's logits are fp32) or the fp32 copy does not fit
      (``fp32_reference_note`` says which). ``hf_model`` is upcast in place for it and cast back.
    """
    B, T = prompts.shape
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  pad_token_id=0)
    if model.config.stop_token_ids:
        kwargs["min_new_tokens"] = new_tokens  # the engine ignores eos: both run every position
    reference = hf_model.generate(prompts, attention_mask=torch.ones_like(prompts), **kwargs)
    hf_tokens = reference.sequences[:, T:]
    hf_logits = torch.stack(reference.logits, dim=1).float()
    del reference

    engine = engine if engine is not None else Engine(model, max_batch=B, max_len=T + new_tokens)
    outputs = engine.generate(prompts.tolist(), SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    tokens = [output.outputs[0].token_ids for output in outputs]
    first_divergence = []
    for ours, theirs in zip(tokens, hf_tokens.tolist()):
        first_divergence.append(next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), new_tokens))

    forced = _teacher_forced_logits(model, prompts, hf_tokens).float()
    per_position = [_compare(forced[:, p], hf_logits[:, p]) for p in range(new_tokens)]
    result = {"positions": new_tokens, "tokens": tokens, "hf_tokens": hf_tokens.tolist(),
              "first_divergence_per_row": first_divergence,
              "greedy_agreement": sum(first_divergence) / (new_tokens * B),
              "teacher_forced": per_position,
              "teacher_forced_worst_max_abs": max(p["max_abs"] for p in per_position),
              "teacher_forced_worst_cosine": min(p["cosine"] for p in per_position),
              "logit_scale": hf_logits[:, 0].abs().max().item(),
              "fp32_reference": None}
    if model.dtype == torch.float32:
        result["fp32_reference_note"] = "the model runs in fp32: HF's own logits are the fp32 reference"
        return result
    reference_logits, how = _hf_fp32_logits(hf_model, prompts, hf_tokens)
    if reference_logits is None:
        result["fp32_reference_note"] = how
        return result
    ours_to_fp32 = [_compare(forced[:, p], reference_logits[:, p])["cosine"] for p in range(new_tokens)]
    hf_to_fp32 = [_compare(hf_logits[:, p], reference_logits[:, p])["cosine"] for p in range(new_tokens)]
    result["fp32_reference"] = {"fuselm_cosine": _compare(forced, reference_logits)["cosine"],
                                "hf_cosine": _compare(hf_logits, reference_logits)["cosine"],
                                "fuselm_per_position": ours_to_fp32, "hf_per_position": hf_to_fp32, "how": how}
    return result


# ============================================================================ fuselm audit
def _parity_bar(parity: dict, dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """(pass, the bar in words) of a ``parity_with_hf`` result."""
    if dtype == torch.float32:
        limit = FP32_MAX_ABS_CPU if device.type == "cpu" else FP32_MAX_ABS_GPU
        ok = parity["teacher_forced_worst_max_abs"] <= limit and parity["greedy_agreement"] == 1.0
        return ok, f"teacher-forced max abs logit diff <= {limit:g} and every greedy token equal (fp32)"
    name = str(dtype)[6:]
    reference = parity["fp32_reference"]
    if reference is not None:
        ok = reference["fuselm_cosine"] >= reference["hf_cosine"] - HALF_COSINE_SLACK
        return ok, (f"teacher-forced cosine to HF fp32 no worse than HF {name}'s own (- {HALF_COSINE_SLACK:g})")
    ok = parity["teacher_forced_worst_cosine"] >= HALF_SAME_DTYPE_COSINE
    return ok, (f"teacher-forced cosine to HF {name} >= {HALF_SAME_DTYPE_COSINE} at every position (HF fp32 not "
                f"measured: {parity['fp32_reference_note']})")


def _parity_lines(parity: dict, dtype: torch.dtype, batch: int, bar: str, ok: bool) -> list[str]:
    name, n = str(dtype)[6:], parity["positions"]
    forced = parity["teacher_forced"]
    lines = ["### Parity with Hugging Face transformers (same weights, greedy)", "",
             "| measure | value |", "|---|---|",
             f"| teacher-forced logits (fed HF's tokens) vs HF {name}, after prefill: max abs diff / cosine | "
             f"{forced[0]['max_abs']:.2e} / {forced[0]['cosine']:.6f} (logits up to {parity['logit_scale']:.1f}) |",
             f"| the same after {n - 1} decode steps | {forced[-1]['max_abs']:.2e} / {forced[-1]['cosine']:.6f} |",
             f"| the same, worst over the {n} positions | {parity['teacher_forced_worst_max_abs']:.2e} / "
             f"{parity['teacher_forced_worst_cosine']:.6f} |",
             f"| free-running greedy tokens through the Engine equal to HF's, {n} tokens x {batch} rows | "
             f"{100 * parity['greedy_agreement']:.1f}% (first divergence per row: "
             f"{parity['first_divergence_per_row']}) |"]
    reference = parity["fp32_reference"]
    if reference is not None:
        lines += [f"| teacher-forced cosine to HF fp32, all positions: fuselm {name} / HF {name} | "
                  f"{reference['fuselm_cosine']:.6f} / {reference['hf_cosine']:.6f} |",
                  f"| the same, worst position | {min(reference['fuselm_per_position']):.6f} / "
                  f"{min(reference['hf_per_position']):.6f} |"]
    elif dtype != torch.float32:
        lines.append(f"| cosine to HF fp32 | not measured: {parity['fp32_reference_note']} |")
    lines += [f"| bar: {bar} | {'pass' if ok else 'FAIL'} |", ""]
    return lines


def run_audit(*, config: Qwen35Config | None = None, checkpoint: Path | None = None, description: str,
              weights: str = "spread", batch: int = 2, prompt_len: int = 16, max_new_tokens: int = 8,
              seed: int = 0, device: torch.device, dtype: torch.dtype) -> tuple[dict, str, bool]:
    """``fuselm audit``: HF parity on the same weights (``parity_with_hf``), then, on CUDA, what one
    decode step launches and syncs (``launch_audit`` at 1 and ``batch`` requests).

    The model: HF ``Qwen3_5ForCausalLM`` from ``checkpoint``, or of ``config`` with random weights
    (``weights``: "spread" or "hf-init", from ``seed``), in ``dtype`` on ``device``; fuselm's
    ``Qwen35.from_hf`` of it. ``batch`` prompts of ``prompt_len`` random ids (``seed``),
    ``max_new_tokens`` greedy tokens. Prints a header line as it starts. Returns (results for json,
    markdown, ok: the parity bar holds and, on CUDA, every step is one graph launch with no kernel
    launched outside it and no host sync, and an MoE layer runs at most MOE_MAX_KERNELS kernels).
    ValueError / FileNotFoundError for bad arguments, ImportError without transformers."""
    try:
        import transformers
        from transformers import Qwen3_5ForCausalLM
    except ImportError:
        raise ImportError("fuselm audit compares against Hugging Face transformers: pip install transformers") from None
    from fuselm.models.qwen35.presets import WEIGHT_SCHEMES, random_hf_qwen35

    for name, value in (("batch", batch), ("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected >= 1, got {value}")
    if (config is None) == (checkpoint is None):
        raise ValueError("run_audit: expected one of config and checkpoint")
    if weights not in WEIGHT_SCHEMES:
        raise ValueError(f"--weights: expected one of {WEIGHT_SCHEMES}, got {weights!r}")
    if checkpoint is not None and weights != "spread":
        raise ValueError("--weights: chooses random weights; it does not apply with --checkpoint")
    device = torch.device(device)
    if checkpoint is not None:
        if not Path(checkpoint).is_dir():
            raise FileNotFoundError(f"{checkpoint}: no such checkpoint directory")
        hf_model = Qwen3_5ForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    else:
        hf_model = random_hf_qwen35(config, dtype=dtype, device=device, seed=seed, weights=weights)
    model = Qwen35.from_hf(hf_model)  # the same weights, re-laid
    on_gpu = device.type == "cuda"
    gpu = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"fuselm audit: Qwen3.5 {description}, {str(dtype)[6:]} on {gpu}; transformers {transformers.__version__}; "
          f"batch {batch}, prompt {prompt_len}, {max_new_tokens} greedy tokens", flush=True)
    engine = Engine(model, max_batch=batch, max_len=prompt_len + max_new_tokens, graph_batch_sizes=(1, batch))
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=generator).to(device)
    parity = parity_with_hf(hf_model, model, prompts, max_new_tokens, engine=engine)
    del hf_model
    parity_ok, bar = _parity_bar(parity, dtype, device)

    results = {"model": description, "dtype": str(dtype)[6:], "device": gpu, "transformers": transformers.__version__,
               "torch": torch.__version__, "batch": batch, "prompt_len": prompt_len, "parity": parity,
               "parity_bar": bar, "parity_ok": parity_ok, "launches": {}}
    lines = [f"## fuselm audit: Qwen3.5 {description}", "",
             f"{gpu}, {str(dtype)[6:]}, transformers {transformers.__version__}, torch {torch.__version__}; batch "
             f"{batch}, prompt {prompt_len}", ""]
    lines += _parity_lines(parity, dtype, batch, bar, parity_ok)
    launches_ok = True
    lines += ["### One decode step", ""]
    if on_gpu:
        steps = min(4, engine.max_len - 3)
        lines += ["| requests (graph batch) | kernels | device copies | graph launches | kernel launches outside "
                  "graphs | host syncs | sync debug mode 'error' |", "|---|---|---|---|---|---|---|"]
        for requests in sorted({1, batch}):
            counts = launch_audit(engine, requests, steps=steps)
            results["launches"][requests] = counts
            launches_ok &= (counts["graph_launches"] == 1 and counts["kernel_launches_outside_graphs"] == 0
                            and counts["host_syncs"] == 0 and counts["sync_debug_error"] is None)
            lines.append(f"| {requests} ({counts['batch_size']}) | {counts['kernels']:g} | {counts['copies']:g} | "
                         f"{counts['graph_launches']:g} | {counts['kernel_launches_outside_graphs']:g} | "
                         f"{counts['host_syncs']:g} | {counts['sync_debug_error'] or 'no error'} |")
        lines += ["", f"Counted by torch.profiler (CUDA activity: every kernel inside the graph replay) over "
                      f"{steps} steps, per step."]
        prefill = prefill_profile(model, prompts)
        results["prefill"] = prefill
        lines += ["", f"Prefill of the {batch} x {prompt_len} prompts (`model.prefill`, eager): {prefill['kernels']:g} "
                  f"kernels and {prefill['copies']:g} device copies, {prefill['gpu_ms']:.2f} ms of GPU kernel time "
                  f"against {prefill['wall_ms']:.2f} ms wall. Kernel time, prefill and one decode step at "
                  f"{batch} requests (ms, launches):", ""]
        lines += kernel_time_rows({"prefill": prefill["kernel_ms"],
                                   "decode step": results["launches"][batch]["kernel_ms"]})
        if model.config.is_moe:
            moe = {requests: moe_layer_kernels(model, requests) for requests in sorted({1, batch})}
            results["moe_layer_kernels"] = moe
            launches_ok &= max(moe.values()) <= MOE_MAX_KERNELS
            lines += ["", "Kernels per MoE layer per decode step (one block call profiled; bar <= "
                      f"{MOE_MAX_KERNELS}): " + ", ".join(f"{k} at {n} token{'s' * (n > 1)}" for n, k in moe.items())]
    else:
        lines.append("n/a on the CPU: the step runs eagerly in the Triton interpreter (no CUDA graph, no device "
                     "kernels to count); run `fuselm audit` on a GPU for kernels, graph launches and host syncs.")
    results["launches_ok"] = launches_ok
    return results, "\n".join(lines) + "\n", parity_ok and launches_ok
