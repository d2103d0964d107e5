"""Loading Qwen3.5 weights: from a live HF model, or from a checkpoint directory on disk.

A checkpoint directory holds ``config.json`` (a causal-LM config, or the released
vision-language wrapper with the text model under ``text_config``), optionally
``generation_config.json`` (its eos ids join the stop ids), and the weights as one
``model.safetensors`` or several shards listed by ``model.safetensors.index.json``. The wrapper's
text weights are named ``model.language_model.*``; vision (``model.visual.*``) and
multi-token-prediction (``mtp.*``) tensors are skipped without being read.

Reading is tensor by tensor (several at once, on threads): each tensor is memory-mapped from its
file, copied to the device and cast to the target dtype there, so host memory never holds a
second copy of the model. Every
name and shape is checked against the config before any data is read. Each module then re-lays
its own tensors (``hf_shapes`` / ``load_hf`` in ``layers.py``), freeing the HF pieces as it goes.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch
from torch import nn

from fuselm.models.qwen35.config import Qwen35Config
from fuselm.models.qwen35.model import Qwen35
from fuselm.runtime import parse_dtype

# Checkpoint tensors that are not part of the text model (Qwen3_5ForConditionalGeneration
# checkpoints): the vision tower and the multi-token-prediction head.
_IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.")
LOAD_THREADS = 8  # tensors read at once by load_checkpoint
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def text_model_name(name: str) -> str | None:
    """A checkpoint tensor's name in ``Qwen3_5ForCausalLM`` terms, or None for tensors that are not
    the text model's (vision tower, MTP head)."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return None if name.startswith(_IGNORED_PREFIXES) else name


def _check_names_and_shapes(model: Qwen35, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """ValueError naming ``source`` when the tensors do not match the config's."""
    expected = model.hf_shapes()
    if model.config.tie_word_embeddings:
        shapes = {k: v for k, v in shapes.items() if k != "lm_head.weight"}  # HF ties lm_head to embed_tokens
    missing = sorted(expected.keys() - shapes.keys())
    unexpected = sorted(shapes.keys() - expected.keys())
    if missing:
        raise ValueError(f"{source}: {len(missing)} tensors the config needs are missing, e.g. {missing[:4]}")
    if unexpected:
        raise ValueError(f"{source}: {len(unexpected)} tensors the config does not describe, e.g. {unexpected[:4]}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(f"{source}: {name} has shape {tuple(shapes[name])}, but the config implies {shape}")


def _build(model: Qwen35, tensors: dict[str, torch.Tensor]) -> Qwen35:
    """``model`` (meta weights) filled from HF-named tensors already on the target device in the
    target dtype; each module takes (and so frees) its own."""
    model.load_hf(tensors.pop)
    return model.eval()


def load_from_hf_model(hf_model: nn.Module, dtype: torch.dtype | str | None = None, device=None) -> Qwen35:
    """``Qwen35.from_hf``: the text model of a live HF ``Qwen3_5ForCausalLM`` or
    ``Qwen3_5ForConditionalGeneration``; dtype and device default to the HF model's."""
    if not hasattr(hf_model, "config") or not hasattr(hf_model, "state_dict"):
        raise TypeError(f"hf_model: expected a Hugging Face Qwen3.5 model, got {type(hf_model).__name__}")
    config = Qwen35Config.from_hf(hf_model.config)
    state = {}
    for name, tensor in hf_model.state_dict().items():
        text_name = text_model_name(name)
        if text_name is not None:
            state[text_name] = tensor
    model = Qwen35(config)
    _check_names_and_shapes(model, {k: tuple(v.shape) for k, v in state.items()}, "hf_model")
    embed = state["model.embed_tokens.weight"]
    dtype = embed.dtype if dtype is None else parse_dtype(dtype)
    device = embed.device if device is None else torch.device(device)
    return _build(model, {name: state[name].detach().to(device=device, dtype=dtype) for name in model.hf_shapes()})


def checkpoint_weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those the index lists, else every ``*.safetensors``;
    FileNotFoundError naming what is missing."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / name for name in names]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: listed in {index.name} but not in the checkpoint directory")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory / 'model.safetensors'}: the checkpoint has no *.safetensors weights")
    return files


def read_checkpoint_config(directory) -> Qwen35Config:
    """The text model's config of a checkpoint directory (``config.json`` plus the stop ids of
    ``generation_config.json`` when present); FileNotFoundError naming a missing config.json."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such checkpoint directory")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: the checkpoint directory has no config.json")
    generation_file = directory / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    return Qwen35Config.from_hf(json.loads(config_file.read_text()), generation)


@torch.no_grad()
def load_checkpoint(path, dtype: torch.dtype | str | None = None, device=None, progress: bool = False) -> Qwen35:
    """``Qwen35.from_pretrained``: a checkpoint directory's text model on ``device`` (default:
    cuda when available, else cpu) in ``dtype`` (default: the checkpoint's). ``progress`` shows a
    progress bar (bytes read)."""
    from safetensors import safe_open

    directory = Path(path)
    config = read_checkpoint_config(directory)
    files = checkpoint_weight_files(directory)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))

    # Every name, shape and dtype first (headers only), so a bad checkpoint fails before reading.
    plan: list[tuple[Path, list[tuple[str, str]]]] = []  # (file, [(checkpoint name, text name)])
    shapes, dtypes = {}, {}
    for file in files:
        entries = []
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                text_name = text_model_name(name)
                if text_name is None:
                    continue
                info = handle.get_slice(name)
                shapes[text_name], dtypes[text_name] = tuple(info.get_shape()), info.get_dtype()
                entries.append((name, text_name))
        plan.append((file, entries))
    model = Qwen35(config)
    model_shapes = model.hf_shapes()
    _check_names_and_shapes(model, shapes, f"checkpoint {directory}")
    if dtype is None:
        stored = dtypes["model.embed_tokens.weight"]
        if stored not in _SAFETENSORS_DTYPES:
            raise ValueError(f"dtype: the checkpoint stores {stored}; pass dtype= explicitly")
        dtype = _SAFETENSORS_DTYPES[stored]
    dtype = parse_dtype(dtype)
    total_bytes = sum(math.prod(shape) for shape in model_shapes.values()) * dtype.itemsize

    from tqdm.auto import tqdm

    def read(file: Path, name: str) -> torch.Tensor:
        with safe_open(file, framework="pt", device="cpu") as handle:
            return handle.get_tensor(name).to(device=device, dtype=dtype)  # mmap -> device, cast there

    jobs = [(file, name, text_name) for file, entries in plan for name, text_name in entries
            if text_name in model_shapes]  # a tied lm_head is skipped, as HF does
    tensors = {}
    # Several tensors in flight: page faults on the mapped files and host-to-device copies release
    # the GIL, so threads overlap them.
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="Loading weights", disable=not progress) as bar, \
            ThreadPoolExecutor(max_workers=LOAD_THREADS) as pool:
        futures = {pool.submit(read, file, name): text_name for file, name, text_name in jobs}
        for future in as_completed(futures):
            tensor = tensors[futures[future]] = future.result()
            bar.update(tensor.numel() * tensor.element_size())
    return _build(model, tensors)
