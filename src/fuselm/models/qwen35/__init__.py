"""Qwen3.5 text model on fuselm kernels.

    config.py   Qwen35Config (HF Qwen3_5TextConfig fields, from config.json / the VL wrapper)
    cache.py    Qwen35Cache: per-slot attention K/V, DeltaNet conv and recurrent state, rotary table
    layers.py   rotary frequencies, Gated DeltaNet, gated attention, MLP, decoder layer
    model.py    Qwen35: forward, prefill into cache slots, CUDA-graph-safe decode step; Qwen35Moe
    weights.py  loading from a live HF model or a checkpoint directory (sharded safetensors)
    presets.py  built-in configs (tiny, 9b), seeded random weights, random-weight checkpoints
"""

from fuselm.models.qwen35.cache import Qwen35Cache
from fuselm.models.qwen35.config import Qwen35Config
from fuselm.models.qwen35.model import Qwen35, Qwen35Moe

__all__ = ["Qwen35", "Qwen35Cache", "Qwen35Config", "Qwen35Moe"]
