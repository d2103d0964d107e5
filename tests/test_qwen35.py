"""fuselm.models.Qwen35 against Hugging Face ``Qwen3_5ForCausalLM`` (transformers 5.17), fp32.

A tiny random config (hidden 64, 4 layers: DeltaNet, attention, DeltaNet, attention; GQA in
both mixers) keeps the Triton interpreter fast on a CPU. The random weights are scaled so the
logits spread over ~[-4, 4] (HF's own init gives near-zero logits, which would let the 1e-3
bars pass for a broken model).
"""

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from fuselm import Qwen35, Qwen35Config
from fuselm.models.qwen35.cache import Qwen35Cache
from fuselm.models.qwen35.presets import random_qwen35, tiny_config
from fuselm.testing import rel_err

transformers = pytest.importorskip("transformers")
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig  # noqa: E402

# Issue 6's bar: max abs logit difference vs HF, fp32, on the CPU. On a GPU both sides leave exact
# fp32: HF's conv1d runs on cuDNN in TF32 (its default) and its GDN on fla-core kernels when
# installed, our GEMMs use TF32 tensor cores; the H100 run measured 1.2e-3 to 1.4e-2 there
# (logits up to ~20), so the GPU check is a coarse 3e-2 (the GPU bar is the bf16 cosine test).
LOGIT_TOL = 1e-3 if torch.device(DEVICE).type == "cpu" else 3e-2
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, layer_types=LAYER_TYPES)


def tiny_hf_model(seed=0, dtype=torch.float32, **overrides):
    """A random HF Qwen3_5ForCausalLM with every weight away from its init value."""
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)  # decay rates exp(A_log) in [0.37, 2.7]
            elif name.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.3)  # plain RMSNorm weight (HF init: ones)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, p[0].numel() ** -0.5)  # unit-variance outputs (conv: fan-in = kernel)
            else:  # zero-centered norm weights, dt_bias, biases
                p.normal_(0.0, 0.3)
    return model.to(device=DEVICE, dtype=dtype).eval()


def prompt(B, T, seed=1):
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def right_padding_mask(lengths, T):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long().to(DEVICE)


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf_model()
    return hf, Qwen35.from_hf(hf)


@pytest.fixture(scope="module")
def greedy_run(models):
    """32 greedy tokens after a [2, 13] prompt, from HF and from fuselm, with every step's logits."""
    hf, model = models
    ids = prompt(2, 13)
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=32, do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens, logits = model.generate(ids, 32, return_logits=True)
    return dict(ids=ids, tokens=tokens, logits=logits, ref_tokens=ref.sequences[:, ids.shape[1]:],
                ref_logits=torch.stack(ref.logits, dim=1))


# ----------------------------------------------------------------------------- parity with HF
def test_forward_logits_match_hf_on_a_right_padded_batch(models):
    """70 tokens (two GDN chunks of 64) and a row of 23: the padded row's padding enters the GDN
    state with beta = g = 0 (no change); HF masks the padding itself. Compared at the real positions."""
    hf, model = models
    ids, lengths = prompt(2, 70, seed=2), [70, 23]
    mask = right_padding_mask(lengths, 70)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits
    out = model(ids, attention_mask=mask)
    assert out.shape == ref.shape == (2, 70, TINY["vocab_size"])
    real = mask.bool()
    assert ref[real].abs().max() > 1.0  # the logits carry signal
    assert (out[real] - ref[real]).abs().max() <= LOGIT_TOL


def test_logits_after_prefill_and_each_decode_step_match_hf(greedy_run):
    logits, ref = greedy_run["logits"], greedy_run["ref_logits"]
    assert logits.shape == ref.shape == (2, 32, TINY["vocab_size"])
    per_step = (logits - ref).abs().amax(dim=(0, 2))
    assert per_step[0] <= LOGIT_TOL, f"after prefill: {per_step[0]:.2e}"
    assert per_step[1:].max() <= LOGIT_TOL, f"decode steps: {per_step[1:].tolist()}"


def test_greedy_32_tokens_match_hf_token_for_token(greedy_run):
    assert torch.equal(greedy_run["tokens"], greedy_run["ref_tokens"])


def test_prefill_then_decode_equals_one_full_forward(models, greedy_run):
    """The same sequence through one forward (chunked kernel) and through prefill + 31 decode
    steps (conv state, recurrent kernel, KV cache): the logits at every position agree."""
    _, model = models
    ids, tokens, logits = greedy_run["ids"], greedy_run["tokens"], greedy_run["logits"]
    full = model(torch.cat([ids, tokens[:, :-1]], dim=1))
    assert (full[:, ids.shape[1] - 1:] - logits).abs().max() <= 1e-4


