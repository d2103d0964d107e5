"""``fuselm generate --config``: Qwen3.5 throughput with random weights, through the ``Engine``.

A batch of requests with random prompt ids (all ``prompt_len`` long) is generated greedily with
``ignore_eos`` (every request runs to ``max_new_tokens``), after a warm-up run on a GPU (Triton
compilation for the prefill shapes). Timings come from the requests' own metrics (host clock;
every time point follows a device read, so the device work is in them):

    prefill  = last first token - first arrival          (one prefill of the whole batch)
    decode   = last finish - first first token            (the remaining tokens, pipelined steps)
    decode tok/s = sum over requests of (tokens - 1) / decode

On a GPU, the weight-bandwidth floor of a decode step is ``decode_weight_bytes(model, batch)`` over the
measured device copy bandwidth (``fuselm.runtime.copy_bandwidth``), and the decode step time is
reported as a share of it.
"""

from __future__ import annotations

import time

import torch

from fuselm.engine import Engine, RequestOutput, SamplingParams
from fuselm.engine.audit import decode_weight_bytes
from fuselm.models.qwen35 import Qwen35Config
from fuselm.models.qwen35.presets import random_qwen35
from fuselm.runtime import INTERPRET, copy_bandwidth, parse_dtype


def request_timings(outputs: list[RequestOutput]) -> dict:
    """Batch timings of requests that ran together: ``prefill_seconds`` (first arrival to the last
    first token), ``decode_seconds`` (first first token to the last finish), ``decode_steps``
    (the longest request's tokens - 1), ``decode_tokens`` (every request's tokens after its
    first), ``decode_tokens_per_s`` and ``decode_ms_per_step`` (nan without a decode step)."""
    metrics = [output.metrics for output in outputs]
    first_token = [m.first_token_time for m in metrics]
    prefill_seconds = max(first_token) - min(m.arrival_time for m in metrics)
    decode_seconds = max(m.finished_time for m in metrics) - min(first_token)
    lengths = [len(output.outputs[0].token_ids) for output in outputs]
    steps, tokens = max(lengths) - 1, sum(n - 1 for n in lengths)
    return {"prefill_seconds": prefill_seconds, "decode_seconds": decode_seconds, "decode_steps": steps,
            "decode_tokens": tokens,
            "decode_tokens_per_s": tokens / decode_seconds if steps else float("nan"),
            "decode_ms_per_step": 1e3 * decode_seconds / steps if steps else float("nan")}


