"""What a user asks for and what comes back: ``SamplingParams``, ``Request``, ``RequestOutput``.

The shapes follow vLLM's offline API (``SamplingParams``, ``RequestOutput.outputs[0].text`` ...)
so that code written for it reads the same here.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence


MAX_LOGPROBS = 20
"""Most top log-probabilities a request may ask for per generated token (``SamplingParams.logprobs``:
OpenAI's ``top_logprobs`` limit and vLLM's default ``max_logprobs``)."""

MAX_LOGIT_BIAS = 256
"""Most tokens a request's ``logit_bias`` may list (the engine keeps that many per slot)."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_token_ids(value) -> bool:
    """A non-empty list (or tuple) of ints: one prompt given as token ids."""
    return isinstance(value, (list, tuple)) and bool(value) and all(_is_int(t) for t in value)


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""``StructuredOutputsParams``' fields of which a request sets exactly one."""


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a language (vLLM's ``StructuredOutputsParams``): exactly one
    of ``json`` (a JSON schema, as a dict or its JSON text), ``regex`` (a regular expression, Rust's
    regex syntax), ``choice`` (a non-empty list of strings: the output is one of them), ``grammar``
    (a Lark grammar, or llama.cpp's GBNF), ``json_object`` (True: any JSON object) or
    ``structural_tag`` (free text in which each trigger string starts a tagged JSON object:
    ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``, as a dict or its JSON
    text: after a trigger the output is some structure's begin, a JSON value of its schema and
    its end; vLLM's structural tags in the form its llguidance backend takes).
    ``disable_any_whitespace``: JSON without free whitespace between tokens (vLLM's option; by
    default the model may lay JSON out as it likes). Before each draw the request's grammar masks
    the tokens that cannot come next (``fuselm.engine.structured_outputs``); once the grammar is
    complete only the eos ids remain. Types are checked here; the grammar itself when the request
    is added (ValueError naming ``structured_outputs`` with the grammar compiler's message)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: expected exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; "
                             f"got {given or 'none'}")
        for name in ("json", "structural_tag"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), (str, dict)):
                raise ValueError(f"structured_outputs.{name}: expected a dict or its JSON text, got "
                                 f"{type(getattr(self, name)).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: expected a non-empty string, got {value!r:.100}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice: expected a non-empty list of non-empty strings, got "
                             f"{self.choice!r:.200}")
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name}: expected a bool, got {value!r}")

    @property
    def kind(self) -> str:
        """The field that is set (one of ``STRUCTURED_OUTPUT_KINDS``)."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False))


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    max_tokens: new tokens at most (>= 1). temperature: 0 is greedy, else >= 0. top_p in (0, 1]
    (1: off). top_k: 0 or -1 is off, else >= 1. min_p in [0, 1] (0: off): keep the tokens at least
    min_p times as likely as the most likely one (after top-k and top-p, HF's order).
    repetition_penalty > 0 (1: off): logits of tokens in the prompt or generated so far divided by
    it when positive, multiplied when not; frequency_penalty and presence_penalty in [-2, 2] (0:
    off): subtracted from a token's logit per time it was generated, and once if it was (vLLM's
    and OpenAI's definitions; ``fuselm.ops.sampling.apply_penalties``). logit_bias: {token id:
    bias in [-100, 100]} added to those logits before the penalties (OpenAI's; at most
    MAX_LOGIT_BIAS tokens). Penalties and bias apply to greedy requests too. seed: a request with
    a seed gives the same tokens every time, whatever else runs beside it (None: a fresh random
    seed per request). stop:
    strings that end the request, cut from the text. stop_token_ids: ids that end it beside the
    model's eos ids (kept in the token ids, their text left out as vLLM leaves it).
    ignore_eos: do not stop at the model's eos ids (stop_token_ids still stop). min_tokens (in [0,
    max_tokens]): no stop id can be drawn, and no stop string ends the request, before that many
    tokens (vLLM's: the stop ids' logits are -inf until then).
    include_stop_str_in_output: the stop string (or the stop id's text) that ended the request
    stays at the end of the text. skip_special_tokens: special tokens are left out of the text
    (vLLM's default; off, they are decoded like any other). These two only shape the text.
    n: sequences drawn for the prompt (>= 1), each a request of its own (``samples``: seeds
    seed, seed + 1, ..., as vLLM's parallel sampling), which share the prompt's prefill (the
    first prefills it, the others copy its state: ``engine.scheduler``).
    logprobs: None (off) or k in [0, MAX_LOGPROBS]: each generated token's log-probability and
    rank under the model's distribution, and the k most likely tokens' (``CompletionOutput.logprobs``,
    as vLLM's). prompt_logprobs: the same for each prompt token after the ones before it
    (``RequestOutput.prompt_logprobs``; a pass over the prompt of its own beside the prefill).
    structured_outputs: a ``StructuredOutputsParams`` (JSON schema, regex, choice, grammar): the
    output follows it (tokens it does not allow are -inf before the draw, so logprobs see them so,
    as vLLM's); not with min_tokens (the grammar decides where the output may end).
    allowed_token_ids: a non-empty list of the only ids that may be drawn; bad_words: strings the
    output may not contain as token sequences (vLLM's: a word's last token is banned where the
    output ends with its other tokens; ``engine.token_masks``; the engine needs a tokenizer). Both
    limit the draw and not the logprobs (vLLM's raw logprobs). truncate_prompt_tokens: keep only
    the prompt's last k tokens (k >= 1; -1: the engine's max_len, as vLLM's -1 is the model's).
    Every field is checked on construction: ValueError naming the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: expected a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k: expected 0 or -1 (off) or an int >= 1, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: expected a number in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty: expected a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}: expected a number in [-2, 2], got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            bias = self.logit_bias
            if (not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS or any(
                    not _is_int(t) or t < 0 or not _is_number(b) or not -100 <= b <= 100 for t, b in bias.items())):
                raise ValueError(f"logit_bias: expected at most {MAX_LOGIT_BIAS} token ids (ints >= 0) mapped to "
                                 f"numbers in [-100, 100], got {bias!r:.200}")
            self.logit_bias = {t: float(b) for t, b in bias.items()} or None
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed: expected None or an int in [0, 2**63), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, (list, tuple))
                                      or any(not isinstance(s, str) or not s for s in self.stop)):
            raise ValueError(f"stop: expected a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and (not isinstance(self.stop_token_ids, (list, tuple))
                                                or any(not _is_int(t) or t < 0 for t in self.stop_token_ids)):
            raise ValueError(f"stop_token_ids: expected a list of token ids (ints >= 0), got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: expected an int in [0, max_tokens = {self.max_tokens}], got "
                             f"{self.min_tokens!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n: expected an int >= 1, got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}: expected None or an int in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs: expected None or a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            if self.min_tokens:
                raise ValueError("min_tokens: cannot be combined with structured_outputs (the grammar decides where "
                                 "the output may end)")
        if self.allowed_token_ids is not None:
            if (not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                    or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)):
                raise ValueError(f"allowed_token_ids: expected a non-empty list of token ids (ints >= 0), got "
                                 f"{self.allowed_token_ids!r:.200}")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or any(
                    not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words: expected a list of strings that are not blank, got "
                                 f"{self.bad_words!r:.200}")
            self.bad_words = list(self.bad_words) or None
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or k >= 1)):
            raise ValueError(f"truncate_prompt_tokens: expected None, -1 or an int >= 1, got {k!r}")

    def samples(self) -> list["SamplingParams"]:
        """The ``n`` requests these params stand for, each with n = 1: sample i gets seed
        (seed + i) mod 2**63 when a seed is set (vLLM's parallel sampling), else a fresh one; the
        first alone computes the prompt's logprobs (the same for every sample)."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else (self.seed + i) % 2**63,
                                    prompt_logprobs=self.prompt_logprobs if i == 0 else None)
                for i in range(self.n)]

    @property
    def detokenizer_options(self) -> dict:
        """``Tokenizer.detokenizer``'s keyword options for a request with these params."""
        return {"skip_special_tokens": self.skip_special_tokens, "stop": self.stop,
                "include_stop_str_in_output": self.include_stop_str_in_output, "min_tokens": self.min_tokens}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """True when top-k, top-p or min-p removes tokens before the draw (the sampler's costlier path)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)

    @property
    def penalized(self) -> bool:
        """True when a penalty, a logit bias or min_tokens changes the logits before the draw (greedy
        requests too)."""
        return (self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
                or bool(self.logit_bias) or self.min_tokens > 0)


def params_per_prompt(params: "SamplingParams | Sequence[SamplingParams] | None", count: int) -> list["SamplingParams"]:
    """One SamplingParams per prompt: ``params`` for all (None: ``SamplingParams()``), or a
    sequence of exactly ``count`` of them; ValueError / TypeError naming ``params`` otherwise."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"params: {len(params)} SamplingParams for {count} prompts")
    if any(not isinstance(p, SamplingParams) for p in params):
        raise TypeError("params: expected SamplingParams objects")
    return params


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model's next-token distribution at one position, and
    its rank there (1: the most likely). The distribution is the raw one: log_softmax of the
    model's logits in fp32, before temperature, top-k and top-p (vLLM's default
    ``logprobs_mode``), so greedy and sampled requests see the same values.
    ``decoded_token``: the token's text, where the caller has a tokenizer (``LLM``)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]
