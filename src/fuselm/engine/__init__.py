"""Generation around a model: request -> scheduler -> runner, and the LLM front end.

    request.py    SamplingParams, Request, RequestOutput, Logprob (vLLM's offline API shapes)
    sampling.py   per-slot sampling parameters and stop counters on the device (graph inputs);
                  the drawn tokens' log-probabilities
    runner.py     ModelRunner: cache slots, prefill, decode as one CUDA graph per batch size over
                  a row -> slot table
    scheduler.py  Scheduler: waiting queue, slot and decode row per running request
    engine.py     Engine: the loop (add_request, step, generate), pipelined one step deep
    structured_outputs.py  grammars of constrained requests: the allowed next tokens as bitmasks
    llm.py        LLM: a checkpoint directory, text in and out, chat
    reference.py  the eager reference loop behind Qwen35.generate (tests)
    audit.py      kernels / graph launches / host syncs per decode step; parity with HF
"""

from fuselm.engine.engine import Engine
from fuselm.engine.request import (CompletionOutput, Logprob, Request, RequestOutput, SamplingParams,
                                   StructuredOutputsParams)

__all__ = ["Engine", "SamplingParams", "StructuredOutputsParams", "Request", "RequestOutput", "CompletionOutput",
           "Logprob"]