def test_config_from_hf_variants(models):
    hf, model = models
    assert model.config == Qwen35Config.from_hf(hf.config.to_dict())  # config.json contents
    assert model.config.rotary_dim == 8 and model.config.layer_types == tuple(LAYER_TYPES)
    assert Qwen35.from_hf(hf).to(torch.float16).inv_freq.dtype == torch.float32  # RoPE frequencies stay fp32
    nested = Qwen3_5Config(text_config={**TINY}, tie_word_embeddings=True)  # the multimodal config
    from_nested = Qwen35Config.from_hf(nested)
    assert from_nested.tie_word_embeddings and from_nested.hidden_size == 64 and from_nested.layer_types == tuple(LAYER_TYPES)
    legacy = Qwen35Config.from_hf({"num_hidden_layers": 8, "full_attention_interval": 2, "rope_theta": 5e6})
    assert legacy.layer_types == ("linear_attention", "full_attention") * 4 and legacy.rope_theta == 5e6
    with pytest.raises(ValueError, match="rope_parameters"):
        Qwen35Config.from_hf({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="layer_types"):
        Qwen35Config.from_hf({"num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"]})


# ----------------------------------------------------------------------------- batching and cache
def test_varying_length_batch_equals_each_row_alone(models):
    _, model = models
    lengths, T = [11, 4, 8], 11
    ids = prompt(3, T, seed=3)
    tokens, logits = model.generate(ids, 5, attention_mask=right_padding_mask(lengths, T), return_logits=True)
    for row, n in enumerate(lengths):
        alone_tokens, alone_logits = model.generate(ids[row:row + 1, :n], 5, return_logits=True)
        assert torch.equal(tokens[row], alone_tokens[0])
        assert (logits[row] - alone_logits[0]).abs().max() <= 1e-4


def test_inactive_rows_write_no_state(models):
    """A decode step with one inactive row leaves that row's conv, recurrent and KV state (its
    pages: slot r owns page r here, the inactive rows write to the scratch page) and its length
    untouched, and the active row's step is what it would be alone."""
    _, model = models
    ids = prompt(2, 6, seed=4)
    cache = model.new_cache(max_batch=3, max_len=10)
    model.prefill(ids, cache)
    cache.active[1] = False  # row 1 pauses; row 2 was never used
    before = [[t.clone() for t in ((layer.key, layer.value) if hasattr(layer, "key") else (layer.conv, layer.recurrent))]
              for layer in cache.layers]
    logits = model.decode_step(torch.tensor([7, 9, 300], device=DEVICE), cache)  # 300: inactive, out of vocab
    assert cache.lengths.tolist() == [7, 6, 0]
    for layer, old in zip(cache.layers, before):
        if hasattr(layer, "key"):
            assert cache.block_table.tolist() == [[0], [1], [2]] and cache.num_pages == 3
            for new, prev in zip((layer.key, layer.value), old):
                assert torch.equal(new[1:3], prev[1:3])
                assert not torch.equal(new[0, :, 6], prev[0, :, 6])  # row 0 wrote its token
        else:
            for new, prev in zip((layer.conv, layer.recurrent), old):
                assert torch.equal(new[1:], prev[1:]) and not torch.equal(new[0], prev[0])
    alone = model.new_cache(max_batch=1, max_len=10)
    model.prefill(ids[:1], alone)
    assert (model.decode_step(torch.tensor([7], device=DEVICE), alone)[0] - logits[0]).abs().max() <= 1e-5


