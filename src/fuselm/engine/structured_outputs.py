"""Structured outputs: each constrained request's grammar, and the tokens it allows next.

    grammars = GrammarCompiler(tokenizer, vocab_size=248320, eos_ids=(248046, 248044))
    matcher = grammars.compile(StructuredOutputsParams(json={"type": "object"}))
    matcher.fill_bitmask(words)    # words: [ceil(V / 32)] int32, bit v % 32 of word v // 32 = v allowed
    matcher.accept(token_id)       # after the draw

The grammars are llguidance's (the library vLLM and SGLang offer as a backend): a JSON schema, a
regex, a choice of strings, a Lark / GBNF grammar or a structural tag compiles to an
``LLMatcher`` over the tokenizer's vocabulary (``LLTokenizer``: built once per compiler from the
tokenizer's tokenizer.json, ~1.5 s at Qwen3.5's 248k tokens; ``warm_up`` builds it ahead). A mask costs
~0.1-0.2 ms of host time per request and step (measured on this machine for a JSON schema);
the engine computes it while the device runs the step's forward pass and applies it with
``fuselm.ops.sampling.apply_token_bitmask`` before the draw. Ids past the tokenizer's vocabulary
(the model's padding rows) are never allowed; the eos ids are allowed once the grammar is
complete, and then only they are.

``starts_after``: a token id (Qwen3.5's ``</think>``) before which the output is free: with a
reasoning parser the grammar constrains the answer, not the thinking (vLLM's reasoning-aware
structured outputs).
"""

from __future__ import annotations

import json
import threading
from typing import Sequence

import torch

from fuselm.engine.request import StructuredOutputsParams


def _llguidance():
    try:
        import llguidance
    except ImportError:  # a declared dependency; an environment without it still runs everything else
        raise ValueError("structured_outputs: needs the llguidance package (pip install llguidance)") from None
    return llguidance


class GrammarMatcher:
    """One request's grammar state: which tokens may come next, advanced by each drawn token."""

    def __init__(self, matcher, starts_after: int | None = None):
        self._matcher = matcher
        self.starts_after = starts_after
        self.started = starts_after is None

    @property
    def constrains(self) -> bool:
        """The next token is masked (False before ``starts_after`` has been drawn)."""
        return self.started

    def fill_bitmask(self, words: torch.Tensor) -> None:
        """Write the allowed next tokens into ``words`` (a contiguous CPU int32 row of ceil(V / 32)
        words, in place)."""
        if words.dtype != torch.int32 or words.device.type != "cpu" or not words.is_contiguous():
            raise ValueError("words: expected a contiguous CPU int32 tensor")
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def accept(self, token: int) -> bool:
        """Advance by a drawn ``token``. False when the grammar cannot take it (it was not among
        the allowed ones: the matcher is in error from then on)."""
        if not self.started:
            self.started = token == self.starts_after
            return True
        return self._matcher.consume_token(token)

    @property
    def matcher(self):
        """The llguidance ``LLMatcher`` (``GrammarCompiler``'s batched calls take it)."""
        return self._matcher

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and takes nothing more but an eos id."""
        return self.started and self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` into ``GrammarMatcher``s over a tokenizer's vocabulary
    (``fuselm.tokenizer.Tokenizer``), for logits of ``vocab_size`` columns; ``eos_ids``: the ids a
    complete grammar allows (the model's eos ids)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._executor = None  # llguidance's thread pool for a batch's masks and tokens

    def warm_up(self) -> None:
        """Build the vocabulary's grammar tables now (else on the first compile)."""
        self._tokenizer()

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                llguidance = _llguidance()
                vocabulary = self.tokenizer.backend.get_vocab_size(with_added_tokens=True)
                if vocabulary > self.vocab_size:
                    raise ValueError(f"structured_outputs: the tokenizer has {vocabulary} tokens, more than the "
                                     f"model's {self.vocab_size} logits")
                # (a complete grammar allows these; a model that names none: the tokenizer's eos)
                eos_ids = self.eos_ids or [i for i in (self.tokenizer.eos_token_id,) if i is not None]
                if not eos_ids:
                    raise ValueError("structured_outputs: neither the model nor the tokenizer names an eos id")
                self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=eos_ids)
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams, starts_after: int | None = None) -> GrammarMatcher:
        """A fresh matcher for ``params``; ValueError naming the field when the grammar is invalid."""
        llguidance = _llguidance()
        tokenizer = self._tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, grammar_of(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {params.kind}: {matcher.get_error()}")
        return GrammarMatcher(matcher, starts_after)


    def _pool(self):
        if self._executor is None:
            self._executor = _llguidance().LLExecutor()  # (80% of the CPUs, up to 32 threads)
        return self._executor

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """``fill_bitmask`` of each of ``matchers`` into its row of ``bitmask`` (a contiguous CPU
        int32 [len(matchers), words] tensor), several at once on llguidance's threads (a mask
        costs ~0.3 ms of CPU at Qwen3.5's vocabulary: a batch's one after another would outlast
        the forward pass they hide behind)."""
        if len(matchers) <= 1:
            for matcher, row in zip(matchers, bitmask):
                matcher.fill_bitmask(row)
            return
        if (bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous()
                or bitmask.dim() != 2 or bitmask.shape[0] != len(matchers)):
            raise ValueError(f"bitmask: expected a contiguous CPU int32 [{len(matchers)}, words] tensor")
        self._pool().unsafe_compute_mask_ptr([(m.matcher, row) for row, m in enumerate(matchers)],
                                             bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])

    def accept_tokens(self, drawn: Sequence[tuple[GrammarMatcher, int]]) -> list[bool]:
        """``accept`` of each (matcher, token) pair, the constraining ones together on llguidance's
        threads; returns each one's verdict."""
        verdicts = [True] * len(drawn)
        started = []
        for index, (matcher, token) in enumerate(drawn):
            if matcher.constrains:
                started.append(index)
            else:
                matcher.accept(token)
        if len(started) == 1:
            verdicts[started[0]] = drawn[started[0]][0].accept(drawn[started[0]][1])
        elif started:
            batch = [(drawn[index][0].matcher, drawn[index][1]) for index in started]
            for index, verdict in zip(started, self._pool().consume_token_par(batch)):
                verdicts[index] = verdict
        return verdicts


