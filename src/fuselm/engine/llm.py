"""``LLM``: text in, text out of a checkpoint directory, in the shape of vLLM's offline API.

    llm = LLM("Qwen3.5-9B/", dtype="bfloat16")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32, temperature=0))
    out[0].outputs[0].text
    out = llm.chat([{"role": "user", "content": "Hi!"}], chat_template_kwargs={"enable_thinking": False})

It loads the model (``Qwen35.from_pretrained``: sharded safetensors straight to the device) and
the tokenizer (``fuselm.tokenizer.Tokenizer``: the directory's tokenizer.json and chat template),
and runs every request through one ``Engine``. Text is detokenized as tokens come (never half a
UTF-8 character), stop strings are cut from it, special tokens are left out of it (as
``SamplingParams`` asks: include_stop_str_in_output, skip_special_tokens).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from fuselm.engine.engine import Engine
from fuselm.engine.request import (Request, RequestOutput, SamplingParams, TokenLogprobs, is_token_ids,
                                   params_per_prompt, samples_output)
from fuselm.models.qwen35 import Qwen35
from fuselm.models.qwen35.weights import read_checkpoint_config
from fuselm.tokenizer import Tokenizer

# generation_config.json fields that become the default SamplingParams (as vLLM does:
# ModelConfig.get_diff_sampling_param).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# generation_config.json fields vLLM also applies and fuselm does not, with their neutral values:
# another value gets a warning (max_new_tokens' default length differs from vLLM's).
_GENERATION_NOT_APPLIED = {"max_new_tokens": None}


class LLM:
    """A Qwen3.5 checkpoint directory, loaded for generation.

    Args:
        model: the checkpoint directory (config.json, safetensors, tokenizer.json, ...).
        dtype: torch dtype or its name ("bfloat16", ...); default: the checkpoint's.
        device: "cuda", "cpu", ...; default: cuda when available.
        max_batch: requests decoded together (more wait); max_len: prompt + output tokens.
        seed: seeds the per-request seeds of requests without one (reproducible runs).
        progress: show a progress bar while loading.
        engine_options: ``Engine``'s keyword options (max_prefill_tokens, kv_cache_tokens,
            state_dtype: the Gated DeltaNet states' dtype in the cache, float32 or bfloat16, ...).
    """

    def __init__(self, model, dtype: torch.dtype | str | None = None, device=None, max_batch: int = 8,
                 max_len: int = 4096, seed: int | None = None, progress: bool = True, **engine_options):
        directory = Path(model)
        self.model_dir = directory
        read_checkpoint_config(directory)  # a missing directory or config.json is named before anything loads
        self.tokenizer = Tokenizer.from_pretrained(directory)
        self.model = Qwen35.from_pretrained(directory, dtype=dtype, device=device, progress=progress)
        self.engine = Engine(self.model, max_batch=max_batch, max_len=max_len, seed=seed, tokenizer=self.tokenizer,
                             **engine_options)
        generation_file = directory / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
        self._defaults = {k: generation[k] for k in _GENERATION_DEFAULTS if generation.get(k) is not None}
        for name, neutral in _GENERATION_NOT_APPLIED.items():
            if generation.get(name) not in (None, neutral):
                warnings.warn(f"{generation_file}: {name} = {generation[name]!r} is not applied by fuselm (vLLM "
                              f"would apply it)", stacklevel=2)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json sampling defaults."""
        return SamplingParams(**self._defaults)

    # ------------------------------------------------------------------------ requests
    def _add(self, prompts, params) -> list[list[Request]]:
        """Tokenize and queue every prompt (n requests for n samples); nothing is queued unless
        all are valid. Returns each prompt's requests."""
        if isinstance(prompts, str) or is_token_ids(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts: expected a string, a list of strings or of token-id lists, got {prompts!r}")
        params_list = params_per_prompt(self.get_default_sampling_params() if params is None else params, len(prompts))
        requests = []
        for index, (prompt, request_params) in enumerate(zip(prompts, params_list)):
            if isinstance(prompt, str):
                text, ids = prompt, self.tokenizer.encode(prompt)
            elif is_token_ids(prompt) or prompt == []:
                text, ids = None, list(prompt)
            else:
                raise TypeError(f"prompts[{index}]: expected a string or a list of token ids, got "
                                f"{type(prompt).__name__}")
            requests.append({"prompt_token_ids": ids, "params": request_params, "prompt": text})
        return self.engine.add_requests(requests, detokenizer=self._detokenizer)

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams):
        return self.tokenizer.detokenizer(prompt_token_ids, **params.detokenizer_options)

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 stream: Callable[[Request], None] | None = None) -> list[RequestOutput]:
        """Generate for a prompt (a string or a list of token ids) or a list of them; one
        ``RequestOutput`` per prompt, in order (``outputs``: its n sequences, ``SamplingParams.n``).
        ``params``: one SamplingParams or one per prompt (default:
        ``get_default_sampling_params()``); ``stream(request)`` is called whenever a request (one
        sequence) gets a token (``request.detokenizer.text`` holds its text so far). With
        ``SamplingParams.logprobs`` / ``prompt_logprobs``, each ``Logprob`` carries its token's text
        (``decoded_token``)."""
        groups = self._add(prompts, params)
        self.engine.run(stream)
        outputs = [samples_output(group) for group in groups]
        for output in outputs:
            output.prompt_logprobs = self._with_token_texts(output.prompt_logprobs)
            for completion in output.outputs:
                completion.logprobs = self._with_token_texts(completion.logprobs)
        return outputs

    def _with_token_texts(self, entries: list[TokenLogprobs | None] | None) -> list[TokenLogprobs | None] | None:
        """``entries`` with each ``Logprob``'s ``decoded_token`` set."""
        if entries is None:
            return None
        text = self.tokenizer.token_text
        return [None if entry is None else {token: dataclasses.replace(logprob, decoded_token=text(token))
                                            for token, logprob in entry.items()} for entry in entries]

    def chat(self, messages, params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             stream: Callable[[Request], None] | None = None, *, continue_final_message: bool = False,
             tools: Sequence[dict] | None = None) -> list[RequestOutput]:
        """Reply to a conversation (a list of {"role", "content"} messages) or a list of
        conversations: each is rendered by the checkpoint's chat template
        (``chat_template_kwargs`` go to the template, e.g. ``{"enable_thinking": False}``; ``tools``:
        OpenAI function tools; ``continue_final_message``: continue the last message, with
        ``add_generation_prompt`` False, as vLLM's) and generated as ``generate`` does."""
        conversations = [messages] if messages and isinstance(messages, (list, tuple)) \
            and isinstance(messages[0], dict) else messages
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise ValueError(f"messages: expected a conversation (a list of role/content dicts) or a list of them, "
                             f"got {messages!r}")
        prompts = [self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      tools=tools, continue_final_message=continue_final_message,
                                                      **(chat_template_kwargs or {}))
                   for conversation in conversations]
        return self.generate(prompts, params, stream)

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text as it comes (stop strings cut, no half UTF-8
        characters). Other queued requests advance meanwhile."""
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected a SamplingParams, got {type(params).__name__}")
        if params is not None and params.n != 1:
            raise ValueError(f"n: stream yields one sequence (n = 1), got n = {params.n}: use generate's stream")
        ((request,),) = self._add(prompt, params)
        while True:
            self.engine.step()
            text = request.take_new_text()
            if text:
                yield text
            if request.finished:
                return