def test_decode_step_reads_the_slots_of_its_row_table(models):
    """A decode step over some slots in another order (``slots``, the engine's row -> slot table)
    gives those slots' logits of a step over every slot, advances only them, and leaves the other
    slots' state as it was; a later step over all of them goes on as if every step had run all."""
    _, model = models
    ids = prompt(3, 6, seed=31)
    every, some = (model.new_cache(max_batch=4, max_len=16) for _ in range(2))
    for cache in (every, some):
        model.prefill(ids, cache, slots=[0, 1, 3])
    tokens = torch.tensor([4, 9, 0, 13], device=DEVICE)
    want = model.decode_step(tokens, every)
    before = [[t.clone() for t in (layer.conv[1], layer.recurrent[1])]
              for layer in some.layers if hasattr(layer, "conv")]
    got = model.decode_step(tokens, some, torch.tensor([3, 2, 0], device=DEVICE))  # slot 2: inactive
    assert got.shape[0] == 3 and (got[[0, 2]] - want[[3, 0]]).abs().max() <= 1e-5
    assert some.lengths.tolist() == [7, 6, 0, 7] and every.lengths.tolist() == [7, 7, 0, 7]
    after = [[layer.conv[1], layer.recurrent[1]] for layer in some.layers if hasattr(layer, "conv")]
    assert all(torch.equal(a, b) for pair_a, pair_b in zip(before, after) for a, b in zip(pair_a, pair_b))
    model.decode_step(tokens, some, torch.tensor([1], device=DEVICE))  # slot 1 catches up alone
    assert some.lengths.tolist() == every.lengths.tolist()
    tokens = want.argmax(-1)
    assert (model.decode_step(tokens, some) - model.decode_step(tokens, every))[[0, 1, 3]].abs().max() <= 1e-5


def test_eos_stops_a_row_and_leaves_the_others(models, greedy_run):
    _, model = models
    ids, greedy = greedy_run["ids"], greedy_run["tokens"]
    eos = int(greedy[0, 2])
    tokens = model.generate(ids, 6, eos_token_id=eos, pad_token_id=0)
    assert tokens[0, :3].tolist() == greedy[0, :3].tolist() and tokens[0, 3:].tolist() == [0, 0, 0]
    row1 = greedy[1, :6].tolist()
    stop = row1.index(eos) + 1 if eos in row1 else 6
    assert tokens[1, :stop].tolist() == row1[:stop] and set(tokens[1, stop:].tolist()) <= {0}


# ----------------------------------------------------------------------------- sampling
def test_generate_sampling_top_k_1_is_greedy(models, greedy_run):
    _, model = models
    tokens = model.generate(greedy_run["ids"], 4, temperature=1.3, top_k=1, seed=0)
    assert torch.equal(tokens, greedy_run["tokens"][:, :4])


def test_greedy_with_a_repetition_penalty_matches_hf(models, greedy_run):
    """HF's repetition_penalty (its logits processor over prompt and generated ids) and the
    reference loop's (``apply_penalties``): the same 24 greedy tokens, and not plain greedy's."""
    hf, model = models
    ids = greedy_run["ids"]
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=24, do_sample=False, repetition_penalty=1.5)[:, ids.shape[1]:]
    tokens = model.generate(ids, 24, repetition_penalty=1.5)
    assert torch.equal(tokens, ref)
    assert not torch.equal(tokens, greedy_run["tokens"][:, :24])


def test_generate_with_frequency_and_presence_penalties(models, greedy_run):
    """Greedy under frequency / presence penalties, against a loop written out here: the penalised
    logits' argmax, with every earlier generated token counted (vLLM's definitions)."""
    _, model = models
    ids = greedy_run["ids"][:1]
    tokens, logits = model.generate(ids, 12, frequency_penalty=0.7, presence_penalty=1.1, return_logits=True)
    counts = torch.zeros(TINY["vocab_size"])
    for i in range(12):
        penalised = logits[0, i].cpu().double() - 0.7 * counts - 1.1 * (counts > 0)
        assert tokens[0, i] == penalised.argmax(), i
        counts[tokens[0, i]] += 1
    assert not torch.equal(tokens, greedy_run["tokens"][:1, :12])  # the penalties changed the answer


# ----------------------------------------------------------------------------- loading
def test_from_pretrained_round_trip(models, tmp_path):
    hf, model = models
    hf.save_pretrained(tmp_path)
    loaded = Qwen35.from_pretrained(tmp_path)
    for (name, p), (name2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert name == name2 and torch.equal(p.cpu(), p2.cpu()), name
    ids = prompt(1, 5, seed=5)
    assert torch.equal(loaded.to(DEVICE)(ids), model(ids))


def test_from_hf_multimodal_model(models):
    """A live Qwen3_5ForConditionalGeneration (tiny vision tower) holding the text model's weights:
    from_hf takes its text_config and its model.language_model.* tensors, skips model.visual.*."""
    hf, model = models
    config = Qwen3_5Config(text_config=dict(TINY), vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                                       num_heads=2, out_hidden_size=64))
    multimodal = Qwen3_5ForConditionalGeneration(config).to(DEVICE).eval()
    result = multimodal.load_state_dict({k.replace("model.", "model.language_model.", 1): v
                                         for k, v in hf.state_dict().items()}, strict=False)
    assert not result.unexpected_keys and all(k.startswith("model.visual.") for k in result.missing_keys)
    ids = prompt(1, 9, seed=9)
    with torch.no_grad():
        ref = multimodal(input_ids=ids).logits
    assert (Qwen35.from_hf(multimodal)(ids) - ref).abs().max() <= LOGIT_TOL


