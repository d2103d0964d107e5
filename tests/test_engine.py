"""fuselm.engine.Engine: continuous batching over cache slots, decode as one CUDA graph per step.

On the CPU the engine runs its step eagerly (Triton interpreter); it must reproduce the eager
reference loop (``Qwen35.generate``, which tests/test_qwen35.py holds against HF) token for token,
and every request must get exactly what it gets alone, whatever joins or leaves beside it. On a
GPU the graph replays must reproduce the eager step. The model is the built-in tiny config cut to
two layers (one Gated DeltaNet, one attention: every kind of state a slot owns, at half the
interpreter's time a step) with seeded random weights, fp32.
"""

import random
from dataclasses import replace

import pytest
import torch

from conftest import DEVICE, ON_GPU
from fuselm.engine import Engine, SamplingParams
from fuselm.models.qwen35.presets import random_qwen35, tiny_config

VOCAB = 256


def two_layer_config():
    return replace(tiny_config(vocab_size=VOCAB), num_hidden_layers=2,
                   layer_types=("linear_attention", "full_attention"))


@pytest.fixture(scope="module")
def model():
    return random_qwen35(two_layer_config(), dtype=torch.float32, device=DEVICE, seed=3)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, max_batch=4, max_len=32, seed=0)


def prompt(T, seed):
    return torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_engine_equals_the_reference_loop(model, engine):
    ids = torch.tensor([prompt(9, 1), prompt(9, 2)], device=DEVICE)
    reference = model.generate(ids, 5, eos_token_id=[])
    outputs = engine.generate(ids, greedy(5))
    assert token_ids(outputs) == reference.tolist()
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length"]
    assert all(o.finished and o.metrics.first_token_time >= o.metrics.arrival_time for o in outputs)


def test_engine_keeps_the_recurrent_states_in_state_dtype(model):
    """Engine(state_dtype=...): the cache's Gated DeltaNet pools in that dtype, requests that run
    through prefill, a mixed step and decode; a dtype the kernels cannot hold is refused by name."""
    rounded = Engine(model, max_batch=2, max_len=32, seed=0, max_prefill_tokens=6, state_dtype="bfloat16")
    pools = [layer.recurrent for layer in rounded.runner.cache.layers if hasattr(layer, "recurrent")]
    assert pools and all(pool.dtype == torch.bfloat16 for pool in pools)
    outputs = rounded.generate([prompt(9, 1), prompt(4, 2)], greedy(5))
    assert [len(ids) for ids in token_ids(outputs)] == [5, 5]
    with pytest.raises(ValueError, match="state_dtype"):
        Engine(model, max_batch=1, max_len=8, state_dtype="int8")


def count_mixed_steps(engine, monkeypatch) -> list:
    """Record each mixed (prefill + decode) step the engine's runner takes."""
    calls, mixed = [], engine.runner.mixed
    monkeypatch.setattr(engine.runner, "mixed", lambda *args, **kwargs: calls.append(args) or mixed(*args, **kwargs))
    return calls


def test_requests_joining_and_leaving_at_random_steps_get_their_solo_output(model, engine, monkeypatch):
    """Prompts of different lengths, max_tokens and sampling (greedy, seeded top-k + top-p, seeded
    top-p alone), added while others run (so they join a running batch at different steps, in
    mixed prefill + decode steps, reuse freed slots, take the rows others leave, wait when all four
    slots are busy): each gives exactly what it gives alone on a fresh engine."""
    mixed_steps = count_mixed_steps(engine, monkeypatch)
    rng = random.Random(0)
    kinds = [lambda n: greedy(n),
             lambda n: SamplingParams(max_tokens=n, temperature=0.9, top_k=20, top_p=0.9, seed=n, ignore_eos=True),
             lambda n: SamplingParams(max_tokens=n, temperature=1.1, top_p=0.8, seed=3 * n, ignore_eos=True)]
    jobs = [(prompt(rng.randint(1, 12), 100 + i), kinds[i % 3](rng.randint(1, 9))) for i in range(9)]
    solo = [token_ids(Engine(model, max_batch=1, max_len=32).generate([p], sp))[0] for p, sp in jobs]
    pending, requests = list(jobs), []
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):  # 0-2 arrivals before each step
            if pending:
                p, sp = pending.pop(0)
                requests.append(engine.add_request(p, sp))
        engine.step()
    assert [r.output_token_ids for r in requests] == solo
    assert len({r.slot for r in requests}) <= engine.max_batch  # slots were reused
    assert len(mixed_steps) >= 3


def test_a_request_left_in_a_high_slot_decodes_in_the_smallest_batch(model, monkeypatch):
    """Four requests in slots 0-3; once the three short ones end, the long one (slot 3) takes row 0
    and decodes in the one-row graph (its state read where it lies, through the row -> slot
    table), with the tokens it gets alone; seeded sampling too."""
    engine = Engine(model, max_batch=4, max_len=32, graph_batch_sizes=(1, 2, 4), seed=0)
    batches, decode = [], engine.runner.decode
    monkeypatch.setattr(engine.runner, "decode",
                        lambda batch, variant, **kwargs: batches.append(batch) or decode(batch, variant, **kwargs))
    prompts = [prompt(5 + i, 130 + i) for i in range(4)]
    params = [greedy(2), greedy(3), greedy(2),
              SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=11, ignore_eos=True)]
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    engine.step()
    assert [r.slot for r in requests] == [0, 1, 2, 3]
    engine.run()
    alone = Engine(model, max_batch=4, max_len=32, seed=0).generate([prompts[3]], params[3])
    assert requests[3].output_token_ids == token_ids(alone)[0]
    assert batches[0] == 4 and batches[-1] == 1 and batches.count(1) >= 8
    assert engine.runner._row_slots[0] == 3 and engine.runner.row_slots.tolist()[0] == 3


def test_long_prompts_are_prefilled_in_chunks_beside_decode_steps(model, monkeypatch):
    """A prefill budget of 5 tokens a step: a 17-token prompt arriving while another request
    decodes takes 4 mixed steps to prefill, the running request gets a token in each of them, and
    both give their solo outputs (also a prompt longer than the budget admitted alone)."""
    engine = Engine(model, max_batch=2, max_len=32, max_prefill_tokens=5)
    mixed_steps = count_mixed_steps(engine, monkeypatch)
    short, long = prompt(3, 50), prompt(17, 51)
    solo = [token_ids(Engine(model, max_batch=1, max_len=32).generate([p], greedy(8)))[0] for p in (short, long)]
    running = engine.add_request(short, greedy(8))
    engine.step()  # prefill the short prompt, launch its first decode step
    late = engine.add_request(long, greedy(8))
    progress = []
    while not late.prompt_computed:
        engine.step()
        progress.append((late.num_prompt_computed, len(running.output_token_ids)))
    assert [done for done, _ in progress] == [5, 10, 15, 17]
    assert [tokens for _, tokens in progress] == [2, 3, 4, 5]  # one decode step per prefill chunk
    assert [[count for _, _, count in plan] for plan, _, _ in mixed_steps] == [[5], [5], [5], [2]]
    engine.run()
    assert [running.output_token_ids, late.output_token_ids] == solo
    assert token_ids(engine.generate([long], greedy(8))) == [solo[1]]


SHARED = 72  # a prompt long enough to share (MIN_SHARED_PREFILL_TOKENS)


