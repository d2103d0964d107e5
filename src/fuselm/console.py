"""Terminal front ends of an ``LLM``: streamed replies, an interactive chat with history, and
random-weight checkpoints to try them on (the bodies of ``fuselm generate MODEL_DIR``, ``fuselm
chat`` and ``fuselm init-checkpoint``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from fuselm.engine.llm import LLM
from fuselm.engine.request import RequestOutput, SamplingParams

# Vocabulary of a checkpoint written by ``init_checkpoint`` for the tiny config: the released
# Qwen3.5 size, so every id of the real tokenizer (written beside the weights) is in range.
QWEN35_VOCAB_SIZE = 248320


def summary(output: RequestOutput) -> str:
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


def stream_reply(llm: LLM, prompt: str, params: SamplingParams) -> RequestOutput:
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
    print(summary(output), file=sys.stderr, flush=True)
    return output


class ChatSession:
    """A conversation with an ``LLM``: an optional system prompt, then the user and assistant
    turns so far, rendered by the checkpoint's chat template for every reply."""

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None,
                 chat_template_kwargs: dict | None = None):
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


def run_chat(session: ChatSession, source: TextIO, title: str) -> int:
    """Read user turns from ``source`` line by line and stream each reply: ``/reset`` clears the
    conversation, ``/exit`` or the end of input ends it; a prompt "> " only on a terminal. A turn
    that fails (e.g. the conversation outgrew max_len) is reported and the chat goes on; the exit
    status is 1 if any did."""
    interactive = source.isatty()
    if interactive:
        print(f"chat with {title}: /reset clears the conversation, /exit or Ctrl-D ends it", file=sys.stderr)
    failed = False
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = source.readline()
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
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


def _human_size(size: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000


def init_checkpoint(directory, config_name: str, dtype: str = "bfloat16", device: str | None = None, seed: int = 0,
                    max_shard_size: str = "4GB") -> None:
    """Write a random-weight checkpoint of the preset ``config_name`` (``presets.PRESETS``) in the
    released Qwen3.5 layout with the real tokenizer (``write_random_checkpoint`` +
    ``write_tokenizer_files``) and list what was written."""
    import torch

    from fuselm.models.qwen35.presets import preset_config, write_random_checkpoint
    from fuselm.tokenizer import write_tokenizer_files

    config = preset_config(config_name, vocab_size=QWEN35_VOCAB_SIZE if config_name.startswith("tiny") else None)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    directory = Path(directory)
    write_random_checkpoint(directory, config, dtype=getattr(torch, dtype), device=device, seed=seed,
                            max_shard_size=max_shard_size)
    write_tokenizer_files(directory)
    files = sorted(p for p in directory.iterdir() if p.is_file())
    print(f"wrote {directory}: Qwen3.5 {config_name}, random weights (seed {seed}), {dtype}, with the "
          f"Qwen3.5 tokenizer")
    for path in files:
        print(f"  {path.name:40s} {_human_size(path.stat().st_size):>10s}")
    print(f"  {len(files)} files, {_human_size(sum(p.stat().st_size for p in files))} in all")
