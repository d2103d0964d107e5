"""The eager reference loop: HF-style ``generate`` for one static batch, step by step in Python.

``Qwen35.generate`` forwards here. It is the simplest correct loop (prefill, then one
``decode_step`` per token, no graphs, no scheduler), which the tests hold against HF transformers
and against the ``Engine``. Sampling is the engine's (``fuselm.ops.sampling.sample_tokens``:
row r of the batch draws from the stream of seed ``seed + r``), so a seeded call here and a
request with that seed in the engine draw the same tokens.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from fuselm.engine.request import SamplingParams
from fuselm.models.qwen35 import Qwen35
from fuselm.ops.sampling import PROMPT_BIT, apply_penalties, sample_tokens


@torch.no_grad()
def generate(model: Qwen35, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, *, min_p: float | None = None,
             repetition_penalty: float | None = None, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
             logit_bias: dict[int, float] | None = None, min_tokens: int = 0,
             attention_mask: torch.Tensor | None = None, eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, seed: int | None = None, return_logits: bool = False):
    """Generate up to ``max_new_tokens`` tokens per row after right-padded prompts.

    Args:
        input_ids: [B, T] int token ids; ``attention_mask`` [B, T] marks real tokens (ones, then
            zeros for right padding); without it every row has T tokens.
        max_new_tokens: tokens to generate per row (>= 0).
        temperature: 0 is greedy; > 0 samples, with optional ``top_k`` (>= 1), ``top_p`` (in
            (0, 1]) and ``min_p`` (in [0, 1]); ``seed`` (None: a random one) seeds row r with
            ``seed + r``.
        repetition_penalty (HF's and vLLM's, over the row's prompt and generated tokens),
            frequency_penalty, presence_penalty (vLLM's / OpenAI's, over the generated ones):
            and ``logit_bias`` ({token id: bias}, OpenAI's): ``SamplingParams``' meanings, applied
            to greedy rows too; the logits returned are the model's, before them.
        min_tokens: the stop ids are not drawn (their logits -inf) before a row has that many tokens.
        eos_token_id: id or ids that end a row; None uses the config's stop ids, ``[]`` never
            stops. A finished row's later tokens are ``pad_token_id`` (default: the config's,
            else the first eos id, else 0), and it writes no more state.
        return_logits: also return the logits each token was chosen from [B, n, vocab].
    Returns:
        new token ids [B, n] (int64), n = max_new_tokens, or fewer if every row stopped; with
        ``return_logits``, ``(ids, logits)``.
    """
    lengths = model.check_prompt(input_ids, attention_mask)
    B = input_ids.shape[0]
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    params = SamplingParams(temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p,
                            min_p=min_p or 0.0, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
                            logit_bias=logit_bias, max_tokens=max(max_new_tokens, 1), min_tokens=min_tokens)
    stop_ids = model.config.stop_token_ids if eos_token_id is None else (
        (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id))
    vocab = model.config.vocab_size
    for name, ids in (("eos_token_id", stop_ids), ("pad_token_id", () if pad_token_id is None else (pad_token_id,))):
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"{name}: expected token ids in [0, {vocab}), got {ids}")
    if pad_token_id is None:
        config_pad = model.config.pad_token_id
        pad_token_id = config_pad if config_pad is not None and 0 <= config_pad < vocab else (stop_ids or (0,))[0]
    device = model.device
    new_tokens = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.int64, device=device)
    if max_new_tokens == 0:
        return (new_tokens, torch.empty(B, 0, vocab, dtype=model.dtype, device=device)) if return_logits else new_tokens

    cache = model.new_cache(B, max(lengths) + max_new_tokens)
    first_seed = random.getrandbits(62) if seed is None else seed
    row_params = dict(temperature=torch.full((B,), params.temperature, dtype=torch.float32, device=device),
                      top_k=torch.full((B,), params.top_k, dtype=torch.int32, device=device),
                      top_p=torch.full((B,), params.top_p, dtype=torch.float32, device=device),
                      seeds=torch.arange(B, device=device) + first_seed)
    if params.filtered:
        row_params["min_p"] = torch.full((B,), params.min_p, dtype=torch.float32, device=device)
    penalties = [torch.full((B,), value, dtype=torch.float32, device=device) for value in
                 (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)]
    counts, bias = None, {}  # each row's draws per token, + PROMPT_BIT for its prompt's (apply_penalties')
    if params.logit_bias:
        bias = dict(bias_ids=torch.tensor([list(params.logit_bias)] * B, dtype=torch.int32, device=device),
                    bias_values=torch.tensor([list(params.logit_bias.values())] * B, device=device),
                    bias_counts=torch.full((B,), len(params.logit_bias), dtype=torch.int32, device=device))
    if params.penalized:
        counts = torch.zeros(B, vocab, dtype=torch.int32, device=device)
        if params.repetition_penalty != 1:
            columns = torch.arange(input_ids.shape[1], device=device)
            real = columns[None, :] < torch.tensor(lengths, device=device)[:, None]
            rows = torch.arange(B, device=device)[:, None].expand_as(input_ids)
            counts[rows[real], input_ids[real]] = PROMPT_BIT
    stop = torch.tensor(stop_ids, dtype=torch.int64, device=device) if stop_ids else None
    logits = model.prefill(input_ids, cache, attention_mask)
    step_logits, generated = [], max_new_tokens
    for i in range(max_new_tokens):
        if return_logits:
            step_logits.append(logits)
        positions = torch.full((B,), i, dtype=torch.int64, device=device)
        scores = logits if counts is None else apply_penalties(logits, counts, *penalties, **bias)
        if i < min_tokens and stop is not None:
            scores = scores.float().index_fill(1, stop, float("-inf"))
        tokens = sample_tokens(scores, **row_params, positions=positions, filtered=params.filtered)
        if counts is not None:
            counts[torch.arange(B, device=device), tokens] += cache.active.int()
        tokens = torch.where(cache.active, tokens, pad_token_id)
        new_tokens[:, i] = tokens
        if stop is not None:
            cache.active &= ~torch.isin(tokens, stop)
        if i + 1 == max_new_tokens:
            break
        if stop is not None and not bool(cache.active.any()):  # the one host sync per step
            generated = i + 1
            break
        logits = model.decode_step(tokens, cache)
    new_tokens = new_tokens[:, :generated]
    return (new_tokens, torch.stack(step_logits, dim=1)) if return_logits else new_tokens
