"""A chat reply's text split into reasoning, content and tool calls, as vLLM's
``--reasoning-parser qwen3`` and ``--tool-call-parser qwen3_coder`` split Qwen3.5's replies.

Qwen3.5's reply format (its chat template opens the reply with ``<think>\\n`` unless the request's
``chat_template_kwargs`` set ``enable_thinking`` false)::

    REASONING\\n</think>\\n\\nCONTENT\\n\\n<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n
    </function>\\n</tool_call>

``ReplyParser`` takes a reply's text as it streams (``feed`` per new piece, then ``finish``) and
returns each step's ``ReplyDelta``: new reasoning, new content and the tool calls completed. A
whole reply goes through the same calls (``ReplyParsing.parse``), so a streamed answer and a whole
one say the same, however the text is cut into pieces.

- Reasoning (a reasoning parser): the text before ``</think>`` when the prompt ends inside a think
  block (``ReplyParsing.opened_by_prompt``: the rendered prompt ends with ``<think>`` and
  whitespace) or the reply opens one (``<think>`` before any other text); a reply cut short before
  ``</think>`` is all reasoning. With tool parsing, ``<tool_call>`` also ends it (vLLM's). Newlines
  around the reasoning, and before the content that follows, are dropped.
- Tool calls (a tool parser and tools in the request): each ``<tool_call>...</tool_call>`` block's
  ``<function=NAME>...</function>`` is a ``ToolCall`` whose arguments are a JSON object of its
  ``<parameter=ARG>VALUE</parameter>`` s (one newline either side of VALUE dropped; a missing
  ``</parameter>`` ends at the next parameter or ``</function>``). A value is converted by the type
  the tool's JSON schema gives its parameter, as vLLM's qwen3_coder parser converts it: integer,
  number, boolean, object, array, or null for "null"; a string, a parameter of unknown type or a
  value that does not convert stays the string. A block that does not parse stays in the content as
  its text; a block the reply's end cuts short is parsed when its functions are complete.
  Whitespace around a call is dropped, but for what separates text after it from earlier content.
  ``max_tool_calls`` (``parallel_tool_calls`` false: 1)
  drops the calls past it.
- Forced calls (``ReplyParsing.forced``: a request's ``tool_choice`` "required" or a named
  function, whose grammar makes the reply JSON, as vLLM's): the content is the call and comes
  back as calls at the reply's end, not as text. A named function's arguments are the reply's
  JSON object as written; "required" replies ``[{"name": ..., "parameters": {...}}, ...]``, each
  item a call. A reply that is not that JSON (cut short by max_tokens) stays content.
"""

from __future__ import annotations

import json
import math
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"

REASONING_PARSERS = ("qwen3",)
"""``fuselm serve --reasoning-parser`` names (vLLM's): Qwen3 / Qwen3.5 ``<think>`` blocks."""
TOOL_CALL_PARSERS = ("qwen3_coder",)
"""``fuselm serve --tool-call-parser`` names (vLLM's): Qwen3-Coder / Qwen3.5 XML tool calls."""

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
_INTEGER = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class ToolCall:
    """A function call of the reply: its ``name``, its ``arguments`` as a JSON object's text, and an
    ``id`` of OpenAI's form ("call_" and 24 hex digits)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_json(self, index: int | None = None) -> dict:
        """OpenAI's ``tool_calls`` entry (``index``: a stream chunk's, which carries it)."""
        entry = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


@dataclass
class ReplyDelta:
    """What a piece of a reply added: ``reasoning`` and ``content`` text, completed ``tool_calls``."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ReplyDelta) -> ReplyDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


@dataclass(frozen=True)
class ReplyParsing:
    """How a chat request's replies are parsed: ``reasoning`` (a reasoning parser runs),
    ``opened_by_prompt`` (the prompt ends inside a think block), ``tools`` (the request's tools,
    whose calls are parsed; None: no tool parsing) and ``max_tool_calls`` (None: no limit)."""

    reasoning: bool
    opened_by_prompt: bool = False
    tools: tuple[Mapping, ...] | None = None
    max_tool_calls: int | None = None
    forced: str | None = None  # "required", or the function a named tool_choice forces (module docstring)

    @classmethod
    def of_prompt(cls, prompt: str, reasoning: bool, tools: Sequence[Mapping] | None = None,
                  max_tool_calls: int | None = None, forced: str | None = None) -> ReplyParsing:
        """The parsing of replies to ``prompt`` (the rendered chat prompt's text)."""
        opened = reasoning and prompt.rstrip().endswith(THINK_START)
        return cls(reasoning, opened, None if tools is None else tuple(tools), max_tool_calls, forced)

    def parser(self) -> ReplyParser:
        """A parser for one reply (one per choice of a stream)."""
        return ReplyParser(self)

    def parse(self, text: str) -> ReplyDelta:
        """A whole reply's reasoning, content and tool calls."""
        parser = self.parser()
        delta = parser.feed(text)
        delta += parser.finish()
        return delta