def sampled(n, **kwargs):
    return SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=n, ignore_eos=True, logprobs=1, **kwargs)


def assert_the_samples_of(outputs, model, prompt, samples):
    """Each sample (output i of params ``samples[i]``) is what a request of its own gives: its
    tokens, and logprobs within 1e-4 (its prefill went in other chunks)."""
    assert len(outputs) == len(samples)
    alone = Engine(model, max_batch=1, max_len=SHARED + 16)
    for sample, output in zip(samples, outputs):
        (reference,) = alone.generate([prompt], sample)[0].outputs
        assert output.token_ids == reference.token_ids
        assert [entry[t].logprob for t, entry in zip(output.token_ids, output.logprobs)] == pytest.approx(
            [entry[t].logprob for t, entry in zip(reference.token_ids, reference.logprobs)], abs=1e-4)


def test_the_samples_of_a_prompt_share_its_prefill(model):
    """n = 3 samples of a 72-token prompt: one prefill of 71 tokens and three of one (the samples
    copy the first one's state and pages), not three of 72; each sample is what a request of its
    own gives."""
    prompt = random.Random(1).choices(range(VOCAB), k=SHARED)
    engine = Engine(model, max_batch=4, max_len=SHARED + 16, seed=0)
    engine.step_log = []
    (output,) = engine.generate([prompt], sampled(3))
    assert [(entry["kind"], entry["prompt_tokens"]) for entry in engine.step_log[:2]] == [
        ("prefill", SHARED - 1), ("prefill+decode", 3)]
    assert len({tuple(o.token_ids) for o in output.outputs}) == 3  # three seeds, three draws
    assert_the_samples_of(output.outputs, model, prompt, sampled(3).samples())


def test_samples_joining_a_running_batch_share_the_prefill_in_mixed_steps(model):
    """The samples come while another request decodes, under a budget of 40 tokens: the first
    sample's chunks and then each sample's last token ride on decode steps (one chunk a mixed
    step); every request gets what it gets alone."""
    prompt = random.Random(2).choices(range(VOCAB), k=SHARED)
    engine = Engine(model, max_batch=4, max_len=SHARED + 16, seed=0, max_prefill_tokens=40)
    engine.step_log = []
    early = engine.add_request([7, 8, 9], greedy(20))
    engine.step()
    groups = engine.add_requests([{"prompt_token_ids": prompt, "params": sampled(3)}])
    engine.run()
    assert sum(entry["prompt_tokens"] for entry in engine.step_log) == 3 + SHARED - 1 + 3
    assert_the_samples_of([request.output().outputs[0] for request in groups[0]], model, prompt,
                          sampled(3).samples())
    alone = Engine(model, max_batch=1, max_len=SHARED + 16).generate([[7, 8, 9]], greedy(20))
    assert early.output_token_ids == token_ids(alone)[0]


def test_a_sample_without_room_or_source_prefills_its_prompt_itself(model):
    """Two slots for three samples: the third finds no slot when the first has its shared tokens
    and prefills its prompt itself later. A source aborted before that: its samples prefill
    themselves. Every sample is still what a request of its own gives; a request given a source
    with another prompt shares nothing."""
    prompt = random.Random(3).choices(range(VOCAB), k=SHARED)
    engine = Engine(model, max_batch=2, max_len=SHARED + 16, seed=0)
    engine.step_log = []
    (output,) = engine.generate([prompt], sampled(3))
    assert sum(entry["prompt_tokens"] for entry in engine.step_log) == SHARED - 1 + 2 + SHARED
    assert_the_samples_of(output.outputs, model, prompt, sampled(3).samples())

    engine = Engine(model, max_batch=4, max_len=SHARED + 16, seed=0, max_prefill_tokens=40)
    source, *others = engine.add_requests([{"prompt_token_ids": prompt, "params": sampled(3)}])[0]
    engine.step()
    engine.abort(source)
    other = engine.add_request(prompt[::-1], sampled(1), shares_prefill_with=others[0])
    engine.run()
    assert other.shares_prefill_with is None
    assert_the_samples_of([r.output().outputs[0] for r in others], model, prompt, sampled(3).samples()[1:])


def test_the_budget_counts_the_decode_rows():
    """vLLM's max_num_batched_tokens: a step's prompt tokens are the budget less its decode rows,
    but never fewer than MIN_PREFILL_TOKENS (nor more than the budget)."""
    from fuselm.engine.request import Request
    from fuselm.engine.scheduler import MIN_PREFILL_TOKENS, Scheduler

    def chunk(budget, decode_rows):
        scheduler = Scheduler(max_batch=4, max_prefill_tokens=budget, num_pages=64, page_size=16)
        scheduler.add(Request("r", list(range(500)), greedy(4), 0, ()))
        return [count for _, _, count in scheduler.schedule_prefill(decode_rows)]

    assert chunk(256, 0) == [256] and chunk(256, 32) == [224] and chunk(256, 250) == [MIN_PREFILL_TOKENS]
    assert chunk(8, 32) == [8]


def test_a_mixed_step_takes_one_prompt_chunk():
    """Beside decode rows a step takes one prompt's chunk (MIXED_MAX_CHUNKS), even with budget left
    (a remainder beside a new prompt would pad to two long continued rows); with nothing decoding
    it takes several prompts."""
    from fuselm.engine.request import Request
    from fuselm.engine.scheduler import MIXED_MAX_CHUNKS, Scheduler

    assert MIXED_MAX_CHUNKS == 1
    scheduler = Scheduler(max_batch=8, max_prefill_tokens=512, num_pages=256, page_size=16)
    for i, n in enumerate((500, 100, 100)):
        scheduler.add(Request(f"r{i}", list(range(n)), greedy(4), 0, ()))
    plans = []
    while scheduler.waiting or scheduler.prefilling:
        plan = scheduler.schedule_prefill(decode_rows=32)
        plans.append([(request.request_id, start, count) for request, start, count in plan])
        for request, _, count in plan:
            scheduler.prefilled(request, count)
    assert plans == [[("r0", 0, 480)], [("r0", 480, 20)], [("r1", 0, 100)], [("r2", 0, 100)]]
    scheduler.add(Request("a", list(range(100)), greedy(4), 0, ()))
    scheduler.add(Request("b", list(range(100)), greedy(4), 0, ()))
    assert len(scheduler.schedule_prefill(decode_rows=0)) == 2


