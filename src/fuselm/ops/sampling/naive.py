"""Plain-PyTorch pieces of ``sample_tokens``: the counter-based RNG, the top-k / top-p cut-off and
the whole op as a float64 reference (the tests' reference and the CPU fallback); and
``token_logprobs_ref``, the definition of ``token_logprobs``.

The RNG, written out (all words uint32, arithmetic mod 2^32; here int64 tensors holding values in
[0, 2^32), the Triton kernel computes the same bits in uint32):

    mix32(x)       = lowbias32 (C. Wellons, hash-prospector): x ^= x >> 16; x *= 0x7FEB352D;
                     x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16           (a bijection of uint32)
    absorb(s, w)   = mix32(s ^ w)
    stream keys    key_a = absorb(absorb(absorb(absorb(STREAM_INIT_A, seed_lo), seed_hi),
                                        position_lo), position_hi); key_b likewise from
                   STREAM_INIT_B. (seed_lo/hi, position_lo/hi: the low / high 32 bits of the int64
                   two's complement.) 64 bits of key per (seed, position).
    bits of token i  h_i = mix32(mix32(key_a ^ i) ^ key_b)
    uniform          v_i = clamp(fp32(h_i) * 2^-32, 2^-33, 1 - 2^-24)   fp32(h): round to nearest
                     even; v is in (0, 1), never 0 or 1, with fp32's relative precision near 0.
    exponential      E_i = -log1p(-v_i)      (= -log(1 - v_i); small E, the race's winners, keep
                     their relative precision because v does)
    Gumbel           g_i = -log(E_i)

A draw is argmax_i (logit_i / T + g_i) over the kept tokens: the Gumbel-max trick, equivalently
the exponential race argmax_i p_i / E_i, distributed as Categorical(softmax(logits / T)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MASK32 = 0xFFFFFFFF
# lowbias32's multipliers.
MIX_MUL_1 = 0x7FEB352D
MIX_MUL_2 = 0x846CA68B
# Initial states of the two key lanes: the first two 32-bit words of pi's fraction.
STREAM_INIT_A = 0x243F6A88
STREAM_INIT_B = 0x85A308D3
# The uniform's scale and clamp (powers of two: exact in fp32).
TWO_POW_MINUS_32 = 2.0**-32
UNIFORM_MIN = 2.0**-33
UNIFORM_MAX = 1.0 - 2.0**-24  # the largest fp32 below 1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32) (int64) and a 32-bit constant, in two 16-bit halves of c
    so that no int64 product overflows (each is < 2^48)."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def mix32_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MUL_1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MUL_2)
    return x ^ (x >> 16)


def stream_keys_ref(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_a, key_b) [B] int64 in [0, 2^32) of each row's stream, from seeds and positions [B]
    int64 (their 32-bit halves absorbed low word first, seed before position)."""
    words = (seeds & MASK32, (seeds >> 32) & MASK32, positions & MASK32, (positions >> 32) & MASK32)
    keys = []
    for init in (STREAM_INIT_A, STREAM_INIT_B):
        state = torch.full_like(seeds, init)
        for word in words:
            state = mix32_ref(state ^ word)
        keys.append(state)
    return keys[0], keys[1]


def random_bits_ref(seeds: torch.Tensor, positions: torch.Tensor, n_vocab: int) -> torch.Tensor:
    """h [B, n_vocab] int64 in [0, 2^32): the 32 random bits of each (row, token)."""
    key_a, key_b = stream_keys_ref(seeds, positions)
    token = torch.arange(n_vocab, dtype=torch.int64, device=seeds.device)
    return mix32_ref(mix32_ref(key_a[:, None] ^ token) ^ key_b[:, None])


