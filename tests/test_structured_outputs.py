"""Structured outputs: a request's grammar masks its logits before each draw.

The engine under test is conftest's byte-level model: two layers (fp32, seeded random weights)
over 256 byte tokens and an eos (so the tests run fast on the CPU and, on a GPU, through the
decode graphs). The reference is an eager loop of the model's prefill and decode steps that
masks the logits with the grammar's bitmask and draws with ``sample_tokens`` at the request's
seed and position: a constrained request must give exactly its tokens, alone or beside others
(whose tokens must not change either), greedy or sampled.
"""

import json
import re
from dataclasses import replace

import pytest
import torch

from conftest import BYTE_EOS, BYTE_VOCAB, DEVICE
from fuselm.engine import Engine, SamplingParams
from fuselm.engine.request import StructuredOutputsParams
from fuselm.engine.structured_outputs import GrammarCompiler
from fuselm.engine.token_masks import bitmask_words
from fuselm.ops.sampling import sample_tokens

pytest.importorskip("llguidance")

EOS, VOCAB = BYTE_EOS, BYTE_VOCAB
NAME_SCHEMA = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
               "required": ["pet", "ok"], "additionalProperties": False}


def prompt(byte_tokenizer, text):
    return byte_tokenizer.encode(text)


def allowed_tokens(matcher, vocab=VOCAB) -> torch.Tensor:
    words = torch.zeros(bitmask_words(vocab), dtype=torch.int32)
    matcher.fill_bitmask(words)
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


def reference(byte_model, byte_tokenizer, prompt_ids, params: SamplingParams) -> list[int]:
    """The request's tokens from an eager loop that masks with its grammar (fresh) and draws with
    its seed at each position."""
    matcher = GrammarCompiler(byte_tokenizer, VOCAB, [EOS]).compile(params.structured_outputs)
    cache = byte_model.new_cache(1, len(prompt_ids) + params.max_tokens)
    logits = byte_model.prefill(torch.tensor([prompt_ids], device=DEVICE), cache)
    tokens = []
    for position in range(params.max_tokens):
        scores = logits.masked_fill(~allowed_tokens(matcher).to(DEVICE), float("-inf"))
        token = int(sample_tokens(scores, torch.tensor([params.temperature], device=DEVICE),
                                  torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.ones(1, device=DEVICE),
                                  torch.tensor([params.seed], device=DEVICE), torch.tensor([position], device=DEVICE),
                                  filtered=False))
        tokens.append(token)
        assert matcher.accept(token)
        if token == EOS:
            break
        logits = byte_model.decode_step(torch.tensor([token], device=DEVICE), cache)
    return tokens


def structured(max_tokens=40, temperature=0.0, seed=7, **grammar):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(**grammar))


def test_a_constrained_request_draws_the_masked_models_tokens_alone_and_beside_others(byte_model, byte_tokenizer,
                                                                                     byte_engine):
    """Greedy and sampled requests under a JSON schema, a regex and a choice each give the
    reference loop's tokens (its text follows the grammar and the request ends at the eos);
    unconstrained requests running beside them give their solo tokens."""
    jobs = [(prompt(byte_tokenizer, "Pet: "), structured(json=NAME_SCHEMA, disable_any_whitespace=True)),
            (prompt(byte_tokenizer, "Code"), structured(temperature=1.0, seed=11, regex=r"[A-Z]{2}-[0-9]{3}")),
            (prompt(byte_tokenizer, "Say"), structured(temperature=0.8, seed=5, choice=["yes", "no", "not today"])),
            (prompt(byte_tokenizer, "Free text"),
             SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True))]
    free_alone = byte_engine.generate([jobs[3][0]], jobs[3][1])[0].outputs[0].token_ids
    outputs = byte_engine.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    for (prompt_ids, params), output in zip(jobs[:3], outputs):
        assert output.outputs[0].token_ids == reference(byte_model, byte_tokenizer, prompt_ids, params)
        assert output.outputs[0].finish_reason == "stop" and output.outputs[0].token_ids[-1] == EOS
    text = [byte_tokenizer.decode(o.outputs[0].token_ids[:-1]) for o in outputs[:3]]
    assert json.loads(text[0])["pet"] in ("cat", "dog")
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text[1]) and text[2] in ("yes", "no", "not today")
    assert outputs[3].outputs[0].token_ids == free_alone