def test_a_mixed_chunk_fills_whole_gemm_tiles(model):
    """A mixed step's one chunk is padded so that decode rows + chunk tokens are a multiple of
    GEMM_TILE_M (the GEMMs' row tile); with graphs, several chunks use the row and token
    buckets; steps of more than GRAPH_MAX_TOKENS padded tokens run eagerly, unpadded."""
    from fuselm.engine.request import Request
    from fuselm.engine.runner import GEMM_TILE_M, GRAPH_MAX_TOKENS, ModelRunner

    runner = ModelRunner(model, max_batch=4, max_len=32, use_graphs=False)
    requests = [Request(f"r{i}", prompt(n, i), greedy(4), 0, (), slot=i, pages=[i]) for i, n in enumerate((20, 9))]
    packed, (rows, tokens, fresh, graphed) = runner._admit([(requests[0], 0, 20)], decode_rows=3)
    assert (rows, (3 + tokens) % GEMM_TILE_M, tokens >= 20, fresh, graphed) == (1, 0, True, True, False)
    assert packed.shape == (1, tokens + 5) and packed[0, :20].tolist() == requests[0].prompt_token_ids
    assert packed[0, tokens:].tolist() == [0, 0, 20, 1, -1]  # slot, start, length, completes, row (none)
    runner.use_graphs = True  # the padding rules only (nothing is captured here)
    two = [(requests[0], 0, 20), (requests[1], 0, 9)]
    assert runner._admit(two, decode_rows=3)[1] == (2, 24, True, True)  # row and token buckets
    many = [(requests[0], 0, 20)] * (GRAPH_MAX_TOKENS // 24 + 1)
    assert runner._admit(many)[1] == (len(many), 20, True, False)  # eager: no padding


def test_a_mixed_step_draws_a_first_id_only_in_the_requests_row_of_the_table(model):
    """ModelRunner.mixed refuses, before any launch, a chunk that completes its prompt without a
    row below the batch whose table entry is its slot (its first id would come from another row)."""
    from fuselm.engine.request import Request
    from fuselm.engine.runner import ModelRunner
    from fuselm.engine.sampling import PLAIN

    runner = ModelRunner(model, max_batch=4, max_len=32, use_graphs=False)
    request = Request("r", prompt(5, 1), greedy(2), 0, (), slot=2, pages=[2])
    with pytest.raises(ValueError, match="plan: request 'r' .* row None"):
        runner.mixed([(request, 0, 5)], 4, PLAIN)
    request.row = 0  # the table's row 0 holds slot 0
    with pytest.raises(ValueError, match="set_rows"):
        runner.mixed([(request, 0, 5)], 4, PLAIN)
    runner.set_rows([2])
    assert not bool(runner.cache.active.any())  # nothing ran
    logits, ids = runner.mixed([(request, 0, 5)], 1, PLAIN)
    assert logits.shape == (1, model.config.vocab_size) and ids.shape == (1,) and runner.input_tokens[2] == ids[0] and bool(runner.cache.active[2])


def test_the_decode_rows_stay_packed_and_cover_the_row_a_step_admits_into():
    """Running requests hold rows 0 .. n-1 whatever their slots: one that ends gives its row to the
    last row's request (its slot stays), and the next admitted request takes the next row."""
    from fuselm.engine.request import Request
    from fuselm.engine.scheduler import Scheduler

    scheduler = Scheduler(max_batch=8, max_prefill_tokens=64, num_pages=64, page_size=16)
    assert scheduler.rows_in_use_after_admission() == 0
    for i in range(3):
        scheduler.add(Request(f"r{i}", list(range(10)), greedy(4), 0, ()))
    first = [request for request, _, _ in scheduler.schedule_prefill()]  # slots and rows 0, 1, 2
    assert [(r.slot, r.row) for r in first] == [(0, 0), (1, 1), (2, 2)]
    assert scheduler.rows_in_use() == scheduler.rows_in_use_after_admission() == 3
    scheduler.add(Request("late", list(range(10)), greedy(4), 0, ()))
    assert scheduler.rows_in_use_after_admission() == 4
    scheduler.finish(first[0])
    assert first[0].row is None and (first[2].slot, first[2].row) == (2, 0) and scheduler.row_slots() == [2, 1]
    late = scheduler.schedule_prefill()[-1][0]  # (after the two prompts still in progress)
    assert (late.slot, late.row) == (0, 2) and scheduler.row_slots() == [2, 1, 0]
    scheduler.finish(late)  # the last row: nobody moves
    assert scheduler.row_slots() == [2, 1] and (first[1].row, first[2].row) == (1, 0)
    for request in first[1:]:
        request.num_prompt_computed = 10
    assert scheduler.decoding() == {0: first[2], 1: first[1]}


def test_a_plan_counts_its_rows_padded_to_the_longest():
    """R chunks run as R rows of the longest one's tokens: the plan keeps R x longest within the
    budget (a continuing 300-token chunk leaves no room for a second row at a budget of 512)."""
    from fuselm.engine.request import Request
    from fuselm.engine.scheduler import Scheduler

    scheduler = Scheduler(max_batch=8, max_prefill_tokens=512, num_pages=256, page_size=16)
    for i, n in enumerate((800, 100, 100, 100, 100, 100)):
        scheduler.add(Request(f"r{i}", list(range(n)), greedy(4), 0, ()))
    plans = []
    while scheduler.waiting or scheduler.prefilling:
        plan = scheduler.schedule_prefill()
        plans.append([count for _, _, count in plan])
        for request, _, count in plan:
            scheduler.prefilled(request, count)
    assert plans == [[512], [288], [100] * 5]
    assert all(len(p) * max(p) <= 512 for p in plans)


def test_a_slow_host_span_or_wait_dumps_every_threads_stack(model, tmp_path):
    """Engine.watch_host_stalls (fuselm serve --stall-dump): host work between two steps, or a
    read after its launch, that takes longer than its threshold writes every thread's stack, the
    stalled one's where it stalls, and no timer is left armed once the requests have finished;
    benchmarks/stall_dump.py groups the stacks by phase."""
    import importlib.util
    import signal
    import time
    from pathlib import Path

    engine = Engine(model, max_batch=2, max_len=32)
    slow = []

    def stream(request):  # runs between one step's read and the next step's launches
        if len(request.output_token_ids) == 2 and "span" not in slow:
            slow.append("span")
            time.sleep(0.4)

    def slow_read(launched, read=engine._read):  # a read that takes long after its launch
        if "wait" not in slow and "span" in slow:
            slow.append("wait")
            time.sleep(0.4)
        return read(launched)

    engine._read = slow_read
    path = tmp_path / "stalls.txt"
    previous = signal.getsignal(signal.SIGALRM)
    with open(path, "w") as file:
        try:
            engine.watch_host_stalls(file, 0.2, wait_seconds=0.2)
            engine.generate([prompt(5, 82)], greedy(5), stream=stream)
            time.sleep(0.4)  # a timer still armed after the last step would write here
        finally:
            engine.watch_host_stalls(None, None)
    assert signal.getsignal(signal.SIGALRM) is previous and slow == ["span", "wait"]
    script = Path(__file__).parents[1] / "benchmarks" / "stall_dump.py"
    spec = importlib.util.spec_from_file_location("stall_dump", script)
    stall_dump = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stall_dump)
    text = path.read_text()
    dumps, phases = stall_dump.parse(text), stall_dump.dump_phases(text)
    # (Here a step's launches are the interpreter's whole computation, so slow spans other than
    # the callback's may be dumped too.) The callback's sleep is in a span's dump, the slow read's
    # in a wait's; none is from the wait after the last step.
    engine_stacks = [stack for dump in dumps for thread, stack in dump if thread.endswith("(engine)")]
    assert len(engine_stacks) == len(dumps) == len(phases)  # (here the engine's thread is the main one)
    assert [phase for phase, stack in zip(phases, engine_stacks)
            if any(frame.endswith(" stream") for frame in stack)] == ["span"], text
    assert [phase for phase, stack in zip(phases, engine_stacks)
            if any(frame.endswith(" slow_read") for frame in stack)] == ["wait"], text
    assert not any(stack[0].endswith(" test_a_slow_host_span_or_wait_dumps_every_threads_stack")
                   for stack in engine_stacks), text
    assert f"{len(dumps)} stall dumps" in stall_dump.summarise(dumps, phases=phases)
    with pytest.raises(ValueError, match="wait_seconds"):
        engine.watch_host_stalls(file, 0.1, wait_seconds=0)


