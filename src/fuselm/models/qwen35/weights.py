"""Loading Qwen3.5 weights: from a live HF model, or from a checkpoint directory on disk.

A checkpoint directory holds ``config.json`` (a causal-LM config, or the released
vision-language wrapper with the text model under ``text_config``), optionally
``generation_config.json`` (its eos ids join the stop ids), and the weights as one
``model.safetensors`` or several shards listed by ``model.safetensors.index.json``. The wrapper's
text weights are named ``model.language_model.*``; vision (``model.visual.*``) and
multi-token-prediction (``mtp.*``) tensors are skipped without being read.

Every name and shape is checked against the config (from the files' headers) before any data is
read. Then the tensors' bytes go from the files to the device in 64 MB chunks through a few
pinned host buffers, several chunks at once on threads (``_ChunkReader``), and each tensor is cast
to the target dtype on the device: host memory never holds a second copy of the model. Each module then re-lays
its own tensors (``hf_shapes`` / ``load_hf`` in ``layers.py``), freeing the HF pieces as it goes.
"""

from __future__ import annotations

import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from fuselm.models.qwen35.config import Qwen35Config
from fuselm.models.qwen35.layers import split_fused_experts
from fuselm.models.qwen35.model import Qwen35
from fuselm.runtime import parse_dtype

# Checkpoint tensors that are not part of the text model (Qwen3_5ForConditionalGeneration
# checkpoints): the vision tower and the multi-token-prediction head.
_IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.")
# load_checkpoint: file chunks in flight at once (threads), and their size.
LOAD_THREADS = 8
LOAD_CHUNK_BYTES = 64 << 20
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
    state = split_fused_experts(state)  # MoE: the checkpoints' per-expert names (views)
    model = Qwen35.for_config(config)
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


def read_safetensors_header(file: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """A safetensors file's tensors: name -> (dtype string, shape, first byte, end byte), offsets
    from the start of the file. (The format: an 8-byte little-endian header size, the JSON header
    of dtype, shape and data_offsets relative to the data, then the data.)"""
    with open(file, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        try:
            header = json.loads(handle.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{file}: not a safetensors file ({error})") from None
    header.pop("__metadata__", None)
    return {name: (info["dtype"], tuple(info["shape"]), 8 + size + info["data_offsets"][0],
                   8 + size + info["data_offsets"][1]) for name, info in header.items()}


class _ChunkReader:
    """Copies byte ranges of files into device tensors through pinned host buffers, on threads.

    Each of ``threads`` workers owns a file handle per file, two pinned chunk buffers and a CUDA
    stream: read a chunk of the file into a buffer (the page cache's copy; ``readinto`` releases
    the GIL, so workers read in parallel), copy it to the device asynchronously on the worker's
    stream, and read the next chunk into the other buffer meanwhile. Off CUDA, chunks are read
    straight into the destination tensors."""

    def __init__(self, device: torch.device, threads: int, chunk_bytes: int):
        self.device, self.threads, self.chunk_bytes = device, threads, chunk_bytes

    def run(self, jobs: list[tuple[Path, int, torch.Tensor]], on_bytes) -> None:
        """``jobs``: (file, first byte, destination uint8 tensor); fills each destination with the
        file's bytes from that offset. ``on_bytes(n)`` is called as chunks arrive."""
        chunks = [(file, offset + start, destination[start:start + self.chunk_bytes])
                  for file, offset, destination in jobs
                  for start in range(0, destination.numel(), self.chunk_bytes)]
        chunks.sort(key=lambda chunk: (str(chunk[0]), chunk[1]))  # each file in order: sequential reads
        shares = [chunks[i::self.threads] for i in range(self.threads)]
        with ThreadPoolExecutor(max_workers=self.threads) as pool:
            for future in [pool.submit(self._worker, share, on_bytes) for share in shares if share]:
                future.result()

    def _worker(self, chunks, on_bytes) -> None:
        handles = {}
        try:
            if self.device.type != "cuda":
                for file, offset, destination in chunks:
                    self._read(handles, file, offset, destination.numpy())
                    on_bytes(destination.numel())
                return
            stream = torch.cuda.Stream(self.device)
            buffers = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            copied = [None, None]  # the event after each buffer's last copy
            for index, (file, offset, destination) in enumerate(chunks):
                slot = index % 2
                if copied[slot] is not None:
                    copied[slot].synchronize()  # the buffer's previous copy has left it
                staged = buffers[slot][: destination.numel()]
                self._read(handles, file, offset, staged.numpy())
                with torch.cuda.stream(stream):
                    destination.copy_(staged, non_blocking=True)
                    copied[slot] = torch.cuda.Event()
                    copied[slot].record(stream)
                on_bytes(destination.numel())
            stream.synchronize()
        finally:
            for handle in handles.values():
                handle.close()

    @staticmethod
    def _read(handles: dict, file: Path, offset: int, target) -> None:
        handle = handles.get(file) or handles.setdefault(file, open(file, "rb", buffering=0))
        handle.seek(offset)
        view, done = memoryview(target).cast("B"), 0
        while done < len(view):
            read = handle.readinto(view[done:])
            if not read:
                raise ValueError(f"{file}: ends before byte {offset + len(view)} (a truncated safetensors file)")
            done += read


@torch.no_grad()
def load_checkpoint(path, dtype: torch.dtype | str | None = None, device=None, progress: bool = False) -> Qwen35:
    """``Qwen35.from_pretrained``: a checkpoint directory's text model on ``device`` (default:
    cuda when available, else cpu) in ``dtype`` (default: the checkpoint's). ``progress`` shows a
    progress bar (bytes read)."""
    directory = Path(path)
    config = read_checkpoint_config(directory)
    files = checkpoint_weight_files(directory)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))

    # Every name, shape and dtype first (headers only), so a bad checkpoint fails before reading.
    entries = {}  # text name -> (file, dtype string, shape, first byte, end byte)
    for file in files:
        for name, (stored, shape, begin, end) in read_safetensors_header(file).items():
            text_name = text_model_name(name)
            if text_name is not None:
                entries[text_name] = (file, stored, shape, begin, end)
    model = Qwen35.for_config(config)
    _check_names_and_shapes(model, {name: entry[2] for name, entry in entries.items()}, f"checkpoint {directory}")
    entries = {name: entries[name] for name in model.hf_shapes()}  # a tied lm_head is skipped, as HF does
    for name, (file, stored, shape, begin, end) in entries.items():
        if stored not in _SAFETENSORS_DTYPES:
            raise ValueError(f"checkpoint {directory}: {name} is stored as {stored}; expected one of "
                             f"{sorted(_SAFETENSORS_DTYPES)}")
        if end - begin != math.prod(shape) * _SAFETENSORS_DTYPES[stored].itemsize:
            raise ValueError(f"{file}: {name} holds {end - begin} bytes, its shape {shape} needs "
                             f"{math.prod(shape) * _SAFETENSORS_DTYPES[stored].itemsize}")
    dtype = _SAFETENSORS_DTYPES[entries["model.embed_tokens.weight"][1]] if dtype is None else parse_dtype(dtype)

    from tqdm.auto import tqdm

    raw = {name: torch.empty(end - begin, dtype=torch.uint8, device=device)
           for name, (_, _, _, begin, end) in entries.items()}
    with tqdm(total=sum(t.numel() for t in raw.values()), unit="B", unit_scale=True, desc="Loading weights",
              disable=not progress) as bar:
        lock = threading.Lock()

        def on_bytes(count: int) -> None:
            with lock:
                bar.update(count)

        _ChunkReader(device, LOAD_THREADS, LOAD_CHUNK_BYTES).run(
            [(entries[name][0], entries[name][3], raw[name]) for name in entries], on_bytes)
    tensors = {}
    for name, (_, stored, shape, _, _) in entries.items():
        tensors[name] = raw.pop(name).view(_SAFETENSORS_DTYPES[stored]).view(shape).to(dtype)  # cast on the device
    return _build(model, tensors)