"""One generated position's log-probabilities by token id: the sampled token first, then the
``SamplingParams.logprobs`` most likely tokens in rank order (the sampled one once), as vLLM's."""


@dataclass
class CompletionOutput:
    """One generated sequence: ``text`` (stop strings cut), ``token_ids``, ``finish_reason``
    ("stop": an eos / stop id / stop string; "length": max_tokens or the context; None while
    running) and ``stop_reason`` (the stop string or stop_token_ids id that ended it; None at the
    model's eos, as vLLM has it). With ``SamplingParams.logprobs`` set: ``logprobs``, one
    ``TokenLogprobs`` per token id, and ``cumulative_logprob``, the sum of the sampled tokens'
    (None otherwise)."""

    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestMetrics:
    """Host clock times (``time.perf_counter``) of a request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """What ``LLM.generate`` / ``Engine.generate`` return per prompt. ``prompt_logprobs`` (with
    ``SamplingParams.prompt_logprobs``): one ``TokenLogprobs`` per prompt token, None for the
    first (nothing comes before it), as vLLM's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"


@dataclass
class Request:
    """A request inside the engine: its prompt, parameters, resolved seed and stop ids, the cache
    slot and K/V pages it owns while it runs (and its row in the decode batch, which may change
    as others leave: the batch reads the slot through a row -> slot table), and what it has
    generated. ``detokenizer`` (optional) turns ids into text incrementally and finds stop
    strings."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: tuple[int, ...]
    prompt: str | None = None
    detokenizer: object | None = None
    slot: int | None = None
    row: int | None = None
    pages: list[int] = field(default_factory=list)  # its K/V pages, for prompt + max_tokens positions
    num_prompt_computed: int = 0  # prompt tokens in the cache (a long prompt is prefilled over several steps)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output id, with params.logprobs
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with params.prompt_logprobs, from its first token on
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))
    _new_text: list[str] = field(default_factory=list, repr=False)  # detokenized, not yet taken
    grammar: object | None = field(default=None, repr=False)  # with params.structured_outputs: its GrammarMatcher
    allowed_mask: object | None = field(default=None, repr=False)  # with params.allowed_token_ids: a bitmask row
    # Prefill sharing (Scheduler): the request whose prefill of this same prompt's first T - 1 tokens
    # this one copies instead of computing them; and, on such a source, the requests waiting to copy its.
    shares_prefill_with: Request | None = field(default=None, repr=False)
    sharers: list[Request] = field(default_factory=list, repr=False)
    bad_words_ids: list[tuple[int, ...]] = field(default_factory=list, repr=False)  # params.bad_words' sequences
    pending_prompt_logprobs: object | None = field(default=None, repr=False)  # the engine's, until its first token

    def take_new_text(self) -> str:
        """The text detokenized since the last call (stop strings cut; held-back text that may
        start a stop string comes once decided)."""
        text = "".join(self._new_text)
        self._new_text.clear()
        return text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def masked(self) -> bool:
        """Some of its draws are masked (a grammar, allowed_token_ids or bad_words:
        ``engine.token_masks``)."""
        return self.grammar is not None or self.allowed_mask is not None or bool(self.bad_words_ids)

    @property
    def prompt_computed(self) -> bool:
        """Its whole prompt is in the cache: it decodes."""
        return self.num_prompt_computed == len(self.prompt_token_ids)

    def completes_prompt(self, start: int, count: int) -> bool:
        """A chunk of ``count`` prompt tokens from position ``start`` is the prompt's last."""
        return start + count == len(self.prompt_token_ids)

    def output(self, index: int = 0) -> RequestOutput:
        """What it has generated so far, as sequence ``index`` of its prompt."""
        text = None if self.detokenizer is None else self.detokenizer.text
        logprobs = cumulative = None
        if self.params.logprobs is not None:
            logprobs = list(self.output_logprobs)
            cumulative = sum(entry[token].logprob for token, entry in zip(self.output_token_ids, logprobs))
        completion = CompletionOutput(index, text, list(self.output_token_ids),
                                      None if self.finish_reason is None else self.finish_reason.value,
                                      self.stop_reason, logprobs, cumulative)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), [completion], self.finished,
                             self.metrics, self.prompt_logprobs)


def samples_output(samples: Sequence[Request]) -> RequestOutput:
    """One prompt's ``RequestOutput`` from the requests of its samples (``SamplingParams.samples``):
    the first sample's request id, ``outputs[i]`` sample i's; finished when all are; metrics from
    the first arrival to the last finish."""
    outputs = [request.output(index) for index, request in enumerate(samples)]
    if len(outputs) == 1:
        return outputs[0]
    times = [o.metrics for o in outputs]
    first_tokens = [m.first_token_time for m in times if m.first_token_time is not None]
    finished = all(o.finished for o in outputs)
    metrics = RequestMetrics(min(m.arrival_time for m in times), min(first_tokens, default=None),
                             max(m.finished_time for m in times) if finished else None)
    return RequestOutput(outputs[0].request_id, outputs[0].prompt, outputs[0].prompt_token_ids,
                         [o.outputs[0] for o in outputs], finished, metrics, outputs[0].prompt_logprobs)