def test_launch_and_read_alternate_and_make_the_steps_of_generate(model):
    """Engine.step() is launch() then read(); a caller that drives the two itself (the server,
    which streams between them) gets what generate gives, and a call out of turn is refused
    without touching the engine."""
    engine = Engine(model, max_batch=2, max_len=32)
    expected = token_ids(engine.generate([prompt(3, 7), prompt(6, 8)], greedy(3)))
    with pytest.raises(RuntimeError, match="read: no step was launched"):
        engine.read()
    requests = [engine.add_request(prompt(3, 7), greedy(3)), engine.add_request(prompt(6, 8), greedy(3))]
    engine.launch()
    with pytest.raises(RuntimeError, match="launch: the step launched before has not been read"):
        engine.launch()
    engine.read()
    while engine.has_unfinished_requests():
        engine.launch()
        engine.read()
    assert [request.output().outputs[0].token_ids for request in requests] == expected


def test_the_step_log_records_each_step(model):
    """Engine.step_log (fuselm serve --step-log): one entry per step with its kind, decode rows and
    prompt tokens; benchmarks/step_log.py times them by the gaps between reads."""
    import importlib.util
    from pathlib import Path

    engine = Engine(model, max_batch=2, max_len=32, max_prefill_tokens=6)
    engine.step_log = []
    engine.generate([prompt(4, 80), prompt(13, 81)], greedy(3))
    kinds = [step["kind"] for step in engine.step_log]
    assert kinds[0] == "prefill+decode" and "mixed" in kinds and kinds[-1] in ("decode", "idle")
    assert sum(step["prompt_tokens"] for step in engine.step_log) == 17
    assert all(step["read"] >= step["launched"] >= step["began"] for step in engine.step_log)
    spec = importlib.util.spec_from_file_location("step_log", Path(__file__).parents[1] / "benchmarks" / "step_log.py")
    step_log = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_log)
    table = step_log.summarise(engine.step_log)
    assert "| mixed |" in table and "| all |" in table
    timed = [step for _, step in step_log.gaps(engine.step_log)]
    rows = sum(step["decode_rows"] for step in timed) / len(timed)
    assert f"decode rows a step {rows:.2f}," in table  # the two requests' occupancy, the ramp and drain included
    # Each request is admitted once, the first at the first step (the other then still queued);
    # where they were, a step:
    admitted = [len(step["admission_waits_ms"]) for step in engine.step_log]
    assert sum(admitted) == 2 and admitted[0] >= 1
    assert engine.step_log[0]["running"] == admitted[0] and engine.step_log[0]["waiting"] == 2 - admitted[0]
    prefilling = sum(step["running"] - step["decode_rows"] for step in timed) / len(timed)
    assert f"{rows:.2f} decoding, {prefilling:.2f} prefilling" in table and "2 admitted, waited" in table
    # A collection inside the slowest gap is named there, with the host's span across it.
    steps = engine.step_log
    gap, before, after = max(step_log.timed_pairs(steps), key=lambda item: item[0])
    pause = {"kind": "gc", "generation": 2, "began": before["read"], "read": before["read"] + gap / 2e3}
    table = step_log.summarise(steps, [pause])
    slowest = table.split("slowest 1%")[1]
    assert f"gc {gap / 2:.1f} ms" in slowest and "host " in slowest
    assert f"garbage collection in the run: {gap / 2:.1f} ms in all" in table
    table = step_log.summarise(steps, [], [pause])  # fuselm serve's HTTP process's, on a line of their own
    assert f"\n\nthe HTTP process's garbage collection in the run: {gap / 2:.1f} ms in all" in table
    assert "\n\ngarbage collection in the run" not in table
    # finished: the requests each read ended (each request once); from the last step that finished
    # one to each submission (made up: one 2 ms, one 6 ms after a finish):
    assert sum(step["finished"] for step in steps) == 2
    loop = [{"read": 1.0, "finished": 1, "began": 0.99, "admission_waits_ms": []},
            {"read": 1.01, "finished": 0, "began": 1.004, "admission_waits_ms": [2.0]},
            {"read": 1.02, "finished": 0, "began": 1.016, "admission_waits_ms": [10.0]}]
    line = step_log.round_trips([(8.0, step) for step in loop])[1]
    assert "max 6.00; over 3 ms 1, over 5 ms 1 of 2" in line, line
    # The engine thread's use at each launch and read: CPU seconds, faults and context switches
    # never go back; over each host span (a read to the next launch) it is summed
    # apart for the spans over 10 ms and the others.
    if step_log.span_usage(steps[0], steps[1]) is not None:  # Linux: getrusage(RUSAGE_THREAD)
        usages = [usage for step in steps for usage in (step["usage_launched"], step["usage_read"])]
        assert all(len(u) == 4 and all(b >= a for a, b in zip(u, v)) for u, v in zip(usages, usages[1:]))
        spans = [1e3 * (after["launched"] - before["read"]) for _, before, after in step_log.timed_pairs(steps)]
        slow = sum(ms > 10 for ms in spans)
        for label, count in (("over 10 ms", slow), ("up to 10 ms", len(spans) - slow)):
            assert (f"host spans {label}: {count}, mean" in table) == (count > 0)
    # A slow span's use, made up: 20 ms of host, 17 ms of CPU, 300 faults.
    before = {**steps[0], "read": 1.0, "usage_read": [0.5, 1000, 10, 1]}
    after = {**steps[1], "launched": 1.02, "read": 1.03, "usage_launched": [0.517, 1300, 14, 1],
             "usage_read": [0.518, 1300, 15, 1]}
    assert step_log.host_spans([(30.0, before, after)]) == [
        "", "engine thread: host spans over 10 ms: 1, mean 20.00 ms; per span CPU 17.0 ms, faults 300, switches 4 "
        "voluntary / 0 involuntary"]
    # With CUDA each step's GPU time (events around its launches) comes in once it has run: every
    # step but the last's (its launches may not have run when the log was last read).
    gpu = [step.get("gpu_ms") for step in steps]
    assert all(ms is not None and ms > 0 for ms in gpu[:-1]) if ON_GPU else gpu == [None] * len(gpu)
    # Slow steps by the part that grew, made up: nine decode steps of 8 ms (0.5 ms of host span,
    # 7.5 of wait, spinning: CPU = wait, no switches), one whose wait grew to 11.5 ms with 30
    # switches, one whose host span grew to 5.5 ms.
    made_up, t = [], 0.0
    normal = (0.5, 7.5, 0)  # host span ms, wait ms, voluntary switches in the wait
    for span, wait, switches in [normal] * 9 + [(0.5, 11.5, 30), (5.5, 7.5, 0), normal]:
        launched = t + span / 1e3
        read = launched + wait / 1e3
        cpu = wait if not switches else wait / 2
        made_up.append({"kind": "decode", "began": t, "launched": launched, "read": read,
                        "usage_launched": [launched, 0, 0, 0], "usage_read": [launched + cpu / 1e3, 0, switches, 0],
                        "gpu_ms": 7.9})
        t = read
    line = step_log.slow_steps(step_log.timed_pairs(made_up))[1]
    assert line.startswith("slow decode steps (over the median 8.00 ms + 1): 2, 9 ms over the median; in 1 the "
                           "host's span grew more than the wait, in 1 the wait;"), line
    assert "(the others: wait 7.50 ms, CPU 7.50 ms, 0.0 voluntary switches)" in line
    timed_steps = [{**step, "gpu_ms": 2.0 + i} for i, step in enumerate(steps)]
    table = step_log.summarise(timed_steps)
    mixed = [2.0 + i for i, step in enumerate(steps[:-1]) if step["kind"] == "mixed"]
    assert f"mixed median {step_log.percentile(mixed, 0.5):.2f}, p99" in table.split("GPU ms a step: ")[1]
    assert "GPU " in table.split("slowest 1%")[1]


