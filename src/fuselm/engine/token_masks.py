"""Token masks: the tokens a draw may not take, as the engine hands them to the runner.

Two kinds, applied at different points (vLLM's order):
- a request's grammar (structured outputs, ``engine.structured_outputs``) is the distribution the
  model samples from: it masks the logits before anything reads them, so the token logprobs are
  those of the masked distribution (vLLM masks the logits with its grammar bitmask in the model
  runner, before its sampler computes logprobs);
- ``SamplingParams.allowed_token_ids`` and ``bad_words`` limit the draw only: the logprobs are
  the raw distribution's (vLLM's sampler computes them before it applies these two).

A bitmask row is ceil(V / 32) int32 words: token v may be drawn when bit v % 32 of word v // 32
is set (``fuselm.ops.sampling.apply_token_bitmask``'s layout, llguidance's and xgrammar's).

Bad words follow vLLM's definition: each word is encoded as it reads at the start of the text and,
when that gives a different first token and as many tokens, as it reads after a space
(``bad_words_token_ids``); a word's last token is banned whenever the tokens generated so far
end with the ones before it (a one-token word: always). Only generated tokens count, never the
prompt's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from fuselm.runtime import cdiv


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return cdiv(vocab_size, 32)


@dataclass
class TokenMasks:
    """One draw's masks, by row of its logits: ``grammar`` [len(grammar_rows), W] int32 words (the
    distribution: logprobs see them) and ``bans`` [len(ban_rows), W] (the draw only). With
    ``raw_logprobs`` some banned row's request asks for logprobs: the runner keeps the logits from
    before the bans for them."""

    grammar_rows: list[int]
    grammar: torch.Tensor
    ban_rows: list[int]
    bans: torch.Tensor
    raw_logprobs: bool = False


def _bits(token_ids) -> tuple[np.ndarray, np.ndarray]:
    """(word index, bit as a uint32) of each token id."""
    ids = np.asarray(token_ids, dtype=np.int64)
    return ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32))


def allowed_bitmask(token_ids: Iterable[int], vocab_size: int) -> torch.Tensor:
    """A bitmask row [ceil(vocab_size / 32)] int32 that allows ``token_ids`` (ints in [0,
    vocab_size)) and nothing else."""
    words = np.zeros(bitmask_words(vocab_size), dtype=np.uint32)
    np.bitwise_or.at(words, *_bits(list(token_ids)))
    return torch.from_numpy(words.view(np.int32))


def bad_words_token_ids(words: Sequence[str], tokenizer) -> list[tuple[int, ...]]:
    """The token sequences ``words`` stand for (module docstring), encoded without special tokens;
    ValueError naming ``bad_words`` for a word that encodes to nothing."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        at_start = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not at_start:
            raise ValueError(f"bad_words: {word!r:.100} encodes to no token")
        sequences.append(at_start)
        after_space = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if after_space and after_space[0] != at_start[0] and len(after_space) == len(at_start):
            sequences.append(after_space)
    return sequences


def banned_by_bad_words(sequences: Sequence[tuple[int, ...]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens ``sequences`` ban at the next draw after ``output_token_ids``: the last token of
    each sequence whose other tokens end the output."""
    banned = []
    for sequence in sequences:
        prefix = len(sequence) - 1
        if prefix > len(output_token_ids):
            continue
        if prefix == 0 or tuple(output_token_ids[-prefix:]) == sequence[:-1]:
            banned.append(sequence[-1])
    return banned


def fill_bans(row: torch.Tensor, allowed: torch.Tensor | None, banned: Sequence[int]) -> None:
    """Write into ``row`` (a contiguous CPU bitmask row, in place) the tokens ``allowed`` allows
    (None: all) less the ``banned`` ones."""
    if allowed is None:
        row.fill_(-1)
    else:
        row.copy_(allowed)
    if len(banned):
        words, bits = _bits(banned)
        np.bitwise_and.at(row.numpy().view(np.uint32), words, ~bits)
