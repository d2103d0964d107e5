"""allowed_token_ids, bad_words and truncate_prompt_tokens (vLLM's SamplingParams fields).

The engine under test is conftest's byte-level model (two layers, fp32, 256 byte tokens and an
eos). The reference is an eager loop of the model's prefill and decode steps that sets the
disallowed and banned tokens' logits to -inf and draws with ``sample_tokens`` at the request's
seed and position; its logprobs are the raw distribution's (log_softmax of the unmasked logits),
as vLLM's. A masked request must give exactly its tokens, alone or joining a running batch, and
the requests beside it theirs.
"""

import re
from dataclasses import replace

import pytest
import torch

from conftest import BYTE_EOS, BYTE_VOCAB, DEVICE
from fuselm.engine import Engine, SamplingParams
from fuselm.engine.token_masks import (allowed_bitmask, bad_words_token_ids, banned_by_bad_words, bitmask_words,
                                       fill_bans)
from fuselm.ops.sampling import sample_tokens
from fuselm.ops.sampling.naive import apply_token_bitmask_ref

PRINTABLE = range(33, 127)  # byte tokens of printable ASCII but the space


def reference(byte_model, prompt_ids, params: SamplingParams, bad_sequences=()) -> tuple[list[int], list[float]]:
    """(tokens, each one's raw log-probability) from an eager masked loop (module docstring)."""
    allowed = torch.ones(BYTE_VOCAB, dtype=torch.bool)
    if params.allowed_token_ids is not None:
        allowed[:] = False
        allowed[params.allowed_token_ids] = True
    prompt_ids = prompt_ids[-params.truncate_prompt_tokens:] if params.truncate_prompt_tokens else prompt_ids
    cache = byte_model.new_cache(1, len(prompt_ids) + params.max_tokens)
    logits = byte_model.prefill(torch.tensor([prompt_ids], device=DEVICE), cache)
    tokens, logprobs = [], []
    for position in range(params.max_tokens):
        scores = logits.masked_fill(~allowed.to(DEVICE), float("-inf"))
        for sequence in bad_sequences:  # vLLM's rule: the last token, where the output ends with the rest
            if len(tokens) >= len(sequence) - 1 and tokens[len(tokens) - len(sequence) + 1:] == list(sequence[:-1]):
                scores[:, sequence[-1]] = float("-inf")
        token = int(sample_tokens(scores, torch.tensor([float(params.temperature)], device=DEVICE),
                                  torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.ones(1, device=DEVICE),
                                  torch.tensor([params.seed or 0], device=DEVICE),
                                  torch.tensor([position], device=DEVICE),
                                  filtered=False))
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits.double(), -1)[0, token]))
        if token == BYTE_EOS and not params.ignore_eos:
            break
        logits = byte_model.decode_step(torch.tensor([token], device=DEVICE), cache)
    return tokens, logprobs


