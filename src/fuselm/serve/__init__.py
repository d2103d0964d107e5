"""``fuselm serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

    protocol.py        request bodies -> prompt ids + SamplingParams (checked, errors naming the
                       field); OpenAI's answer, chunk and error JSON
    async_engine.py    EngineLoop: the Engine stepped on a thread of its own, commands in and
                       answers out as messages; EngineClient: requests as asyncio streams;
                       AsyncEngine: the loop on a thread of this process
    engine_process.py  EngineProcess: the loop in a process of its own (what fuselm serve runs)
    reply_parser.py    chat replies split into reasoning, content and tool calls (vLLM's qwen3
                       reasoning parser and qwen3_coder tool-call parser)
    app.py             the aiohttp app: /health, /v1/models, /v1/completions, /v1/chat/completions;
                       ServedModel (a checkpoint's LLM, or random weights without a tokenizer)

    from fuselm.serve import run_server, serve_spec
    run_server(serve_spec("Qwen3.5-9B/", max_batch=32), port=8000)   # the engine in a child process
"""

from fuselm.serve.app import SERVER, OpenAIServer, ServedModel, build_app, run_server, serve_spec
from fuselm.serve.async_engine import AsyncEngine, EngineClient, RequestDelta
from fuselm.serve.engine_process import EngineProcess, EngineSpec

__all__ = ["AsyncEngine", "EngineClient", "EngineProcess", "EngineSpec", "RequestDelta", "OpenAIServer",
           "ServedModel", "SERVER", "build_app", "run_server", "serve_spec"]