def test_from_pretrained_multimodal_checkpoint_with_tied_embeddings_and_attention_bias(tmp_path):
    """A Qwen3_5ForConditionalGeneration-style directory: nested text_config, the top-level tie
    flag, text weights under model.language_model., vision and MTP tensors to skip."""
    from safetensors.torch import save_file
    hf = tiny_hf_model(seed=7, tie_word_embeddings=True, attention_bias=True)
    text = {k: v for k, v in hf.config.to_dict().items() if k != "tie_word_embeddings"}
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": text, "vision_config": {"depth": 1}}))
    state = {k.replace("model.", "model.language_model.", 1): v.detach().cpu().contiguous()
             for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state["model.visual.patch_embed.proj.weight"] = torch.zeros(3, 3)
    state["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(state, tmp_path / "model.safetensors")
    model = Qwen35.from_pretrained(tmp_path, device=DEVICE)
    assert model.config.tie_word_embeddings and model.lm_head is None and model.config.attention_bias
    ids = prompt(1, 9, seed=8)
    with torch.no_grad():
        ref = hf(ids).logits
    assert (model(ids) - ref).abs().max() <= LOGIT_TOL


def test_checkpoint_that_disagrees_with_its_config(models, tmp_path):
    from safetensors.torch import load_file, save_file
    hf, _ = models
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight has shape .*config implies"):
        Qwen35.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.linear_attn.A_log"] = torch.zeros(5)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.linear_attn\.A_log has shape \(5,\).*\(2,\)"):
        Qwen35.from_pretrained(tmp_path)
    del weights["model.layers.0.linear_attn.A_log"]
    weights["model.layers.0.extra.weight"] = torch.zeros(1)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing"):
        Qwen35.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Qwen35.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Qwen35.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------- bad input
def test_bad_input_raises_and_the_model_stays_usable(models):
    _, model = models
    ids = prompt(2, 6, seed=6)
    cache = model.new_cache(max_batch=3, max_len=9)
    expected = model.prefill(ids, cache)
    state_after = [cache.lengths.clone(), cache.active.clone()]
    bad_calls = {
        "empty prompt": (lambda: model.generate(ids[:, :0], 3), "input_ids: empty prompt"),
        "empty padded row": (lambda: model.generate(ids, 3, attention_mask=right_padding_mask([6, 0], 6)),
                             "attention_mask: row 1 is an empty prompt"),
        "longer than the cache": (lambda: model.prefill(prompt(1, 10), cache, slots=[2]),
                                  "input_ids: .*longer than the cache"),
        "too many rows": (lambda: model.prefill(prompt(4, 2), cache), "input_ids: 4 rows"),
        "slot out of range": (lambda: model.prefill(prompt(1, 2), cache, slots=[3]), r"slots: .*\[0, 3\)"),
        "repeated slot": (lambda: model.prefill(prompt(2, 2), cache, slots=[2, 2]), "slots: expected distinct"),
        "slots of another length": (lambda: model.prefill(prompt(2, 2), cache, slots=[2]), "slots: expected 2"),
        "id >= vocab": (lambda: model.prefill(torch.cat([ids[:, :5], ids[:, :1] * 0 + 256], 1), cache),
                        r"input_ids: token ids must be in \[0, 256\)"),
        "negative id": (lambda: model(ids - 300), "input_ids: token ids"),
        "left padding": (lambda: model.generate(ids, 3, attention_mask=right_padding_mask([6, 4], 6).flip(1)),
                         "attention_mask: prompts must be right-padded"),
        "negative max_new_tokens": (lambda: model.generate(ids, -1), "max_new_tokens"),
        "temperature": (lambda: model.generate(ids, 1, temperature=-0.5), "temperature"),
        "top_p": (lambda: model.generate(ids, 1, temperature=1.0, top_p=0.0), "top_p"),
        "top_k": (lambda: model.generate(ids, 1, temperature=1.0, top_k=-2), "top_k"),
        "eos out of vocab": (lambda: model.generate(ids, 1, eos_token_id=999), "eos_token_id"),
    }
    for case, (call, message) in bad_calls.items():
        with pytest.raises(ValueError, match=message):
            call()
        assert torch.equal(cache.lengths, state_after[0]) and torch.equal(cache.active, state_after[1]), \
            f"{case} changed the cache"
    assert torch.equal(model.prefill(ids, cache), expected)
    with pytest.raises(TypeError, match="input_ids"):
        model(ids.float())


def test_prefill_into_slots_leaves_the_other_slots_decoding(models):
    """A request prefilled into slot 2 while slot 0 decodes: slot 0's next logits are what they
    would be without it, and slot 2 decodes as if alone."""
    _, model = models
    first, second = prompt(1, 7, seed=21), prompt(1, 5, seed=22)
    cache = model.new_cache(max_batch=3, max_len=16)
    model.prefill(first, cache, slots=[0])
    token = torch.tensor([5, 0, 0], device=DEVICE)
    model.decode_step(token, cache)
    assert cache.active.tolist() == [True, False, False]
    model.prefill(second, cache, slots=[2])
    assert cache.active.tolist() == [True, False, True] and cache.lengths.tolist() == [8, 0, 5]
    both = model.decode_step(torch.tensor([9, 0, 11], device=DEVICE), cache)
    alone = model.new_cache(max_batch=1, max_len=16)
    model.prefill(first, alone)
    model.decode_step(torch.tensor([5], device=DEVICE), alone)
    assert (model.decode_step(torch.tensor([9], device=DEVICE), alone)[0] - both[0]).abs().max() <= 1e-5
    model.prefill(second, alone)
    assert (model.decode_step(torch.tensor([11], device=DEVICE), alone)[0] - both[2]).abs().max() <= 1e-5


@pytest.mark.parametrize("lengths, chunk_size", [([9, 6], 1), ([19, 6], 4), ([70, 23], 64), ([37], 8)])
def test_chunked_prefill_equals_one_prefill(models, lengths, chunk_size):
    """Prompts prefilled chunk_size tokens at a time (each chunk continuing from the conv state,
    the GDN state and the K/V of the chunks before it; the shorter row dropping out) give the
    one-call prefill's logits within 1e-4 and the same state: the next 4 greedy decode steps agree.
    (One prompt: its continued chunks read and write the state pool in place; two: gathered.)"""
    _, model = models
    T = max(lengths)
    slots = [2, 0][:len(lengths)]
    ids, mask = prompt(len(lengths), T, seed=31), right_padding_mask(lengths, T)
    whole, chunked = model.new_cache(max_batch=3, max_len=T + 5), model.new_cache(max_batch=3, max_len=T + 5)
    logits = model.prefill(ids, whole, mask, slots=slots)
    chunk_logits = model.prefill(ids, chunked, mask, slots=slots, chunk_size=chunk_size)
    assert (logits - chunk_logits).abs().max() <= 1e-4
    expected_lengths = [0, 0, 0]
    for slot, length in zip(slots, lengths):
        expected_lengths[slot] = length
    assert whole.lengths.tolist() == chunked.lengths.tolist() == expected_lengths
    tokens = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    for _ in range(4):
        tokens[slots] = logits.argmax(-1)
        assert torch.equal(tokens[slots], chunk_logits.argmax(-1))
        logits, chunk_logits = (model.decode_step(tokens, cache)[slots] for cache in (whole, chunked))
        assert (logits - chunk_logits).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="chunk_size"):
        model.prefill(ids, chunked, mask, slots=slots, chunk_size=0)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_16_bit_recurrent_states_round_each_step_and_stay_close(models, state_dtype):
    """A cache whose Gated DeltaNet states are 16-bit (vLLM's default): the pools hold that dtype
    after a chunked prefill (fresh and continued chunks) and decode steps, every kernel computes in
    fp32 and rounds each new state once, so the logits differ from the fp32-state cache's by about
    that rounding (not bit for bit: the states are rounded) and the greedy tokens agree."""
    _, model = models
    lengths, T = [19, 6], 19
    ids, mask = prompt(2, T, seed=41), right_padding_mask(lengths, T)
    exact = model.new_cache(max_batch=3, max_len=T + 5)
    rounded = model.new_cache(max_batch=3, max_len=T + 5, state_dtype=state_dtype)
    pools = [layer.recurrent for layer in rounded.layers if hasattr(layer, "recurrent")]
    assert pools and all(pool.dtype == state_dtype for pool in pools)
    logits = model.prefill(ids, exact, mask, slots=[2, 0], chunk_size=8)
    rounded_logits = model.prefill(ids, rounded, mask, slots=[2, 0], chunk_size=8)
    tokens = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    for step in range(4):
        assert rel_err(rounded_logits, logits) <= 2e-2, step
        assert not torch.equal(rounded_logits, logits), step
        assert torch.equal(rounded_logits.argmax(-1), logits.argmax(-1)), step
        tokens[[2, 0]] = logits.argmax(-1)
        logits, rounded_logits = (model.decode_step(tokens, cache)[[2, 0]] for cache in (exact, rounded))
    assert all(pool.dtype == state_dtype for pool in pools)
    assert all(not pool[[0, 2]].eq(0).all() and pool[1].eq(0).all() for pool in pools)  # slot 1 unused
    with pytest.raises(ValueError, match="state_dtype"):
        model.new_cache(max_batch=1, max_len=8, state_dtype=torch.int8)


