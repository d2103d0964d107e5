"""fuselm.engine.Engine: batched generation on a static cache, decode as one CUDA graph per step.

On the CPU the engine runs its step eagerly (Triton interpreter); it must reproduce
``Qwen35.generate`` token for token (which tests/test_qwen35.py holds against HF). On a GPU the
graph replays must reproduce the eager step, with one graph launch and no host sync per step.
The model is the built-in tiny config with seeded random weights, fp32.
"""

import pytest
import torch

from conftest import DEVICE
from fuselm.engine import Engine
from fuselm.models.qwen35_random import random_qwen35, tiny_config

VOCAB = 256
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def model():
    return random_qwen35(tiny_config(vocab_size=VOCAB), dtype=torch.float32, device=DEVICE, seed=3)


def prompt(B, T, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.fixture(scope="module")
def greedy(model):
    """Qwen35.generate's greedy tokens and logits for a [2, 9] prompt: the engine's reference."""
    ids = prompt(2, 9)
    tokens, logits = model.generate(ids, NEW_TOKENS, eos_token_id=[], return_logits=True)
    return dict(ids=ids, tokens=tokens.cpu(), logits=logits)


def test_engine_equals_model_generate(model, greedy):
    engine = Engine(model, max_batch=4, max_len=24, eos_token_id=[])
    result = engine.generate(greedy["ids"], NEW_TOKENS, return_logits=True)
    assert result.batch_size == 2 and result.decode_steps == NEW_TOKENS - 1
    assert torch.equal(result.tokens, greedy["tokens"])
    assert (result.logits - greedy["logits"]).abs().max() <= 1e-5
    assert result.num_generated == [NEW_TOKENS, NEW_TOKENS]
    # a list of prompts is the same request
    again = engine.generate([row.tolist() for row in greedy["ids"]], NEW_TOKENS)
    assert torch.equal(again.tokens, greedy["tokens"])


def test_varying_lengths_in_one_batch_with_a_padded_graph_row(model):
    """Three requests of 9, 3 and 6 tokens run on the batch-4 step: row 3 is padding and stays
    inactive (no length, no state); each request matches Qwen35.generate on the padded batch."""
    lengths, T = [9, 3, 6], 9
    ids = prompt(3, T, seed=2)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long().to(DEVICE)
    reference = model.generate(ids, NEW_TOKENS, attention_mask=mask, eos_token_id=[]).cpu()
    engine = Engine(model, max_batch=4, max_len=16, graph_batch_sizes=(1, 2, 4), eos_token_id=[])
    padded_row_state = [layer.recurrent[3].clone() for layer in engine.cache.layers if hasattr(layer, "recurrent")]
    result = engine.generate([ids[r, :n].tolist() for r, n in enumerate(lengths)], NEW_TOKENS)
    assert result.batch_size == 4
    assert torch.equal(result.tokens, reference)
    assert engine.cache.lengths.tolist() == [n + NEW_TOKENS - 1 for n in lengths] + [0]
    states = [layer.recurrent[3] for layer in engine.cache.layers if hasattr(layer, "recurrent")]
    assert all(torch.equal(a, b) for a, b in zip(states, padded_row_state))


def test_eos_ends_a_row_and_an_all_finished_batch_stops(model, greedy):
    ids, tokens = greedy["ids"], greedy["tokens"]
    eos = int(tokens[0, 1])
    reference = model.generate(ids, NEW_TOKENS, eos_token_id=eos, pad_token_id=0).cpu()
    engine = Engine(model, max_batch=2, max_len=24, eos_token_id=eos, pad_token_id=0)
    streamed = []
    result = engine.generate(ids, NEW_TOKENS, stream=lambda index, ids_now: streamed.append((index, ids_now)))
    assert torch.equal(result.tokens, reference)
    assert result.tokens[0, :2].tolist() == tokens[0, :2].tolist() and set(result.tokens[0, 2:].tolist()) <= {0}
    assert result.num_generated[0] == 2
    assert [index for index, _ in streamed] == list(range(result.tokens.shape[1]))
    assert [ids_now for _, ids_now in streamed] == result.tokens.T.tolist()
    alone = engine.generate(ids[:1], NEW_TOKENS)  # the only row ends at its 2nd token: one decode step
    assert alone.decode_steps == 1 and alone.tokens.tolist() == [tokens[0, :2].tolist()]


def test_bad_input_raises_and_the_engine_stays_usable(model, greedy):
    engine = Engine(model, max_batch=2, max_len=12, eos_token_id=[])
    ids = greedy["ids"]
    expected = engine.generate(ids, 3).tokens
    bad_calls = {
        "no prompts": (lambda: engine.generate([], 3), ValueError, "prompts"),
        "empty prompt": (lambda: engine.generate([[1, 2], []], 3), ValueError, r"prompts\[1\]: empty prompt"),
        "empty tensor prompt": (lambda: engine.generate(ids[:, :0], 3), ValueError, "empty prompt"),
        "longer than the cache": (lambda: engine.generate([list(range(13))], 1), ValueError, "longer than the cache"),
        "no room to generate": (lambda: engine.generate(ids, 4), ValueError, "max_new_tokens"),
        "too many requests": (lambda: engine.generate([[1], [2], [3]], 1), ValueError, "3 rows exceed"),
        "id >= vocab": (lambda: engine.generate([[1, VOCAB]], 2), ValueError, r"token ids must be in \[0, 256\)"),
        "negative id": (lambda: engine.generate([[-1, 4]], 2), ValueError, "token ids"),
        "float id": (lambda: engine.generate([[1.5]], 2), TypeError, "ints"),
        "zero new tokens": (lambda: engine.generate(ids, 0), ValueError, "max_new_tokens"),
        "stream not callable": (lambda: engine.generate(ids, 2, stream=3), TypeError, "stream"),
    }
    for case, (call, error, message) in bad_calls.items():
        with pytest.raises(error, match=message):
            call()
    assert torch.equal(engine.generate(ids, 3).tokens, expected)


def test_sampling_is_seeded_and_top_k_1_is_greedy(model, greedy):
    ids = greedy["ids"]
    top1 = Engine(model, max_batch=2, max_len=16, temperature=1.3, top_k=1, seed=0, eos_token_id=[])
    assert torch.equal(top1.generate(ids, NEW_TOKENS).tokens, greedy["tokens"])
    runs = [Engine(model, max_batch=2, max_len=16, temperature=1.0, top_p=0.9, seed=7, eos_token_id=[])
            .generate(ids, NEW_TOKENS).tokens for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and 0 <= int(runs[0].min()) and int(runs[0].max()) < VOCAB


def test_graph_batch_sizes_are_clipped_and_checked(model):
    engine = Engine(model, max_batch=3, max_len=8, graph_batch_sizes=(1, 2, 4, 8))
    assert engine.batch_sizes == (1, 2, 3) and [engine.step_batch_size(n) for n in (1, 2, 3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="graph_batch_sizes"):
        Engine(model, max_batch=3, max_len=8, graph_batch_sizes=(0, 2))
    with pytest.raises(ValueError, match="temperature"):
        Engine(model, max_batch=3, max_len=8, temperature=-1.0)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="use_graphs"):
            Engine(model, max_batch=1, max_len=8, use_graphs=True)


# ----------------------------------------------------------------------------- GPU: graphs
@pytest.mark.gpu
def test_graph_replay_equals_eager_steps(model, greedy):
    lengths = [9, 4, 7]
    prompts = [prompt(3, 9, seed=4)[r, :n].tolist() for r, n in enumerate(lengths)]
    runs = {}
    for use_graphs in (False, True):
        engine = Engine(model, max_batch=4, max_len=32, eos_token_id=[], use_graphs=use_graphs)
        runs[use_graphs] = engine.generate(prompts, 12, return_logits=True)
        assert torch.equal(engine.generate(greedy["ids"], NEW_TOKENS).tokens, greedy["tokens"])
    assert torch.equal(runs[True].tokens, runs[False].tokens)
    assert (runs[True].logits - runs[False].logits).abs().max() <= 1e-4
    sampled = [Engine(model, max_batch=4, max_len=32, temperature=1.0, seed=5, eos_token_id=[])
               .generate(prompts, 12).tokens for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1])  # the engine's generator drives the graphs


@pytest.mark.gpu
def test_one_graph_launch_and_no_host_sync_per_step(model):
    graphs = Engine(model, max_batch=8, max_len=32).launch_audit(requests=3, steps=4)
    assert graphs["batch_size"] == 4 and graphs["graphs"]
    assert graphs["graph_launches"] == 1 and graphs["kernel_launches_outside_graphs"] == 0
    assert graphs["host_syncs"] == 0 and graphs["sync_debug_error"] is None
    assert graphs["kernels"] >= 2 * model.config.num_hidden_layers  # every layer: mixer + MLP at least
    eager = Engine(model, max_batch=8, max_len=32, use_graphs=False).launch_audit(requests=3, steps=4)
    assert eager["graph_launches"] == 0 and eager["kernel_launches_outside_graphs"] >= graphs["kernels"] / 2


# ----------------------------------------------------------------------------- the CLI
def test_cli_generate_and_audit_on_the_tiny_default(tmp_path, capsys):
    import json

    from fuselm.cli import main

    pytest.importorskip("transformers")
    args = ["--prompt-len", "5", "--max-new-tokens", "3", "--batch", "2", "--device", DEVICE, "--dtype", "float32"]
    assert main(["generate", *args, "--out", str(tmp_path)]) == 0
    generated = json.loads((tmp_path / "generate.json").read_text())
    assert len(generated["tokens"]) == 2 and all(len(row) == 3 for row in generated["tokens"])
    assert generated["decode_steps"] == 2 and generated["prefill_tokens_per_s"] > 0
    assert main(["audit", *args, "--out", str(tmp_path)]) == 0
    audited = json.loads((tmp_path / "audit.json").read_text())
    assert audited["parity_ok"] and audited["parity"]["greedy_agreement"] == 1.0
    assert audited["parity"]["worst_max_abs"] <= (1e-3 if DEVICE == "cpu" else 1e-2)
    assert audited["parity"]["comparable_positions"] == 3 and len(audited["parity"]["teacher_forced"]) == 3
    if DEVICE == "cuda":  # requests 1 and 2: one graph launch, no host sync per step
        assert sorted(audited["launches"]) == ["1", "2"] and audited["launches_ok"]
        assert all(c["graph_launches"] == 1 and c["host_syncs"] == 0 for c in audited["launches"].values())
    else:
        assert audited["launches"] == {}
    assert "greedy agreement" in capsys.readouterr().out