def test_seeded_sampling_is_the_same_alone_and_in_any_batch(model, engine):
    params = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    target = prompt(7, 5)
    alone = token_ids(engine.generate([target], params))[0]
    assert token_ids(engine.generate([target], params))[0] == alone  # again: same tokens
    others = [prompt(4, 6), prompt(11, 7)]
    mixed = engine.generate(others + [target], [greedy(3), SamplingParams(max_tokens=6, temperature=1.0), params])
    assert token_ids(mixed)[2] == alone
    other_seed = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert token_ids(engine.generate([target], other_seed))[0] != alone  # 6 draws: a different stream
    top_k_1 = SamplingParams(max_tokens=6, temperature=1.5, top_k=1, seed=3, ignore_eos=True)
    assert token_ids(engine.generate([target], top_k_1)) == token_ids(engine.generate([target], greedy(6)))


def test_n_sequences_of_a_prompt_are_the_requests_of_seeds_seed_plus_i(engine):
    """SamplingParams.n: one RequestOutput per prompt whose outputs[i] is what seed + i gives
    alone (vLLM's parallel sampling), beside a prompt of n = 1; the last seed wraps at 2**63."""
    target, other = prompt(7, 5), prompt(4, 6)
    params = SamplingParams(max_tokens=5, temperature=0.9, seed=2**63 - 2, ignore_eos=True)
    alone = [token_ids(engine.generate([target], replace(params, seed=seed)))[0] for seed in (2**63 - 2, 2**63 - 1, 0)]
    both = engine.generate([target, other], [replace(params, n=3), greedy(3)])
    assert [o.index for o in both[0].outputs] == [0, 1, 2] and both[0].finished
    assert [o.token_ids for o in both[0].outputs] == alone and len(set(map(tuple, alone))) > 1
    assert token_ids([both[1]]) == token_ids(engine.generate([other], greedy(3)))
    assert both[0].metrics.finished_time >= both[0].metrics.first_token_time >= both[0].metrics.arrival_time


def test_a_prompt_completed_in_a_mixed_step_draws_its_first_id_as_alone(model, monkeypatch):
    """A prompt whose last chunk runs beside decode rows draws its first id in their draw (its
    last token's logits in its slot's row of the decode logits): requests of each sampler variant,
    seeded, and a greedy one, each completing its prompt in a mixed step while the others decode,
    give their solo output."""
    engine = Engine(model, max_batch=4, max_len=32, seed=0, max_prefill_tokens=6)
    mixed_steps = count_mixed_steps(engine, monkeypatch)
    settings = [SamplingParams(max_tokens=5, temperature=1.3, top_k=40, top_p=0.95, seed=77, ignore_eos=True),
                SamplingParams(max_tokens=5, temperature=1.0, top_p=0.8, seed=5, ignore_eos=True),
                SamplingParams(max_tokens=5, temperature=0.9, seed=11, ignore_eos=True), greedy(5)]
    prompts = [prompt(n, 120 + i) for i, n in enumerate((4, 9, 3, 7))]
    solo = [token_ids(Engine(model, max_batch=1, max_len=32).generate([p], params))[0]
            for p, params in zip(prompts, settings)]
    requests = [engine.add_request(prompts[0], settings[0])]
    for p, params in zip(prompts[1:], settings[1:]):
        engine.step()
        requests.append(engine.add_request(p, params))
    engine.run()
    assert [r.output_token_ids for r in requests] == solo
    completed = {id(request) for plan, _, _ in mixed_steps for request, start, count in plan
                 if start + count == len(request.prompt_token_ids)}
    assert all(id(request) in completed for request in requests[1:])


def test_sampler_variants_draw_the_same_tokens(model):
    """A sampled request without filters draws the same tokens in the plain sampler (alone) and in
    the filtering one (beside a top-p request)."""
    import fuselm.engine.sampling as sampling

    engine = Engine(model, max_batch=4, max_len=32, seed=0)
    plain = SamplingParams(max_tokens=6, temperature=1.3, seed=77, ignore_eos=True)
    top_p_only = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.8, seed=5, ignore_eos=True)
    requests = [engine.add_request(prompt(9, 8), plain), engine.add_request(prompt(5, 9), top_p_only)]
    assert sampling.sampler_variant(requests[:1]) == sampling.PLAIN
    assert sampling.sampler_variant(requests) == sampling.FILTERED
    assert sampling.sampler_variant([engine.add_request(prompt(3, 1), greedy(2))]) == sampling.PLAIN
    penalized = engine.add_request(prompt(3, 2), greedy(2, presence_penalty=0.5))
    assert sampling.sampler_variant(requests[:1] + [penalized]) == sampling.PENALIZED
    assert sampling.sampler_variant(requests + [penalized]) == sampling.PENALIZED_FILTERED  # top-p alone
    qwen = engine.add_request(prompt(3, 4), SamplingParams(max_tokens=2, temperature=0.7, top_k=20, top_p=0.8,
                                                           presence_penalty=1.5))
    assert sampling.sampler_variant([qwen, penalized, requests[0]]) == sampling.PENALIZED_TOP_K
    min_p = engine.add_request(prompt(3, 3), SamplingParams(max_tokens=2, min_p=0.2))
    assert sampling.sampler_variant([min_p]) == sampling.FILTERED
    engine.run()
    alone = token_ids(engine.generate([prompt(9, 8)], plain))[0]
    assert requests[0].output().outputs[0].token_ids == alone


def test_penalties_and_min_p_in_a_running_batch_give_the_reference_loops_tokens(model, monkeypatch):
    """Requests with repetition, frequency and presence penalties, a logit bias and min-p (greedy and seeded),
    joining a running batch at different steps beside requests without them, in prefill and
    mixed steps, on reused slots (2 slots, 6 requests): each gives the reference loop's tokens
    for its settings, so a slot's counts start fresh and never leak into another request."""
    engine = Engine(model, max_batch=2, max_len=40, seed=0, max_prefill_tokens=6)
    mixed_steps = count_mixed_steps(engine, monkeypatch)
    kinds = [dict(temperature=0.0, repetition_penalty=0.3),  # < 1: the prompt's tokens made likely
             dict(temperature=0.9, top_k=20, presence_penalty=1.5, frequency_penalty=0.5, seed=5),
             dict(temperature=1.2, min_p=0.1, seed=9),
             dict(temperature=0.0),
             dict(temperature=0.8, repetition_penalty=0.7, frequency_penalty=-1.0, top_p=0.9, seed=13),
             dict(temperature=0.0, logit_bias={5: 100.0, 9: 99.5}, presence_penalty=2.0)]
    rng = random.Random(4)
    jobs = [(prompt(rng.randint(1, 12), 200 + i), kinds[i % 6], rng.randint(3, 7)) for i in range(6)]
    reference = [model.generate(torch.tensor([p], device=DEVICE), n, eos_token_id=[], **k)[0].tolist()
                 for p, k, n in jobs]
    pending, requests = list(jobs), []
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):
            if pending:
                p, k, n = pending.pop(0)
                requests.append(engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, **k)))
        engine.step()
    assert [r.output_token_ids for r in requests] == reference
    assert len(mixed_steps) >= 3
    def processed(key):
        return key.endswith("penalty") or key == "logit_bias"

    penalised = [i for i, (_, k, _) in enumerate(jobs) if any(processed(key) for key in k)]
    unpenalised = {i: model.generate(torch.tensor([jobs[i][0]], device=DEVICE), jobs[i][2], eos_token_id=[],
                                     **{key: v for key, v in jobs[i][1].items() if not processed(key)})
                   for i in penalised}
    assert any(reference[i] != unpenalised[i][0].tolist() for i in penalised)  # the penalties mattered
    assert set(reference[5]) <= {5, 9}  # +100 and +99.5 over logits of a few units


