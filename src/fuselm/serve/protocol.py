"""The OpenAI HTTP API's shapes: request bodies in (checked, turned into engine inputs), JSON out.

Requests: ``parse_completion_request`` (``POST /v1/completions``) and ``parse_chat_request``
(``POST /v1/chat/completions``) check a decoded JSON body and return a ``GenerationRequest``: the
prompt's token ids, the ``SamplingParams`` (built in one place, ``sampling_params_from_request``)
and how to answer (streamed or not). Anything wrong is an ``APIError`` naming the field.

Fields read (``null`` is the same as absent; other fields, which do not change the answer,
are ignored, as vLLM does):
    model                 must be the served name when given (404 otherwise)
    prompt                completions: a string or a list of token ids, or a list of either (a
                          batch: choices[p n + i] is prompt p's sequence i)
    messages              chat: a list of {"role", "content"} (content: a string or text parts;
                          an assistant's tool_calls with JSON-text arguments, and its reasoning
                          as "reasoning" or "reasoning_content", reach the template as Qwen's reads them)
    tools, tool_choice, parallel_tool_calls
                          chat: OpenAI's function tools, rendered by the chat template; with
                          tool_choice "auto" (the default when tools are given) the server's tool-call
                          parser turns the reply's calls into ``tool_calls`` (finish_reason
                          "tool_calls"); "none" renders the tools and parses nothing; "required" or a
                          named function force a call (vLLM's way: a grammar makes the reply the
                          call's compact JSON, returned as ``tool_calls``; no parser needed)
    chat_template_kwargs  chat: extra template variables, e.g. {"enable_thinking": false}
    reasoning_effort      chat: a template variable too, as vLLM passes it
    add_generation_prompt chat: default true
    continue_final_message
                          chat (vLLM's): the prompt ends inside the last message (a prefilled
                          assistant reply the model continues); needs add_generation_prompt false
    echo                  chat (vLLM's): the last message's text, when it is the assistant's, comes
                          back before the reply's content (in the first chunk of a stream)
    max_tokens            (chat: max_completion_tokens wins) default: completions 16, chat the
                          rest of the context; either way at most max_len - prompt tokens
    temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos,
    frequency_penalty, presence_penalty (OpenAI's, in [-2, 2]), repetition_penalty, min_p,
    logit_bias            {"token id": bias in [-100, 100]}, as OpenAI sends it (string keys)
    include_stop_str_in_output, skip_special_tokens, min_tokens, allowed_token_ids, bad_words
                          (vLLM's)  -> SamplingParams
    truncate_prompt_tokens
                          (vLLM's) k >= 1: only the prompt's last k tokens are kept (after the chat
                          template); -1: the last max_len
    n                     sequences for the prompt, 1 .. MAX_N: n engine requests (seeds seed,
                          seed + 1, ... when seeded, as vLLM's), choices[i] / chunks of index i
    stream, stream_options.include_usage, stream_options.continuous_usage_stats (vLLM's: with
                          include_usage, every chunk carries the usage of its sequence so far)
    return_token_ids      (vLLM's) each choice carries its generated "token_ids"
    logprobs              completions: an int k in [0, MAX_LOGPROBS]; chat: true or false, with
    top_logprobs          chat: k in [0, MAX_LOGPROBS] (needs logprobs true) -> each generated
                          token's log-probability, and the k most likely tokens' (OpenAI's shapes:
                          ``logprobs`` of each choice or chunk; -inf is written -9999.0, as vLLM)
    echo                  completions: the prompt comes back before the text (the first chunk of
                          a stream), and with logprobs its tokens' too (the first one's null), as
                          lm-eval's loglikelihood requests read them
    prompt_logprobs       (vLLM's) k in [0, MAX_LOGPROBS]: each prompt token's log-probability and
                          rank, and the k most likely tokens there, in vLLM's shape (a list, null for
                          the first token, of {"token id": {"logprob", "rank", "decoded_token"}}):
                          completions per choice, chat beside the choices; not with stream
    response_format       {"type": "text"}, {"type": "json_object"} (any JSON object), {"type":
                          "json_schema", "json_schema": {"name", "schema", ...}}: the output follows
                          the schema (structured outputs: ``SamplingParams.structured_outputs``), or
                          vLLM's {"type": "structural_tag", "structures": [{"begin", "schema", "end"}],
                          "triggers": [...]}: free text in which each trigger starts a tagged JSON value
    structured_outputs    (vLLM's) {"json" | "regex" | "choice" | "grammar" | "json_object" |
                          "structural_tag": ..., "disable_any_whitespace"?}; vLLM's older guided_json,
                          guided_regex, guided_choice, guided_grammar and structural_tag (JSON text)
                          likewise (one of these fields at most)
Fields that would change the answer but are not implemented (``UNSUPPORTED_FIELDS``: best_of > 1,
the legacy functions, and vLLM's own: beam search, logits processors ...) are refused with a 400
naming them unless they hold their neutral value.

Chat replies are parsed (``fuselm.serve.reply_parser``) when the server runs a reasoning parser
(the message's ``reasoning``, and ``reasoning_content`` as DeepSeek and SGLang name it, beside its
``content``) or a tool-call parser (``tool_calls``); streamed chunks carry the same fields as deltas.

Responses: ``CompletionFormat`` and ``ChatFormat`` write OpenAI's answer and stream-chunk JSON
for their endpoint; ``token_usage``, ``model_list`` and ``APIError.body`` the rest.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from fuselm.engine.request import MAX_LOGPROBS, Logprob, SamplingParams, StructuredOutputsParams, TokenLogprobs
from fuselm.engine.structured_outputs import check_grammar
from fuselm.serve.reply_parser import (REASONING_PARSERS, THINK_END, TOOL_CALL_PARSERS, ReplyParser, ReplyParsing,
                                      forced_call_schema)

MAX_N = 128
"""Largest ``n`` (sequences a request asks for per prompt) taken: OpenAI's limit."""
MAX_REQUEST_SEQUENCES = 4096
"""Most sequences (prompts x n) one request may ask for."""

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""``max_tokens`` of a completion request that gives none (OpenAI's default); chat requests
default to the rest of the context."""


class APIError(Exception):
    """A request that gets an error answer: HTTP ``status`` and OpenAI's error JSON
    ``{"error": {"message", "type", "param", "code"}}`` (``body``)."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
             413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    @property
    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def param_named_by(error: Exception, renames: Mapping[str, str]) -> str | None:
    """The request field an engine error is about. ``SamplingParams`` and ``Engine.add_request``
    start their messages with the argument's name ("max_tokens: ..."); ``renames`` maps those
    names to the request's field names (e.g. prompt_token_ids -> prompt)."""
    match = re.match(r"(\w+):", str(error))
    if match is None:
        return None
    return renames.get(match.group(1), match.group(1))


# ================================================================================== request fields
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def absent_or(*neutral) -> Callable[[Any], bool]:
    """A test for an unsupported field's neutral values: None or one of ``neutral`` (numbers by
    value, never a bool for a number)."""
    def is_neutral(value) -> bool:
        if value is None:
            return True
        if _is_number(value):
            return any(_is_number(n) and value == n for n in neutral)
        return any(type(value) is type(n) and value == n for n in neutral)
    return is_neutral


# Documented fields that would change the answer and are not implemented: a request may send
# them only with the neutral value (a 400 naming the field otherwise, never a silent ignore).
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "best_of": absent_or(1),
    # vLLM's own (its extra_body): users of a vLLM server send them
    "use_beam_search": absent_or(False),
    "length_penalty": absent_or(1),
    "spaces_between_special_tokens": absent_or(True),
    "logits_processors": absent_or(),
    "guided_whitespace_pattern": absent_or(),
}
COMPLETION_UNSUPPORTED_FIELDS = {**UNSUPPORTED_FIELDS, "suffix": absent_or("")}
CHAT_UNSUPPORTED_FIELDS = {
    **UNSUPPORTED_FIELDS,
    "chat_template": absent_or(),
    "documents": absent_or([]),
    "functions": absent_or([]),
    "function_call": absent_or("none", "auto"),
    "modalities": absent_or(["text"]),
    "audio": absent_or({}),
    "prediction": absent_or({}),
}


