"""The ``fuselm`` command.

    fuselm demo      run every op on fresh random inputs against its float64 reference and print
                     a table: op, shape, dtype, backend, relative error, time per call.
    fuselm swapffn   Swap-FFN at the seed config: tokens/s of the reference (eager and
                     torch.compile), the fused path (eager and one CUDA graph per token) and the
                     token's FFN matrix products alone in cuBLAS; kernels per token, and
                     fused-vs-reference parity (GPU).
    fuselm generate  Qwen3.5 generation through the engine (prefill, then one CUDA graph per
                     decode step): streams token ids, then prefill tok/s, decode tok/s and the
                     share of the weight-bandwidth floor. Default: a tiny random model.
    fuselm audit     Qwen3.5 engine audit: kernels and graph launches per decode step, host syncs
                     inside it (GPU), and parity with Hugging Face transformers on the same weights.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from fuselm import Activation, add_rms_norm, gemm_swiglu, interleave_gate_up, rms_norm, silu_mul, swiglu_mlp
from fuselm.ops.activation import gate_factor_ref, up_factor_ref
from fuselm.runtime import INTERPRET, capture_graph, copy_bandwidth
from fuselm.testing import rel_err


def _time_ms(fn) -> float:
    if torch.cuda.is_available():
        import triton

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _demo_cases(device: str, dtype: torch.dtype, rows: int, hidden: int, inter: int):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    gate, up = randn(rows, inter, scale=3), randn(rows, inter, scale=3)
    for act in (Activation(), Activation.swiglu_limit(7.0), Activation.swiglu_oai()):
        exact = gate_factor_ref(gate.double(), act) * up_factor_ref(up.double(), act)
        yield f"silu_mul[{act.kind}]", gate.shape, (lambda act=act: silu_mul(gate, up, act)), exact

    g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    out, grad = silu_mul(g, u), randn(rows, inter)
    g64, u64 = gate.double().requires_grad_(True), up.double().requires_grad_(True)
    d_gate_exact = torch.autograd.grad(gate_factor_ref(g64, Activation()) * u64, g64, grad.double())[0]
    yield "silu_mul backward (d_gate)", gate.shape, (
        lambda: torch.autograd.grad(out, (g, u), grad, retain_graph=True)[0]), d_gate_exact

    x, residual = randn(rows, hidden), randn(rows, hidden)
    weight = randn(hidden, scale=0.1)
    for offset, label in ((0.0, "llama"), (1.0, "zero-centered")):
        x64 = x.double()
        exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + weight.double())
        yield f"rms_norm[{label}]", x.shape, (lambda offset=offset: rms_norm(x, weight, 1e-6, offset)), exact
    s64 = x.double() + residual.double()
    exact = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weight.double())
    yield "add_rms_norm[zero-centered]", x.shape, (lambda: add_rms_norm(x, residual, weight, 1e-6, 1.0)[0]), exact

    if dtype == torch.bfloat16 and device == "cpu":
        return  # the interpreter's bf16 tl.dot is wrong (triton issue 11584): matrix ops on the GPU only
    w_gate, w_up = randn(inter, hidden, scale=hidden**-0.5), randn(inter, hidden, scale=hidden**-0.5)
    w13, w2 = interleave_gate_up(w_gate, w_up), randn(hidden, inter, scale=inter**-0.5)
    h64 = gate_factor_ref(x.double() @ w_gate.double().T, Activation()) * (x.double() @ w_up.double().T)
    yield "gemm_swiglu", (rows, inter), (lambda: gemm_swiglu(x, w13)), h64
    yield "swiglu_mlp", x.shape, (lambda: swiglu_mlp(x, w13, w2)), h64 @ w2.double().T
    x1 = x[:1]
    yield "swiglu_mlp (decode, 1 row)", x1.shape, (lambda: swiglu_mlp(x1, w13, w2)), h64[:1] @ w2.double().T


def demo(args) -> int:
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    backend = "triton" if on_gpu else ("triton interpreter" if INTERPRET else "reference (set TRITON_INTERPRET=1)")
    dtypes = [torch.bfloat16, torch.float16] if on_gpu else [torch.float32, torch.float16, torch.bfloat16]
    shape = (4096, 4096, 14336) if on_gpu else (37, 256, 688)
    name = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"fuselm demo on {name}: every op on random inputs vs its float64 reference ({backend})\n")
    print(f"| {'op':30s} | {'shape':13s} | {'dtype':8s} | {'rel. error':>10s} | {'ms/call':>9s} |")
    print(f"|{'-' * 32}|{'-' * 15}|{'-' * 10}|{'-' * 12}|{'-' * 11}|")
    worst = 0.0
    for dtype in dtypes:
        for op, op_shape, fn, exact in _demo_cases(device, dtype, *shape):
            err = rel_err(fn(), exact)
            worst = max(worst, err)
            dims = "x".join(map(str, op_shape))
            print(f"| {op:30s} | {dims:13s} | {str(dtype)[6:]:8s} | {err:10.2e} | {_time_ms(fn):9.4f} |", flush=True)
    print(f"\nworst relative error {worst:.2e} (bf16 rounding is ~4e-3 per element)")
    return 0 if worst < 2e-2 else 1


def _kernels_per_call(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _matrix_tflops(bench) -> float:
    """bf16 8192^3 torch.mm rate on random data, TFLOP/s."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / bench(lambda: a @ a) / 1e9


