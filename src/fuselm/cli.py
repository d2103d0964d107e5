"""The ``fuselm`` command: argument parsing and dispatch (every import is lazy).

    fuselm generate MODEL_DIR --prompt TEXT [--chat] ...  stream text from a checkpoint directory
    fuselm generate [--config PRESET|config.json] ...     random-weight throughput (fuselm.bench.generate)
    fuselm chat MODEL_DIR ...                               interactive chat, one line per user turn
    fuselm init-checkpoint DIR --config PRESET ...         a random-weight checkpoint with the real tokenizer
    fuselm serve MODEL_DIR | --config PRESET ...           an OpenAI-compatible HTTP server (fuselm.serve)
    fuselm bench-serve [URL] ...                            load generator for such a server (fuselm.bench.serve)
    fuselm audit ...                                        decode-step launches, parity with HF (fuselm.engine.audit)
    fuselm demo                                             every op vs its reference (fuselm.bench.ops_demo)
    fuselm swapffn ...                                      Swap-FFN paths on a GPU (fuselm.bench.swap_ffn)

PRESET: tiny, 9b, tiny-moe or 35b-a3b (``fuselm.models.qwen35.presets``), random weights.

The text commands (``generate MODEL_DIR``, ``chat``) are thin over ``fuselm.engine.llm.LLM``:
sampling defaults are the checkpoint's generation_config (``LLM.get_default_sampling_params``),
each sampling flag overriding its field; text goes to stdout as it comes, and a one-line summary
per reply (tokens, time to first token, decode tok/s, finish reason) to stderr.

Errors: a bad command line is argparse's usage message and exit status 2; a ValueError,
FileNotFoundError or ImportError from a command is one line ``error: <message>`` on stderr and
exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
PRESETS = ("tiny", "9b", "tiny-moe", "35b-a3b", "0.8b")  # fuselm.models.qwen35.presets.PRESETS (no import here: lazy)
TEXT_MAX_TOKENS, TEXT_MAX_LEN = 256, 4096
# Tokens per engine step when serving (decode rows + a prompt chunk): what bounds the stall of
# running decodes. H100, 9B, 32 clients, 512-token prompts: 288 takes a prompt in two mixed steps
# of 256 tokens beside the 32-row decode graph (GEMMs of 288 rows: 2.79 + 2.92 ms over two decode
# steps, against 3.65 + 2.36 for 320's 288 + 224, whose 320 rows take cuBLAS's slower picks;
# benchmarks/NOTES.md 87); three steps (256) or one (544) cost more; 2048 gave ITL p99 14x the
# median (whole prompts in one step; NOTES 65).
SERVE_MAX_PREFILL_TOKENS = 288
# fuselm.serve.reply_parser.REASONING_PARSERS and TOOL_CALL_PARSERS (no import here: lazy)
REASONING_PARSERS, TOOL_CALL_PARSERS = ("qwen3",), ("qwen3_coder",)
# fuselm.serve.async_engine.ADMISSION_WAIT_S and MAX_ADMISSION_WAIT_S, in ms (no import here: lazy)
SERVE_ADMISSION_WAIT_MS, SERVE_MAX_ADMISSION_WAIT_MS = 3.0, 50.0
BENCH_PROMPT_LEN, BENCH_MAX_NEW_TOKENS, BENCH_BATCH = 32, 16, 1


# ============================================================================ argument values
def _model_config(value: str):
    """``--config`` of the random-weight commands: a preset name ('tiny', '9b', 'tiny-moe',
    '35b-a3b') or a config.json path -> (Qwen35Config, description). argparse reports a bad value
    as a usage error."""
    import json

    from fuselm.models.qwen35 import Qwen35Config
    from fuselm.models.qwen35.presets import preset_config

    described = {"tiny": "tiny (built-in)", "9b": "9B (HF Qwen3_5TextConfig() defaults)",
                 "tiny-moe": "tiny MoE (built-in)", "35b-a3b": "35B-A3B (HF Qwen3_5MoeTextConfig() defaults)"}
    if value.lower() in PRESETS:
        return preset_config(value.lower()), described[value.lower()]
    path = Path(value)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(PRESETS)} or a config.json file, got {value!r}")
    try:
        return Qwen35Config.from_hf(json.loads(path.read_text())), str(path)
    except (ValueError, TypeError, KeyError) as error:
        raise argparse.ArgumentTypeError(f"{path}: not a Qwen3.5 config ({error})") from None


def _device_and_dtype(args):
    """(device, dtype) of the random-weight commands: cuda when available, else cpu; bfloat16 on
    a GPU, float32 on the CPU (the Triton interpreter's bf16 dot is wrong, triton issue 11584)."""
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    return device, dtype


# ============================================================================ text: generate, chat
def _load_llm(args):
    """``LLM`` of ``args.model_dir`` for one request at a time; dtype: --dtype, else the
    checkpoint's on a GPU and float32 on the CPU."""
    import torch

    from fuselm.engine.llm import LLM

    directory = Path(args.model_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such checkpoint directory")
    on_cpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
    dtype = args.dtype or ("float32" if on_cpu else None)
    return LLM(directory, dtype=dtype, device=args.device, max_batch=1, max_len=args.max_len, seed=args.seed,
               state_dtype=args.state_dtype)


def _sampling_params(llm, args):
    """The checkpoint's default SamplingParams with --max-tokens and every sampling flag given."""
    import dataclasses

    flags = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
             "stop": args.stop, **_penalty_flags(args)}
    overrides = {field: value for field, value in flags.items() if value is not None}
    return dataclasses.replace(llm.get_default_sampling_params(), max_tokens=args.max_tokens, **overrides)


def _penalty_flags(args) -> dict:
    """The min-p and penalty flags given (SamplingParams' fields of the same names)."""
    names = ("min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _chat_template_kwargs(args) -> dict:
    return {"enable_thinking": False} if args.no_thinking else {}


def _generate_text(args) -> int:
    from fuselm.console import ChatSession, stream_reply

    llm = _load_llm(args)
    params = _sampling_params(llm, args)
    if args.chat:
        prompt = ChatSession(llm, params, args.system, _chat_template_kwargs(args)).prompt(args.prompt)
    else:
        prompt = args.prompt
    stream_reply(llm, prompt, params)
    return 0


def _chat(args) -> int:
    from fuselm.console import ChatSession, run_chat

    llm = _load_llm(args)
    session = ChatSession(llm, _sampling_params(llm, args), args.system, _chat_template_kwargs(args))
    return run_chat(session, sys.stdin, str(args.model_dir))


# ============================================================================ serve
def _json_list(text: str) -> list:
    """A flag's JSON list (vLLM's form: '["https://a.example"]')."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"expected a JSON list, got {text!r}")
    return value


def _serve(args) -> int:
    """``fuselm serve``: MODEL_DIR (text and chat) or --config (random weights, token-id
    prompts only) behind ``fuselm.serve.run_server`` until SIGINT / SIGTERM (exit status 0)."""
    from fuselm.serve.app import check_api_keys, run_server, serve_spec

    if (args.model_dir is None) == (args.config is None):
        args.command_parser.error("expected exactly one of MODEL_DIR (a checkpoint) and --config tiny|9b (random "
                                  "weights)")
    if not 0 <= args.port <= 65535:
        args.command_parser.error(f"--port: expected 0..65535, got {args.port}")
    if args.max_queue is not None and args.max_queue < 0:
        args.command_parser.error(f"--max-queue: expected >= 0, got {args.max_queue}")
    if not args.stall_dump_ms > 0:
        args.command_parser.error(f"--stall-dump-ms: expected > 0, got {args.stall_dump_ms:g}")
    if args.stall_dump_wait_ms is not None and not args.stall_dump_wait_ms > 0:
        args.command_parser.error(f"--stall-dump-wait-ms: expected > 0, got {args.stall_dump_wait_ms:g}")
    if not 0 <= args.admission_wait_ms <= SERVE_MAX_ADMISSION_WAIT_MS:
        args.command_parser.error(f"--admission-wait-ms: expected 0..{SERVE_MAX_ADMISSION_WAIT_MS:g}, got "
                                  f"{args.admission_wait_ms:g}")
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        args.command_parser.error("--enable-auto-tool-choice and --tool-call-parser go together (vLLM's flags): "
                                  "tool_choice \"auto\" parses the reply's calls with the named parser")
    if args.model_dir is None and (args.reasoning_parser or args.tool_call_parser):
        args.command_parser.error("--reasoning-parser and --tool-call-parser parse chat replies, which need a "
                                  "checkpoint's tokenizer (MODEL_DIR); --config serves token-id prompts only")
    api_keys = args.api_key or ([os.environ["FUSELM_API_KEY"]] if os.environ.get("FUSELM_API_KEY") else [])
    try:
        check_api_keys(api_keys)
    except ValueError:
        args.command_parser.error("--api-key: expected non-empty keys")
    from fuselm.serve.cors import CorsPolicy

    try:
        cors = CorsPolicy(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)
    except ValueError as error:
        args.command_parser.error(f"--allowed-origins / --allowed-methods / --allowed-headers: {error}")
    options = dict(max_batch=args.max_batch, max_len=args.max_len, seed=args.seed, name=args.served_model_name,
                   max_prefill_tokens=args.max_prefill_tokens, kv_cache_tokens=args.kv_cache_tokens,
                   state_dtype=args.state_dtype)
    if args.model_dir is not None:
        import torch

        directory = Path(args.model_dir)
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory}: no such checkpoint directory")
        on_cpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
        options.update(dtype=args.dtype or ("float32" if on_cpu else None), device=args.device)
    else:
        device, dtype = _device_and_dtype(args)
        options.update(dtype=dtype, device=device)
    spec = serve_spec(None if args.model_dir is None else str(args.model_dir), args.config,
                      max_queue=args.max_queue, admission_wait=args.admission_wait_ms / 1e3, step_log=args.step_log,
                      stall_dump=args.stall_dump, stall_dump_s=args.stall_dump_ms / 1e3,
                      stall_dump_wait_s=args.stall_dump_wait_ms and args.stall_dump_wait_ms / 1e3, **options)
    try:
        run_server(spec, args.host, args.port, args.reasoning_parser, args.tool_call_parser, api_keys, cors)
    except OSError as error:  # the address cannot be listened on
        raise ValueError(f"--host/--port: {error}") from None
    return 0


# ============================================================================ random weights
def _generate_benchmark(args) -> int:
    from fuselm.bench import write_results
    from fuselm.bench.generate import run_generate_benchmark

    config, description = args.config
    device, dtype = _device_and_dtype(args)
    results, markdown = run_generate_benchmark(config, description, batch=args.batch, prompt_len=args.prompt_len,
                                               max_new_tokens=args.max_new_tokens, seed=args.seed, device=device,
                                               dtype=dtype, temperature=args.temperature or 0.0,
                                               top_p=1.0 if args.top_p is None else args.top_p, top_k=args.top_k or 0,
                                               state_dtype=args.state_dtype, logprobs=args.logprobs,
                                               **_penalty_flags(args))
    print("\n" + markdown)
    write_results(args.out, "generate", results, markdown)
    return 0


def _generate(args) -> int:
    return _generate_text(args) if args.model_dir is not None else _generate_benchmark(args)


def _init_checkpoint(args) -> int:
    from fuselm.console import init_checkpoint

    dtype = args.dtype or ("float32" if args.config.startswith("tiny") else "bfloat16")
    init_checkpoint(args.directory, args.config, dtype, args.device, args.seed, args.max_shard_size)
    return 0


def _audit(args) -> int:
    from fuselm.bench import write_results
    from fuselm.engine.audit import run_audit

    device, dtype = _device_and_dtype(args)
    if args.checkpoint is not None:
        config, description = None, f"checkpoint {args.checkpoint}"
    else:
        config, name = args.config or _model_config("tiny")
        description = f"{name}, random weights ({args.weights}, seed {args.seed})"
    results, markdown, ok = run_audit(config=config, checkpoint=args.checkpoint, description=description,
                                      weights=args.weights, batch=args.batch, prompt_len=args.prompt_len,
                                      max_new_tokens=args.max_new_tokens, seed=args.seed, device=device, dtype=dtype)
    print("\n" + markdown)
    write_results(args.out, "audit" if args.weights == "spread" else f"audit_{args.weights.replace('-', '_')}",
                  results, markdown)
    return 0 if ok else 1


def _demo(args) -> int:
    from fuselm.bench.ops_demo import run_ops_demo

    return run_ops_demo()


def _swapffn(args) -> int:
    from fuselm.bench.swap_ffn import run_swap_ffn

    return run_swap_ffn(args.batch, time_compile=args.compile, parity_tokens=args.parity_tokens, out=args.out)


def _bench_serve(args) -> int:
    from fuselm.bench.serve import DEFAULT_BASE_URL, run_bench_serve

    if args.url and args.base_url and args.url.rstrip("/") != args.base_url.rstrip("/"):
        raise ValueError(f"URL {args.url} and --base-url {args.base_url} differ: give one")
    results = run_bench_serve(
        args.url or args.base_url or DEFAULT_BASE_URL, backend=args.backend, endpoint=args.endpoint,
        model=args.model, tokenizer=args.tokenizer, dataset_name=args.dataset_name, dataset_path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len, num_prompts=args.num_prompts,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, random_vocab_size=args.random_vocab_size, seed=args.seed,
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        warmup_requests=args.warmup_requests, request_timeout=args.request_timeout, goodput=args.goodput,
        percentiles=args.percentiles, out=args.out, label=args.label, progress=not args.disable_tqdm)
    return 0 if results["completed"] else 1


# ============================================================================ the parser
def _add_sampling_arguments(command, max_tokens, max_len) -> None:
    """The text commands' sampling, stop and model-loading flags (sampling defaults: the
    checkpoint's generation_config)."""
    command.add_argument("--max-tokens", type=int, default=max_tokens, help=f"new tokens at most ({TEXT_MAX_TOKENS})")
    command.add_argument("--temperature", type=float, default=None,
                         help="0: greedy (default: the checkpoint's; --config: 0)")
    command.add_argument("--top-p", type=float, default=None, help="default: the checkpoint's (--config: 1, off)")
    command.add_argument("--top-k", type=int, default=None, help="0: off (default: the checkpoint's; --config: 0)")
    command.add_argument("--min-p", type=float, default=None, help="in [0, 1], 0: off (default: the checkpoint's)")
    command.add_argument("--repetition-penalty", type=float, default=None,
                         help="> 0, 1: off (default: the checkpoint's): over the prompt's and the reply's tokens")
    command.add_argument("--frequency-penalty", type=float, default=None,
                         help="in [-2, 2] (0): subtracted from a token's logit per time it was generated")
    command.add_argument("--presence-penalty", type=float, default=None,
                         help="in [-2, 2] (0): subtracted once a token was generated")
    command.add_argument("--stop", nargs="+", default=None, metavar="STR", help="strings that end the reply")
    command.add_argument("--max-len", type=int, default=max_len,
                         help=f"prompt + reply tokens the cache holds ({TEXT_MAX_LEN})")


def _add_chat_arguments(command) -> None:
    command.add_argument("--system", default=None, help="a system prompt")
    command.add_argument("--no-thinking", action="store_true",
                         help="render the chat template with enable_thinking=False")


def _add_model_arguments(command, seed_help: str) -> None:
    command.add_argument("--seed", type=int, default=None, help=seed_help)
    command.add_argument("--dtype", default=None, choices=DTYPES)
    command.add_argument("--device", default=None, help="default: cuda when available, else cpu")


def _add_state_dtype_argument(command) -> None:
    command.add_argument("--state-dtype", default="float32", choices=DTYPES,
                         help="the Gated DeltaNet recurrent states' dtype in the cache: float32 (HF's numerics) or "
                              "16 bits (vLLM's default, its --mamba-ssm-cache-dtype auto: half the state bytes a "
                              "decode step moves; computed in fp32, each step's state rounded once) (float32)")


def _add_random_model_arguments(command, prompt_len: int, new_tokens: int, batch: int, fill_defaults: bool) -> None:
    """The random-weight runs' sizes and output; ``fill_defaults`` False leaves them None when not
    given (generate fills them once it knows its mode)."""
    command.add_argument("--prompt-len", type=int, default=prompt_len if fill_defaults else None,
                         help=f"random prompt tokens per request ({prompt_len})")
    command.add_argument("--max-new-tokens", type=int, default=new_tokens if fill_defaults else None,
                         help=f"({new_tokens})")
    command.add_argument("--batch", type=int, default=batch if fill_defaults else None,
                         help=f"requests in the batch ({batch})")
    command.add_argument("--out", type=Path, default=None, help="write json + md here")


# generate's options by mode: with MODEL_DIR (text) or without it (the random-weight benchmark).
_TEXT_OPTIONS = ("prompt", "chat", "system", "no_thinking", "max_tokens", "stop", "max_len")
_BENCH_OPTIONS = ("prompt_len", "max_new_tokens", "batch", "out", "logprobs")


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _resolve_generate_mode(command: argparse.ArgumentParser, args) -> None:
    """Check that ``generate``'s options fit its mode (usage error otherwise) and fill that mode's
    defaults."""
    given = lambda names: [_option(name) for name in names if getattr(args, name) not in (None, False)]  # noqa: E731
    if args.model_dir is not None:
        if args.config is not None:
            command.error("MODEL_DIR and --config are exclusive: text from a checkpoint, or the random-weight "
                          "benchmark of a config")
        if given(_BENCH_OPTIONS):
            command.error(f"{', '.join(given(_BENCH_OPTIONS))}: random-weight benchmark options (--config), not for "
                          f"MODEL_DIR")
        if args.prompt is None:
            command.error("--prompt is required with MODEL_DIR")
        if (args.system is not None or args.no_thinking) and not args.chat:
            command.error("--system and --no-thinking apply to the chat template: add --chat")
        args.max_tokens = TEXT_MAX_TOKENS if args.max_tokens is None else args.max_tokens
        args.max_len = TEXT_MAX_LEN if args.max_len is None else args.max_len
        return
    if given(_TEXT_OPTIONS):
        command.error(f"{', '.join(given(_TEXT_OPTIONS))}: text options, they need MODEL_DIR")
    args.config = args.config or _model_config("tiny")
    args.seed = 0 if args.seed is None else args.seed
    for name, default in (("prompt_len", BENCH_PROMPT_LEN), ("max_new_tokens", BENCH_MAX_NEW_TOKENS),
                          ("batch", BENCH_BATCH)):
        if getattr(args, name) is None:
            setattr(args, name, default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fuselm", description="fused Triton kernels and an inference engine for "
                                                                "Qwen3.5")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser(
        "generate", help="text from a checkpoint (MODEL_DIR), or the random-weight throughput benchmark (--config)",
        description="With MODEL_DIR: stream the reply to --prompt (with --chat: as one chat turn). Without it: "
                    "the random-weight benchmark of --config (default tiny): prefill and decode tok/s, share of "
                    "the weight-bandwidth floor on a GPU.")
    gen.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR", help="a checkpoint directory")
    gen.add_argument("--prompt", default=None, help="the prompt text (MODEL_DIR)")
    gen.add_argument("--chat", action="store_true", help="render --prompt as a user turn by the chat template")
    _add_chat_arguments(gen)
    _add_sampling_arguments(gen, max_tokens=None, max_len=None)
    gen.add_argument("--config", type=_model_config, default=None,
                     help="random weights of 'tiny' (built-in), '9b' (HF Qwen3_5TextConfig() defaults) or a "
                          "config.json path (the default without MODEL_DIR: tiny)")
    _add_random_model_arguments(gen, BENCH_PROMPT_LEN, BENCH_MAX_NEW_TOKENS, BENCH_BATCH, fill_defaults=False)
    _add_model_arguments(gen, "sampling seed (MODEL_DIR); weights and prompts (--config, default 0)")
    _add_state_dtype_argument(gen)
    gen.add_argument("--logprobs", type=int, default=None, metavar="K",
                     help="(--config) every request asks for its tokens' log-probabilities and the K most likely "
                          "tokens' (SamplingParams.logprobs): what they cost a step")
    gen.set_defaults(run=_generate, command_parser=gen)

    chat = commands.add_parser("chat", help="interactive chat with a checkpoint (user lines from stdin)",
                               description="One user turn per stdin line; each reply is streamed and kept in the "
                                           "conversation. /reset clears it, /exit or end of input ends the chat.")
    chat.add_argument("model_dir", metavar="MODEL_DIR", help="a checkpoint directory")
    _add_chat_arguments(chat)
    _add_sampling_arguments(chat, max_tokens=TEXT_MAX_TOKENS, max_len=TEXT_MAX_LEN)
    _add_model_arguments(chat, "sampling seed")
    _add_state_dtype_argument(chat)
    chat.set_defaults(run=_chat)

    init = commands.add_parser("init-checkpoint", help="write a random-weight Qwen3.5 checkpoint with the tokenizer",
                               description="A checkpoint directory in the released Qwen3.5 layout (config.json, "
                                           "sharded safetensors + index, generation_config.json, tokenizer files) "
                                           "with seeded random weights: its text is gibberish.")
    init.add_argument("directory", metavar="DIR", help="created if missing")
    init.add_argument("--config", required=True, choices=PRESETS,
                      help="a built-in config (the tiny ones with the tokenizer's vocab_size, 248320)")
    init.add_argument("--dtype", default=None, choices=DTYPES,
                      help="default: float32 for the tiny configs (CPU and test models), else bfloat16")
    init.add_argument("--device", default=None, help="where the weights are drawn (default: cuda when available)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--max-shard-size", default="4GB", help="e.g. 4GB, 500MB")
    init.set_defaults(run=_init_checkpoint)

    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models)",
        description="Serve a checkpoint (MODEL_DIR) or random weights (--config: no tokenizer, so only token-id "
                    "prompts on /v1/completions) over HTTP in OpenAI's API until SIGINT or SIGTERM. Requests "
                    "beyond --max-batch wait in the engine's queue.")
    serve.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR", help="a checkpoint directory")
    serve.add_argument("--config", default=None, choices=PRESETS,
                       help="random weights of a built-in config instead of MODEL_DIR (weights from --seed)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch", "--max-num-seqs", type=int, default=8,
                       help="requests decoded together (8; --max-num-seqs: vLLM's name)")
    serve.add_argument("--max-len", "--max-model-len", type=int, default=TEXT_MAX_LEN,
                       help=f"prompt + completion tokens per request ({TEXT_MAX_LEN}; --max-model-len: vLLM's name)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name of requests and answers (default: MODEL_DIR's name, or the --config)")
    serve.add_argument("--kv-cache-tokens", type=int, default=None,
                       help="attention K/V positions the cache holds, shared by the requests in pages "
                            "(default: max-batch x max-len)")
    serve.add_argument("--max-prefill-tokens", type=int, default=SERVE_MAX_PREFILL_TOKENS,
                       help=f"tokens per engine step, the running requests' decode rows included (vLLM's "
                            f"max_num_batched_tokens): prompt chunks fill the rest, in one pass with the decode step; "
                            f"longer prompts go in chunks over several steps ({SERVE_MAX_PREFILL_TOKENS})")
    serve.add_argument("--max-queue", type=int, default=None,
                       help="requests that may wait for a slot; more get a 503 (default: no limit)")
    serve.add_argument("--admission-wait-ms", type=float, default=SERVE_ADMISSION_WAIT_MS,
                       help="after a step that finished a request, while none waits, how long the engine waits for "
                            "the next one before it plans the next step, so that a client's follow-up request is "
                            f"admitted a step sooner (0: never; default {SERVE_ADMISSION_WAIT_MS:g})")
    serve.add_argument("--step-log", default=None, metavar="PATH",
                       help="write one JSON line per engine step to PATH at shutdown (kind, decode rows, prompt "
                            "tokens, host times, requests running and queued, admitted requests' waits), then one per "
                            "garbage collection (kind gc); "
                            "benchmarks/step_log.py summarises it")
    serve.add_argument("--stall-dump", default=None, metavar="PATH",
                       help="write every thread's Python stack to PATH whenever the engine thread's host work between "
                            "two steps takes longer than --stall-dump-ms (a SIGALRM timer armed each step: where a "
                            "stalled engine thread is); benchmarks/stall_dump.py groups them")
    serve.add_argument("--stall-dump-ms", type=float, default=10.0,
                       help="the host span that counts as a stall for --stall-dump (10; the admission wait is part of "
                            "the span: keep it above --admission-wait-ms)")
    serve.add_argument("--stall-dump-wait-ms", type=float, default=None,
                       help="with --stall-dump, also write the stacks when a step's wait for the step before it (its "
                            "device time, then reading its ids) takes longer than this (default: not watched; keep it "
                            "above the slowest normal step)")
    serve.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                       help="requests under /v1 must send 'Authorization: Bearer KEY' with one of these keys, "
                            "else 401 (vLLM's flag; default: the FUSELM_API_KEY environment variable, if set)")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        serve.add_argument(flag, type=_json_list, default=["*"], metavar="JSON",
                           help=f'the {what} browsers may send cross-origin requests with, a JSON list (vLLM\'s '
                                f'flag; default ["*"])')
    serve.add_argument("--allow-credentials", action="store_true",
                       help="cross-origin requests may carry credentials (vLLM's flag)")
    serve.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="split chat replies' reasoning (<think> ... </think>) into message.reasoning and "
                            "reasoning_content, as vLLM's qwen3 parser")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="chat requests with tools (tool_choice \"auto\") get the reply's calls as tool_calls; "
                            "needs --tool-call-parser")
    serve.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                       help="the tool-call format: qwen3_coder (Qwen3.5's <tool_call><function=...> XML, as vLLM's)")
    _add_model_arguments(serve, "seeds the sampling seeds of requests without one (and --config's weights)")
    _add_state_dtype_argument(serve)
    serve.set_defaults(run=_serve, command_parser=serve)

    bench_serve = commands.add_parser(
        "bench-serve", help="load generator for an OpenAI-compatible server: TTFT, TPOT, ITL, throughput, goodput",
        description="Like vllm bench serve: random-token (or ShareGPT) prompts streamed to URL's /v1/completions (or "
                    "/v1/chat/completions) at --request-rate, at most --max-concurrency at once; reports TTFT, TPOT, "
                    "ITL and E2EL (mean, median, percentiles), request and token throughput, goodput under SLOs "
                    "(fuselm.bench.serve). Contacts URL only.")
    bench_serve.add_argument("url", nargs="?", default=None, metavar="URL",
                             help="the server's base URL (default http://127.0.0.1:8000)")
    bench_serve.add_argument("--base-url", default=None, help="the same as URL")
    bench_serve.add_argument("--backend", default="openai", choices=("openai", "openai-chat"),
                             help="openai: /v1/completions, prompts as token ids (default); openai-chat: "
                                  "/v1/chat/completions, prompts as text (needs --tokenizer)")
    bench_serve.add_argument("--endpoint", default=None, help="a path replacing the backend's")
    bench_serve.add_argument("--model", default=None, help="default: the first model of GET /v1/models")
    bench_serve.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                             help="tokenizer.json or its directory: prompts of its ordinary token ids; openai-chat "
                                  "needs it (the prompt is the text it decodes)")
    bench_serve.add_argument("--dataset-name", default="random", choices=("random", "sharegpt"),
                             help="random: random-token prompts (default); sharegpt: the first turns of a ShareGPT "
                                  "JSON file (--dataset-path) as text prompts, sampled as vLLM samples them (needs "
                                  "--tokenizer)")
    bench_serve.add_argument("--dataset-path", type=Path, default=None, metavar="FILE",
                             help="the ShareGPT JSON file, e.g. ShareGPT_V3_unfiltered_cleaned_split.json")
    bench_serve.add_argument("--sharegpt-output-len", type=int, default=None,
                             help="tokens generated per ShareGPT request (default: its reply's length)")
    bench_serve.add_argument("--num-prompts", type=int, default=200, help="requests measured (200)")
    bench_serve.add_argument("--random-input-len", type=int, default=512, help="prompt tokens (512)")
    bench_serve.add_argument("--random-output-len", type=int, default=256, help="tokens generated per request (256)")
    bench_serve.add_argument("--random-range-ratio", type=float, default=0.0,
                             help="r: lengths uniform in [len*(1-r), len*(1+r)] (0)")
    bench_serve.add_argument("--random-vocab-size", type=int, default=None,
                             help="without --tokenizer: token ids drawn from [0, N) (32000)")
    bench_serve.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrival times (0)")
    bench_serve.add_argument("--request-rate", type=float, default=float("inf"),
                             help="requests/s (default inf: all at once)")
    bench_serve.add_argument("--burstiness", type=float, default=1.0,
                             help="gamma shape of the inter-arrival times: 1 Poisson, <1 burstier, >1 more even (1)")
    bench_serve.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (no limit)")
    bench_serve.add_argument("--warmup-requests", type=int, default=0, help="sent first, not counted (0)")
    bench_serve.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take (600)")
    bench_serve.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                             help="SLOs in ms of ttft, tpot, e2el, e.g. --goodput ttft:500 tpot:50")
    bench_serve.add_argument("--percentiles", default="50,90,99", help="reported besides mean, median, p99 and max")
    bench_serve.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    bench_serve.add_argument("--out", type=Path, default=None, help="write <label>.json, .md and .png here")
    bench_serve.add_argument("--label", default="bench_serve", help="the files' name in --out (bench_serve)")
    bench_serve.set_defaults(run=_bench_serve)

    aud = commands.add_parser("audit", help="Qwen3.5 engine: kernels/graph launches/host syncs per step, HF parity")
    aud.add_argument("--config", type=_model_config, default=None,
                     help="'tiny' (built-in, default), '9b' (HF Qwen3_5TextConfig() defaults) or a config.json "
                          "path; random weights from --seed")
    aud.add_argument("--checkpoint", type=Path, default=None,
                     help="a local HF checkpoint directory (config.json + safetensors) instead of random weights")
    _add_random_model_arguments(aud, 16, 8, 2, fill_defaults=True)
    aud.add_argument("--weights", default="spread",
                     help="random weights: 'spread' (every weight away from its init: fuselm.models.qwen35.presets, "
                          "default) or 'hf-init' (HF's own initialisation); writes audit.json / audit_hf_init.json")
    _add_model_arguments(aud, "weights and prompts (default 0)")
    aud.set_defaults(run=_audit, seed=0, command_parser=aud)

    commands.add_parser("demo", help="every op vs its reference: error and time table").set_defaults(run=_demo)

    swap = commands.add_parser("swapffn", help="Swap-FFN seed config: tokens/s, kernels per token, parity (GPU)")
    swap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    swap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                      help="also time torch.compile of the reference (slow to compile)")
    swap.add_argument("--parity-tokens", type=int, default=4)
    swap.add_argument("--out", type=Path, default=None, help="write swap_ffn.json here")
    swap.set_defaults(run=_swapffn)
    return parser


def main(argv=None) -> int:
    """Run ``fuselm`` with ``argv`` (default: sys.argv[1:]); returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        _resolve_generate_mode(args.command_parser, args)
    elif args.command == "audit" and args.checkpoint is not None and args.config is not None:
        args.command_parser.error("--config and --checkpoint are exclusive")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