def reject_unsupported(body: Mapping, unsupported: Mapping[str, Callable[[Any], bool]]) -> None:
    for name, is_neutral in unsupported.items():
        if name in body and not is_neutral(body[name]):
            raise bad_request(f"{name} is not supported by this server (got {body[name]!r:.100})", name)
    n = body.get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= MAX_N):
        raise bad_request(f"n: expected an int in [1, {MAX_N}], got {n!r:.100}", "n")


def _optional_bool(body: Mapping, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name}: expected true or false, got {value!r:.100}", name)
    return value


def _stream_options(body: Mapping) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage: vLLM's continuous_usage_stats, with include_usage)
    of a request."""
    stream = _optional_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, Mapping):
        raise bad_request(f"stream_options: expected an object, got {options!r:.100}", "stream_options")
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"stream_options.{name}: expected true or false, got {value!r:.100}", "stream_options")
        flags.append(bool(value))
    return stream, flags[0], flags[0] and flags[1]


# ================================================================================== sampling
def _max_tokens_field(body: Mapping, max_tokens_fields: tuple[str, ...]) -> str:
    """The field that sets a request's max_tokens: the first of ``max_tokens_fields`` the body
    sets, else the last one (the name errors use)."""
    return next((name for name in max_tokens_fields if body.get(name) is not None), max_tokens_fields[-1])


# Request fields that go to the SamplingParams field of the same name as they are.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                   "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
                   "skip_special_tokens", "n", "min_tokens", "allowed_token_ids", "bad_words", "truncate_prompt_tokens")


def sampling_params_from_request(body: Mapping, defaults: SamplingParams, *, prompt_tokens: int, max_len: int,
                                 default_max_tokens: int | None, max_tokens_fields: tuple[str, ...],
                                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                                 forced_grammar: StructuredOutputsParams | None = None) -> SamplingParams:
    """The one mapping from a request body to ``SamplingParams``.

    - ``max_tokens``: the first of ``max_tokens_fields`` the body sets (chat:
      max_completion_tokens, then max_tokens); if none, ``default_max_tokens`` capped by the room
      left in the context (``max_len - prompt_tokens``), or all of that room when the default is
      None. ``prompt_tokens + max_tokens`` must fit in ``max_len``; errors name the field that
      set it (the last of ``max_tokens_fields`` when none did).
    - ``SAMPLING_FIELDS`` (temperature, top_p, top_k, min_p, the penalties, seed, stop,
      stop_token_ids, ignore_eos, include_stop_str_in_output, skip_special_tokens, n): the
      body's value when set, else ``defaults``' (the checkpoint's generation_config sampling). A
      negative seed (OpenAI's are any int64) is taken modulo 2**63, the engine's seeds.
    - ``logprobs``, ``prompt_logprobs``: SamplingParams', read from the body by the endpoint (its
      fields differ).
    - structured outputs: the body's (``structured_outputs_of_request``), or ``forced_grammar`` (a
      chat request's forced tool call); not both.
    SamplingParams checks every value; a bad one is an APIError 400 naming the request field."""
    room = max_len - prompt_tokens
    max_tokens_field = _max_tokens_field(body, max_tokens_fields)
    if body.get(max_tokens_field) is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    else:
        max_tokens = body[max_tokens_field]
    overrides = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    overrides.update({name: value for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs))
                      if value is not None})
    if body.get("logit_bias") is not None:
        overrides["logit_bias"] = _logit_bias(body["logit_bias"])
    structured, structured_field = structured_outputs_of_request(body)
    if structured is not None and forced_grammar is not None:
        raise bad_request(f"{structured_field}: a forced tool call (tool_choice) already constrains the output",
                          structured_field)
    if forced_grammar is not None:
        structured, structured_field = forced_grammar, "tool_choice"
    if structured is not None:
        overrides["structured_outputs"] = structured
    seed = overrides.get("seed")
    if _is_int(seed) and -2**63 <= seed < 0:  # OpenAI's seeds are int64; the engine's 63-bit
        overrides["seed"] = seed % 2**63
    try:
        params = dataclasses.replace(defaults, max_tokens=max_tokens, **overrides)
    except (ValueError, TypeError) as error:
        raise bad_request(str(error), param_named_by(error, {"max_tokens": max_tokens_field,
                                                             "structured_outputs": structured_field})) from None
    if params.max_tokens > room:
        raise bad_request(f"This model's maximum context length is {max_len} tokens. However, you requested "
                          f"{prompt_tokens + params.max_tokens} tokens ({prompt_tokens} in the prompt, "
                          f"{params.max_tokens} in the completion). Please reduce the prompt or "
                          f"{max_tokens_field}.", max_tokens_field)
    return params


# vLLM's older structured-output fields (its top-level structural_tag too): each is one
# StructuredOutputsParams field.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "structural_tag": "structural_tag"}
# StructuredOutputsParams fields a request's ``structured_outputs`` may set; vLLM's others are refused
# unless neutral (its backend choice is ignored: there is one).
_STRUCTURED_KEYS = tuple(field.name for field in dataclasses.fields(StructuredOutputsParams))
_STRUCTURED_IGNORED = ("backend", "disable_fallback")


def structured_outputs_of_request(body: Mapping) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the request's ``StructuredOutputsParams`` or None, the field that set it): from
    ``response_format`` (json_object, json_schema), ``structured_outputs`` or a ``guided_*`` field,
    at most one of them; the grammar compiles (a 400 naming the field otherwise: the check needs no
    vocabulary, the engine compiles it again over its tokenizer's)."""
    given = [name for name in ("response_format", "structured_outputs", *GUIDED_FIELDS) if body.get(name) is not None]
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, Mapping):
            raise bad_request(f"response_format: expected an object with a 'type', got {response_format!r:.100}",
                              "response_format")
        if response_format.get("type") == "text":
            given.remove("response_format")
    if len(given) > 1:
        raise bad_request(f"{given[1]}: only one of {given} may constrain the output", given[1])
    if not given:
        return None, None
    field = given[0]
    if field == "response_format":
        kind = response_format.get("type")
        if kind == "json_object":
            options = {"json_object": True}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, Mapping) else None
            if schema is None:
                raise bad_request("response_format.json_schema: expected an object with a 'schema' (and a 'name')",
                                  field)
            options = {"json": schema}
        elif kind == "structural_tag":
            if response_format.get("format") is not None:
                raise bad_request("response_format: a structural tag's \"format\" form is not supported; send "
                                  "\"structures\" and \"triggers\"", field)
            options = {"structural_tag": {key: response_format.get(key) for key in ("structures", "triggers")}}
        else:
            raise bad_request(f"response_format.type: expected \"text\", \"json_object\", \"json_schema\" or "
                              f"\"structural_tag\", got {kind!r:.100}", field)
    elif field == "structured_outputs":
        value = body[field]
        if not isinstance(value, Mapping):
            raise bad_request(f"structured_outputs: expected an object, got {value!r:.100}", field)
        unknown = [key for key, item in value.items()
                   if key not in _STRUCTURED_KEYS + _STRUCTURED_IGNORED and item not in (None, False)]
        if unknown:
            raise bad_request(f"structured_outputs: {unknown} are not supported by this server (it takes "
                              f"{list(_STRUCTURED_KEYS)})", field)
        options = {key: value[key] for key in _STRUCTURED_KEYS if value.get(key) is not None}
    else:
        options = {GUIDED_FIELDS[field]: body[field]}
    try:
        params = StructuredOutputsParams(**options)
        check_grammar(params)
    except ValueError as error:
        raise bad_request(str(error).replace("structured_outputs", field, 1), field) from None
    return params, field