def _cublas_ffn_products(cfg, batch: int) -> torch.cuda.CUDAGraph:
    """One CUDA graph of the token step's FFN matrix products alone, by cuBLAS at the step's shapes
    (per FFN step [B*C, D] @ [D, 2F] and [B*C, F] @ [F, D]; no router, norm, SwiGLU or collapse):
    the time any path built on cuBLAS GEMMs, torch.compile's included, spends in them."""
    rows, D, F = batch * cfg.n_cores, cfg.d_model, cfg.d_ff
    x = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.empty(rows, 2 * F, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(rows, F, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(2 * F, D, device="cuda", dtype=torch.bfloat16) * D**-0.5
    w2 = torch.randn(D, F, device="cuda", dtype=torch.bfloat16) * F**-0.5

    def products():
        for _ in range(cfg.n_events * cfg.k_ffn):
            torch.mm(x, w13.T, out=gate_up)
            torch.mm(h, w2.T, out=x)

    return capture_graph(products)[0]


def swapffn(args) -> int:
    import json

    import triton

    from fuselm.models.swap_ffn import FusedSwapFFN, SwapFFN, SwapFFNConfig, SwapFFNDecoder

    if not torch.cuda.is_available():
        print("fuselm swapffn times the GPU paths; no CUDA device here. The CPU tests cover parity.")
        return 0
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    matrix_tflops = _matrix_tflops(bench)
    cfg = SwapFFNConfig()
    torch.manual_seed(0)
    module = SwapFFN(cfg, device="cuda", dtype=torch.bfloat16).eval()
    print(f"Swap-FFN seed config on {torch.cuda.get_device_name()}, bf16; {cfg.flops_per_token() / 1e9:.1f} GFLOP "
          f"per token; bf16 mm measured {matrix_tflops:.0f} TFLOP/s\n")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "matrix_tflops": matrix_tflops, "flops_per_token": cfg.flops_per_token(), "batches": {}}
    for batch in args.batch:
        floor_ms = batch * cfg.flops_per_token() / matrix_tflops / 1e9
        x = torch.randn(batch, cfg.d_model, device="cuda", dtype=torch.bfloat16)
        state = module.init_state(batch)
        rows = {}
        with torch.no_grad():
            rows["reference, eager"] = bench(lambda: module.reference_step(x, state.ram, state.stream_map))
            if args.compile:
                for mode in ("default", "reduce-overhead"):
                    step = torch.compile(module.reference_step, mode=mode)
                    start = time.perf_counter()
                    for _ in range(3):
                        step(x, state.ram, state.stream_map)
                    torch.cuda.synchronize()
                    print(f"  torch.compile mode={mode}: compiled and warmed in {time.perf_counter() - start:.0f} s")
                    rows[f"reference, torch.compile {mode}"] = bench(lambda: step(x, state.ram, state.stream_map))
            fused = FusedSwapFFN(module, batch)
            ram, stream_map = state.ram.clone(), state.stream_map.clone()
            rows["fused, eager launches"] = bench(lambda: fused.step(x, ram, stream_map))
            decoder = SwapFFNDecoder(module, batch)
            rows["fused, one CUDA graph"] = bench(lambda: decoder.step(x))
            rows["cuBLAS FFN products alone, one CUDA graph"] = bench(_cublas_ffn_products(cfg, batch).replay)
            kernels = _kernels_per_call(lambda: decoder.step(x))
            # parity over a few tokens, state carried
            ref_state, dec = module.init_state(batch), SwapFFNDecoder(module, batch)
            router, agree, errors = [], [], []
            for _ in range(args.parity_tokens):
                tok = torch.randn(batch, cfg.d_model, device="cuda", dtype=torch.bfloat16)
                router.append(module.router_agreement(tok, ref_state.ram, ref_state.stream_map))
                y_ref, ref_state = module(tok, ref_state, impl="reference")
                y_fused = dec.step(tok)
                agree.append((ref_state.stream_map == dec.state.stream_map).float().mean().item())
                errors.append(rel_err(y_fused, y_ref))
        best_compile = min((v for k, v in rows.items() if "compile" in k), default=None)
        graph_ms = rows["fused, one CUDA graph"]
        results["batches"][batch] = {"ms_per_step": rows, "floor_ms": floor_ms, "kernels_per_step": kernels,
                                     "graph_launches_per_step": 1, "router_decision_agreement": router,
                                     "free_running_stream_map_agreement": agree, "rel_err": errors}
        print(f"batch {batch}: compute floor {floor_ms:.3f} ms per step")
        print("| path | ms per step | tokens/s | vs eager reference |\n|---|---|---|---|")
        for name, ms in rows.items():
            print(f"| {name} | {ms:.3f} | {batch * 1e3 / ms:.0f} | {rows['reference, eager'] / ms:.1f}x |")
        print(f"fused graph: {100 * floor_ms / graph_ms:.0f}% of the compute floor"
              + (f", {best_compile / graph_ms:.2f}x the best torch.compile" if best_compile else "")
              + f"; {kernels} kernels in 1 graph launch per step")
        print(f"parity (bf16), per token: router decisions agreeing on the reference's state "
              f"{[f'{a:.4f}' for a in router]}; free-running stream-map agreement {[f'{a:.4f}' for a in agree]}; "
              f"y rel err {[f'{e:.2e}' for e in errors]}\n", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "swap_ffn.json").write_text(json.dumps(results, indent=1))
    return 0


# ============================================================================ Qwen3.5: generate, audit
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return device, dtype


def _model_config(args):
    """(Qwen35Config, name) of --config: 'tiny', '9b' or a config.json path."""
    import json
    from pathlib import Path

    from fuselm.models.qwen35 import Qwen35Config
    from fuselm.models.qwen35_random import config_9b, tiny_config

    if args.config == "tiny":
        return tiny_config(), "tiny (built-in)"
    if args.config.lower() == "9b":
        return config_9b(), "9B (HF Qwen3_5TextConfig() defaults)"
    path = Path(args.config)
    if not path.is_file():
        raise SystemExit(f"--config: {args.config!r} is not 'tiny', '9b' or a config.json file")
    return Qwen35Config.from_hf(json.loads(path.read_text())), str(path)


def _load_qwen35(args, device, dtype):
    """(model, description): --checkpoint weights, or seeded random weights made on the device."""
    from fuselm.models.qwen35 import Qwen35
    from fuselm.models.qwen35_random import random_qwen35

    if args.checkpoint is not None:
        return Qwen35.from_pretrained(args.checkpoint, dtype=dtype, device=device), f"checkpoint {args.checkpoint}"
    config, name = _model_config(args)
    return random_qwen35(config, dtype=dtype, device=device, seed=args.seed), f"{name}, random weights (seed {args.seed})"


def _random_prompts(args, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, vocab_size, (args.batch, args.prompt_len), generator=generator)


def _check_sizes(args) -> None:
    for name in ("prompt_len", "max_new_tokens", "batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")


def _write_outputs(out, name: str, results: dict, markdown: str) -> None:
    import json

    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1, default=str))
    (out / f"{name}.md").write_text(markdown)
    print(f"wrote {out / (name + '.json')} and {out / (name + '.md')}")


