"""Built-in Qwen3.5 configs, seeded random weights and random-weight checkpoints (nothing to download).

- ``tiny_config()``: a 4-layer Qwen3.5-architecture model (DeltaNet, attention, DeltaNet,
  attention; GQA in both mixers) small enough for the Triton interpreter on a CPU;
- ``config_9b()``: HF ``Qwen3_5TextConfig()`` defaults (the 9B text model);
- ``tiny_moe_config()`` / ``config_35b_a3b()``: the same for Qwen3.5-MoE (``Qwen35Moe``; the
  latter HF ``Qwen3_5MoeTextConfig()`` defaults, 35B-A3B);
- ``preset_config(name)``: "tiny", "9b", "tiny-moe" or "35b-a3b" by name;
- ``random_qwen35(config, ...)``: a ``Qwen35`` with seeded random weights made directly on the
  device in the model dtype (9B parameters in bf16 never pass through a CPU fp32 copy);
- ``randomize_hf_weights_(hf_model, ...)``: the same scheme on a live HF model, for parity runs;
- ``write_random_checkpoint(directory, config, ...)``: a checkpoint directory in the released
  layout (the vision-language wrapper's config.json and weight names, a small vision tower,
  sharded safetensors with an index, generation_config.json) holding those random weights. The
  tokenizer files are ``fuselm.tokenizer.write_tokenizer_files``'s.

Scheme (as ``tests/test_qwen35.py``): HF's own init gives near-zero logits, which would let a
parity check pass for a broken model, so every weight moves away from its init value:
embeddings N(0, 1); every matrix N(0, fan_in^-1/2) (unit-variance outputs; the depthwise conv's
fan-in is its kernel width); decay rates A_log ~ U(-1, 1) (exp(A_log) in [0.37, 2.7]); the
DeltaNet's plain RMSNorm weight N(1, 0.3); zero-centered norm weights, dt_bias and biases
N(0, 0.3). Our fused layout (stacked projections, interleaved gate/up) stacks rows that share a
fan-in, so drawing directly in it gives the same distribution as drawing HF's tensors.
"""

from __future__ import annotations

import torch

from fuselm.models.qwen35.config import Qwen35Config
from fuselm.models.qwen35.model import Qwen35

TINY_LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "full_attention")


def tiny_config(vocab_size: int = 512) -> Qwen35Config:
    """The built-in default of ``fuselm generate`` / ``fuselm audit``: hidden 64, 4 layers."""
    return Qwen35Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4,
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=1,
                        linear_num_value_heads=2, layer_types=TINY_LAYER_TYPES)


def config_9b() -> Qwen35Config:
    """HF ``Qwen3_5TextConfig()`` defaults: 32 layers (every 4th full attention), hidden 4096,
    vocab 248320. The fields are this package's defaults, which are HF's; the HF object is used
    when transformers is installed so the two cannot drift apart."""
    try:
        from transformers import Qwen3_5TextConfig
    except ImportError:
        return Qwen35Config()
    return Qwen35Config.from_hf(Qwen3_5TextConfig())


def tiny_moe_config(vocab_size: int = 512) -> Qwen35Config:
    """``tiny_config`` with MoE MLPs: 8 experts of 32 features, 2 per token, a 48-wide shared
    expert (wider than a routed one: two chunks in the kernels' layout)."""
    from dataclasses import replace

    return replace(tiny_config(vocab_size), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48)


def config_35b_a3b() -> Qwen35Config:
    """HF ``Qwen3_5MoeTextConfig()`` defaults, Qwen3.5-35B-A3B: 40 layers (every 4th full
    attention), hidden 2048, 256 experts of 512 features, 8 per token, a 512-wide shared expert."""
    try:
        from transformers import Qwen3_5MoeTextConfig
    except ImportError:
        return Qwen35Config(hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2, num_experts=256,
                            num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512)
    return Qwen35Config.from_hf(Qwen3_5MoeTextConfig())