def _logit_bias(value) -> dict[int, float]:
    """OpenAI's logit_bias, {"token id": bias} (JSON keys are strings), as SamplingParams takes it;
    the ids' and biases' ranges are SamplingParams' and the engine's checks."""
    if not isinstance(value, Mapping):
        raise bad_request(f"logit_bias: expected an object of token ids to biases, got {value!r:.100}", "logit_bias")
    bias = {}
    for key, number in value.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not _is_int(token):
            raise bad_request(f"logit_bias: expected token ids as keys, got {key!r:.50}", "logit_bias")
        bias[token] = number
    return bias


# ================================================================================== requests
@dataclass
class Prompt:
    """One prompt of a request: its ``text`` when it came as text, its ``token_ids`` and the
    ``params`` it runs with (max_tokens depends on the prompt's length)."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams


@dataclass
class GenerationRequest:
    """A checked completion or chat request: what the engine runs (``prompts``: a completion
    request may send several, a chat request has one; each asks for ``params.n`` sequences) and
    how to answer (``stream``, ``include_usage``: a last streamed chunk with the usage,
    ``return_token_ids``: choices carry their token ids). ``prompt_field`` and
    ``max_tokens_field``: the request fields that set the prompt ("prompt" or "messages") and
    max_tokens, named by errors the engine raises later; ``echo``: the prompt comes back before
    each choice's text (completions)."""

    prompts: list[Prompt]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    prompt_field: str
    max_tokens_field: str
    echo: bool = False
    reply_parsing: ReplyParsing | None = None  # chat: how its replies are parsed (None: not at all)
    prompt_logprobs: int | None = None  # vLLM's field: the answer carries the prompt's logprobs
    echo_text: str | None = None  # chat's echo: the last (assistant) message's text, before the reply
    grammar_starts_after: int | None = None  # structured outputs after the thinking: the end-of-thinking id
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: every chunk carries usage

    @property
    def logprobs(self) -> int | None:
        """The top log-probabilities asked for per token (None: no logprobs), the same for every prompt."""
        return self.prompts[0].params.logprobs

    @property
    def prompt_tokens(self) -> int:
        """The usage's prompt_tokens: every prompt's, each counted once whatever its n."""
        return sum(len(prompt.token_ids) for prompt in self.prompts)

    def param_of(self, error: Exception) -> str | None:
        """The request field an ``Engine.add_request`` error names."""
        return param_named_by(error, {"prompt": self.prompt_field, "prompt_token_ids": self.prompt_field,
                                      "max_tokens": self.max_tokens_field})


def check_model(body: Mapping, served_name: str) -> None:
    """A request's ``model``, when given, must be the served name: APIError 404 otherwise."""
    model = body.get("model")
    if model is not None and model != served_name:
        raise APIError(404, f"The model `{model!s:.100}` does not exist (this server serves `{served_name}`).",
                       "model")


def _encode(tokenizer, text: str, field: str, add_special_tokens: bool = False, param: str | None = None) -> list[int]:
    """``tokenizer.encode(text)``; text it cannot take (a lone surrogate, which JSON's \\u escapes
    can carry but UTF-8 cannot) is a 400 naming ``field`` (the request field ``param``, default
    ``field``)."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (TypeError, ValueError, UnicodeError) as error:
        raise bad_request(f"{field}: the text cannot be tokenized ({error})", param or field) from None


def _token_ids(value: list, where: str) -> list[int]:
    """``value`` as a prompt of token ids: a 400 naming ``where`` (and the element) otherwise."""
    if not value:
        raise bad_request(f"{where}: the prompt is empty (0 tokens)", "prompt")
    bad = next((i for i, token in enumerate(value) if not _is_int(token)), None)
    if bad is not None:
        raise bad_request(f"{where}[{bad}]: expected a token id (an int), got {value[bad]!r:.100}", "prompt")
    return list(value)


def _completion_prompts(prompt, tokenizer, no_tokenizer_reason: str) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) of each prompt of a completion request's ``prompt``: a string, a
    list of token ids, or a list of either (a batch). Errors name the prompt (``prompt[i]`` in a
    batch)."""
    if prompt is None:
        raise bad_request("prompt is required: a string or a list of token ids, or a list of either", "prompt")
    if isinstance(prompt, str):
        items, names = [prompt], ["prompt"]
    elif isinstance(prompt, list) and prompt and all(isinstance(token, (int, float)) for token in prompt):
        return [(None, _token_ids(prompt, "prompt"))]  # one prompt of ids (or numbers that are not)
    elif isinstance(prompt, list) and prompt:
        items, names = prompt, [f"prompt[{index}]" for index in range(len(prompt))]
    else:
        raise bad_request(f"prompt: expected a string or a list of token ids (ints), or a non-empty list of "
                          f"either, got {prompt!r:.100}", "prompt")
    prompts = []
    for item, where in zip(items, names):
        if isinstance(item, list):
            prompts.append((None, _token_ids(item, where)))
        elif isinstance(item, str):
            if tokenizer is None:
                raise bad_request(f"{where}: this server has no tokenizer ({no_tokenizer_reason}): send the prompt "
                                  f"as a list of token ids", "prompt")
            prompts.append((item, _encode(tokenizer, item, where, param="prompt")))
        else:
            raise bad_request(f"{where}: expected a string or a list of token ids (ints), got {item!r:.100}",
                              "prompt")
    return prompts