def generate(args) -> int:
    from fuselm.engine import Engine, decode_weight_bytes

    _check_sizes(args)
    device, dtype = _device_and_dtype(args)
    started = time.perf_counter()
    model, description = _load_qwen35(args, device, dtype)
    eos = None if args.checkpoint is not None else []  # random weights: no eos, every row runs to the end
    engine = Engine(model, max_batch=args.batch, max_len=args.prompt_len + args.max_new_tokens,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=eos, seed=args.seed)
    prompts = _random_prompts(args, model.config.vocab_size)
    backend = ("CUDA graphs" if engine.use_graphs else "eager") + (
        ", Triton kernels" if device.type == "cuda" else (", Triton interpreter" if INTERPRET else ", PyTorch reference"))
    params = sum(p.numel() for p in model.parameters())
    print(f"fuselm generate: Qwen3.5 {description}; {params / 1e6:.1f}M parameters, {str(dtype)[6:]}, {device} "
          f"({backend}); batch {args.batch}, prompt {args.prompt_len}, {args.max_new_tokens} new tokens; "
          f"sampling {'greedy' if args.temperature == 0 else f'temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}'}; "
          f"built in {time.perf_counter() - started:.1f} s")
    if device.type == "cuda":  # compile the prefill kernels for these shapes before timing
        engine.generate(prompts, min(2, args.max_new_tokens))

    per_line, line_start = 16, [time.perf_counter()]

    def stream(index, ids):
        print(ids[0], end=" ", flush=True)
        if (index + 1) % per_line == 0 or index + 1 == args.max_new_tokens:
            rate = (index + 1) * args.batch / (time.perf_counter() - line_start[0])
            print(f"  [{index + 1}/{args.max_new_tokens}, {rate:.0f} tok/s]", flush=True)

    if args.stream:
        print(f"streaming request 0{' of ' + str(args.batch) if args.batch > 1 else ''} (token ids; no tokenizer for "
              f"random weights):")
        line_start[0] = time.perf_counter()
        result = engine.generate(prompts, args.max_new_tokens, stream=stream)
        if result.decode_steps + 1 < args.max_new_tokens:
            print(f"  [stopped at eos after {result.decode_steps + 1} tokens]")
    if not args.stream or device.type == "cuda":  # the timed run: no per-step host read
        result = engine.generate(prompts, args.max_new_tokens)
    if args.batch > 1 and result.tokens.shape[1] <= 64:
        for row, ids in enumerate(result.tokens.tolist()[:8]):
            print(f"request {row}: {' '.join(map(str, ids[: result.num_generated[row]]))}")

    prefill_tps = args.batch * args.prompt_len / result.prefill_seconds
    decode_tps = args.batch * result.decode_steps / result.decode_seconds if result.decode_steps else float("nan")
    step_ms = 1e3 * result.decode_seconds / result.decode_steps if result.decode_steps else float("nan")
    weight_bytes = decode_weight_bytes(model)
    results = {"model": description, "parameters": params, "dtype": str(dtype)[6:], "device": str(device),
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
               "backend": backend, "batch": args.batch, "prompt_len": args.prompt_len,
               "max_new_tokens": args.max_new_tokens, "graph_batch_size": result.batch_size,
               "prefill_seconds": result.prefill_seconds, "prefill_tokens_per_s": prefill_tps,
               "decode_steps": result.decode_steps, "decode_seconds": result.decode_seconds,
               "decode_tokens_per_s": decode_tps, "decode_ms_per_step": step_ms, "weight_bytes_per_step": weight_bytes,
               "tokens": result.tokens.tolist()}
    lines = [f"## fuselm generate: {description}", "",
             f"{results['gpu'] or 'CPU'}, {results['dtype']}, {backend}; batch {args.batch}, prompt {args.prompt_len}, "
             f"{args.max_new_tokens} new tokens", "",
             "| measure | value |", "|---|---|",
             f"| prefill | {args.batch * args.prompt_len} tokens in {1e3 * result.prefill_seconds:.1f} ms: "
             f"{prefill_tps:,.0f} tok/s |",
             f"| decode | {result.decode_steps} steps x {args.batch} rows in {1e3 * result.decode_seconds:.1f} ms: "
             f"{decode_tps:,.1f} tok/s ({step_ms:.3f} ms/step) |"]
    if device.type == "cuda":
        bandwidth = copy_bandwidth(device) * 1e12  # bytes/s
        floor_ms = weight_bytes / bandwidth * 1e3
        results.update(copy_bandwidth_bytes_per_s=bandwidth, weight_floor_ms_per_step=floor_ms,
                       weight_floor_tokens_per_s=args.batch * 1e3 / floor_ms,
                       percent_of_weight_floor=100 * floor_ms / step_ms)
        lines.append(f"| weight-bandwidth floor | {weight_bytes / 1e9:.2f} GB of weights per step / "
                     f"{bandwidth / 1e12:.2f} TB/s copy = {floor_ms:.3f} ms/step = "
                     f"{args.batch * 1e3 / floor_ms:,.1f} tok/s; decode at **{100 * floor_ms / step_ms:.1f}%** |")
    else:
        lines.append(f"| weight-bandwidth floor | n/a on the CPU ({weight_bytes / 1e6:.2f} MB of weights per step; the "
                     "interpreter's speed says nothing about the kernels) |")
    markdown = "\n".join(lines) + "\n"
    print("\n" + markdown)
    _write_outputs(args.out, "generate", results, markdown)
    return 0


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    import torch.nn.functional as F

    return {"max_abs": (a - b).abs().max().item(), "cosine": F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()}