def test_constrained_requests_joining_a_running_batch_get_their_solo_tokens(byte_model, byte_tokenizer, byte_engine):
    """Constrained requests added while others decode (mixed prefill + decode steps, the draw of a
    completing prompt masked in its row; decode steps with masks) and n = 3 samples, each with a
    grammar of its own: every request gives its reference tokens."""
    early = byte_engine.add_request(prompt(byte_tokenizer, "Long free run"),
                               SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    byte_engine.step()
    byte_engine.step()
    params = structured(temperature=1.0, seed=21, regex=r"(ab|cd)+!")
    params = replace(params, n=3)
    added = byte_engine.add_requests([{"prompt_token_ids": prompt(byte_tokenizer, "Q"), "params": params}])[0]
    byte_engine.step()
    late = byte_engine.add_request(prompt(byte_tokenizer, "Pet"),
                                   structured(json=NAME_SCHEMA, disable_any_whitespace=True))
    byte_engine.run()
    for request in added + [late]:
        assert request.output_token_ids == reference(byte_model, byte_tokenizer, request.prompt_token_ids,
                                                     request.params)
    assert len({tuple(r.output_token_ids) for r in added}) > 1  # three seeds, three draws
    alone = Engine(byte_model, max_batch=1, max_len=64).generate([early.prompt_token_ids], early.params)
    assert early.output_token_ids == alone[0].outputs[0].token_ids


def test_a_complete_grammar_ends_a_request_that_ignores_eos(byte_tokenizer, byte_engine):
    """With ignore_eos the eos the complete grammar allows would not end the request: the engine
    ends it when the grammar is complete (the eos not drawn); max_tokens still cuts an
    unfinished one."""
    params = replace(structured(choice=["maybe"]), ignore_eos=True)
    (output,) = byte_engine.generate([prompt(byte_tokenizer, "Well")], params)
    assert byte_tokenizer.decode(output.outputs[0].token_ids) == "maybe" and output.outputs[0].finish_reason == "stop"
    (cut,) = byte_engine.generate([prompt(byte_tokenizer, "Well")], structured(max_tokens=3, choice=["maybe"]))
    assert byte_tokenizer.decode(cut.outputs[0].token_ids) == "may" and cut.outputs[0].finish_reason == "length"


def test_logprobs_of_a_constrained_request_are_of_its_masked_logits(byte_tokenizer, byte_engine):
    """A constrained request's logprobs (vLLM's: the distribution it was drawn from): the
    disallowed tokens are -inf, so its top tokens are allowed ones and a forced token has
    log-probability 0."""
    params = replace(structured(choice=["xyz"]), logprobs=3)
    (output,) = byte_engine.generate([prompt(byte_tokenizer, "Hm")], params)
    completion = output.outputs[0]
    assert byte_tokenizer.decode(completion.token_ids[:-1]) == "xyz"
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert entry[token].logprob == pytest.approx(0.0, abs=1e-5) and entry[token].rank == 1


@pytest.mark.parametrize("grammar, message", [
    ({"regex": "[a-"}, "structured_outputs: regex"),
    ({"json": {"type": "nothing"}}, "structured_outputs: json"),
    ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs: grammar"),
])
def test_a_grammar_that_does_not_compile_is_refused_naming_the_field(byte_tokenizer, byte_engine, grammar, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        byte_engine.add_request(prompt(byte_tokenizer, "x"), structured(**grammar))
    assert not byte_engine.has_unfinished_requests()


def test_bad_structured_outputs_are_refused_naming_the_argument(byte_model, byte_tokenizer):
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json=5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="structured_outputs: expected None or a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="no tokenizer"):
        Engine(byte_model, max_batch=1, max_len=64).add_request([1, 2], structured(regex="a"))


def test_a_grammar_that_starts_after_a_token_leaves_the_output_free_until_it(byte_tokenizer, byte_engine):
    """grammar_starts_after (a reasoning model's end-of-thinking id): the grammar constrains only
    what follows that token. A logit bias makes it the first token drawn (the bias cannot bring
    it back later: the grammar's -inf stays -inf)."""
    marker = byte_tokenizer.encode("|")[0]
    params = replace(structured(regex="[0-9]{2}"), logit_bias={marker: 100.0})
    request = byte_engine.add_request(prompt(byte_tokenizer, "Think"), params, grammar_starts_after=marker)
    byte_engine.run()
    tokens = request.output_token_ids
    assert tokens[0] == marker and re.fullmatch("[0-9]{2}", byte_tokenizer.decode(tokens[1:3])) and tokens[3:] == [EOS]
    (plain,) = byte_engine.generate([prompt(byte_tokenizer, "Think")], params)  # constrained from the first token
    assert re.fullmatch("[0-9]{2}", byte_tokenizer.decode(plain.outputs[0].token_ids[:-1]))


def test_a_structural_tag_leaves_text_free_and_makes_each_trigger_a_tagged_json_value(byte_tokenizer, byte_engine):
    """vLLM's structural tag: free text, but a trigger ("<", which a logit bias makes the model
    write) goes on as a structure's begin, a JSON value of its schema and its end; a text that
    breaks the tag is refused by the grammar, one that keeps it is taken."""
    schema = {**NAME_SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    tag = {"structures": [{"begin": "<pet>", "schema": schema, "end": "</pet>"}], "triggers": ["<"]}
    params = replace(structured(max_tokens=48, temperature=0.8, structural_tag=tag),
                     logit_bias={byte_tokenizer.encode("<")[0]: 100.0})
    (output,) = byte_engine.generate([prompt(byte_tokenizer, "Tags")], params)
    text = byte_tokenizer.decode(output.outputs[0].token_ids)
    tagged = re.findall(r"<pet>(.*?)</pet>", text)
    assert tagged and all(json.loads(value)["pet"] in ("cat", "dog") for value in tagged), text
    assert text.startswith("<pet>") and re.fullmatch(r"(<pet>[^<]*</pet>)*(<[^<]*)?", text), text
    grammars = GrammarCompiler(byte_tokenizer, VOCAB, [EOS])
    for text, taken in (('free <pet>{"pet":"cat","ok":true}</pet> more', True), ("free <cat>", False)):
        matcher = grammars.compile(StructuredOutputsParams(structural_tag=json.dumps(tag)))
        assert all(matcher.accept(token) for token in prompt(byte_tokenizer, text)) == taken, text