def in_batch(error: APIError, index: int, count: int) -> APIError:
    """``error`` about prompt ``index`` of a batch of ``count``: its message starts with
    ``prompt[index]`` (unchanged for a batch of one)."""
    if count == 1 or error.message.startswith(f"prompt[{index}]"):
        return error
    message = error.message.removeprefix("prompt: ")
    return APIError(error.status, f"prompt[{index}]: {message}", error.param)


def truncated_prompt(body: Mapping, ids: list[int], max_len: int) -> list[int]:
    """The prompt's ids the request keeps: with ``truncate_prompt_tokens`` k, the last k (-1: the
    last max_len, as vLLM's), else all; a 400 naming the field for another value."""
    keep = body.get("truncate_prompt_tokens")
    if keep is None:
        return ids
    if not _is_int(keep) or not (keep == -1 or 1 <= keep <= max_len):
        raise bad_request(f"truncate_prompt_tokens: expected -1 or an int in [1, {max_len}] (max_len), got "
                          f"{keep!r:.100}", "truncate_prompt_tokens")
    return ids[-(max_len if keep == -1 else keep):]


def _check_prompt_length(prompt_tokens: int, max_len: int, field: str) -> None:
    if prompt_tokens == 0:
        raise bad_request(f"{field}: the prompt is empty (0 tokens)", field)
    if prompt_tokens >= max_len:
        raise bad_request(f"This model's maximum context length is {max_len} tokens. However, your {field} has "
                          f"{prompt_tokens} tokens, which leaves no room for a completion.", field)


def _prompt_logprobs_field(body: Mapping) -> int | None:
    """vLLM's ``prompt_logprobs`` of a request (None: not asked); a 400 with stream (vLLM's rule)."""
    value = body.get("prompt_logprobs")
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs: expected an int in [0, {MAX_LOGPROBS}], got {value!r:.100}",
                          "prompt_logprobs")
    if body.get("stream"):
        raise bad_request("prompt_logprobs: not available with stream", "prompt_logprobs")
    return value


def _completion_logprobs(body: Mapping):
    """SamplingParams.logprobs of a completion request: its ``logprobs`` (false: off, as absent)."""
    logprobs = body.get("logprobs")
    return None if logprobs is False else logprobs


def parse_completion_request(body: Mapping, tokenizer, defaults: SamplingParams, max_len: int,
                             no_tokenizer_reason: str = "") -> GenerationRequest:
    """Check a ``/v1/completions`` body (the module docstring lists the fields) and tokenize its
    prompt (``tokenizer`` None: token-id prompts only, ``no_tokenizer_reason`` says why)."""
    reject_unsupported(body, COMPLETION_UNSUPPORTED_FIELDS)
    items, prompts = _completion_prompts(body.get("prompt"), tokenizer, no_tokenizer_reason), []
    sequences = len(items) * (body.get("n") or 1)
    if sequences > MAX_REQUEST_SEQUENCES:
        raise bad_request(f"{len(items)} prompts x n = {body.get('n') or 1} are {sequences} sequences; a request may "
                          f"ask for {MAX_REQUEST_SEQUENCES} at most", "prompt" if len(items) > 1 else "n")
    echo, logprobs = _optional_bool(body, "echo", False), _completion_logprobs(body)
    asked = _prompt_logprobs_field(body)
    # the engine computes one top count a prompt: the larger of echo's (with logprobs) and the field's
    wanted = [k for k in (logprobs if echo else None, asked) if isinstance(k, int) and not isinstance(k, bool)]
    prompt_logprobs = max(wanted) if wanted else None
    for index, (text, ids) in enumerate(items):
        try:
            kept = truncated_prompt(body, ids, max_len)
            if len(kept) < len(ids):  # (echo sends back what the model read)
                text, ids = None, kept
            _check_prompt_length(len(ids), max_len, "prompt")
            params = sampling_params_from_request(body, defaults, prompt_tokens=len(ids), max_len=max_len,
                                                  default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS,
                                                  max_tokens_fields=("max_tokens",), logprobs=logprobs,
                                                  prompt_logprobs=prompt_logprobs)
        except APIError as error:
            raise in_batch(error, index, len(items)) from None
        prompts.append(Prompt(text, ids, params))
    if tokenizer is None and prompts[0].params.stop:
        raise bad_request(f"stop strings need a tokenizer and this server has none ({no_tokenizer_reason}): use "
                          f"stop_token_ids", "stop")
    stream, include_usage, continuous_usage = _stream_options(body)
    return_token_ids = _optional_bool(body, "return_token_ids", tokenizer is None)
    return GenerationRequest(prompts, stream, include_usage, return_token_ids, "prompt", "max_tokens", echo,
                             prompt_logprobs=asked, continuous_usage=continuous_usage)


# Names apply_chat_template takes itself: a chat_template_kwargs entry may not set them.
_RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools", "documents", "continue_final_message")