def test_paged_cache_with_shuffled_pages_equals_the_default_one(models):
    """Pages of 16 tokens handed out in a shuffled order (slot 2 owns pages 5, 0, 3; slot 0 owns
    1, 4), fewer pages than max_batch x max_len: the chunked prefill (a chunk crossing pages) and
    4 decode steps (crossing a page boundary) equal the default cache's within 1e-5."""
    _, model = models
    lengths = [30, 13]
    ids, mask = prompt(2, 30, seed=33), right_padding_mask(lengths, 30)
    default = model.new_cache(max_batch=3, max_len=40)
    paged = model.new_cache(max_batch=3, max_len=40, num_pages=6, page_size=16)
    assert paged.block_table.tolist() == [[6, 6, 6]] * 3  # nobody owns a page yet: all at the scratch page
    paged.assign_pages([2, 0], [[5, 0, 3], [1, 4]])
    assert paged.block_table.tolist() == [[1, 4, 6], [6, 6, 6], [5, 0, 3]]
    expected = model.prefill(ids, default, mask, slots=[2, 0], chunk_size=20)
    logits = model.prefill(ids, paged, mask, slots=[2, 0], chunk_size=20)
    assert (logits - expected).abs().max() <= 1e-5
    tokens = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    for _ in range(4):
        tokens[[2, 0]] = expected.argmax(-1)
        expected, logits = (model.decode_step(tokens, cache)[[2, 0]] for cache in (default, paged))
        assert (logits - expected).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="page_size"):
        model.new_cache(max_batch=1, max_len=8, page_size=24)
    with pytest.raises(ValueError, match="max_len"):
        model.new_cache(max_batch=1, max_len=-1)
    assert default.rotary.shape == (40, 2, model.config.rotary_dim)
    with pytest.raises(ValueError, match="rotary: expected"):  # a table shorter than max_len
        Qwen35Cache.allocate(model.config, 1, 41, model.dtype, model.device, default.rotary)