def run_generate_benchmark(config: Qwen35Config, description: str, *, batch: int = 1, prompt_len: int = 32,
                           max_new_tokens: int = 16, seed: int = 0, device: torch.device,
                           dtype: torch.dtype, temperature: float = 0.0, top_p: float = 1.0,
                           top_k: int = 0, state_dtype: torch.dtype | str = torch.float32,
                           logprobs: int | None = None, **penalties) -> tuple[dict, str]:
    """Build a random-weight model of ``config`` (weights and prompts from ``seed``) on ``device``
    in ``dtype``, run the batch and print what it does; returns (results for json, markdown
    table). ``description`` names the model in the output; sampling: greedy by default (each
    request seeded from ``seed`` otherwise); ``state_dtype``: the cache's Gated DeltaNet states'
    (``Engine``); ``logprobs``: every request asks for that many top log-probabilities a token
    (``SamplingParams.logprobs``); ``penalties``: SamplingParams' min_p and penalty fields, for
    every request. ValueError names a bad size or sampling value."""
    for name, value in (("batch", batch), ("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected >= 1, got {value}")
    device = torch.device(device)
    state_dtype = parse_dtype(state_dtype, "state_dtype")
    started = time.perf_counter()
    model = random_qwen35(config, dtype=dtype, device=device, seed=seed)
    engine = Engine(model, max_batch=batch, max_len=prompt_len + max_new_tokens, graph_batch_sizes=(batch,),
                    state_dtype=state_dtype)
    prompts = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                             seed=seed + row, ignore_eos=True, logprobs=logprobs, **penalties) for row in range(batch)]
    sampling = "greedy" if temperature == 0 else f"temperature {temperature}, top-k {top_k}, top-p {top_p}"
    sampling += "" if logprobs is None else f", logprobs {logprobs}"
    sampling += "".join(f", {name.replace('_', ' ')} {value}" for name, value in penalties.items())
    on_cpu_kernels = "Triton interpreter" if INTERPRET else "PyTorch reference"
    kernels = "Triton kernels" if device.type == "cuda" else on_cpu_kernels
    backend = f"{'CUDA graphs' if engine.runner.use_graphs else 'eager'}, {kernels}"
    parameters = sum(p.numel() for p in model.parameters())
    print(f"fuselm generate: Qwen3.5 {description}, random weights (seed {seed}); {parameters / 1e6:.1f}M parameters, "
          f"{str(dtype)[6:]} ({str(state_dtype)[6:]} recurrent states), {device} ({backend}); batch {batch}, "
          f"prompt {prompt_len}, {max_new_tokens} new tokens, "
          f"{sampling}, no eos; built in {time.perf_counter() - started:.1f} s", flush=True)
    if device.type == "cuda":  # compiles the prefill kernels for these shapes before the timed run
        engine.generate(prompts, SamplingParams(max_tokens=min(2, max_new_tokens), temperature=0.0, ignore_eos=True))
    outputs = engine.generate(prompts, params)
    tokens = [output.outputs[0].token_ids for output in outputs]
    if max_new_tokens <= 64:
        for row, ids in enumerate(tokens[:8]):
            print(f"request {row}: {' '.join(map(str, ids))}")

    timings = request_timings(outputs)
    prefill_tps = batch * prompt_len / timings["prefill_seconds"]
    step_ms = timings["decode_ms_per_step"]
    weight_bytes = decode_weight_bytes(model, batch)
    results = {"model": description, "parameters": parameters, "dtype": str(dtype)[6:],
               "state_dtype": str(state_dtype)[6:], "device": str(device),
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "backend": backend,
               "batch": batch, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens, "sampling": sampling,
               "graph_batch_size": engine.runner.batch_size_for(batch), **timings,
               "prefill_tokens_per_s": prefill_tps, "weight_bytes_per_step": weight_bytes, "tokens": tokens}
    lines = [f"## fuselm generate: {description}, random weights", "",
             f"{results['gpu'] or 'CPU'}, {results['dtype']} ({results['state_dtype']} recurrent states), {backend}; "
             f"batch {batch}, prompt {prompt_len}, "
             f"{max_new_tokens} new tokens, {sampling}", "",
             "| measure | value |", "|---|---|",
             f"| prefill | {batch * prompt_len} tokens in {1e3 * timings['prefill_seconds']:.1f} ms: "
             f"{prefill_tps:,.0f} tok/s |",
             f"| decode | {timings['decode_steps']} steps x {batch} requests in {1e3 * timings['decode_seconds']:.1f} "
             f"ms: {timings['decode_tokens_per_s']:,.1f} tok/s ({step_ms:.3f} ms/step) |"]
    if device.type == "cuda":
        bandwidth = copy_bandwidth(device) * 1e12  # bytes/s
        floor_ms = weight_bytes / bandwidth * 1e3
        results.update(copy_bandwidth_bytes_per_s=bandwidth, weight_floor_ms_per_step=floor_ms,
                       weight_floor_tokens_per_s=batch * 1e3 / floor_ms,
                       percent_of_weight_floor=100 * floor_ms / step_ms)
        lines.append(f"| weight-bandwidth floor | {weight_bytes / 1e9:.2f} GB of weights per step / "
                     f"{bandwidth / 1e12:.2f} TB/s copy = {floor_ms:.3f} ms/step = "
                     f"{batch * 1e3 / floor_ms:,.1f} tok/s; decode at **{100 * floor_ms / step_ms:.1f}%** |")
    else:
        lines.append(f"| weight-bandwidth floor | n/a on the CPU ({weight_bytes / 1e6:.2f} MB of weights per step; the "
                     "interpreter's speed says nothing about the kernels) |")
    return results, "\n".join(lines) + "\n"
