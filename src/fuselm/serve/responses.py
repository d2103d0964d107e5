"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: a request becomes a chat
request (``chat_body_of``, then ``protocol.parse_chat_request``: the same template, sampling,
structured outputs and reply parsing), and its reply becomes a Response's output items
(``ResponsesFormat``).

Request fields (``null`` is as absent):
    model                 must be the served name when given (404 otherwise)
    input                 a string (one user message), or a list of items: messages {"role":
                          "user" | "system" | "developer" (a system message) | "assistant",
                          "content": a string or text parts ("input_text" / "output_text")},
                          {"type": "function_call", "call_id", "name", "arguments"} (an assistant
                          turn's calls), {"type": "function_call_output", "call_id", "output"}
                          (a tool message) and {"type": "reasoning", "content": [{"type":
                          "reasoning_text", "text"}]} (the next assistant turn's reasoning)
    instructions          a system message before the input (the leading system and developer
                          messages are joined into one: chat templates take one, first)
    max_output_tokens     the chat's max_completion_tokens (default: the rest of the context)
    temperature, top_p, parallel_tool_calls, stream
    tools                 function tools {"type": "function", "name", "description", "parameters"}
    tool_choice           "auto", "none", "required" or {"type": "function", "name"} (chat's rules:
                          "auto" needs the server's tool-call parser)
    text.format           {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name",
                          "schema"}: structured outputs
    reasoning.effort      passed to the chat template as reasoning_effort (vLLM's way)
    metadata              returned as sent; store, user, service_tier, prompt_cache_key,
                          safety_identifier, stream_options: accepted, change nothing (no
                          response is stored: the answer says "store": false)
    vLLM's sampling extras as chat takes them (top_k, min_p, seed, stop, ...; ``CHAT_EXTRAS``)
Refused with a 400 naming them: previous_response_id and conversation (nothing is stored to go on
from), background, include, top_logprobs, truncation other than "disabled", max_tool_calls,
prompt, tools of other types, input items of other types or with non-text content.

Output items, from the reply as the chat path parses it (reasoning with a reasoning parser, calls
with a tool-call parser or a forced tool_choice): "reasoning" (its text as "reasoning_text"
content), "message" ("output_text" content), "function_call" (call_id, name, arguments), in the
order the reply wrote them. status "completed", or "incomplete" with incomplete_details
{"reason": "max_output_tokens"} when the token limit cut the reply; usage: input_tokens,
output_tokens, output_tokens_details.reasoning_tokens (the output tokens up to the end of the
thinking).

Streaming (server-sent events ``event: <type>`` + ``data: <json>``, each with a sequence_number,
OpenAI's order): response.created, response.in_progress; for each item response.output_item.added,
then for text items response.content_part.added, response.output_text.delta (or
response.reasoning_text.delta) per step, .done, response.content_part.done, and for a call
response.function_call_arguments.delta and .done; response.output_item.done; last
response.completed (or response.incomplete) with the whole response. A request cut short ends
with an "error" event.
"""

from __future__ import annotations

import time
import uuid
from typing import Mapping

from fuselm.engine.request import TokenLogprobs
from fuselm.serve.protocol import (APIError, GenerationRequest, ResponseFormat, absent_or, bad_request,
                                   reject_unsupported)
from fuselm.serve.reply_parser import THINK_END, ReplyDelta, ReplyParser, ToolCall

# Responses fields that would change the answer and are not implemented (a 400 unless neutral).
UNSUPPORTED_FIELDS = {name: absent_or(False, 0, [], "disabled") for name in (
    "previous_response_id", "conversation", "background", "include", "top_logprobs", "truncation",
    "max_tool_calls", "prompt")}
# Fields accepted that change nothing here.
IGNORED_FIELDS = ("store", "user", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options",
                  "metadata")
# vLLM's extra fields that go to the chat request as they are.
CHAT_EXTRAS = ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop",
               "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "skip_special_tokens",
               "include_stop_str_in_output", "allowed_token_ids", "bad_words", "chat_template_kwargs",
               "structured_outputs", "truncate_prompt_tokens")
# chat field -> the Responses field errors name
_FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text", "reasoning_effort": "reasoning"}


def _text_of(content, where: str) -> str | None:
    """A message's content as text: a string, or text parts (input_text, output_text, text) joined."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: expected a string or a list of text parts, got {content!r:.100}", "input")
    texts = []
    for part in content:
        if (not isinstance(part, Mapping) or part.get("type") not in ("input_text", "output_text", "text")
                or not isinstance(part.get("text"), str)):
            raise bad_request(f"{where}.content: only text parts ({{'type': 'input_text', 'text': ...}}) are "
                              f"supported, got {part!r:.100}", "input")
        texts.append(part["text"])
    return "".join(texts)


def _messages_of(body: Mapping) -> list[dict]:
    """The chat messages of a Responses request's ``instructions`` and ``input``."""
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request(f"instructions: expected a string, got {instructions!r:.100}", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input is required: a string or a non-empty list of items", "input")
    reasoning = None  # a reasoning item's text, for the next assistant turn

    def assistant_turn() -> dict:
        """The assistant message the next call or text goes into (a new one after any other turn)."""
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or last.get("content") is not None:
            last = {"role": "assistant", "content": None}
            messages.append(last)
        if reasoning is not None:
            last["reasoning"], reasoning = reasoning, None
        return last

    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise bad_request(f"{where}: expected an object, got {item!r:.100}", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role: expected user, system, developer or assistant, got {role!r:.50}",
                                  "input")
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                turn = assistant_turn()
                turn["content"] = (turn.get("content") or "") + (text or "")
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            if not all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments")):
                raise bad_request(f"{where}: a function_call needs string call_id, name and arguments", "input")
            turn = assistant_turn()
            turn.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output needs a string call_id", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), where) or ""})
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list) or any(not isinstance(p, Mapping) or not isinstance(p.get("text"), str)
                                                  for p in parts):
                raise bad_request(f"{where}.content: expected reasoning_text parts", "input")
            reasoning = (reasoning or "") + "".join(part["text"] for part in parts)
        else:
            raise bad_request(f"{where}.type: expected message, function_call, function_call_output or reasoning, "
                              f"got {kind!r:.50}", "input")
    return _one_system_message(messages)


def _one_system_message(messages: list[dict]) -> list[dict]:
    """The leading system messages (instructions, developer and system items) as one, their texts
    joined by a blank line: chat templates take one system message, first."""
    leading = 0
    while leading < len(messages) and messages[leading]["role"] == "system":
        leading += 1
    if leading <= 1:
        return messages
    text = "\n\n".join(message["content"] or "" for message in messages[:leading])
    return [{"role": "system", "content": text}] + messages[leading:]


def _chat_tools(tools) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"tools: expected a list of function tools, got {tools!r:.100}", "tools")
    converted = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise bad_request(f"tools[{index}]: only function tools ({{'type': 'function', 'name', 'parameters'}}) "
                              f"are supported, got {tool!r:.100}", "tools")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        converted.append({"type": "function", "function": function})
    return converted


def _chat_tool_choice(choice):
    if isinstance(choice, Mapping):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request(f"tool_choice: expected \"auto\", \"none\", \"required\" or {{'type': 'function', "
                              f"'name': ...}}, got {choice!r:.100}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text) -> dict | None:
    """The chat ``response_format`` of a Responses ``text`` field."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if fmt is None:
        if isinstance(text, Mapping) and set(text) <= {"format", "verbosity"}:
            return None
        raise bad_request(f"text: expected {{'format': {{'type': ...}}}}, got {text!r:.100}", "text")
    if not isinstance(fmt, Mapping):
        raise bad_request(f"text.format: expected an object with a 'type', got {fmt!r:.100}", "text")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return dict(fmt)


def chat_body_of(body: Mapping) -> dict:
    """The chat request a Responses request stands for (module docstring); a 400 naming the
    Responses field otherwise."""
    reject_unsupported(body, UNSUPPORTED_FIELDS)
    if body.get("n") is not None:
        raise bad_request("n is not a Responses field: one response per request", "n")
    chat = {"messages": _messages_of(body), "stream": bool(body.get("stream"))}
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise bad_request(f"stream: expected true or false, got {body['stream']!r:.50}", "stream")
    for source, target in (("model", "model"), ("max_output_tokens", "max_completion_tokens"),
                           ("temperature", "temperature"), ("top_p", "top_p"),
                           ("parallel_tool_calls", "parallel_tool_calls")) + tuple((n, n) for n in CHAT_EXTRAS):
        if body.get(source) is not None:
            chat[target] = body[source]
    tools = _chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, Mapping):
            raise bad_request(f"reasoning: expected an object, got {reasoning!r:.100}", "reasoning")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    return chat


def responses_error(error: APIError) -> APIError:
    """A chat-path error about a request that came as a Responses request: the field it names as
    the Responses request names it."""
    param = _FIELD_NAMES.get(error.param, error.param)
    message = error.message
    for chat_name, name in _FIELD_NAMES.items():
        if message.startswith(chat_name):
            message = name + message[len(chat_name):]
            break
    return APIError(error.status, message, param)


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class ResponsesFormat(ResponseFormat):
    """``/v1/responses`` answers (module docstring): ``response`` (whole; ``choice`` gives the
    output of the one sequence), or the event stream (``first_chunks``, ``chunks`` per step,
    ``closing_chunks``). ``body``: the Responses request (its settings go back in the answer)."""

    id_prefix, object_name, chunk_object_name = "resp_", "response", "response"
    named_events = True

    def __init__(self, *args, generation: GenerationRequest, body: Mapping, **kwargs):
        super().__init__(*args, **kwargs)
        self.generation, self.body = generation, body
        self.created_at = time.time()
        self._sequence = 0
        self._items: list[dict] = []
        self._open: dict | None = None  # the text item being written: reasoning or message
        self._parser: ReplyParser | None = None
        self._token_ids: list[int] = []
        self._finish_reason: str | None = None

    @classmethod
    def for_request(cls, request_id: str, model: str, generation: GenerationRequest, tokenizer=None,
                    body: Mapping | None = None):
        # (return_token_ids: every delta reaches ``chunks``, text or not: reasoning_tokens counts them all)
        return cls(request_id, model, True, None, tokenizer, generation=generation, body=body or {})

    # ------------------------------------------------------------------ the response object
    def _response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        params = self.generation.prompts[0].params
        body = self.body
        tools = list(body.get("tools") or [])
        text = body.get("text") or {"format": {"type": "text"}}
        return {"id": self.request_id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "metadata": body.get("metadata"), "model": self.model, "output": output,
                "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": None,
                "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
                "store": False, "temperature": params.temperature, "text": text,
                "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"), "tools": tools,
                "top_p": params.top_p, "truncation": "disabled", "usage": usage, "user": body.get("user")}

    def _usage(self, usage: dict) -> dict:
        """Responses' usage from the chat path's (prompt_tokens, completion_tokens)."""
        return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
                "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}

    def _reasoning_tokens(self) -> int:
        """Output tokens up to and with the end of the thinking (all, when the reply ended inside it)."""
        parsing = self.generation.reply_parsing
        if parsing is None or not parsing.reasoning or not any(i["type"] == "reasoning" for i in self._items):
            return 0
        end = None if self.tokenizer is None else self.tokenizer.token_to_id(THINK_END)
        return self._token_ids.index(end) + 1 if end in self._token_ids else len(self._token_ids)

    def _status(self) -> str:
        return "incomplete" if self._finish_reason == "length" else "completed"

    # ------------------------------------------------------------------ output items, as events
    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return event

    def _close_open(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index, part = len(self._items) - 1, item["content"][0]
        item["status"] = "incomplete" if self._finish_reason == "length" else "completed"  # (cut: the last item)
        kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return [self._event(kind, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _text(self, kind: str, text: str) -> list[dict]:
        """Events of ``text`` written into an item of ``kind`` (reasoning or message), opening one
        (and closing the other) as needed."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close_open()
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                item = {"id": _new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": [part]}
            else:
                part = {"type": "reasoning_text", "text": ""}
                item = {"id": _new_id("rs_"), "type": "reasoning", "summary": [], "status": "in_progress",
                        "content": [part]}
            self._items.append(item)
            self._open = item
            index = len(self._items) - 1
            events += [self._event("response.output_item.added", output_index=index, item={**_copy(item),
                                                                                             "content": []}),
                       self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=dict(part))]
        item, index = self._open, len(self._items) - 1
        item["content"][0]["text"] += text
        if kind == "message":
            events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=text))
        return events

    def _call(self, call: ToolCall) -> list[dict]:
        events = self._close_open()
        item = {"id": _new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                "name": call.name, "arguments": ""}
        self._items.append(item)
        index = len(self._items) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        item["arguments"] = call.arguments
        events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=call.arguments))
        events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=call.name, arguments=call.arguments))
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def _feed(self, text: str, token_ids: list[int], finish_reason: str | None) -> list[dict]:
        """The events of the reply's next ``text`` (and, at its end, of closing its items)."""
        self._token_ids += token_ids
        parsing = self.generation.reply_parsing
        if parsing is None:
            reply = ReplyDelta(content=text)
        else:
            if self._parser is None:
                self._parser = parsing.parser()
            reply = self._parser.feed(text)
            if finish_reason is not None:
                reply += self._parser.finish()
        events = []
        if reply.reasoning:
            events += self._text("reasoning", reply.reasoning)
        if reply.content:
            events += self._text("message", reply.content)
        for call in reply.tool_calls:
            events += self._call(call)
        if finish_reason is not None:
            self._finish_reason = finish_reason
            events += self._close_open()
        return events

    # ------------------------------------------------------------------ ResponseFormat
    def choice(self, index: int, text: str, token_ids: list[int], finish_reason: str,
               stop_reason: str | int | None = None, logprobs: list[TokenLogprobs] | None = None,
               echo=None) -> dict:
        self._feed(text, token_ids, finish_reason)
        return {"output": [_copy(item) for item in self._items]}

    def response(self, choices: list[dict], usage: dict) -> dict:
        return self._response(self._status(), choices[0]["output"], self._usage(usage))

    def first_chunks(self, n: int = 1) -> list[dict]:
        snapshot = self._response("in_progress", [], None)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def chunks(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
               stop_reason: str | int | None = None, logprobs: list[TokenLogprobs] | None = None,
               echo=None) -> list[dict]:
        return self._feed(text, token_ids, finish_reason)

    def closing_chunks(self, usage: dict, include_usage: bool, cut: bool = False) -> list[dict]:
        if cut:  # (the error event ended it)
            return []
        status = self._status()
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [self._event(kind, response=self._response(status, [_copy(item) for item in self._items],
                                                          self._usage(usage)))]

    def error_chunk(self, error: APIError) -> dict:
        return self._event("error", code=str(error.status), message=error.message, param=error.param)


def _copy(item: dict) -> dict:
    return {**item, "content": [dict(part) for part in item["content"]]} if "content" in item else dict(item)