def test_logprobs_are_the_log_softmax_of_the_logits_each_token_was_drawn_from(model, monkeypatch):
    """SamplingParams.logprobs: each generated token's log-probability and rank and the k most
    likely tokens', from the logits the reference loop draws the same tokens from (float64
    log_softmax), for requests asking for different k beside one asking for none, greedy and
    seeded, their first ids drawn in a prefill step and in mixed steps."""
    engine = Engine(model, max_batch=4, max_len=32, seed=0, max_prefill_tokens=6)
    mixed_steps = count_mixed_steps(engine, monkeypatch)
    settings = [greedy(5, logprobs=3), SamplingParams(max_tokens=5, temperature=0.9, seed=11, ignore_eos=True,
                                                       logprobs=0), greedy(5), greedy(4, logprobs=20)]
    prompts = [prompt(n, 140 + i) for i, n in enumerate((4, 9, 3, 7))]
    requests = [engine.add_request(prompts[0], settings[0])]
    for p, params in zip(prompts[1:], settings[1:]):
        engine.step()
        requests.append(engine.add_request(p, params))
    engine.run()
    assert len(mixed_steps) >= 3
    for request, p, params in zip(requests, prompts, settings):
        output = request.output().outputs[0]
        if params.logprobs is None:
            assert output.logprobs is None and output.cumulative_logprob is None
            continue
        ids, logits = model.generate(torch.tensor([p], device=DEVICE), params.max_tokens,
                                     temperature=params.temperature, seed=params.seed, eos_token_id=[],
                                     return_logits=True)
        assert output.token_ids == ids[0].tolist() and len(output.logprobs) == len(output.token_ids)
        logits = logits[0].double().cpu()
        exact = logits.log_softmax(-1)
        for position, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
            top = exact[position].topk(params.logprobs).indices.tolist()
            assert list(entry)[0] == token and set(entry) == {token, *top}
            assert entry[token].rank == 1 + int((logits[position] > logits[position, token]).sum())
            assert [entry[t].rank for t in top] == list(range(1, params.logprobs + 1))
            assert all(abs(lp.logprob - exact[position, t]) < 1e-5 for t, lp in entry.items())
        drawn = sum(exact[i, t].item() for i, t in enumerate(output.token_ids))
        assert output.cumulative_logprob == pytest.approx(drawn, abs=1e-4)


def test_prompt_logprobs_are_the_log_softmax_of_the_models_logits(model):
    """SamplingParams.prompt_logprobs: None for the first prompt token, then each one's
    log-probability and rank after the ones before it and the k most likely, from ``model(ids)``'s
    logits (float64 log_softmax); a request queued behind a full batch gets them too, n samples
    share the first's, and a request without them has None."""
    engine = Engine(model, max_batch=1, max_len=32, seed=0)
    prompts = [prompt(9, 160), prompt(5, 161), prompt(1, 162)]
    settings = [greedy(3, prompt_logprobs=4), greedy(2, prompt_logprobs=0, n=2), greedy(2, prompt_logprobs=2)]
    outputs = engine.generate(prompts, settings)
    for p, params, output in zip(prompts, settings, outputs):
        assert len(output.prompt_logprobs) == len(p) and output.prompt_logprobs[0] is None
        logits = model(torch.tensor([p], device=DEVICE))[0].double().cpu()
        exact = logits.log_softmax(-1)
        for position, (token, entry) in enumerate(zip(p[1:], output.prompt_logprobs[1:])):
            top = exact[position].topk(params.prompt_logprobs).indices.tolist()
            assert list(entry)[0] == token and set(entry) == {token, *top}
            assert entry[token].rank == 1 + int((logits[position] > logits[position, token]).sum())
            assert all(abs(lp.logprob - exact[position, t]) < 1e-5 for t, lp in entry.items())
    assert len(outputs[1].outputs) == 2
    assert engine.generate([prompts[0]], greedy(2))[0].prompt_logprobs is None


def test_stop_ids_end_a_request_and_leave_the_others(model, engine):
    p0, p1 = prompt(9, 11), prompt(5, 12)
    free = token_ids(engine.generate([p0, p1], greedy(8)))
    stop = free[0][2]
    outputs = engine.generate([p0, p1], greedy(8, stop_token_ids=[stop]))
    first = outputs[0].outputs[0]
    assert first.token_ids == free[0][:3] and first.finish_reason == "stop" and first.stop_reason == stop
    second = free[1][: free[1].index(stop) + 1] if stop in free[1] else free[1]
    assert outputs[1].outputs[0].token_ids == second