@torch.no_grad()
def _teacher_forced_logits(model, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits [B, n, vocab] when fed HF's tokens [B, n]: prefill, then one decode
    step per token (the kernels the engine's graphs hold, run eagerly)."""
    cache = model.new_cache(prompts.shape[0], prompts.shape[1] + tokens.shape[1])
    logits = [model.prefill(prompts, cache)]
    for position in range(tokens.shape[1] - 1):
        logits.append(model.decode_step(tokens[:, position].to(prompts.device), cache))
    return torch.stack(logits, dim=1)


def _parity(hf_model, engine, prompts: torch.Tensor, new_tokens: int, eos_ids) -> dict:
    """Greedy generation by HF and by the engine from the same prompts. Teacher-forced: the
    model fed HF's tokens, logits compared at every position (max abs difference and cosine over
    all rows): after prefill and after each decode step. Free-running: the engine's own greedy
    tokens; greedy agreement = tokens equal up to each row's first divergence, and the logits at
    the positions whose preceding tokens agree in every row."""
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  pad_token_id=0)
    if eos_ids:
        kwargs["min_new_tokens"] = new_tokens  # the engine runs with no eos: both run all positions
    with torch.no_grad():
        reference = hf_model.generate(prompts, **kwargs)
    ref_tokens = reference.sequences[:, prompts.shape[1]:].cpu()
    ref_logits = torch.stack(reference.logits, dim=1).float()
    ours = engine.generate(prompts, new_tokens, return_logits=True)
    logits = ours.logits.float().to(ref_logits.device)
    same = (ours.tokens == ref_tokens)
    first_divergence = [int(row.logical_not().nonzero()[0]) if not bool(row.all()) else new_tokens for row in same]
    comparable = min(first_divergence) + 1  # position p compares when tokens 0 .. p-1 agree in all rows
    comparable = min(comparable, new_tokens)
    per_position = [_compare(logits[:, p], ref_logits[:, p]) for p in range(comparable)]
    forced = _teacher_forced_logits(engine.model, prompts, ref_tokens).float().to(ref_logits.device)
    forced_per_position = [_compare(forced[:, p], ref_logits[:, p]) for p in range(new_tokens)]
    return {"positions": new_tokens, "comparable_positions": comparable, "per_position": per_position,
            "teacher_forced": forced_per_position,
            "teacher_forced_worst_cosine": min(p["cosine"] for p in forced_per_position),
            "teacher_forced_worst_max_abs": max(p["max_abs"] for p in forced_per_position),
            "prefill": per_position[0], "last_compared": per_position[-1],
            "worst_max_abs": max(p["max_abs"] for p in per_position),
            "worst_cosine": min(p["cosine"] for p in per_position),
            "greedy_agreement": sum(first_divergence) / (new_tokens * len(first_divergence)),
            "first_divergence_per_row": first_divergence, "tokens": ours.tokens.tolist(), "hf_tokens": ref_tokens.tolist(),
            "logit_scale": ref_logits[:, 0].abs().max().item()}


def audit(args) -> int:
    """HF parity on the same weights, then (CUDA) what one decode step launches and syncs."""
    from fuselm.engine import Engine
    from fuselm.models.qwen35 import Qwen35
    from fuselm.models.qwen35_random import random_hf_qwen35

    try:
        import transformers
        from transformers import Qwen3_5ForCausalLM
    except ImportError:
        raise SystemExit("fuselm audit compares against Hugging Face transformers: pip install transformers") from None
    _check_sizes(args)
    if args.checkpoint is not None and args.weights != "spread":
        raise SystemExit("--weights: chooses random weights; it does not apply with --checkpoint")
    device, dtype = _device_and_dtype(args)
    if args.checkpoint is not None:
        hf_model = Qwen3_5ForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).to(device).eval()
        description = f"checkpoint {args.checkpoint}"
    else:
        config, name = _model_config(args)
        hf_model = random_hf_qwen35(config, dtype=dtype, device=device, seed=args.seed, weights=args.weights)
        description = f"{name}, random weights ({args.weights}, seed {args.seed})"
    model = Qwen35.from_hf(hf_model)  # the same weights, re-laid
    on_gpu = device.type == "cuda"
    gpu = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"fuselm audit: Qwen3.5 {description}, {str(dtype)[6:]} on {gpu}; transformers {transformers.__version__}; "
          f"batch {args.batch}, prompt {args.prompt_len}, {args.max_new_tokens} greedy tokens", flush=True)
    engine = Engine(model, max_batch=args.batch, max_len=args.prompt_len + args.max_new_tokens, eos_token_id=[])
    prompts = _random_prompts(args, model.config.vocab_size).to(device)
    parity = _parity(hf_model, engine, prompts, args.max_new_tokens, model.config.eos_token_id)
    del hf_model
    # fp32 holds HF to summation order (issue 6: 1e-3 absolute on the CPU; a GPU adds Triton's
    # approximate exp/rsqrt and other reduction orders on both sides: 1e-2); half precision by the
    # cosine of the teacher-forced logits (issue 6: >= 0.999 after prefill and after 64 steps)
    if dtype == torch.float32:
        limit = 1e-3 if device.type == "cpu" else 1e-2
        parity_ok = max(parity["worst_max_abs"], parity["teacher_forced_worst_max_abs"]) <= limit \
            and parity["greedy_agreement"] == 1.0
        bar = f"max abs logit diff <= {limit:g} and every greedy token equal (fp32)"
    else:
        parity_ok = parity["teacher_forced_worst_cosine"] >= 0.999
        bar = "teacher-forced logit cosine >= 0.999 after prefill and after every decode step (half precision)"
    results = {"model": description, "dtype": str(dtype)[6:], "device": gpu, "transformers": transformers.__version__,
               "torch": torch.__version__, "batch": args.batch, "prompt_len": args.prompt_len, "parity": parity,
               "parity_bar": bar, "parity_ok": parity_ok, "launches": {}}
    lines = [f"## fuselm audit: Qwen3.5 {description}", "",
             f"{gpu}, {str(dtype)[6:]}, transformers {transformers.__version__}, torch {torch.__version__}; batch "
             f"{args.batch}, prompt {args.prompt_len}", "",
             "### Parity with Hugging Face transformers (same weights, greedy; engine path)", "",
             "| measure | value |", "|---|---|",
             f"| logits after prefill: max abs diff / cosine | {parity['prefill']['max_abs']:.2e} / "
             f"{parity['prefill']['cosine']:.6f} (logits up to {parity['logit_scale']:.1f}) |",
             f"| logits after {parity['comparable_positions'] - 1} decode steps: max abs diff / cosine | "
             f"{parity['last_compared']['max_abs']:.2e} / {parity['last_compared']['cosine']:.6f} |",
             f"| worst over the compared positions | {parity['worst_max_abs']:.2e} / {parity['worst_cosine']:.6f} |",
             f"| teacher-forced (fed HF's tokens): after prefill / after {args.max_new_tokens - 1} decode steps / "
             f"worst cosine | {parity['teacher_forced'][0]['cosine']:.6f} / {parity['teacher_forced'][-1]['cosine']:.6f} "
             f"/ {parity['teacher_forced_worst_cosine']:.6f} (worst max abs {parity['teacher_forced_worst_max_abs']:.2e}) |",
             f"| greedy agreement over {args.max_new_tokens} tokens x {args.batch} rows | "
             f"{100 * parity['greedy_agreement']:.1f}% (first divergence per row: {parity['first_divergence_per_row']}) |",
             f"| bar: {bar} | {'pass' if parity_ok else 'FAIL'} |", ""]
    launches_ok = True
    lines += ["### One decode step", ""]
    if on_gpu:
        lines += ["| requests (graph batch) | kernels | device copies | graph launches | kernel launches outside graphs "
                  "| host syncs | sync debug mode 'error' |", "|---|---|---|---|---|---|---|"]
        for requests in sorted({1, args.batch}):
            counts = engine.launch_audit(requests, steps=min(4, args.max_new_tokens))
            results["launches"][requests] = counts
            launches_ok &= (counts["graph_launches"] == 1 and counts["kernel_launches_outside_graphs"] == 0
                            and counts["host_syncs"] == 0 and counts["sync_debug_error"] is None)
            lines.append(f"| {requests} ({counts['batch_size']}) | {counts['kernels']:g} | {counts['copies']:g} | "
                         f"{counts['graph_launches']:g} | {counts['kernel_launches_outside_graphs']:g} | "
                         f"{counts['host_syncs']:g} | {counts['sync_debug_error'] or 'no error'} |")
        lines += ["", f"Counted by torch.profiler (CUDA activity: every kernel inside the graph replay) over "
                      f"{min(4, args.max_new_tokens)} steps, per step."]
    else:
        lines.append("n/a on the CPU: the step runs eagerly in the Triton interpreter (no CUDA graph, no device "
                     "kernels to count); run `fuselm audit` on a GPU for kernels, graph launches and host syncs.")
    results["launches_ok"] = launches_ok
    markdown = "\n".join(lines) + "\n"
    print("\n" + markdown)
    _write_outputs(args.out, "audit" if args.weights == "spread" else f"audit_{args.weights.replace('-', '_')}",
                   results, markdown)
    return 0 if parity_ok and launches_ok else 1