def test_prefill_step_padding_rows_and_tokens_change_nothing():
    """What the engine's prefill graphs rely on: a chunk padded with extra tokens and with a
    padding row that repeats row 0 (same slot, same ids) gives the exact-shape call's logits and
    cache state, for fresh chunks and for continued ones (per-row starts 5 and 0)."""
    model = random_qwen35(tiny_config(), dtype=torch.float32, device=DEVICE, seed=7)
    ids = prompt(2, 12, seed=41)
    caches = [model.new_cache(max_batch=3, max_len=40) for _ in range(2)]

    def step(cache, pad, starts, lengths, fresh):
        """Rows 0 and 1 of ids from starts, into slots 2 and 0; pad > 0: pad more tokens and a
        third row repeating row 0."""
        slots = [2, 0] + [2] * (pad > 0)
        starts, lengths = starts + starts[:1] * (pad > 0), lengths + lengths[:1] * (pad > 0)
        chunk = torch.zeros(len(slots), max(lengths) + pad, dtype=torch.int64, device=DEVICE)
        for i, (start, n) in enumerate(zip(starts, lengths)):
            chunk[i, :n] = ids[i % 2, start:start + n]
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=DEVICE)
        return model.prefill_step(chunk, cache, as_tensor(slots), as_tensor(starts), as_tensor(lengths), fresh)[:2]

    for cache, pad in zip(caches, (0, 7)):
        first = step(cache, pad, [0, 0], [5, 9], True)
        second = step(cache, pad, [5, 9], [7, 3], False)
        if pad == 0:
            expected = first, second
    assert (first - expected[0]).abs().max() <= 1e-5 and (second - expected[1]).abs().max() <= 1e-5
    exact, padded = caches
    assert exact.lengths.tolist() == padded.lengths.tolist() == [12, 0, 12]
    for a, b in zip(exact.layers, padded.layers):
        for name in ("conv", "recurrent") if hasattr(a, "conv") else ("key", "value"):
            x, y = getattr(a, name)[[2, 0]], getattr(b, name)[[2, 0]]
            if name in ("key", "value"):
                x, y = x[..., :12, :], y[..., :12, :]  # padding may write beyond a row's length
            assert (x - y).abs().max() <= 1e-5, name


