"""The ``fuselm`` command: argument parsing and dispatch (every import is lazy).

    fuselm generate MODEL_DIR --prompt TEXT [--chat] ...  stream text from a checkpoint directory
    fuselm generate [--config tiny|9b|config.json] ...     random-weight throughput (fuselm.bench.generate)
    fuselm chat MODEL_DIR ...                               interactive chat, one line per user turn
    fuselm init-checkpoint DIR --config tiny|9b ...         a random-weight checkpoint with the real tokenizer
    fuselm audit ...                                        decode-step launches, parity with HF (fuselm.engine.audit)
    fuselm demo                                             every op vs its reference (fuselm.bench.ops_demo)
    fuselm swapffn ...                                      Swap-FFN paths on a GPU (fuselm.bench.swap_ffn)

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
import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
# Vocabulary of a checkpoint written by ``init-checkpoint`` for the tiny config: the released
# Qwen3.5 size, so every id of the real tokenizer (written beside the weights) is in range.
QWEN35_VOCAB_SIZE = 248320
TEXT_MAX_TOKENS, TEXT_MAX_LEN = 256, 4096
BENCH_PROMPT_LEN, BENCH_MAX_NEW_TOKENS, BENCH_BATCH = 32, 16, 1


# ============================================================================ argument values
def _model_config(value: str):
    """``--config`` of the random-weight commands: 'tiny', '9b' or a config.json path ->
    (Qwen35Config, description). argparse reports a bad value as a usage error."""
    import json

    from fuselm.models.qwen35 import Qwen35Config
    from fuselm.models.qwen35.presets import preset_config

    if value == "tiny":
        return preset_config("tiny"), "tiny (built-in)"
    if value.lower() == "9b":
        return preset_config("9b"), "9B (HF Qwen3_5TextConfig() defaults)"
    path = Path(value)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"expected 'tiny', '9b' or a config.json file, got {value!r}")
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
    return LLM(directory, dtype=dtype, device=args.device, max_batch=1, max_len=args.max_len, seed=args.seed)


def _sampling_params(llm, args):
    """The checkpoint's default SamplingParams with --max-tokens and every sampling flag given."""
    import dataclasses

    flags = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
             "stop": args.stop}
    overrides = {field: value for field, value in flags.items() if value is not None}
    return dataclasses.replace(llm.get_default_sampling_params(), max_tokens=args.max_tokens, **overrides)


def _summary(output) -> str:
    """One line: tokens, time to first token, decode tok/s (after the first token), finish reason."""
    completion, metrics = output.outputs[0], output.metrics
    tokens = len(completion.token_ids)
    decode_seconds = metrics.finished_time - metrics.first_token_time
    decode = f"{(tokens - 1) / decode_seconds:.1f} tok/s" if tokens > 1 and decode_seconds > 0 else "n/a"
    reason = completion.finish_reason
    if completion.stop_reason is not None:
        reason += f" ({completion.stop_reason!r})"
    return (f"[{tokens} tokens, time to first token {1e3 * metrics.time_to_first_token:.0f} ms, decode {decode}, "
            f"finish: {reason}]")


def stream_reply(llm, prompt: str, params):
    """Generate for ``prompt``, writing the text to stdout as it comes (then a newline) and the
    summary line to stderr; returns the ``RequestOutput``."""

    def write(request):
        text = request.take_new_text()
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()

    (output,) = llm.generate(prompt, params, stream=write)
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(_summary(output), file=sys.stderr, flush=True)
    return output


class ChatSession:
    """A conversation with an ``LLM``: an optional system prompt, then the user and assistant
    turns so far, rendered by the checkpoint's chat template for every reply."""

    def __init__(self, llm, params, system: str | None = None, chat_template_kwargs: dict | None = None):
        self.llm, self.params = llm, params
        self.system = system
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.turns: list[dict] = []

    def reset(self) -> None:
        """Forget every turn (the system prompt stays)."""
        self.turns.clear()

    def prompt(self, user_text: str) -> str:
        """The rendered prompt of the conversation so far followed by ``user_text``, ready for the
        assistant's reply."""
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.turns
        messages.append({"role": "user", "content": user_text})
        return self.llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      **self.chat_template_kwargs)

    def reply(self, user_text: str):
        """Stream the assistant's reply to ``user_text`` (``stream_reply``) and keep both turns;
        returns the ``RequestOutput``. A turn that fails (ValueError) is not kept."""
        output = stream_reply(self.llm, self.prompt(user_text), self.params)
        self.turns += [{"role": "user", "content": user_text},
                       {"role": "assistant", "content": output.outputs[0].text}]
        return output


def _chat_template_kwargs(args) -> dict:
    return {"enable_thinking": False} if args.no_thinking else {}