def main(argv=None) -> int:
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="fuselm", description="fused Triton kernels for gated-MLP LMs")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="every op vs its reference: error and time table").set_defaults(run=demo)
    swap = commands.add_parser("swapffn", help="Swap-FFN seed config: tokens/s, kernels per token, parity")
    swap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    swap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                      help="also time torch.compile of the reference (slow to compile)")
    swap.add_argument("--parity-tokens", type=int, default=4)
    swap.add_argument("--out", type=Path, default=None, help="write swap_ffn.json here")
    swap.set_defaults(run=swapffn)

    def model_arguments(command, prompt_len, new_tokens, batch):
        command.add_argument("--config", default="tiny",
                             help="'tiny' (built-in, default), '9b' (HF Qwen3_5TextConfig() defaults) or a config.json "
                                  "path; random weights from --seed")
        command.add_argument("--checkpoint", type=Path, default=None,
                             help="a local HF checkpoint directory (config.json + safetensors) instead of random weights")
        command.add_argument("--prompt-len", type=int, default=prompt_len, help="random prompt tokens per request")
        command.add_argument("--max-new-tokens", type=int, default=new_tokens)
        command.add_argument("--batch", type=int, default=batch, help="requests in the batch")
        command.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling")
        command.add_argument("--device", default=None, help="default: cuda when available, else cpu")
        command.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                             help="default: bfloat16 on a GPU, float32 on the CPU (the interpreter's bf16 dot is wrong)")
        command.add_argument("--out", type=Path, default=None, help="write json + md here")

    gen = commands.add_parser("generate", help="Qwen3.5 generation: streamed ids, prefill/decode tok/s, weight floor")
    model_arguments(gen, 32, 16, 1)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--no-stream", dest="stream", action="store_false", help="do not print ids as they come")
    gen.set_defaults(run=generate)
    from fuselm.models.qwen35_random import WEIGHT_SCHEMES

    aud = commands.add_parser("audit", help="Qwen3.5 engine: kernels/graph launches/host syncs per step, HF parity")
    model_arguments(aud, 16, 8, 2)
    aud.add_argument("--weights", default="spread", choices=WEIGHT_SCHEMES,
                     help="random weights: 'spread' (every weight away from its init: fuselm.models.qwen35_random) "
                          "or HF's own initialisation; writes audit.json / audit_hf_init.json")
    aud.set_defaults(run=audit)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