def mixed_step_case(model):
    """Two equal caches of 4 slots (3 and 1 prompts prefilled, slot 1 idle: its prompt goes on) and
    a mixed step's inputs: each slot's decode token, prompt chunks into slots 3 (fresh) and 1
    (continued from 6 cached tokens, among the decode rows: inactive there), the decode rows' slots
    (2, 0, 1: rows 0 and 1 decode)."""
    ids = prompt(3, 14, seed=42)
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=DEVICE)  # noqa: E731
    caches = [model.new_cache(max_batch=4, max_len=40, num_pages=12, page_size=16) for _ in range(2)]
    for cache in caches:
        cache.assign_pages([0, 2, 3, 1], [[4, 7], [0, 9], [2, 11], [5, 3]])
        model.prefill(ids[:2, :9], cache, slots=[0, 2])
        model.prefill(ids[2:, :6], cache, slots=[1])
        cache.active[1] = False  # slot 1's prompt goes on below: not decoding
    chunk = torch.zeros(2, 8, dtype=torch.int64, device=DEVICE)
    chunk[0, :8], chunk[1, :5] = ids[0, :8], ids[2, 6:11]
    return (caches, as_tensor([5, 0, 17, 0]), chunk, as_tensor([3, 1]), as_tensor([0, 6]), as_tensor([8, 5]),
            as_tensor([2, 0, 1]))


def assert_same_cache_state(a: Qwen35Cache, b: Qwen35Cache, tol: float) -> None:
    """Every layer's conv and recurrent states, and K/V but the scratch page (the last: both halves
    of a mixed step write padding there), within ``tol``."""
    for x_layer, y_layer in zip(a.layers, b.layers):
        for name in ("conv", "recurrent") if hasattr(x_layer, "conv") else ("key", "value"):
            x, y = getattr(x_layer, name), getattr(y_layer, name)
            if name in ("key", "value"):
                x, y = x[:-1], y[:-1]
            assert (x - y).abs().max() <= tol, name


def test_mixed_step_equals_a_decode_step_then_a_prefill_step():
    """One pass of a decode step and two prompt chunks (``mixed_step_case``) gives the two calls'
    logits and cache state within 1e-5; the chunks' slots keep their active flags. Row 2's decode
    logits are meaningless (an inactive row: no state read, its K/V to the scratch page), as is the
    scratch page both halves write: neither is compared."""
    model = random_qwen35(tiny_config(), dtype=torch.float32, device=DEVICE, seed=8)
    (apart, mixed), tokens, chunk, slots, starts, lengths, decode_slots = mixed_step_case(model)
    decode_logits = model.decode_step(tokens, apart, decode_slots)
    prefill_logits = model.prefill_step(chunk, apart, slots, starts, lengths)
    apart.active[[3, 1]] = False  # prefill_step activates its slots; mixed_step leaves that to the caller
    got_decode, got_prefill = model.mixed_step(tokens, mixed, chunk, slots, starts, lengths, decode_slots=decode_slots)
    assert got_decode.shape[0] == 3
    assert (got_decode[:2] - decode_logits[:2]).abs().max() <= 1e-5
    assert (got_prefill - prefill_logits).abs().max() <= 1e-5
    assert mixed.lengths.tolist() == apart.lengths.tolist() == [10, 11, 10, 8]
    assert mixed.active.tolist() == [True, False, True, False]
    assert_same_cache_state(apart, mixed, 1e-5)


def test_stop_ids_are_the_union_of_the_checkpoint_files():
    """Released layout: top-level eos 248046 (<|im_end|>), text_config 248044, generation_config
    both: a chat reply's end and the text end both stop."""
    wrapper = {"model_type": "qwen3_5", "eos_token_id": 248046, "text_config": {**TINY, "vocab_size": 248320,
                                                                               "eos_token_id": 248044}}
    assert Qwen35Config.from_hf(wrapper).stop_token_ids == (248046, 248044)
    assert Qwen35Config.from_hf(wrapper, {"eos_token_id": [248046, 248044]}).stop_token_ids == (248046, 248044)
    assert Qwen35Config.from_hf({**TINY, "eos_token_id": 7}, {"eos_token_id": [8, 7]}).stop_token_ids == (7, 8)
    assert Qwen35Config.from_hf(TINY).stop_token_ids == ()