def test_allowed_bitmask_and_bans_set_exactly_their_bits():
    """Each word's 32 bits, bit 31 (the int32's sign) included, against the bitmask reference."""
    vocab = 100
    ids = [0, 5, 31, 32, 63, 64, 95, 99]
    words = allowed_bitmask(ids, vocab)
    assert words.dtype == torch.int32 and tuple(words.shape) == (bitmask_words(vocab),)
    logits = apply_token_bitmask_ref(torch.zeros(1, vocab), words[None], torch.tensor([0]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == ids
    row = torch.empty(bitmask_words(vocab), dtype=torch.int32)
    fill_bans(row, None, [31, 64, 7])
    logits = apply_token_bitmask_ref(torch.zeros(1, vocab), row[None], torch.tensor([0]))
    assert torch.isinf(logits[0]).nonzero().flatten().tolist() == [7, 31, 64]
    fill_bans(row, words, [31, 99, 40])  # allowed ids less the banned ones (40 was not allowed)
    logits = apply_token_bitmask_ref(torch.zeros(1, vocab), row[None], torch.tensor([0]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 5, 32, 63, 64, 95]


def test_bad_words_are_encoded_at_the_start_and_after_a_space_as_vllm_does():
    """A word's ids at the text's start, and after a space when that changes the first token and
    keeps the length (else it is not a new word token: left out)."""

    class Encodings:
        table = {"cat": [5], " cat": [9], "hot dog": [1, 2], " hot dog": [3, 2], "xy": [4, 5], " xy": [6, 4, 5],
                 "same": [7], " same": [7]}

        def encode(self, text, add_special_tokens=False):
            return self.table[text]

    assert bad_words_token_ids(["cat", " hot dog", "xy", "same"], Encodings()) == [(5,), (9,), (1, 2), (3, 2),
                                                                                 (4, 5), (7,)]
    assert banned_by_bad_words([(5,), (1, 2), (4, 5, 6)], []) == [5]
    assert banned_by_bad_words([(5,), (1, 2), (4, 5, 6)], [9, 1]) == [5, 2]
    assert banned_by_bad_words([(5,), (1, 2), (4, 5, 6)], [4, 5]) == [5, 6]
    assert banned_by_bad_words([(1, 2)], [1, 3]) == []


def test_allowed_token_ids_limit_the_draw_and_not_the_logprobs(byte_model, byte_engine):
    """Greedy and sampled requests with allowed_token_ids give the reference's tokens, all of them
    allowed; their logprobs are the raw distribution's (a top token that is not allowed shows up);
    a free request beside them gives its solo tokens."""
    allowed = [40, 41, 42, 120, BYTE_EOS]
    jobs = [([5, 6, 7], SamplingParams(max_tokens=12, temperature=0, allowed_token_ids=allowed, logprobs=3)),
            ([9, 8], SamplingParams(max_tokens=12, temperature=1.0, seed=11, allowed_token_ids=allowed[:4],
                                    ignore_eos=True)),
            ([3, 2, 1], SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True))]
    free_alone = byte_engine.generate([jobs[2][0]], jobs[2][1])[0].outputs[0].token_ids
    outputs = byte_engine.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    for (prompt_ids, params), output in zip(jobs[:2], outputs):
        tokens, logprobs = reference(byte_model, prompt_ids, params)
        completion = output.outputs[0]
        assert completion.token_ids == tokens and set(tokens) <= set(params.allowed_token_ids)
    completion = outputs[0].outputs[0]
    _, raw = reference(byte_model, *jobs[0])
    assert [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)] == pytest.approx(
        raw, abs=1e-4)
    assert any(set(entry) - set(allowed) for entry in completion.logprobs)  # raw top tokens, allowed or not
    assert outputs[2].outputs[0].token_ids == free_alone


def test_bad_words_never_appear_and_the_rest_of_the_draw_is_unchanged(byte_model, byte_tokenizer, byte_engine):
    """A two-token bad word (a pair the free output has) and a one-token one: the output is the
    reference's under vLLM's rule and holds neither; a greedy request with the same bans gives
    the reference's too."""
    prompt_ids = byte_tokenizer.encode("Words")
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=2, ignore_eos=True)
    free = byte_engine.generate([prompt_ids], params)[0].outputs[0].token_ids
    pair = next(free[i:i + 2] for i in range(len(free) - 1) if free[i] in PRINTABLE and free[i + 1] in PRINTABLE)
    single = next(t for t in free if t in PRINTABLE and t not in pair)
    words = [byte_tokenizer.decode(pair), byte_tokenizer.decode([single])]
    sequences = bad_words_token_ids(words, byte_tokenizer)
    assert sequences == [tuple(pair), (single,)]  # (the byte vocabulary has no word tokens after a space)
    for banned in (replace(params, bad_words=words), replace(params, temperature=0.0, bad_words=words)):
        (output,) = byte_engine.generate([prompt_ids], banned)
        tokens = output.outputs[0].token_ids
        assert tokens == reference(byte_model, prompt_ids, banned, sequences)[0]
        assert single not in tokens and all(tokens[i:i + 2] != pair for i in range(len(tokens) - 1))
    assert byte_engine.generate([prompt_ids], params)[0].outputs[0].token_ids == free


