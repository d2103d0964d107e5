"""Qwen3.5 text-model configuration: the fields of HF ``Qwen3_5TextConfig`` (transformers >= 5.2),
and of ``Qwen3_5MoeTextConfig`` for the MoE models (the same model with sparse MoE MLPs).

``Qwen35Config.from_hf`` reads a text config, the vision-language wrapper's ``config.json``
(``Qwen3_5ForConditionalGeneration``: the text model under ``text_config``) or either as a dict,
and, optionally, ``generation_config.json``. Stop ids are the union of every place that names
one: released checkpoints say 248046 (``<|im_end|>``, the end of a chat reply) at the top level and
in generation_config, 248044 (``<|endoftext|>``) in ``text_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
# HF's remap_legacy_layer_types (configuration_utils.py)
_LEGACY_LAYER_TYPES = {"mamba": LINEAR_ATTENTION, "conv": LINEAR_ATTENTION, "attention": FULL_ATTENTION}


def _ids(value) -> tuple[int, ...]:
    """None, an id or a list of ids -> a tuple of ids."""
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


@dataclass(frozen=True)
class Qwen35Config:
    """The text-model fields of HF ``Qwen3_5TextConfig``; the defaults are HF's (the 9B model)."""

    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    # gated full attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    # Gated DeltaNet
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # one of "linear_attention" / "full_attention" per layer; default: every 4th is full
    layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Qwen3.5-MoE (HF ``Qwen3_5MoeTextConfig``): every layer's MLP is a sparse MoE block of
    # ``num_experts`` routed SwiGLU experts (``num_experts_per_tok`` per token, each
    # ``moe_intermediate_size`` wide) plus a gated shared expert; 0 experts: the dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple(
                FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(self.num_hidden_layers)))
        object.__setattr__(self, "layer_types", tuple(_LEGACY_LAYER_TYPES.get(t, t) for t in self.layer_types))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types: {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
        if unknown:
            raise ValueError(f"layer_types: unknown {sorted(unknown)} (expected {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r})")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is implemented (Qwen3.5), got {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                             f"num_attention_heads = {self.num_attention_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_key_heads: {self.linear_num_key_heads} does not divide "
                             f"linear_num_value_heads = {self.linear_num_value_heads}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok: expected 1 .. num_experts = {self.num_experts}, "
                                 f"got {self.num_experts_per_tok}")
            for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name}: expected >= 1 for an MoE model, got {getattr(self, name)}")
        if self.rotary_dim < 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"partial_rotary_factor: head_dim {self.head_dim} x {self.partial_rotary_factor} gives "
                             f"rotary dim {self.rotary_dim}; it must be even, >= 2 and <= head_dim")

    # derived sizes -----------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # HF: int(head_dim * partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v of the delta rule."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def is_moe(self) -> bool:
        """Sparse MoE MLPs (Qwen3.5-MoE) instead of dense ones."""
        return self.num_experts > 0

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids that end a sequence (``eos_token_id`` as a tuple; empty when none is known)."""
        return _ids(self.eos_token_id)

    @classmethod
    def from_hf(cls, config, generation_config: dict | None = None) -> "Qwen35Config":
        """From an HF ``Qwen3_5TextConfig``, a multimodal ``Qwen3_5Config`` (its ``text_config``),
        or either as a dict (the contents of ``config.json``); ``generation_config``: the contents
        of ``generation_config.json``, whose eos ids join the stop ids."""
        top = config if isinstance(config, dict) else getattr(config, "to_dict", lambda: None)()
        if not isinstance(top, dict):
            raise TypeError(f"config: expected an HF config or a dict, got {type(config).__name__}")
        text = top.get("text_config") or top
        if not isinstance(text, dict):
            text = text.to_dict()
        model_type = text.get("model_type", "qwen3_5_text")
        if model_type not in ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"):
            raise ValueError(f"config: model_type {model_type!r} is not a Qwen3.5 (or Qwen3.5-MoE) text model")
        if model_type.startswith("qwen3_5_moe") and not text.get("num_experts"):
            raise ValueError(f"config: a {model_type} config without num_experts")
        values = {f.name: text[f.name] for f in fields(cls) if f.name in text and text[f.name] is not None
                  and f.name not in ("rope_theta", "partial_rotary_factor", "layer_types", "eos_token_id")}
        if text is not top:  # multimodal: HF ties the LM head by the top-level flag
            if top.get("tie_word_embeddings") is not None:
                values["tie_word_embeddings"] = top["tie_word_embeddings"]
            if values.get("pad_token_id") is None and top.get("pad_token_id") is not None:
                values["pad_token_id"] = top["pad_token_id"]
        # Stop ids: the union, the chat reply's end (top level, generation config) first.
        stop = []
        for source in (top, generation_config or {}, text):
            stop += [i for i in _ids(source.get("eos_token_id")) if i not in stop]
        if stop:
            values["eos_token_id"] = stop[0] if len(stop) == 1 else tuple(stop)
        # RoPE: rope_parameters (or the legacy rope_scaling), then top-level keys, then defaults
        # (Qwen3_5TextConfig.__post_init__ defaults partial_rotary_factor to 0.25).
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_parameters: rope_type {rope_type!r} is not implemented (only 'default')")
        values["rope_theta"] = float(rope.get("rope_theta") or text.get("rope_theta") or cls.rope_theta)
        factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor"))
        values["partial_rotary_factor"] = float(cls.partial_rotary_factor if factor is None else factor)
        if text.get("layer_types"):
            values["layer_types"] = tuple(text["layer_types"])
        else:
            interval = text.get("full_attention_interval", 4)
            layers = values.get("num_hidden_layers", cls.num_hidden_layers)
            values["layer_types"] = tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                                          for i in range(layers))
        return cls(**values)