def _generate_text(args) -> int:
    llm = _load_llm(args)
    params = _sampling_params(llm, args)
    if args.chat:
        prompt = ChatSession(llm, params, args.system, _chat_template_kwargs(args)).prompt(args.prompt)
    else:
        prompt = args.prompt
    stream_reply(llm, prompt, params)
    return 0


def _chat(args) -> int:
    llm = _load_llm(args)
    session = ChatSession(llm, _sampling_params(llm, args), args.system, _chat_template_kwargs(args))
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chat with {args.model_dir}: /reset clears the conversation, /exit or Ctrl-D ends it", file=sys.stderr)
    failed = False
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:  # end of input
            if interactive:
                print()
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            session.reset()
            print("(conversation cleared)", file=sys.stderr)
            continue
        try:
            session.reply(text)
        except ValueError as error:  # e.g. the conversation outgrew --max-len; the chat goes on
            print(f"error: {error}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


# ============================================================================ random weights
def _generate_benchmark(args) -> int:
    from fuselm.bench import write_results
    from fuselm.bench.generate import run_generate_benchmark

    config, description = args.config
    device, dtype = _device_and_dtype(args)
    results, markdown = run_generate_benchmark(config, description, batch=args.batch, prompt_len=args.prompt_len,
                                               max_new_tokens=args.max_new_tokens, seed=args.seed, device=device,
                                               dtype=dtype)
    print("\n" + markdown)
    write_results(args.out, "generate", results, markdown)
    return 0


def _generate(args) -> int:
    return _generate_text(args) if args.model_dir is not None else _generate_benchmark(args)


def _human_size(size: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000


def _init_checkpoint(args) -> int:
    import torch

    from fuselm.models.qwen35.presets import preset_config, write_random_checkpoint
    from fuselm.tokenizer import write_tokenizer_files

    config = preset_config(args.config, vocab_size=QWEN35_VOCAB_SIZE if args.config == "tiny" else None)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    directory = Path(args.directory)
    write_random_checkpoint(directory, config, dtype=getattr(torch, args.dtype), device=device, seed=args.seed,
                            max_shard_size=args.max_shard_size)
    write_tokenizer_files(directory)
    files = sorted(p for p in directory.iterdir() if p.is_file())
    print(f"wrote {directory}: Qwen3.5 {args.config}, random weights (seed {args.seed}), {args.dtype}, with the "
          f"Qwen3.5 tokenizer")
    for path in files:
        print(f"  {path.name:40s} {_human_size(path.stat().st_size):>10s}")
    print(f"  {len(files)} files, {_human_size(sum(p.stat().st_size for p in files))} in all")
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


# ============================================================================ the parser
def _add_sampling_arguments(command, max_tokens, max_len) -> None:
    """The text commands' sampling, stop and model-loading flags (sampling defaults: the
    checkpoint's generation_config)."""
    command.add_argument("--max-tokens", type=int, default=max_tokens, help=f"new tokens at most ({TEXT_MAX_TOKENS})")
    command.add_argument("--temperature", type=float, default=None, help="0: greedy (default: the checkpoint's)")
    command.add_argument("--top-p", type=float, default=None, help="default: the checkpoint's")
    command.add_argument("--top-k", type=int, default=None, help="0: off (default: the checkpoint's)")
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
_TEXT_OPTIONS = ("prompt", "chat", "system", "no_thinking", "max_tokens", "temperature", "top_p", "top_k", "stop",
                 "max_len")
_BENCH_OPTIONS = ("prompt_len", "max_new_tokens", "batch", "out")


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
    gen.set_defaults(run=_generate, command_parser=gen)

    chat = commands.add_parser("chat", help="interactive chat with a checkpoint (user lines from stdin)",
                               description="One user turn per stdin line; each reply is streamed and kept in the "
                                           "conversation. /reset clears it, /exit or end of input ends the chat.")
    chat.add_argument("model_dir", metavar="MODEL_DIR", help="a checkpoint directory")
    _add_chat_arguments(chat)
    _add_sampling_arguments(chat, max_tokens=TEXT_MAX_TOKENS, max_len=TEXT_MAX_LEN)
    _add_model_arguments(chat, "sampling seed")
    chat.set_defaults(run=_chat)

    init = commands.add_parser("init-checkpoint", help="write a random-weight Qwen3.5 checkpoint with the tokenizer",
                               description="A checkpoint directory in the released Qwen3.5 layout (config.json, "
                                           "sharded safetensors + index, generation_config.json, tokenizer files) "
                                           "with seeded random weights: its text is gibberish.")
    init.add_argument("directory", metavar="DIR", help="created if missing")
    init.add_argument("--config", required=True, choices=("tiny", "9b"),
                      help=f"tiny (with vocab_size {QWEN35_VOCAB_SIZE}, the tokenizer's) or 9b")
    init.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    init.add_argument("--device", default=None, help="where the weights are drawn (default: cuda when available)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--max-shard-size", default="4GB", help="e.g. 4GB, 500MB")
    init.set_defaults(run=_init_checkpoint)

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