def test_masked_requests_joining_a_running_batch_get_their_reference_tokens(byte_model, byte_tokenizer, byte_engine):
    """allowed_token_ids and bad_words requests (n = 2) added while another decodes: their first
    ids drawn in mixed steps, the rest in decode steps with masks; each gives the reference's
    tokens, and the running request its solo ones."""
    early = byte_engine.add_request([7, 7, 7], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    byte_engine.step()
    byte_engine.step()
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=21, n=2, allowed_token_ids=list(range(97, 123)),
                             bad_words=["e", "th"], ignore_eos=True)
    added = byte_engine.add_requests([{"prompt_token_ids": byte_tokenizer.encode("Q"), "params": sampled}])[0]
    byte_engine.step()
    late = byte_engine.add_request(byte_tokenizer.encode("Late"),
                                   SamplingParams(max_tokens=12, temperature=0, bad_words=["!"]))
    byte_engine.run()
    for request in added + [late]:
        sequences = bad_words_token_ids(request.params.bad_words, byte_tokenizer)
        assert request.output_token_ids == reference(byte_model, request.prompt_token_ids, request.params, sequences)[0]
    assert "e" not in byte_tokenizer.decode(added[0].output_token_ids) and "th" not in byte_tokenizer.decode(
        added[0].output_token_ids)
    alone = Engine(byte_model, max_batch=1, max_len=64).generate([early.prompt_token_ids], early.params)
    assert early.output_token_ids == alone[0].outputs[0].token_ids


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(byte_model, byte_engine):
    """k >= 1: the request runs on its prompt's last k tokens (its prompt_token_ids are those);
    -1: the last max_len, so a prompt longer than the context is refused as the context's;
    k past max_len is refused naming the field."""
    prompt_ids = list(range(10, 40))
    params = SamplingParams(max_tokens=8, temperature=0, truncate_prompt_tokens=5, ignore_eos=True)
    (output,) = byte_engine.generate([prompt_ids], params)
    assert output.prompt_token_ids == prompt_ids[-5:]
    assert output.outputs[0].token_ids == reference(byte_model, prompt_ids, params)[0]
    assert output.outputs[0].token_ids == byte_engine.generate([prompt_ids[-5:]], replace(
        params, truncate_prompt_tokens=None))[0].outputs[0].token_ids
    (whole,) = byte_engine.generate([prompt_ids], replace(params, truncate_prompt_tokens=-1))
    assert whole.prompt_token_ids == prompt_ids
    with pytest.raises(ValueError, match="prompt: 64 tokens leave no room"):
        byte_engine.add_request(list(range(100)), replace(params, truncate_prompt_tokens=-1))
    with pytest.raises(ValueError, match=re.escape("truncate_prompt_tokens: 65 is more than max_len = 64")):
        byte_engine.add_request(prompt_ids, replace(params, truncate_prompt_tokens=65))
    assert not byte_engine.has_unfinished_requests()


@pytest.mark.parametrize("fields, message", [
    ({"allowed_token_ids": []}, "allowed_token_ids: expected a non-empty list"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids: expected"),
    ({"allowed_token_ids": [3, True]}, "allowed_token_ids: expected"),
    ({"bad_words": ["ok", " "]}, "bad_words: expected a list of strings that are not blank"),
    ({"bad_words": "word"}, "bad_words: expected"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens: expected None, -1 or an int >= 1"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens: expected"),
])
def test_bad_fields_are_refused_naming_them(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**fields)


def test_requests_the_engine_cannot_mask_are_refused_naming_the_field(byte_model, byte_engine):
    with pytest.raises(ValueError, match=re.escape(f"allowed_token_ids: token ids [{BYTE_VOCAB}] are not in")):
        byte_engine.add_request([1, 2], SamplingParams(allowed_token_ids=[5, BYTE_VOCAB]))
    with pytest.raises(ValueError, match="allowed_token_ids: every allowed id is a stop id"):
        byte_engine.add_request([1, 2], SamplingParams(allowed_token_ids=[BYTE_EOS], min_tokens=2))
    with pytest.raises(ValueError, match="bad_words: this engine has no tokenizer"):
        Engine(byte_model, max_batch=1, max_len=64).add_request([1, 2], SamplingParams(bad_words=["x"]))
    assert not byte_engine.has_unfinished_requests()