def test_min_tokens_keeps_stop_ids_out_until_then_as_the_reference_loop(model, engine):
    """min_tokens: the stop ids' logits are -inf until a request has that many tokens (greedy and
    seeded, beside a request without it): the reference loop's tokens; a stop id drawn after then
    ends the request. More stop ids than the device holds with min_tokens: a ValueError."""
    p0, p1 = prompt(9, 11), prompt(5, 12)
    free = token_ids(engine.generate([p0], greedy(8)))[0]
    stop = free[1]  # the greedy reply's second token: it would end the request at 2 tokens
    jobs = [(p0, dict(temperature=0.0), 4), (p0, dict(temperature=1.0, seed=7), 3), (p1, dict(temperature=0.0), 0)]
    reference = [model.generate(torch.tensor([p], device=DEVICE), 8, eos_token_id=[stop], min_tokens=m, **k)[0]
                 for p, k, m in jobs]
    reference = [ids[: ids.tolist().index(stop) + 1].tolist() if stop in ids.tolist() else ids.tolist()
                 for ids in reference]
    outputs = engine.generate([p for p, _, _ in jobs], [SamplingParams(max_tokens=8, ignore_eos=True, min_tokens=m,
                                                                       stop_token_ids=[stop], **k)
                                                        for _, k, m in jobs])
    assert token_ids(outputs) == reference
    assert stop not in reference[0][:4] and len(reference[0]) > 2  # the ban mattered
    assert all(stop not in ids[:m] for ids, (_, _, m) in zip(reference, jobs))
    with pytest.raises(ValueError, match="min_tokens: a request with min_tokens may have 8 stop ids at most"):
        engine.add_request(p0, SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=list(range(9))))
    with pytest.raises(ValueError, match="min_tokens: expected an int in"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_model_eos_stops_unless_ignore_eos(model):
    p = prompt(9, 13)
    free = token_ids(Engine(model, max_batch=2, max_len=32).generate([p], greedy(8)))[0]
    eos_model = random_qwen35(replace(two_layer_config(), eos_token_id=free[3]), device=DEVICE, seed=3)
    engine = Engine(eos_model, max_batch=2, max_len=32)
    stopped = engine.generate([p], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert stopped.token_ids == free[: free.index(free[3]) + 1] and stopped.finish_reason == "stop"
    assert stopped.stop_reason is None  # the model's eos (vLLM's); an asked-for stop id is named
    assert token_ids(engine.generate([p], greedy(8)))[0] == free


def test_more_requests_than_slots_wait_and_all_finish(model):
    engine = Engine(model, max_batch=2, max_len=32)
    prompts = [prompt(3 + i, 20 + i) for i in range(5)]
    outputs = engine.generate(prompts, greedy(4))
    solo = [token_ids(Engine(model, max_batch=1, max_len=32).generate([p], greedy(4)))[0] for p in prompts]
    assert token_ids(outputs) == solo


def test_requests_wait_for_kv_pages_and_get_their_solo_output(model):
    """A cache of 3 pages of 16 tokens for 4 slots: requests needing 2 pages (prompt + max_tokens
    over 16) and 1 page share them; the queue's head waits until enough pages are free, every
    request gets its solo output, all pages come back. A request needing more pages than the cache
    has is refused, naming max_tokens."""
    engine = Engine(model, max_batch=4, max_len=32, kv_cache_tokens=48, page_size=16, seed=0)
    assert (engine.runner.cache.num_pages, engine.runner.cache.page_size) == (3, 16)
    assert engine.max_request_tokens == 32  # max_len; the cache's 48 tokens hold more
    prompts = [prompt(12, 20), prompt(5, 21), prompt(9, 22), prompt(3, 23)]
    params = [greedy(8), greedy(4), greedy(10), greedy(6)]  # pages: 2, 1, 2, 1
    requests = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    running_pages, running = [], []
    while engine.has_unfinished_requests():
        engine.step()
        running_pages.append(sum(len(r.pages) for r in engine.scheduler.rows))
        running.append(engine.scheduler.rows_in_use())
    assert max(running_pages) <= 3 and max(running) == 2  # 4 slots, but pages for 2 at a time
    solo = Engine(model, max_batch=1, max_len=32, seed=0)
    for request, p, q in zip(requests, prompts, params):
        assert request.output().outputs[0].token_ids == token_ids(solo.generate([p], q))[0]
    assert engine.scheduler.free_pages == 3
    small = Engine(model, max_batch=2, max_len=64, kv_cache_tokens=48, page_size=16)
    assert small.max_request_tokens == 48  # the cache's 3 pages, under max_len
    with pytest.raises(ValueError, match="max_tokens: 20 prompt tokens .* need 4 K/V pages of 16 tokens; the cache has 3"):
        small.add_request(prompt(20, 1), greedy(30))


def test_bad_input_raises_and_the_engine_stays_usable(model, engine):
    good = prompt(6, 30)
    expected = token_ids(engine.generate([good], greedy(3)))
    bad_calls = {
        "empty prompt": (lambda: engine.add_request([], greedy(2)), "prompt: empty"),
        "id >= vocab": (lambda: engine.add_request([1, VOCAB], greedy(2)), r"prompt_token_ids: .*\[0, 256\)"),
        "prompt fills the context": (lambda: engine.add_request(prompt(32, 1), greedy(1)), "prompt: 32 tokens"),
        "prompt + max_tokens": (lambda: engine.add_request(prompt(30, 1), greedy(3)), "max_tokens: 30 prompt"),
        "stop id out of vocab": (lambda: engine.add_request(good, greedy(2, stop_token_ids=[999])), "stop_token_ids"),
        "one bad prompt of three": (lambda: engine.generate([good, [], good], greedy(2)), r"prompts\[1\]: prompt: empty"),
        "params per prompt": (lambda: engine.generate([good, good], [greedy(2)]), "params: 1 SamplingParams for 2"),
        "n > 1 in one request": (lambda: engine.add_request(good, greedy(2, n=2)), "n: a request draws one sequence"),
        "a sample of the second prompt": (lambda: engine.generate([good, prompt(30, 1)], greedy(3, n=2)),
                                          r"prompts\[1\]: max_tokens"),
    }
    for case, (call, message) in bad_calls.items():
        with pytest.raises(ValueError, match=message):
            call()
        assert not engine.has_unfinished_requests(), f"{case} left a request queued"
    with pytest.raises(TypeError, match="params"):
        engine.add_request(good, {"max_tokens": 2})
    assert token_ids(engine.generate([good], greedy(3))) == expected


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "max_tokens"), ("temperature", -0.1, "temperature"), ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"), ("top_k", -2, "top_k"), ("seed", -1, "seed"), ("stop", [""], "stop"),
    ("stop_token_ids", [-1], "stop_token_ids"), ("temperature", float("nan"), "temperature"),
    ("ignore_eos", 1, "ignore_eos"), ("include_stop_str_in_output", "yes", "include_stop_str_in_output"),
    ("skip_special_tokens", None, "skip_special_tokens"), ("n", 0, "n"), ("n", 2.0, "n"),
    ("logprobs", -1, "logprobs"), ("logprobs", 21, "logprobs"), ("logprobs", True, "logprobs"),
    ("prompt_logprobs", 21, "prompt_logprobs"), ("prompt_logprobs", 1.0, "prompt_logprobs"),
    ("min_p", -0.1, "min_p"), ("min_p", 1.5, "min_p"), ("repetition_penalty", 0.0, "repetition_penalty"),
    ("repetition_penalty", float("inf"), "repetition_penalty"), ("frequency_penalty", 2.5, "frequency_penalty"),
    ("presence_penalty", -3, "presence_penalty"), ("presence_penalty", True, "presence_penalty"),
    ("logit_bias", {1: 101}, "logit_bias"), ("logit_bias", {-1: 1.0}, "logit_bias"),
    ("logit_bias", {"1": 1}, "logit_bias"), ("logit_bias", [1], "logit_bias"),
    ("logit_bias", {t: 1 for t in range(257)}, "logit_bias")])
def test_sampling_params_name_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_graph_batch_sizes_are_clipped_and_checked(model):
    engine = Engine(model, max_batch=6, max_len=16, graph_batch_sizes=(1, 4, 16), use_graphs=False)
    assert engine.runner.batch_sizes == (1, 4, 6)
    assert [engine.runner.batch_size_for(n) for n in (1, 2, 5, 6)] == [1, 4, 6, 6]
    with pytest.raises(ValueError, match="graph_batch_sizes"):
        Engine(model, max_batch=4, max_len=16, graph_batch_sizes=(0, 2), use_graphs=False)
    with pytest.raises(ValueError, match="max_batch"):
        Engine(model, max_batch=0, max_len=16)