def gumbel_noise_ref(seeds: torch.Tensor, positions: torch.Tensor, n_vocab: int) -> torch.Tensor:
    """g [B, n_vocab] float64: the Gumbel noise of each (row, token), from the fp32 uniform."""
    uniform = random_bits_ref(seeds, positions, n_vocab).to(torch.float32) * TWO_POW_MINUS_32
    uniform = uniform.clamp(UNIFORM_MIN, UNIFORM_MAX).double()
    return -torch.log(-torch.log1p(-uniform))


# Prefix sums over a row run as two short scans: within chunks of this many tokens, then over the
# chunk totals. torch's scan of long rows gives each row to one thread block: at [32, 248320]
# float64 it took 460 µs on the H100, the chunked scans 62 µs (cut-off 1.59 -> 1.04 ms).
PREFIX_SUM_CHUNK = 512


def exclusive_prefix_sums(weight: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B, V]: entry r is the sum of weight[:, :r] (0 at r = 0); non-decreasing for
    non-negative weights. Static shapes: the row is shifted right by one and zero-padded to whole
    chunks, so the chunks' inclusive scans are the row's exclusive one."""
    n_rows, n_vocab = weight.shape
    n_chunks = (n_vocab + PREFIX_SUM_CHUNK) // PREFIX_SUM_CHUNK  # cdiv(V + 1, chunk)
    chunks = F.pad(weight, (1, n_chunks * PREFIX_SUM_CHUNK - n_vocab - 1)).view(n_rows, n_chunks, PREFIX_SUM_CHUNK)
    within = chunks.cumsum(dim=-1)
    before_chunk = F.pad(within[:, :-1, -1].cumsum(dim=-1), (1, 0))  # [B, n_chunks]
    return (within + before_chunk[:, :, None]).view(n_rows, -1)[:, :n_vocab]


KEYS = 1 << 16  # the values of a 16-bit float


def order_keys(logits: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2^16) of 16-bit logits, in the logits' order (equal logits, -0 and +0
    included, get equal keys): positive x -> bits + 2^15, negative x -> 2^16 - 1 - bits. The map
    ``kernels.cutoffs_of_16_bit_logits`` counts tokens by."""
    bits = (logits + 0.0).view(torch.int16).long() & (KEYS - 1)  # + 0.0 turns -0 into +0
    return torch.where(bits >= KEYS // 2, KEYS - 1 - bits, bits + KEYS // 2)


def keep_thresholds(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row cut-off [B] fp32 of top-k, then top-p, then min-p (HF's order): a row keeps token i
    iff logit_i >= its cut-off.
    The definition, by a sort of each row (``cutoffs.py`` has the faster way to the same values).

    Plain PyTorch with static shapes and no host sync. Comparisons are on the logits themselves:
    dividing by T > 0 keeps their order, and no rounding enters.

    - top-k (k in 1 .. V-1; else off): keep logit_i >= the k-th largest logit (ties with it kept).
    - top-p (p < 1; else off): with q the softmax of logits / T over the top-k-kept tokens (float64),
      keep token i iff the mass of the tokens strictly more likely than i is < p. In the sorted
      order this is HF's rule (drop a token once the mass before it reaches p), except that tokens
      tied with the last kept one are all kept (HF splits such ties by sort order). The most likely
      token is always kept (also for p <= 0).
    - min-p (``min_p`` [B] fp32, > 0; None or <= 0 off): keep tokens at least min_p times as likely
      as the most likely one, logit_i >= max + T log(min_p), the bound computed in float64 and
      rounded to fp32. The ratio to the most likely token does not change when top-k / top-p
      renormalise, so min-p after them is the larger of the two cut-offs.
    Rows with none of them get -inf. Rows with temperature 0 get a cut-off too (computed at T = 1);
    the sampler ignores it.
    """
    n_vocab = logits.shape[-1]
    ordered = logits.sort(dim=-1, descending=True).values  # [B, V], largest first
    k = top_k.long()
    k_on = (k > 0) & (k < n_vocab)
    k = torch.where(k_on, k, n_vocab)
    kth = ordered.gather(-1, (k - 1)[:, None])  # [B, 1]
    in_top_k = ordered >= kth
    # Unnormalised probabilities in sorted order, float64: exp((logit - max) / T), 0 outside top-k.
    t = torch.where(temperature > 0, temperature, 1.0).double()[:, None]
    weight = (ordered.double() - ordered[:, :1].double()).div_(t).exp_().mul_(in_top_k)  # (a new tensor for fp64 too)
    total = weight.sum(dim=-1, keepdim=True)
    mass_before = exclusive_prefix_sums(weight)
    p = top_p.double()[:, None]
    kept = in_top_k & ((mass_before < p * total) | (p >= 1))
    # ``kept`` is a prefix of the sorted row; its last entry is the smallest kept logit.
    n_kept = kept.sum(dim=-1).clamp(min=1)
    cutoff = ordered.gather(-1, (n_kept - 1)[:, None]).squeeze(-1).float()
    cutoff = torch.where(k_on | (top_p < 1), cutoff, float("-inf"))  # neither top-k nor top-p: no cut-off
    return with_min_p(cutoff, ordered[:, 0], t[:, 0], min_p)


def with_min_p(cutoff: torch.Tensor, largest: torch.Tensor, t: torch.Tensor,
               min_p: torch.Tensor | None) -> torch.Tensor:
    """Cut-offs [B] fp32 raised to min-p's where min_p > 0: fp32(largest + t log(min_p)), computed in
    float64 (``largest``: each row's largest logit; ``t``: its temperature, 1 for greedy rows)."""
    if min_p is None:
        return cutoff
    min_p = min_p.double()
    min_p_cut = (largest.double() + t * torch.log(torch.where(min_p > 0, min_p, 1.0))).float()
    return torch.where(min_p > 0, torch.maximum(cutoff, min_p_cut), cutoff)


def sample_tokens_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, *,
                      filtered: bool = True, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """ids [B] int64 as ``sample_tokens`` defines them, the arithmetic in float64.

    Greedy rows (T = 0): the first index of the largest logit. Other rows: the first index of the
    largest logit / T + g over the kept tokens (all tokens when ``filtered`` is False).
    """
    x = logits.double()
    greedy_ids = x.argmax(dim=-1)  # the first maximal index
    t = torch.where(temperature > 0, temperature, 1.0).double()[:, None]
    noisy = x / t + gumbel_noise_ref(seeds, positions, x.shape[-1])
    if filtered:
        cutoff = keep_thresholds(logits, temperature, top_k, top_p, min_p).double()[:, None]
        noisy = noisy.masked_fill(x < cutoff, float("-inf"))
    return torch.where(temperature > 0, noisy.argmax(dim=-1), greedy_ids)


PROMPT_BIT = 1 << 30  # ``apply_penalties``' counts: this bit marks a prompt token, the bits below count generations


def apply_penalties_ref(logits: torch.Tensor, counts: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                        presence: torch.Tensor, slots: torch.Tensor | None = None, bias_ids: torch.Tensor | None = None,
                        bias_values: torch.Tensor | None = None, bias_counts: torch.Tensor | None = None,
                        banned_ids: torch.Tensor | None = None, banned_until: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None) -> torch.Tensor:
    """``apply_penalties``' definition (and its CPU fallback): fp32 [n, V], each step a separate
    fp32 operation (one rounding each), in vLLM's order: the logit bias of each row's slot (its
    first ``bias_counts`` entries of ``bias_ids`` / ``bias_values``; ids outside [0, V) skipped),
    repetition over prompt and generated tokens, then frequency x count, then presence over
    generated tokens; last, -inf over each row's slot's ``banned_ids`` (ids outside [0, V) skipped)
    while ``positions[slot] < banned_until[slot]``."""
    x = logits.float().clone()
    rows = torch.arange(x.shape[0], device=x.device) if slots is None else slots
    if bias_ids is not None:
        entries = torch.arange(bias_ids.shape[1], device=x.device)
        listed = (entries[None, :] < bias_counts[rows, None]) & (bias_ids[rows] >= 0) & (bias_ids[rows] < x.shape[1])
        row_of = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(listed)
        x[row_of[listed], bias_ids[rows][listed].long()] += bias_values[rows][listed]
    count = counts[rows]
    generated = count & (PROMPT_BIT - 1)
    r = repetition[:, None]
    x = torch.where(count != 0, torch.where(x > 0, x / r, x * r), x)
    x = x - frequency[:, None] * generated.float()
    x = x - torch.where(generated > 0, presence[:, None], 0.0)
    if banned_ids is not None:
        ids = banned_ids[rows]
        banned = (positions[rows] < banned_until[rows])[:, None] & (ids >= 0) & (ids < x.shape[1])
        row_of = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(banned)
        x[row_of[banned], ids[banned]] = float("-inf")
    return x


def advance_slots_ref(ids, active, positions, remaining, stop_ids, slots=None, next_inputs=None, counts=None) -> None:
    """``advance_slots``'s contract, in place: for row i of ``ids`` [n] and its slot s (``slots[i]``,
    default i): a slot that was active counts its draw (positions[s] += 1, remaining[s] -= 1,
    counts[s, ids[i]] += 1 when ``counts`` is given and the id is in [0, V)) and
    stays active unless ids[i] is one of its ``stop_ids[s]`` (-1 pads) or remaining[s] reaches 0;
    an inactive slot keeps its counters; ``next_inputs[s] = ids[i]`` when given."""
    index = (lambda t: t[:ids.shape[0]]) if slots is None else (lambda t: t[slots])
    was_active = index(active)
    counted = was_active.to(torch.int64)
    left = index(remaining) - counted
    stopped = (ids[:, None] == index(stop_ids)).any(dim=-1) | (left <= 0)
    rows = torch.arange(ids.shape[0], device=ids.device) if slots is None else slots
    positions.index_add_(0, rows, counted)
    remaining.index_copy_(0, rows, left)
    active.index_copy_(0, rows, was_active & ~stopped)
    if next_inputs is not None:
        next_inputs.index_copy_(0, rows, ids)
    if counts is not None:
        n_vocab = counts.shape[1]
        counted_id = (counted > 0) & (ids >= 0) & (ids < n_vocab)  # (was_active may view the updated flags)
        counts.view(-1).index_add_(0, rows * n_vocab + ids.clamp(0, n_vocab - 1), counted_id.to(counts.dtype))


def token_logprobs_ref(logits: torch.Tensor, ids: torch.Tensor,
                       num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_logprobs``' definition (and its CPU fallback): with x = logits.float(),
    logprob = x[drawn] - logsumexp(x) (fp32 accumulation), rank = 1 + #{x > x[drawn]}, and
    ``torch.topk`` of x less logsumexp, min(num_top, V) of them."""
    x = logits.float()
    log_normalizer = torch.logsumexp(x, dim=-1, keepdim=True)
    drawn = x.gather(1, ids.view(-1, 1))
    rank = (x > drawn).sum(dim=-1) + 1
    top, top_ids = x.topk(min(num_top, x.shape[-1]), dim=-1)
    return (drawn - log_normalizer).view(-1), rank, top - log_normalizer, top_ids


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``apply_token_bitmask``'s definition (and its CPU fallback), in place: row ``rows[i]`` of
    ``logits`` [n, V] is -inf wherever bit v % 32 of ``bitmask[i, v // 32]`` is clear (tokens past
    32 W included); returns ``logits``."""
    n_vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :n_vocab].bool()  # [m, min(V, 32 W)]
    allowed = torch.zeros(bitmask.shape[0], n_vocab, dtype=torch.bool, device=logits.device)
    allowed[:, :bits.shape[1]] = bits
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits
