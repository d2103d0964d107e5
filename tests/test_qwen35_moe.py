"""Qwen35Moe (Qwen3.5-MoE: the Qwen3.5 hybrid with sparse MoE MLPs on the routing and grouped-GEMM
kernels, in the interpreter on a CPU) against HF transformers' Qwen3_5MoeForCausalLM with the same
random weights, fp32: logits within 1e-3, 32 greedy tokens identical; the engine's continuous
batching on it; a released-layout checkpoint (per-expert tensors, the VL wrapper) read back; the
config and class checks."""

import contextlib
import json

import pytest
import torch

from conftest import DEVICE
from fuselm import Qwen35, Qwen35Config, Qwen35Moe
from fuselm.engine import Engine, SamplingParams
from fuselm.models.qwen35.presets import (PRESETS, config_35b_a3b, random_hf_qwen35, tiny_config, tiny_moe_config,
                                          write_random_checkpoint)

transformers = pytest.importorskip("transformers")

VOCAB = 256


# HF runs on the CPU even in a GPU run: on a GPU its conv1d takes cuDNN's TF32 and its Gated
# DeltaNet fla-core's kernels, ~1e-3 from exact fp32, enough to flip a near-tie in the router (a
# different expert: a logit difference of ~0.1, measured on the H100) where our fp32 kernels are
# exact products (IEEE dots).
@pytest.fixture(scope="module")
def models():
    hf = random_hf_qwen35(tiny_moe_config(vocab_size=VOCAB), dtype=torch.float32, device="cpu", seed=5)
    return hf, Qwen35Moe.from_hf(hf).to(DEVICE)


@contextlib.contextmanager
def hf_torch_path():
    """HF's own PyTorch Gated DeltaNet and conv1d: with fla-core installed (the GPU runs) its
    module calls fla's Triton kernels, which cannot take the CPU tensors of the reference."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
             "causal_conv1d_update")
    saved = {name: getattr(modeling, name) for name in names}
    try:
        for name, fn in saved.items():
            setattr(modeling, name, getattr(fn, "__wrapped__", fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(modeling, name, fn)


def hf_logits(hf, ids):
    with torch.no_grad(), hf_torch_path():
        return hf(input_ids=ids.cpu()).logits.to(DEVICE)


def prompt(B, T, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def test_logits_match_hf_in_fp32(models):
    hf, model = models
    assert type(model) is Qwen35Moe and model.config.is_moe
    ids = prompt(2, 11)
    expected = hf_logits(hf, ids)
    logits = model(ids)
    assert (logits - expected).abs().max() <= 1e-3
    assert expected.std() > 0.5  # random weights away from init: logits far from zero


def test_greedy_32_tokens_match_hf(models):
    hf, model = models
    ids = prompt(1, 7, seed=2)
    with torch.no_grad(), hf_torch_path():
        expected = hf.generate(ids.cpu(), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert model.generate(ids, 32, eos_token_id=[]).tolist() == expected[:, 7:].tolist()


def test_engine_requests_get_their_solo_output(models):
    """Continuous batching (mixed prefill + decode steps) over the MoE model: three prompts of
    different lengths (one longer than the 8-token prefill budget), joining as slots free up, each
    equals its own run. Three tokens each keep the CPU suite short (the dense engine's tests join
    requests at random steps at length)."""
    _, model = models
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts = [prompt(1, n, seed=10 + n)[0].tolist() for n in (3, 9, 6)]
    solo = [Engine(model, max_batch=1, max_len=24).generate([p], params)[0].outputs[0].token_ids for p in prompts]
    outputs = Engine(model, max_batch=2, max_len=24, max_prefill_tokens=8).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == solo


def test_released_checkpoint_layout_reads_back(tmp_path):
    """write_random_checkpoint of an MoE config: the VL wrapper with one tensor per expert, as
    save_pretrained writes it; from_pretrained gives a Qwen35Moe whose logits are HF's."""
    config = tiny_moe_config(vocab_size=VOCAB)
    write_random_checkpoint(tmp_path, config, dtype=torch.float32, seed=3, max_shard_size="200KB")
    from safetensors import safe_open

    names = set()
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            names |= set(handle.keys())
    assert "model.language_model.layers.0.mlp.experts.7.down_proj.weight" in names
    model = Qwen35.from_pretrained(tmp_path)
    assert type(model) is Qwen35Moe and model.config == Qwen35Config.from_hf(
        json.loads((tmp_path / "config.json").read_text()), json.loads((tmp_path / "generation_config.json").read_text()))
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    ids = prompt(1, 6, seed=4)
    expected = hf_logits(hf, ids)
    assert (model.to(DEVICE)(ids) - expected).abs().max() <= 1e-3


def test_configs_and_classes():
    big = config_35b_a3b()
    assert (big.hidden_size, big.num_hidden_layers, big.num_experts, big.num_experts_per_tok,
            big.moe_intermediate_size, big.shared_expert_intermediate_size) == (2048, 40, 256, 8, 512, 512)
    assert big.layer_types.count("full_attention") == 10 and "35b-a3b" in PRESETS
    from fuselm import cli

    assert cli.PRESETS == PRESETS
    with pytest.raises(ValueError, match="Qwen35Moe"):
        Qwen35(tiny_moe_config())
    with pytest.raises(ValueError, match="dense"):
        Qwen35Moe(tiny_config())
    assert type(Qwen35.for_config(tiny_moe_config())) is Qwen35Moe
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Qwen35Config(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8, shared_expert_intermediate_size=8)
    with pytest.raises(ValueError, match="num_experts"):
        Qwen35Config.from_hf({"model_type": "qwen3_5_moe_text", "num_experts": 0})


def test_decode_weight_bytes_count_the_experts_a_step_reads(models):
    """The floor's bytes: at batch 1 an MoE layer reads k of its E routed experts (uniform
    routing), at a large batch all of them (and every other weight either way)."""
    from fuselm.engine.audit import decode_weight_bytes

    _, model = models
    c = model.config
    whole = sum(p.numel() * p.element_size() for p in model.parameters()) - model.embed_tokens.numel() * 4
    routed = sum(layer.mlp.w13[:c.num_experts].numel() + layer.mlp.w2[:c.num_experts].numel()
                 for layer in model.layers) * 4
    assert decode_weight_bytes(model, 10 ** 4) == whole
    assert abs(decode_weight_bytes(model, 1) - (whole - routed * (1 - c.num_experts_per_tok / c.num_experts))) <= 32


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_an_moe_layer_runs_at_most_four_kernels_a_decode_step(models, tokens):
    """Seed 003's gate, as ``fuselm audit`` counts it: router GEMM, routing, gate/up (activation
    and shared expert inside), down with the combine."""
    from fuselm.engine.audit import MOE_MAX_KERNELS, moe_layer_kernels

    _, model = models
    assert moe_layer_kernels(model, tokens) <= MOE_MAX_KERNELS == 4