# ----------------------------------------------------------------------------- GPU
def cosine(a, b):
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@pytest.mark.gpu
def test_bf16_logits_match_hf_on_gpu():
    """bf16 on the GPU kernels: prefill (one padded row) and 8 decode steps vs HF bf16."""
    hf = tiny_hf_model(seed=11, dtype=torch.bfloat16, hidden_size=256, intermediate_size=512, head_dim=64,
                       linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
                       linear_num_value_heads=4)
    model = Qwen35.from_hf(hf)
    ids, lengths = prompt(2, 100, seed=12), [100, 37]
    mask = right_padding_mask(lengths, 100)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits
    out = model(ids, attention_mask=mask)
    real = mask.bool()
    assert cosine(out[real], ref[real]) >= 0.999
    with torch.no_grad():
        ref_run = hf.generate(ids[:1], max_new_tokens=8, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
    tokens, logits = model.generate(ids[:1], 8, return_logits=True)
    ref_logits = torch.stack(ref_run.logits, dim=1)
    for step in range(8):
        assert cosine(logits[:, step], ref_logits[:, step]) >= 0.999, step
        if not torch.equal(tokens[:, : step + 1], ref_run.sequences[:, 100: 101 + step]):
            break  # a bf16 near-tie changed the path: later steps are not comparable


@pytest.mark.gpu
def test_mixed_step_on_a_side_stream_equals_one_stream(monkeypatch):
    """On CUDA a mixed step runs its prompt chunk's token mixing on a side stream: the same logits
    (active rows) and cache state as with FUSELM_SIDE_STREAM=0 (one stream, in order), eager and
    replayed from a CUDA graph (the fork and join captured as graph branches)."""
    from fuselm import runtime

    model = random_qwen35(tiny_config(), dtype=torch.float32, device=DEVICE, seed=8)
    assert runtime.side_stream(model.device) is not None
    (side, graphed), tokens, chunk, slots, starts, lengths, decode_slots = mixed_step_case(model)
    (single, scratch), *_ = mixed_step_case(model)
    got = model.mixed_step(tokens, side, chunk, slots, starts, lengths, decode_slots=decode_slots)
    caches = iter([scratch, graphed])  # capture_graph's warm-up call takes the scratch cache
    graph, graph_out = runtime.capture_graph(
        lambda: model.mixed_step(tokens, next(caches), chunk, slots, starts, lengths, decode_slots=decode_slots))
    graph.replay()
    monkeypatch.setattr(runtime, "SIDE_STREAM", False)
    assert runtime.side_stream(model.device) is None
    want = model.mixed_step(tokens, single, chunk, slots, starts, lengths, decode_slots=decode_slots)
    torch.cuda.synchronize()
    for out, cache in ((got, side), (graph_out, graphed)):
        assert (out[0][:2] - want[0][:2]).abs().max() <= 1e-5
        assert (out[1] - want[1]).abs().max() <= 1e-5
        assert_same_cache_state(cache, single, 1e-5)


@pytest.mark.gpu
def test_decode_step_replays_in_a_cuda_graph(models):
    """decode_step captured once and replayed equals eager decode steps (static cache tensors)."""
    _, model = models
    ids = prompt(2, 7, seed=13)
    eager_cache, graph_cache = model.new_cache(2, 16), model.new_cache(2, 16)
    first = model.prefill(ids, eager_cache).argmax(-1)
    model.prefill(ids, graph_cache)
    tokens = first.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (kernels compiled) on a scratch copy of the cache
        scratch = model.new_cache(2, 16)
        model.prefill(ids, scratch)
        model.decode_step(tokens, scratch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_logits = model.decode_step(tokens, graph_cache)
    eager_tokens = first
    for _ in range(4):
        eager_logits = model.decode_step(eager_tokens, eager_cache)
        graph.replay()
        assert torch.allclose(graph_logits, eager_logits, atol=1e-4, rtol=0)
        assert torch.equal(graph_cache.lengths, eager_cache.lengths)
        eager_tokens = eager_logits.argmax(-1)
        tokens.copy_(graph_logits.argmax(-1))