_OPENING, _REASONING, _CONTENT, _TOOL_CALL = "opening", "reasoning", "content", "tool_call"


def _partial_marker(text: str, markers: Sequence[str]) -> int:
    """The length of ``text``'s longest end that begins a marker (it may be one once more text comes)."""
    for length in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(marker.startswith(text[-length:]) for marker in markers):
            return length
    return 0


class ReplyParser:
    """One reply's parser (module docstring): ``feed`` its text piece by piece, then ``finish``."""

    def __init__(self, parsing: ReplyParsing):
        self.parsing = parsing
        self.parse_tools = parsing.tools is not None and parsing.forced is None
        self._forced_text = ""  # a forced call's JSON, until the reply ends
        self._properties = _parameter_schemas(parsing.tools or ())
        self.tool_calls = 0  # calls returned so far
        self._buffer = ""
        self._done = False
        self._has_content = False  # content text returned so far
        state = _REASONING if parsing.opened_by_prompt else _OPENING if parsing.reasoning else _CONTENT
        self._enter(state)

    def feed(self, text: str) -> ReplyDelta:
        if self._done:
            raise RuntimeError("ReplyParser.feed after finish")
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> ReplyDelta:
        """The rest, at the reply's end: held-back text, a cut-short block."""
        if self._done:
            raise RuntimeError("ReplyParser.finish called twice")
        self._done = True
        out = self._run(final=True)
        if self.parsing.forced is not None:
            calls = _forced_calls(self._forced_text, self.parsing.forced)
            if calls is None:
                out.content += self._forced_text
            else:
                out.tool_calls += calls if self.parsing.max_tool_calls is None else calls[:self.parsing.max_tool_calls]
                self.tool_calls += len(out.tool_calls)
        return out

    # -- sections ------------------------------------------------------------------------------
    def _enter(self, state: str, after_call: bool = False) -> None:
        """Start a section: what its start and end drop (leading / trailing characters)."""
        self._state, self._started, self._held = state, False, ""
        if state == _REASONING:
            self._leading, self._trailing = "\n", "\n"
        elif after_call:  # whitespace between calls goes; text after a call keeps what separates it from earlier text
            self._leading, self._trailing = "" if self._has_content else string.whitespace, string.whitespace
        else:
            self._leading, self._trailing = "\n", string.whitespace if self.parse_tools else ""

    def _text(self, out: ReplyDelta, text: str, end: str | None) -> None:
        """Add a section's text to ``out``. ``end``: None (more may follow: trailing characters are
        held back), "marker" (a marker closes the section: they are dropped), "final" (the reply's
        end: dropped after reasoning or a tool call, kept otherwise)."""
        if not self._started:
            text = text.lstrip(self._leading)
            self._started = bool(text)
        text, self._held = self._held + text, ""
        if end == "marker" or (end == "final" and (self._state == _REASONING or self.tool_calls)):
            text = text.rstrip(self._trailing)
        elif end is None:
            kept = text.rstrip(self._trailing)  # ("" strips nothing)
            text, self._held = kept, text[len(kept):]
        if self._state == _REASONING:
            out.reasoning += text
        elif self.parsing.forced is not None:
            self._forced_text += text
        else:
            out.content += text
            self._has_content = self._has_content or bool(text)

    def _run(self, final: bool) -> ReplyDelta:
        out = ReplyDelta()
        while True:
            buffer = self._buffer
            if self._state == _OPENING:  # may the reply open a think block itself?
                opening = buffer.lstrip()
                if opening.startswith(THINK_START):
                    self._buffer = opening[len(THINK_START):]
                    self._enter(_REASONING)
                elif not final and THINK_START.startswith(opening):
                    return out
                else:
                    self._enter(_CONTENT)
                continue
            if self._state == _TOOL_CALL:
                end = buffer.find(TOOL_CALL_END)
                if end < 0 and not final:
                    return out
                block, self._buffer = (buffer, "") if end < 0 else (buffer[:end], buffer[end + len(TOOL_CALL_END):])
                calls = _parse_block(block, self._properties)
                if calls is None:  # not a call: the content keeps its text, and the whitespace before it
                    before = self._held
                    self._enter(_CONTENT, after_call=bool(self.tool_calls))
                    self._started = True
                    self._text(out, before + TOOL_CALL_START + block + (TOOL_CALL_END if end >= 0 else ""), None)
                    continue
                limit = self.parsing.max_tool_calls
                kept = calls if limit is None else calls[:max(0, limit - self.tool_calls)]
                out.tool_calls += kept
                self.tool_calls += len(kept)
                self._enter(_CONTENT, after_call=True)
                continue
            if self._state == _REASONING:
                markers = (THINK_END, TOOL_CALL_START) if self.parse_tools else (THINK_END,)
            else:
                markers = (TOOL_CALL_START,) if self.parse_tools else ()
            found = [(index, marker) for marker in markers if (index := buffer.find(marker)) >= 0]
            if not found:
                held = 0 if final or not markers else _partial_marker(buffer, markers)
                self._text(out, buffer[:len(buffer) - held], "final" if final else None)
                self._buffer = buffer[len(buffer) - held:]
                return out
            index, marker = min(found)
            # a block's whitespace before it is held until the block parses (dropped) or not (kept)
            self._text(out, buffer[:index], "marker" if self._state == _REASONING else None)
            if marker == THINK_END:
                self._buffer = buffer[index + len(THINK_END):]
                self._enter(_CONTENT)
            else:  # <tool_call>: a call begins (and ends the reasoning)
                self._buffer = buffer[index + len(TOOL_CALL_START):]
                self._state = _TOOL_CALL


