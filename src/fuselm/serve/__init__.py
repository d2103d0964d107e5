"""``fuselm serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

    protocol.py      request bodies -> prompt ids + SamplingParams (checked, errors naming the
                     field); OpenAI's answer, chunk and error JSON
    async_engine.py  AsyncEngine: the Engine on one thread of its own, requests as asyncio streams
    app.py           the aiohttp app: /health, /v1/models, /v1/completions, /v1/chat/completions;
                     ServedModel (a checkpoint's LLM, or random weights without a tokenizer)

    from fuselm.engine.llm import LLM
    from fuselm.serve import ServedModel, run_server
    run_server(ServedModel.from_llm(LLM("Qwen3.5-9B/")), port=8000)
"""

from fuselm.serve.app import SERVER, OpenAIServer, ServedModel, build_app, run_server
from fuselm.serve.async_engine import AsyncEngine, RequestDelta

__all__ = ["AsyncEngine", "RequestDelta", "OpenAIServer", "ServedModel", "SERVER", "build_app", "run_server"]