def config_0_8b() -> Qwen35Config:
    """A Qwen3.5-shaped config of ~0.8B parameters for training runs and benchmarks (issue 20; not
    a released checkpoint's config): hidden 1024, 24 layers (every 4th full attention, 8 query
    and 2 KV heads of 256), Gated DeltaNet with 16 key and 16 value heads of 128, MLP 4096, the
    real 248,320-token vocabulary with tied embeddings (254M of the parameters)."""
    return Qwen35Config(vocab_size=248320, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16,
                        tie_word_embeddings=True,
                        layer_types=tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(24)))


PRESETS = ("tiny", "9b", "tiny-moe", "35b-a3b", "0.8b")


def preset_config(name: str, vocab_size: int | None = None) -> Qwen35Config:
    """The built-in config called ``name`` (``PRESETS``); ``vocab_size`` overrides the tiny
    models' (a checkpoint with the real tokenizer needs 248320)."""
    tiny = {} if vocab_size is None else {"vocab_size": vocab_size}
    builders = {"tiny": lambda: tiny_config(**tiny), "9b": config_9b, "tiny-moe": lambda: tiny_moe_config(**tiny),
                "35b-a3b": config_35b_a3b, "0.8b": config_0_8b}
    if not isinstance(name, str) or name.lower() not in builders:
        raise ValueError(f"config: expected one of {PRESETS}, got {name!r}")
    return builders[name.lower()]()


def _fill_random_(name: str, weight: torch.Tensor, generator: torch.Generator) -> None:
    """One weight in place by the module docstring's scheme; ``name`` in HF's or our naming."""
    if name.endswith("A_log"):
        weight.uniform_(-1.0, 1.0, generator=generator)
    elif name.endswith(("linear_attn.norm.weight", "mixer.norm")) and weight.dim() == 1:
        weight.normal_(1.0, 0.3, generator=generator)
    elif "embed_tokens" in name:
        weight.normal_(0.0, 1.0, generator=generator)
    elif weight.dim() >= 2:  # fan-in: the last dim (a depthwise conv's: its kernel width)
        weight.normal_(0.0, weight.shape[-1] ** -0.5, generator=generator)
    else:
        weight.normal_(0.0, 0.3, generator=generator)


@torch.no_grad()
def random_qwen35(config: Qwen35Config, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0) -> Qwen35:
    """A ``Qwen35`` with seeded random weights, each drawn on ``device`` in ``dtype``."""
    device = torch.device(device)
    generator = torch.Generator(device).manual_seed(seed)
    model = Qwen35.for_config(config)
    weights = {}
    for name, meta in model.named_parameters():
        weight = torch.empty(meta.shape, dtype=dtype, device=device)
        _fill_random_(name, weight, generator)
        weights[name] = weight
    model.load_state_dict(weights, strict=True, assign=True)
    return model.eval()