def _forced_calls(text: str, forced: str) -> list[ToolCall] | None:
    """A forced reply's calls (module docstring), or None when its text is not the JSON they take."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if forced != "required":
        return [ToolCall(forced, text.strip())] if isinstance(value, dict) else None
    if not isinstance(value, list) or not all(
            isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("parameters"), dict)
            for item in value):
        return None
    return [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value]


def forced_call_schema(tools: Sequence[Mapping], forced: str, max_calls: int | None = None) -> dict:
    """The JSON schema a forced reply follows (vLLM's): a named function's parameters (any object
    when it has none), or for "required" a list of at least one ``{"name", "parameters"}`` item of
    the tools (at most ``max_calls``)."""
    def parameters(function: Mapping) -> Mapping:
        schema = function.get("parameters")
        return schema if isinstance(schema, Mapping) and schema else {"type": "object"}

    functions = [tool.get("function") or {} for tool in tools]
    if forced != "required":
        return dict(next(parameters(f) for f in functions if f.get("name") == forced))
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                               "parameters": parameters(f)},
              "required": ["name", "parameters"]} for f in functions]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def _parameter_schemas(tools: Sequence[Mapping]) -> dict[str, Mapping]:
    """{function name: its parameters' JSON schemas by name} of OpenAI-format tools."""
    schemas = {}
    for tool in tools:
        function = tool.get("function") or {}
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        schemas[function.get("name")] = properties if isinstance(properties, Mapping) else {}
    return schemas


def _schema_type(schema: Any) -> str | None:
    """A parameter schema's type ("string", "integer", ...; the first that is not "null" of a list)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def convert_argument(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type says (module docstring)."""
    kind = _schema_type(schema)
    if kind in (None, "string"):
        return value
    text = value.strip()
    if text.lower() == "null":
        return None
    if kind == "integer":
        return int(text) if _INTEGER.fullmatch(text) else value
    if kind == "number":
        if _INTEGER.fullmatch(text):
            return int(text)
        try:
            number = float(text)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), value)
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return value
    if kind == "object" and not isinstance(parsed, dict) or kind == "array" and not isinstance(parsed, list):
        return value
    return parsed


def _parse_block(block: str, properties: Mapping[str, Mapping]) -> list[ToolCall] | None:
    """The calls of one ``<tool_call>`` block's text, or None when it is not one or more complete
    functions (with nothing but whitespace around them)."""
    calls, position = [], 0
    for function in _FUNCTION.finditer(block):
        name = function.group(1).strip()
        if block[position:function.start()].strip() or not name:
            return None
        position = function.end()
        body, arguments, inner = function.group(2), {}, 0
        schemas = properties.get(name, {})
        for parameter in _PARAMETER.finditer(body):
            argument = parameter.group(1).strip()
            if body[inner:parameter.start()].strip() or not argument:
                return None
            inner = parameter.end()
            value = parameter.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            arguments[argument] = convert_argument(value, schemas.get(argument))
        if body[inner:].strip():
            return None
        calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    if not calls or block[position:].strip():
        return None
    return calls
