"""Test set-up: without a CUDA device the kernels run in the Triton interpreter.

TRITON_INTERPRET must be set before triton is imported, so this runs before fuselm is imported.
On a CPU machine the suite uses small odd shapes in fp32/fp16 (bf16 for elementwise kernels:
the interpreter's bf16 ``tl.dot`` is wrong, triton issue 11584). On a GPU the same tests run
at bf16 too, and ``--large`` adds the real model shapes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


def pytest_addoption(parser):
    parser.addoption("--large", action="store_true", help="also run the real-model-shape cases (GPU)")


# The files that take longest on a CPU (~70-250 s each), run first: with pytest-xdist handing out a
# file a worker (`make test`), a long file started last would leave the other workers idle.
SLOW_FILES_FIRST = ("test_serve.py", "test_qwen35.py", "test_engine.py", "test_llm.py", "test_qwen35_moe.py")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_large = pytest.mark.skip(reason="large shapes: pass --large on a GPU")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)
        if "large" in item.keywords and not (ON_GPU and config.getoption("--large")):
            item.add_marker(skip_large)
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's order kept


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


# A byte-level vocabulary for engine tests that need a tokenizer (structured outputs, token masks):
# 256 byte tokens and an eos, under logits of BYTE_VOCAB columns (the rest: padding rows no token
# stands for), a two-layer model (fp32, seeded random weights) over it, and an engine of 4 slots of
# 64 tokens with that tokenizer (fixtures byte_tokenizer, byte_model, byte_engine: one per module).
BYTE_EOS = 256
BYTE_VOCAB = 264


@pytest.fixture(scope="module")
def byte_tokenizer():
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers

    from fuselm.tokenizer import Tokenizer, _bytes_to_unicode

    alphabet = _bytes_to_unicode()
    backend = Backend(models.BPE({alphabet[b]: b for b in range(256)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return Tokenizer(backend, {"eos_token": "<eos>"})


@pytest.fixture(scope="module")
def byte_model():
    from dataclasses import replace

    from fuselm.models.qwen35.presets import random_qwen35, tiny_config

    config = replace(tiny_config(vocab_size=BYTE_VOCAB), num_hidden_layers=2,
                     layer_types=("linear_attention", "full_attention"), eos_token_id=BYTE_EOS)
    return random_qwen35(config, dtype=torch.float32, device=DEVICE, seed=3)


@pytest.fixture(scope="module")
def byte_engine(byte_model, byte_tokenizer):
    from fuselm.engine import Engine

    return Engine(byte_model, max_batch=4, max_len=64, seed=0, tokenizer=byte_tokenizer)