@torch.no_grad()
def randomize_hf_weights_(hf_model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite every parameter of a live HF Qwen3.5 model by the same scheme, in place."""
    parameters = list(hf_model.named_parameters())
    generator = torch.Generator(parameters[0][1].device).manual_seed(seed)
    for name, weight in parameters:
        _fill_random_(name, weight, generator)
    return hf_model


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def to_hf_config(config: Qwen35Config):
    """The HF ``Qwen3_5TextConfig`` (``Qwen3_5MoeTextConfig`` for MoE) of ``config`` (the inverse
    of ``Qwen35Config.from_hf``)."""
    from dataclasses import asdict

    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    fields = asdict(config)
    for name in ("intermediate_size",) if config.is_moe else MOE_FIELDS:  # not a field of that HF class
        fields.pop(name)
    rope = {"rope_type": "default", "rope_theta": fields.pop("rope_theta"),
            "partial_rotary_factor": fields.pop("partial_rotary_factor")}
    fields["layer_types"] = list(fields["layer_types"])
    if isinstance(fields["eos_token_id"], tuple):
        fields["eos_token_id"] = list(fields["eos_token_id"])
    return (Qwen3_5MoeTextConfig if config.is_moe else Qwen3_5TextConfig)(**fields, rope_parameters=rope)


WEIGHT_SCHEMES = ("spread", "hf-init")


@torch.no_grad()
def random_hf_qwen35(config: Qwen35Config, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0,
                     weights: str = "spread"):
    """An HF ``Qwen3_5ForCausalLM`` (``Qwen3_5MoeForCausalLM``) of ``config`` built on ``device`` in ``dtype`` (no fp32 CPU
    copy first). ``weights``: "spread", drawn by ``randomize_hf_weights_`` (the module
    docstring's scheme); "hf-init", HF's own initialisation (``_init_weights``: N(0, 0.02)
    matrices and embeddings, zero-centered norms at 0, ...) drawn from torch's global RNG seeded
    with ``seed`` inside ``torch.random.fork_rng`` (the caller's RNG state is left as it was)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    if weights not in WEIGHT_SCHEMES:
        raise ValueError(f"weights: expected one of {WEIGHT_SCHEMES}, got {weights!r}")
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(seed)
        hf_class = Qwen3_5MoeForCausalLM if config.is_moe else Qwen3_5ForCausalLM
        hf_model = hf_class._from_config(to_hf_config(config), dtype=dtype)
    return (randomize_hf_weights_(hf_model, seed) if weights == "spread" else hf_model).eval()


# Released checkpoints' stop ids: a chat reply ends with <|im_end|> (the top level and
# generation_config name it), text_config names <|endoftext|>, the pad token.
IM_END_ID, END_OF_TEXT_ID = 248046, 248044
# The fixture's vision tower: the released wrapper's layout at the smallest size (never run).
_FIXTURE_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
# Sampling defaults a released Qwen3.5 generation_config carries (thinking mode).
_GENERATION_DEFAULTS = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)


@torch.no_grad()
def write_random_checkpoint(directory, config: Qwen35Config, dtype: torch.dtype = torch.bfloat16, device="cpu",
                            seed: int = 0, max_shard_size: str = "4GB") -> None:
    """Write a checkpoint directory in the released Qwen3.5 layout with seeded random weights
    (``randomize_hf_weights_``'s scheme): ``config.json`` of ``Qwen3_5ForConditionalGeneration``
    (``config`` as ``text_config``, a small vision tower), the weights as safetensors shards of at
    most ``max_shard_size`` with ``model.safetensors.index.json`` (text weights under
    ``model.language_model.``, vision weights under ``model.visual.``), and
    ``generation_config.json``. The weights are drawn on ``device`` in ``dtype``; HF transformers
    writes the files, so they are what its ``from_pretrained`` expects. Tokenizer files are
    ``fuselm.tokenizer.write_tokenizer_files``'s."""
    from transformers import (GenerationConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)

    wrapper, model_class = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if config.is_moe
                            else (Qwen3_5Config, Qwen3_5ForConditionalGeneration))

    text = to_hf_config(config).to_dict()
    text["eos_token_id"] = END_OF_TEXT_ID if config.vocab_size > IM_END_ID else text.get("eos_token_id")
    eos = [IM_END_ID, END_OF_TEXT_ID] if config.vocab_size > IM_END_ID else config.stop_token_ids
    hf_config = wrapper(text_config=text, vision_config=dict(_FIXTURE_VISION, out_hidden_size=config.hidden_size),
                              tie_word_embeddings=config.tie_word_embeddings)
    hf_config.eos_token_id = eos[0] if eos else None
    hf_config.architectures = [model_class.__name__]
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(seed)
        hf_model = model_class._from_config(hf_config, dtype=dtype)
    randomize_hf_weights_(hf_model, seed)
    hf_model.generation_config = GenerationConfig(
        eos_token_id=list(eos), pad_token_id=END_OF_TEXT_ID if config.vocab_size > IM_END_ID else config.pad_token_id,
        **_GENERATION_DEFAULTS)
    hf_model.save_pretrained(directory, max_shard_size=max_shard_size)