def _check_messages(messages) -> None:
    """A chat's messages: a non-empty list of {"role": str, "content": str | text parts | null}."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages is required: a non-empty list of {role, content} objects", "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{index}]: expected an object with a string 'role', got {message!r:.100}",
                              "messages")
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{index}].content: only text parts ({{'type': 'text', 'text': "
                                      f"...}}) are supported, got {part!r:.100}", "messages")
        elif content is not None and not isinstance(content, str):
            raise bad_request(f"messages[{index}].content: expected a string or a list of text parts, got "
                              f"{content!r:.100}", "messages")
        for name in ("reasoning", "reasoning_content"):
            if message.get(name) is not None and not isinstance(message[name], str):
                raise bad_request(f"messages[{index}].{name}: expected a string, got {message[name]!r:.100}",
                                  "messages")


def _template_tool_calls(index: int, calls) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates read them: each function's
    ``arguments`` a dict (OpenAI sends a JSON object's text)."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where}: expected a list of tool calls, got {calls!r:.100}", "messages")
    converted = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}[{k}]: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}, "
                              f"got {call!r:.100}", "messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as error:
                raise bad_request(f"{where}[{k}].function.arguments: not JSON ({error})", "messages") from None
        arguments = {} if arguments is None else arguments
        if not isinstance(arguments, Mapping):
            raise bad_request(f"{where}[{k}].function.arguments: expected a JSON object, got {arguments!r:.100}",
                              "messages")
        converted.append({**call, "function": {**function, "arguments": arguments}})
    return converted


def _template_messages(messages: list) -> list[dict]:
    """The request's (checked) messages as the chat template reads them: content always present (an
    assistant turn of tool calls has none: null), tool calls' arguments as dicts, an assistant's
    ``reasoning`` (vLLM's name) also as ``reasoning_content`` (Qwen's templates' name)."""
    converted = []
    for index, message in enumerate(messages):
        message = {**message, "content": message.get("content")}
        if message.get("reasoning") is not None and message.get("reasoning_content") is None:
            message["reasoning_content"] = message["reasoning"]
        if message.get("tool_calls") is not None:
            message["tool_calls"] = _template_tool_calls(index, message["tool_calls"])
        converted.append(message)
    return converted


_TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _check_tools(tools) -> list | None:
    """A chat request's ``tools``: None, or a list of OpenAI function tools ({"type": "function",
    "function": {"name", "description"?, "parameters"?: a JSON schema object}})."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"tools: expected a list of {{'type': 'function', 'function': ...}} objects, got "
                          f"{tools!r:.100}", "tools")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or tool.get("type", "function") != "function":
            raise bad_request(f"tools[{index}]: expected {{'type': 'function', 'function': {{'name', 'description', "
                              f"'parameters'}}}}, got {tool!r:.100}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise bad_request(f"tools[{index}].function.name: expected 1-64 letters, digits, '_', '-', '.' or ':', "
                              f"got {name!r:.100}", "tools")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise bad_request(f"tools[{index}].function.description: expected a string", "tools")
        if function.get("parameters") is not None and not isinstance(function["parameters"], Mapping):
            raise bad_request(f"tools[{index}].function.parameters: expected a JSON schema object, got "
                              f"{function['parameters']!r:.100}", "tools")
    return tools


def _tool_choice(body: Mapping, tool_call_parser: str | None) -> tuple[list | None, str | None]:
    """(the tools whose calls the reply is parsed for, None: no tool parsing; the forced call:
    "required", a function's name, or None). The tools are the request's (checked by
    ``_chat_prompt``). ``tool_choice`` "auto" (the default when tools are given) parses the reply's
    calls with the server's tool-call parser (a 400 without one); "required" and a named function
    ({"type": "function", "function": {"name"}}) force a call through a grammar (vLLM's: no parser
    needed); "none" parses nothing."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request(f"tool_choice: expected {{'type': 'function', 'function': {{'name': ...}}}}, got "
                              f"{choice!r:.100}", "tool_choice")
        if name not in [(tool.get("function") or {}).get("name") for tool in tools or ()]:
            raise bad_request(f"tool_choice: the function {name!r:.100} is not among the request's tools",
                              "tool_choice")
        return tools, name
    if choice not in ("auto", "none", "required"):
        raise bad_request(f"tool_choice: expected \"auto\", \"none\", \"required\" or a named function, got "
                          f"{choice!r:.100}", "tool_choice")
    if choice == "required":
        if not tools:
            raise bad_request("tool_choice: \"required\" needs tools", "tool_choice")
        return tools, "required"
    if choice == "none" or not tools:
        return None, None
    if tool_call_parser is None:
        raise bad_request("\"auto\" tool choice needs a tool-call parser: start the server with "
                          "--enable-auto-tool-choice --tool-call-parser qwen3_coder (or send tool_choice \"none\")",
                          "tool_choice")
    return tools, None


def _chat_prompt(body: Mapping, tokenizer) -> str:
    """The chat template's rendering of the request's messages (and tools)."""
    messages = body.get("messages")
    _check_messages(messages)
    tools = _check_tools(body.get("tools"))
    template_kwargs = _template_kwargs(body)
    add_generation_prompt = _optional_bool(body, "add_generation_prompt", True)
    continue_final_message = _optional_bool(body, "continue_final_message", False)
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message: needs add_generation_prompt false (the prompt ends inside the "
                          "last message, not with a new turn)", "continue_final_message")
    try:
        return tokenizer.apply_chat_template(_template_messages(messages), add_generation_prompt=add_generation_prompt,
                                             tools=tools, continue_final_message=continue_final_message,
                                             **template_kwargs)
    except (ValueError, TypeError) as error:  # the template's own checks, or values it cannot use
        raise bad_request(str(error), "messages") from None


def _template_kwargs(body: Mapping) -> dict:
    """The request's extra chat template variables: ``chat_template_kwargs``, ``reasoning_effort``."""
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is None:
        template_kwargs = {}
    if not isinstance(template_kwargs, Mapping):
        raise bad_request(f"chat_template_kwargs: expected an object, got {template_kwargs!r:.100}",
                          "chat_template_kwargs")
    effort = body.get("reasoning_effort")  # vLLM hands it to the template (Qwen3.5's ignores it)
    if effort is not None:
        if not isinstance(effort, str):
            raise bad_request(f"reasoning_effort: expected a string, got {effort!r:.100}", "reasoning_effort")
        template_kwargs = {"reasoning_effort": effort, **template_kwargs}
    reserved = [name for name in _RESERVED_TEMPLATE_VARIABLES if name in template_kwargs]
    if reserved:
        raise bad_request(f"chat_template_kwargs: {reserved} are set by the request itself", "chat_template_kwargs")
    return dict(template_kwargs)


def _chat_logprobs(body: Mapping) -> int | None:
    """SamplingParams.logprobs of a chat request: ``top_logprobs`` (default 0) when ``logprobs`` is
    true, else None (a top_logprobs above 0 then is a 400, as OpenAI's)."""
    wanted = _optional_bool(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise bad_request(f"top_logprobs: expected an int in [0, {MAX_LOGPROBS}], got {top!r:.100}", "top_logprobs")
    if top and not wanted:
        raise bad_request("top_logprobs: logprobs must be true to ask for top_logprobs", "top_logprobs")
    return (top or 0) if wanted else None


def parse_chat_request(body: Mapping, tokenizer, defaults: SamplingParams, max_len: int,
                       no_tokenizer_reason: str = "", reasoning_parser: str | None = None,
                       tool_call_parser: str | None = None) -> GenerationRequest:
    """Check a ``/v1/chat/completions`` body (the module docstring lists the fields), render its
    messages with the checkpoint's chat template and tokenize them (``tokenizer`` None: a 400,
    ``no_tokenizer_reason`` says why). ``reasoning_parser`` and ``tool_call_parser``: the
    server's (``reply_parser.REASONING_PARSERS``, ``TOOL_CALL_PARSERS``; None: none)."""
    reject_unsupported(body, CHAT_UNSUPPORTED_FIELDS)
    check_reply_parsers(reasoning_parser, tool_call_parser)
    if tokenizer is None:
        raise bad_request(f"chat needs a tokenizer and a chat template, and this server has none "
                          f"({no_tokenizer_reason}): use /v1/completions with a list of token ids", "messages")
    text = _chat_prompt(body, tokenizer)
    parsed_tools, forced = _tool_choice(body, tool_call_parser)
    max_tool_calls = None if _optional_bool(body, "parallel_tool_calls", True) else 1
    reply_parsing = None
    if reasoning_parser is not None or parsed_tools is not None:
        reply_parsing = ReplyParsing.of_prompt(text, reasoning_parser is not None, parsed_tools, max_tool_calls,
                                               forced)
    # (compact JSON: a forced call is read by a program, and free whitespace only costs tokens)
    forced_grammar = None if forced is None else StructuredOutputsParams(
        json=forced_call_schema(parsed_tools, forced, max_tool_calls), disable_any_whitespace=True)
    ids = truncated_prompt(body, _encode(tokenizer, text, "messages"), max_len)
    _check_prompt_length(len(ids), max_len, "messages")
    max_tokens_fields = ("max_completion_tokens", "max_tokens")
    asked = _prompt_logprobs_field(body)
    params = sampling_params_from_request(body, defaults, prompt_tokens=len(ids), max_len=max_len,
                                          default_max_tokens=None, max_tokens_fields=max_tokens_fields,
                                          logprobs=_chat_logprobs(body), prompt_logprobs=asked,
                                          forced_grammar=forced_grammar)
    stream, include_usage, continuous_usage = _stream_options(body)
    # With a reasoning parser and the prompt's think block open, the grammar constrains the answer
    # after it (vLLM's reasoning-aware structured outputs).
    starts_after = None
    if params.structured_outputs is not None and reply_parsing is not None and reply_parsing.opened_by_prompt:
        starts_after = tokenizer.token_to_id(THINK_END)
    return GenerationRequest([Prompt(text, ids, params)], stream, include_usage,
                             _optional_bool(body, "return_token_ids", False), "messages",
                             _max_tokens_field(body, max_tokens_fields), reply_parsing=reply_parsing,
                             grammar_starts_after=starts_after, prompt_logprobs=asked,
                             continuous_usage=continuous_usage,
                             echo_text=_chat_echo(body))


def _chat_echo(body: Mapping) -> str | None:
    """vLLM's chat ``echo``: the last message's text when it is the assistant's (None: no echo)."""
    if not _optional_bool(body, "echo", False):
        return None
    last = body["messages"][-1]
    if last.get("role") != "assistant":
        return None
    content = last.get("content")
    if isinstance(content, list):
        return "".join(part["text"] for part in content)
    return content or ""


def check_reply_parsers(reasoning_parser: str | None, tool_call_parser: str | None) -> None:
    """ValueError naming the argument unless each parser is None or one this server has."""
    for name, value, known in (("reasoning_parser", reasoning_parser, REASONING_PARSERS),
                               ("tool_call_parser", tool_call_parser, TOOL_CALL_PARSERS)):
        if value is not None and value not in known:
            raise ValueError(f"{name}: expected one of {list(known)} or None, got {value!r}")


# ================================================================================== tokenizer routes
def _need_tokenizer(tokenizer, no_tokenizer_reason: str, field: str) -> None:
    if tokenizer is None:
        raise bad_request(f"this server has no tokenizer ({no_tokenizer_reason})", field)


def tokenize_response(body: Mapping, tokenizer, max_len: int, no_tokenizer_reason: str = "") -> dict:
    """``POST /tokenize`` (vLLM's): the token ids of ``prompt`` (a string), or of ``messages``
    rendered by the chat template (with the chat fields: chat_template_kwargs,
    add_generation_prompt, reasoning_effort), as a completion or chat request would send them:
    ``{"count", "max_model_len", "tokens"}``, and ``token_strs`` (the vocabulary strings) with
    ``return_token_strs``."""
    field = "messages" if body.get("messages") is not None else "prompt"
    _need_tokenizer(tokenizer, no_tokenizer_reason, field)
    if body.get("messages") is not None and body.get("prompt") is not None:
        raise bad_request("expected one of prompt and messages, got both", "prompt")
    if field == "messages":
        reject_unsupported(body, CHAT_UNSUPPORTED_FIELDS)  # (tools, chat_template ...: as chat refuses them)
        text = _chat_prompt(body, tokenizer)
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise bad_request(f"prompt: expected a string (or send messages), got {text!r:.100}", "prompt")
    # tokenizer.json's post-processor (Qwen's adds nothing); vLLM's defaults: on for a prompt, off for messages
    add_special_tokens = _optional_bool(body, "add_special_tokens", field == "prompt")
    ids = _encode(tokenizer, text, field, add_special_tokens)
    answer = {"count": len(ids), "max_model_len": max_len, "tokens": ids}
    if _optional_bool(body, "return_token_strs", False):
        answer["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
    return answer


def detokenize_response(body: Mapping, tokenizer, no_tokenizer_reason: str = "") -> dict:
    """``POST /detokenize`` (vLLM's): ``{"tokens": [ids]}`` -> ``{"prompt": text}`` (special tokens
    kept, as vLLM's)."""
    _need_tokenizer(tokenizer, no_tokenizer_reason, "tokens")
    ids = body.get("tokens")
    vocab = tokenizer.vocab_size
    if not isinstance(ids, list) or not all(_is_int(i) and 0 <= i < vocab for i in ids):
        raise bad_request(f"tokens: expected a list of token ids in [0, {vocab}), got {ids!r:.100}", "tokens")
    return {"prompt": tokenizer.decode(ids)}


# ================================================================================== responses
def token_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_card(name: str, created: int, max_len: int) -> dict:
    """``GET /v1/models/{name}``: the served model (OpenAI's model object, vLLM's max_model_len)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "fuselm", "max_model_len": max_len}


def model_list(name: str, created: int, max_len: int) -> dict:
    """``GET /v1/models``: the one served model."""
    return {"object": "list", "data": [model_card(name, created, max_len)]}


@dataclass(frozen=True)
class Echo:
    """A completion's prompt as ``echo`` sends it back before the text: its ``text``, ``token_ids``
    and, with logprobs, their ``TokenLogprobs`` (None for the first token)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None


def echo_of(generation: GenerationRequest, prompt: Prompt, prompt_logprobs: list | None, tokenizer) -> Echo | None:
    """What a choice of ``prompt`` echoes (None unless the request asked for ``echo``): the prompt
    as sent (a token-id prompt decoded, special tokens kept; "" without a tokenizer), its ids and,
    with logprobs, ``prompt_logprobs``."""
    if not generation.echo:
        return None
    text = prompt.text if prompt.text is not None else "" if tokenizer is None else tokenizer.decode(prompt.token_ids)
    return Echo(text, list(prompt.token_ids), prompt_logprobs if generation.logprobs is not None else None)


class ResponseFormat:
    """OpenAI's answer JSON for one request of an endpoint: ``response`` (the whole answer, one
    ``choice`` per sequence), ``first_chunks`` + ``chunk`` per new text of a sequence +
    ``usage_chunk`` (a streamed answer). Choices carry their sequence's ``index``, ``token_ids``
    when ``return_token_ids``, vLLM's ``stop_reason`` (the stop string or stop_token_ids id that
    ended the sequence; null otherwise, the model's eos included) and, when the request asked
    for ``logprobs`` (top log-probabilities per token), the ``TokenLogprobs`` of the choice's or
    chunk's tokens in the endpoint's shape, each token as its text (``tokenizer.token_text``;
    without a tokenizer "token_id:<id>", as vLLM's return_tokens_as_token_ids)."""

    id_prefix: str  # of the request id, as OpenAI's ("cmpl-", "chatcmpl-")
    object_name: str  # of the whole answer
    chunk_object_name: str  # of a streamed chunk
    named_events = False  # streamed events carry an "event: <type>" line (the Responses API's)

    def __init__(self, request_id: str, model: str, return_token_ids: bool, logprobs: int | None = None,
                 tokenizer=None):
        self.request_id, self.model, self.return_token_ids = request_id, model, return_token_ids
        self.logprobs, self.tokenizer = logprobs, tokenizer
        self.created = int(time.time())

    @classmethod
    def for_request(cls, request_id: str, model: str, generation: GenerationRequest, tokenizer=None):
        """The answer format of a checked request (its token ids, logprobs and reply parsing)."""
        return cls(request_id, model, generation.return_token_ids, generation.logprobs, tokenizer)

    def _answer(self, object_name: str, choices: list[dict], **extra) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _with_token_ids(self, choice: dict, token_ids: list[int]) -> dict:
        return {**choice, "token_ids": token_ids} if self.return_token_ids else choice

    def _token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.token_text(token_id)

    def choice(self, index: int, text: str, token_ids: list[int], finish_reason: str,
               stop_reason: str | int | None = None, logprobs: list[TokenLogprobs] | None = None,
               echo: Echo | None = None) -> dict:
        """Sequence ``index`` of the whole answer (``echo``: completions only)."""
        raise NotImplementedError

    def response(self, choices: list[dict], usage: dict) -> dict:
        return self._answer(self.object_name, choices, usage=usage)

    def first_chunks(self, n: int = 1) -> list[dict]:
        return []

    def chunk(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
              stop_reason: str | int | None = None, logprobs: list[TokenLogprobs] | None = None,
              echo: Echo | None = None) -> dict:
        """A streamed chunk of sequence ``index`` (``echo``: its first chunk's, completions only)."""
        raise NotImplementedError

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
        return self._answer(self.chunk_object_name, [], usage=usage)

    def chunks(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
               stop_reason: str | int | None = None, logprobs: list[TokenLogprobs] | None = None,
               echo: Echo | None = None) -> list[dict]:
        """The events a step's new text of sequence ``index`` makes: its ``chunk``."""
        return [self.chunk(index, text, token_ids, finish_reason, stop_reason, logprobs, echo)]

    def closing_chunks(self, usage: dict, include_usage: bool, cut: bool = False) -> list[dict | str]:
        """The events after every sequence's last (or after the error event of a stream ``cut``
        short): the usage chunk when asked for, then [DONE]."""
        return ([self.usage_chunk(usage)] if include_usage else []) + ["[DONE]"]

    def error_chunk(self, error: APIError) -> dict:
        """The event that ends a stream cut short: OpenAI's error JSON."""
        return error.body

    def prompt_logprobs(self, entries: list[TokenLogprobs | None], num_top: int) -> list[dict | None]:
        """vLLM's ``prompt_logprobs`` JSON: per prompt token None (the first) or {"token id":
        {"logprob", "rank", "decoded_token"}} of the token and the ``num_top`` most likely."""
        return [None if entry is None else {
            str(token): {"logprob": _json_logprob(logprob.logprob), "rank": logprob.rank,
                         "decoded_token": self._token(token)}
            for k, (token, logprob) in enumerate(entry.items()) if k == 0 or logprob.rank <= num_top}
            for entry in entries]

    def with_prompt_logprobs(self, response: dict, per_choice: list[list | None], num_top: int) -> dict:
        """The whole ``response`` with each choice's prompt logprobs (vLLM's place: in each choice)."""
        for choice, entries in zip(response["choices"], per_choice):
            choice["prompt_logprobs"] = None if entries is None else self.prompt_logprobs(entries, num_top)
        return response


def _json_logprob(logprob: float) -> float:
    """A log-probability JSON can carry: -inf as -9999.0 (OpenAI's and vLLM's)."""
    return max(logprob, -9999.0)


class CompletionFormat(ResponseFormat):
    """``/v1/completions``: ``text_completion`` objects, the (new) text in ``choices[i].text``;
    logprobs as OpenAI's legacy object: ``tokens``, ``token_logprobs``, ``top_logprobs`` (per
    token {text: logprob} of the sampled token and the k most likely) and ``text_offset`` (each
    token's offset in the sequence's text, counted over the tokens' texts and carried across a
    stream's chunks, as vLLM's). An ``Echo`` puts the prompt's text first, and its tokens first in
    the logprobs (the first token's logprob and top null)."""

    id_prefix, object_name, chunk_object_name = "cmpl-", "text_completion", "text_completion"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._text_offsets: dict[int, int] = {}  # per choice index: where its next streamed token starts

    def _logprobs(self, index: int, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
                  offset: int) -> dict | None:
        if logprobs is None:
            return None
        answer = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, logprobs):
            token = self._token(token_id)
            answer["tokens"].append(token)
            answer["token_logprobs"].append(None if entry is None else _json_logprob(entry[token_id].logprob))
            answer["top_logprobs"].append(None if entry is None else {self._token(t): _json_logprob(lp.logprob)
                                                                      for t, lp in entry.items()})
            answer["text_offset"].append(offset)
            offset += len(token)
        self._text_offsets[index] = offset
        return answer

    def _choice(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
                stop_reason: str | int | None, logprobs: dict | None) -> dict:
        return self._with_token_ids({"index": index, "text": text, "logprobs": logprobs,
                                     "finish_reason": finish_reason, "stop_reason": stop_reason}, token_ids)

    def _with_echo(self, text: str, token_ids: list[int], logprobs: list | None,
                   echo: Echo | None) -> tuple[str, list[int], list | None]:
        """(text, the ids its logprobs are of, those logprobs) with the echoed prompt first."""
        if echo is None:
            return text, token_ids, logprobs
        if logprobs is None:
            return echo.text + text, token_ids, None
        prompt_logprobs = echo.logprobs if echo.logprobs is not None else [None] * len(echo.token_ids)
        return echo.text + text, echo.token_ids + token_ids, list(prompt_logprobs) + list(logprobs)

    def choice(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
               stop_reason: str | int | None = None, logprobs: list[TokenLogprobs] | None = None,
               echo: Echo | None = None) -> dict:
        text, logprob_ids, logprobs = self._with_echo(text, token_ids, logprobs, echo)
        return self._choice(index, text, token_ids, finish_reason, stop_reason,
                            self._logprobs(index, logprob_ids, logprobs, 0))

    def chunk(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
              stop_reason: str | int | None = None, logprobs: list[TokenLogprobs] | None = None,
              echo: Echo | None = None) -> dict:
        offset = self._text_offsets.get(index, 0)
        text, logprob_ids, logprobs = self._with_echo(text, token_ids, logprobs, echo)
        return self._answer(self.chunk_object_name, [self._choice(
            index, text, token_ids, finish_reason, stop_reason, self._logprobs(index, logprob_ids, logprobs, offset))])


class ChatFormat(ResponseFormat):
    """``/v1/chat/completions``: a ``chat.completion`` with the assistant's ``message`` per choice,
    or ``chat.completion.chunk`` s: first ``delta: {"role": "assistant", "content": ""}`` per
    choice, then ``delta: {"content": ...}``. With ``reply_parsing`` (``reply_parser``) the reply
    is split: the message has ``content`` (null when empty), ``reasoning`` and
    ``reasoning_content`` (a reasoning parser; null when none) and ``tool_calls`` (a list, when
    tools are parsed); a delta has those that grew (each tool call whole, with its ``index``), and
    finish_reason "stop" becomes "tool_calls" when the reply called a tool. ``echo_text`` (chat's
    echo) comes before each choice's content: in the message, in the first chunk's delta."""

    id_prefix, object_name, chunk_object_name = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def __init__(self, *args, reply_parsing: ReplyParsing | None = None, echo_text: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.reply_parsing = reply_parsing
        self.echo_text = echo_text  # (chat's echo) before each choice's content
        self._parsers: dict[int, ReplyParser] = {}  # a stream's, by choice index

    @classmethod
    def for_request(cls, request_id: str, model: str, generation: GenerationRequest, tokenizer=None):
        return cls(request_id, model, generation.return_token_ids, generation.logprobs, tokenizer,
                   reply_parsing=generation.reply_parsing, echo_text=generation.echo_text)

    def _finish_reason(self, finish_reason: str | None, tool_calls: int) -> str | None:
        """"tool_calls" for a stop with calls, but after a named forced call ("stop", as OpenAI's and vLLM's)."""
        named = self.reply_parsing is not None and self.reply_parsing.forced not in (None, "required")
        return "tool_calls" if tool_calls and finish_reason == "stop" and not named else finish_reason

    def _message(self, text: str) -> tuple[dict, int]:
        """(the whole reply's message, the number of tool calls in it)."""
        parsing, echo = self.reply_parsing, self.echo_text or ""
        if parsing is None:
            return {"role": "assistant", "content": echo + text}, 0
        reply = parsing.parse(text)
        message = {"role": "assistant", "content": echo + reply.content or None}
        if parsing.reasoning:
            message["reasoning"] = message["reasoning_content"] = reply.reasoning or None
        if parsing.tools is not None:
            message["tool_calls"] = [call.to_json() for call in reply.tool_calls]
        return message, len(reply.tool_calls)

    def _delta(self, index: int, text: str, last: bool) -> tuple[dict, int]:
        """(the delta of choice ``index``'s new ``text``, the number of tool calls it has made so far)."""
        parsing = self.reply_parsing
        if parsing is None:
            return ({"content": text} if text else {}), 0
        parser = self._parsers.setdefault(index, parsing.parser())
        earlier_calls = parser.tool_calls
        reply = parser.feed(text)
        if last:
            reply += parser.finish()
        delta = {}
        if reply.reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reply.reasoning
        if reply.content:
            delta["content"] = reply.content
        if reply.tool_calls:
            delta["tool_calls"] = [call.to_json(earlier_calls + k) for k, call in enumerate(reply.tool_calls)]
        return delta, parser.tool_calls

    def with_prompt_logprobs(self, response: dict, per_choice: list[list | None], num_top: int) -> dict:
        """The chat answer with its prompt's logprobs beside the choices (vLLM's place)."""
        entries = per_choice[0] if per_choice else None
        return {**response, "prompt_logprobs": None if entries is None else self.prompt_logprobs(entries, num_top)}

    def _token_bytes(self, token_id: int) -> list[int]:
        return list(self._token(token_id).encode() if self.tokenizer is None else self.tokenizer.token_bytes(token_id))

    def _top(self, entry: TokenLogprobs) -> list[tuple[int, Logprob]]:
        """The request's ``logprobs`` most likely tokens of one position, in rank order: ``entry``
        less its first item (the sampled token) when that is not one of them."""
        items = list(entry.items())
        return sorted(items[1:] if len(items) > self.logprobs else items, key=lambda item: item[1].rank)

    def _logprob(self, token_id: int, logprob: Logprob) -> dict:
        return {"token": self._token(token_id), "logprob": _json_logprob(logprob.logprob),
                "bytes": self._token_bytes(token_id)}

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None) -> dict | None:
        """OpenAI's chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs: [{token,
        logprob, bytes}, ...]}, ...]}``, top_logprobs the k most likely in rank order."""
        if logprobs is None:
            return None
        return {"content": [{**self._logprob(token_id, entry[token_id]),
                             "top_logprobs": [self._logprob(t, lp) for t, lp in self._top(entry)]}
                            for token_id, entry in zip(token_ids, logprobs)]}

    def choice(self, index: int, text: str, token_ids: list[int], finish_reason: str,
               stop_reason: str | int | None = None, logprobs: list[TokenLogprobs] | None = None,
               echo: Echo | None = None) -> dict:
        message, tool_calls = self._message(text)
        choice = {"index": index, "message": message, "logprobs": self._logprobs(token_ids, logprobs),
                  "finish_reason": self._finish_reason(finish_reason, tool_calls), "stop_reason": stop_reason}
        return self._with_token_ids(choice, token_ids)

    def first_chunks(self, n: int = 1) -> list[dict]:
        return [self._answer(self.chunk_object_name, [{"index": index,
                                                       "delta": {"role": "assistant", "content": self.echo_text or ""},
                                                       "logprobs": None, "finish_reason": None}])
                for index in range(n)]

    def chunk(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
              stop_reason: str | int | None = None, logprobs: list[TokenLogprobs] | None = None,
              echo: Echo | None = None) -> dict:
        delta, tool_calls = self._delta(index, text, finish_reason is not None)
        choice = {"index": index, "delta": delta, "logprobs": self._logprobs(token_ids, logprobs),
                  "finish_reason": self._finish_reason(finish_reason, tool_calls), "stop_reason": stop_reason}
        return self._answer(self.chunk_object_name, [self._with_token_ids(choice, token_ids)])