@pytest.mark.gpu
def test_graph_replay_equals_eager_steps(model):
    prompts = [prompt(9, 40), prompt(4, 41), prompt(13, 42)]
    params = [greedy(6), SamplingParams(max_tokens=6, temperature=0.8, top_p=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, seed=6, ignore_eos=True)]
    graphs = Engine(model, max_batch=4, max_len=32)
    eager = Engine(model, max_batch=4, max_len=32, use_graphs=False)
    assert graphs.runner.use_graphs and not eager.runner.use_graphs
    assert token_ids(graphs.generate(prompts, params)) == token_ids(eager.generate(prompts, params))


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [None, 8])
def test_prefill_graphs_equal_eager_prefill(model, budget):
    """Prefill graphs (rows and tokens padded up to buckets, fresh and continued chunks, captured
    on a bucket's first use and replayed after) give the eager engine's tokens; budget 8 splits
    the 13- and 20-token prompts into chunks between decode steps."""
    prompts = [prompt(n, 60 + i) for i, n in enumerate((9, 4, 13, 20, 7, 11))]
    expected = token_ids(Engine(model, max_batch=4, max_len=32, max_prefill_tokens=budget,
                                use_graphs=False).generate(prompts, greedy(5)))
    engine = Engine(model, max_batch=4, max_len=32, max_prefill_tokens=budget)
    decode_graphs = len(engine.runner._graphs)
    for _ in range(2):  # the second pass replays what the first captured
        assert token_ids(engine.generate(prompts, greedy(5))) == expected
    assert len(engine.runner._graphs) > decode_graphs


@pytest.mark.gpu
def test_mixed_graphs_captured_up_front_serve_the_run(model):
    """Engine.capture_mixed_graphs before any request: a run whose mixed steps carry one chunk
    each (budget 12, prompts joining one by one) captures no mixed graph at all, and gives
    the eager engine's tokens; the cache is left idle and empty."""
    params = [greedy(6 + i) for i in range(4)]
    prompts = [prompt(n, 70 + i) for i, n in enumerate((9, 17, 6, 13))]
    expected = token_ids(Engine(model, max_batch=4, max_len=32, max_prefill_tokens=12,
                                use_graphs=False).generate(prompts, params))
    engine = Engine(model, max_batch=4, max_len=32, max_prefill_tokens=12)
    assert engine.capture_mixed_graphs() > 0
    assert not bool(engine.runner.cache.active.any()) and int(engine.runner.cache.lengths.abs().sum()) == 0
    before = set(engine.runner._graphs)
    outputs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        outputs.append(engine.add_request(p, sp))
        engine.step()
    engine.run()
    assert [r.output_token_ids for r in outputs] == expected
    new = [key for key in set(engine.runner._graphs) - before if key[0] == "mixed"]
    assert not new, new  # one chunk per mixed step: all captured up front


@pytest.mark.gpu
def test_a_served_run_makes_no_host_sync_and_pins_no_memory(model):
    """Requests joining one by one (prompts in chunks beside decode steps), finishing on the
    device (max_tokens) and aborted on the host: no step of the engine synchronizes with the GPU
    (sync debug mode "error"; the engine waits only on its own CUDA events, which it does not
    flag). A sync in a step delays every running request's token by a step (release() once did:
    ITL p99 two steps on the H100). Nor does it pin host memory. The first pass captures the
    graphs; the second is checked."""
    prompts = [prompt(n, 80 + i) for i, n in enumerate((9, 17, 6, 13))]
    engine = Engine(model, max_batch=4, max_len=32, max_prefill_tokens=12)
    engine.capture_mixed_graphs()

    def serve():
        requests = []
        for i, p in enumerate(prompts):
            requests.append(engine.add_request(p, greedy(6 + i)))
            engine.step()
        engine.abort(requests[1])
        engine.run()
        return requests

    serve()
    torch.cuda.synchronize()
    # Pinned blocks the caching host allocator hands out inside each launch and read.
    handouts = []

    def counted(phase):
        def run():
            before = torch.cuda.host_memory_stats()["active_requests.allocated"]
            result = phase()
            handouts.append(torch.cuda.host_memory_stats()["active_requests.allocated"] - before)
            return result
        return run

    engine.launch, engine.read = counted(engine.launch), counted(engine.read)
    torch.cuda.set_sync_debug_mode("error")
    try:
        requests = serve()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [len(r.output_token_ids) for i, r in enumerate(requests) if i != 1] == [6, 8, 9]
    assert not bool(engine.runner.cache.active.any())
    # Its copies between host and device go through the engine's own pinned buffers: not one
    # block from the caching host allocator in a step (no allocation in the decode path).
    assert len(handouts) > 2 * len(prompts) and sum(handouts) == 0, handouts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launched_ids_read_after_their_pinned_buffer_came_back_raise():
    """A step's ids land in that step's staging buffer; read once the buffer has been handed out
    again they could be a later step's, so reading them raises instead."""
    from fuselm.engine.engine import _Launched
    from fuselm.runtime import PinnedStaging

    staging = PinnedStaging("cuda", depth=2)
    staging.next_step()
    launched = _Launched(torch.arange(5, device="cuda"), {}, staging)
    staging.next_step()
    assert launched.read() == ([0, 1, 2, 3, 4], None)
    staging.next_step()
    with pytest.raises(RuntimeError, match="pinned buffer was reused"):
        launched.read()


@pytest.mark.gpu
def test_one_graph_launch_and_no_host_sync_per_step(model):
    from fuselm.engine.audit import launch_audit

    engine = Engine(model, max_batch=4, max_len=32)
    counts = launch_audit(engine, requests=3, steps=4)
    assert counts["graph_launches"] == 1 and counts["kernel_launches_outside_graphs"] == 0
    assert counts["host_syncs"] == 0 and counts["sync_debug_error"] is None and counts["kernels"] > 0
    assert not ON_GPU or counts["batch_size"] == 4
    total_ms, launches = counts["kernel_ms"]["(all)"]
    assert launches == counts["kernels"] + counts["copies"] and total_ms > 0


@pytest.mark.gpu
def test_prefill_profile_counts_kernels_and_times_them(model):
    from fuselm.engine.audit import prefill_profile

    ids = torch.randint(0, model.config.vocab_size, (2, 9), device=model.device)
    profile = prefill_profile(model, ids)
    assert profile["kernels"] > 0 and profile["gpu_ms"] > 0 and profile["wall_ms"] > 0
    assert profile["kernel_ms"]["(all)"] == [profile["gpu_ms"], profile["kernels"] + profile["copies"]]


def test_kernel_time_table_groups_device_events_by_name():
    """The audit's kernel-time table from profiler events: CUDA events only, grouped by the first
    60 characters of the name, ms and launches per call, slowest first, the total last; and its
    markdown, tables side by side."""
    from types import SimpleNamespace

    from fuselm.engine.audit import kernel_time_rows, kernel_time_table

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name=name, device_type=device, device_time_total=us) for name, device, us in (
        ("gemm", cuda, 300.0), ("norm", cuda, 50.0), ("gemm", cuda, 100.0), ("aten::mm", cpu, 400.0),
        ("k" * 70, cuda, 10.0))]
    table = kernel_time_table(events, calls=2, top=2)
    assert table == {"gemm": [0.2, 1.0], "norm": [0.025, 0.5], "(all)": [0.23, 2.0]}
    assert kernel_time_rows({"a": table, "b": {"gemv": [1.5, 3], "(all)": [1.5, 3]}}) == [
        "| kernel | a | b |", "|---|---|---|", "| gemm | 0.200 (1) | - |", "| norm | 0.025 (0.5) | - |",
        "| gemv | - | 1.500 (3) |", "| (all) | 0.230 (2) | 1.500 (3) |"]