def _json_value(value, name: str):
    """``value``, or the value its JSON text holds (ValueError naming ``structured_outputs.<name>``)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise ValueError(f"structured_outputs.{name}: not valid JSON text: {error}") from None


def _structural_tag_grammar(spec) -> str:
    """A structural tag's grammar (vLLM's legacy form, as its llguidance backend builds it): free
    text, each trigger starting one of the structures whose begin it starts."""
    llguidance = _llguidance()
    spec = _json_value(spec, "structural_tag")
    structures = spec.get("structures") if isinstance(spec, dict) else None
    triggers = spec.get("triggers") if isinstance(spec, dict) else None
    if (not isinstance(structures, list) or not structures or not isinstance(triggers, list)
            or any(not isinstance(t, str) or not t for t in triggers)
            or any(not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str)
                   or not isinstance(s.get("schema"), (dict, bool)) for s in structures)):
        raise ValueError('structured_outputs.structural_tag: expected {"structures": [{"begin": str, "schema": '
                         '{JSON schema}, "end": str}, ...], "triggers": [str, ...]} with at least one structure')
    tags = []
    for structure in structures:
        trigger = next((t for t in triggers if structure["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structured_outputs.structural_tag: no trigger in {triggers!r:.200} starts the begin "
                             f"{structure['begin']!r:.100}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=structure["begin"], grammar=structure["schema"],
                                         end=structure["end"]))
    return llguidance.StructTag.to_grammar(tags)


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params`` (not yet checked)."""
    llguidance = _llguidance()
    json_options = {"whitespace_flexible": not params.disable_any_whitespace}
    if params.structural_tag is not None:
        return _structural_tag_grammar(params.structural_tag)
    if params.json is not None or params.json_object:
        schema = {"type": "object"} if params.json_object else _json_value(params.json, "json")
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structured_outputs.json: expected a JSON schema object, got "
                             f"{type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=json_options)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("choice", list(params.choice))
    try:
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as error:
        raise ValueError(f"structured_outputs.grammar: {error}") from None


def check_grammar(params: StructuredOutputsParams) -> None:
    """ValueError naming ``structured_outputs`` and its field when the grammar does not compile (no
    vocabulary needed: a server checks requests before they reach the engine)."""
    message = _llguidance().LLMatcher.validate_grammar(grammar_of(params))
    if message:
        raise ValueError(f"structured_outputs: {params.kind}: {message}")
