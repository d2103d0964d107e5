"""``sample_tokens``: kernel == float64 reference id for id, greedy argmax and its ties, per-request
determinism, the sampled distribution, the top-k / top-p cut-offs, errors, compile, CUDA graphs.

On the CPU the kernel runs in the Triton interpreter, whose cost is per program: the statistical
tests draw many samples with the (vectorised) reference and tie the kernel to it on a subset.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from fuselm.ops.sampling import (PROMPT_BIT, apply_penalties, apply_penalties_ref, apply_token_bitmask,
                                 apply_token_bitmask_ref, cutoffs, gumbel_noise_ref,
                                 keep_thresholds, random_bits_ref, sample_tokens, sample_tokens_ref, token_logprobs,
                                 token_logprobs_ref)
from fuselm.ops.sampling.kernels import (
    _STREAM_INIT_A, _STREAM_INIT_B, _gumbel_noise, _key_of_bits, _logit_of_key, _stream_key, sample_tokens_kernel,
    split_geometry,
)
from fuselm.ops.sampling.naive import exclusive_prefix_sums
from fuselm.runtime import capture_graph

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46}


def row_params(temperature, top_k, top_p, seeds=None, positions=None, device=DEVICE):
    """The five [B] parameter tensors from per-row lists (random seeds and positions by default)."""
    n = len(temperature)
    if seeds is None:
        seeds = torch.randint(-(2**63), 2**63 - 1, (n,)).tolist()
    if positions is None:  # small and 64-bit positions
        positions = [int(p) if r % 2 else int(p) << 31 for r, p in enumerate(torch.randint(0, 2**31, (n,)))]
    return (torch.tensor(temperature, dtype=torch.float32, device=device),
            torch.tensor(top_k, dtype=torch.int32, device=device),
            torch.tensor(top_p, dtype=torch.float32, device=device),
            torch.tensor(seeds, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device))


# (temperature, top_k, top_p) per mode; rows cycle through them.
MODES = [(0.0, 0, 1.0),     # greedy
         (0.8, 0, 1.0),     # plain sampling
         (1.0, 40, 1.0),    # top-k
         (1.2, 0, 0.9),     # top-p
         (0.7, 20, 0.8),    # both
         (2.0, 0, 1.0),     # hot, flat
         (1.0, 3, 0.5)]     # both, tight


def mixed_params(n_rows, **kwargs):
    modes = [MODES[r % len(MODES)] for r in range(n_rows)]
    return row_params(*map(list, zip(*modes)), **kwargs)


def logits_like_a_model(n_rows, n_vocab, dtype=torch.float32, scale=3.0):
    """Gaussian logits with a few exact ties (a duplicated maximum and duplicated values)."""
    logits = torch.randn(n_rows, n_vocab) * scale
    logits[:, n_vocab // 2] = logits.max(dim=-1).values  # the max, twice: greedy takes the first
    logits[:, 1::97] = logits[:, :1]
    return logits.to(device=DEVICE, dtype=dtype)


# ----------------------------------------------------------------------------- kernel == reference
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_rows, n_vocab", [(1, 4099), (3, 1000), (7, 4099)])
def test_kernel_matches_reference(n_rows, n_vocab, dtype):
    logits = logits_like_a_model(n_rows, n_vocab, dtype)
    for _ in range(2):  # two draws per configuration (fresh seeds and positions)
        params = mixed_params(n_rows)
        ids = sample_tokens(logits, *params)
        assert torch.equal(ids, sample_tokens_ref(logits, *params))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_logits_view(dtype):
    """Rows of a wider buffer (row stride > V, an offset start): no copy, the same ids."""
    buffer = logits_like_a_model(5, 1100, dtype)
    logits = buffer[:, 37:1037]
    assert logits.stride(0) == 1100
    params = mixed_params(5)
    ids = sample_tokens(logits, *params)
    assert torch.equal(ids, sample_tokens(logits.contiguous(), *params))
    assert torch.equal(ids, sample_tokens_ref(logits, *params))


def test_unfiltered_path_when_no_row_filters():
    """filtered=False skips the cut-offs: the same ids when top-k / top-p are off in every row
    (k = 0, k = V, k > V, p = 1)."""
    n_vocab = 1000
    logits = logits_like_a_model(6, n_vocab)
    params = row_params([0.0, 0.9, 1.0, 1.5, 0.3, 1.0], [0, 0, n_vocab, n_vocab + 5, 0, -1], [1.0] * 6)
    ids = sample_tokens(logits, *params, filtered=False)
    assert torch.equal(ids, sample_tokens(logits, *params, filtered=True))
    assert torch.equal(ids, sample_tokens_ref(logits, *params, filtered=False))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_key_counts_give_the_cut_offs_of_the_sort(dtype):
    """16-bit logits: the cut-offs from key counts equal the sort's for top-p
    alone, top-k alone (k-th largest far down, k = V - 1), both, neither, p <= 0 (the top token),
    flat rows, -0 beside +0, ties at the k-th largest, rows spread over many key blocks, with one
    replica of the counts or several."""
    from fuselm.ops.sampling.kernels import cutoffs_of_16_bit_logits

    g = torch.Generator().manual_seed(8)
    n_rows, n_vocab = 16, 3001
    logits = torch.randn(n_rows, n_vocab, generator=g) * torch.linspace(0.5, 8, n_rows)[:, None]
    logits[0] = 0.0
    logits[1, ::2] = -0.0
    logits[2] = (logits[2] * 2).round() / 2  # heavy ties
    logits[6] = torch.randn(n_vocab, generator=g) * 1e3  # keys over many blocks
    logits = logits.to(DEVICE, dtype)
    temperature = (torch.rand(n_rows, generator=g) * 1.5 + 0.2).to(DEVICE)
    temperature[3] = 0.0
    top_k = torch.randint(0, 50, (n_rows,), generator=g).to(DEVICE, torch.int32)
    top_k[::3] = 0
    top_k[7], top_k[8], top_k[9], top_k[10] = 2000, n_vocab - 1, n_vocab, 2500
    top_p = (torch.rand(n_rows, generator=g) * 0.99 + 0.01).to(DEVICE)
    top_p[::4] = 1.0
    top_p[5] = 0.0
    top_p[10] = 1.0
    expected = keep_thresholds(logits, temperature, top_k, top_p)
    assert torch.equal(cutoffs(logits, temperature, top_k, top_p), expected)  # 2 replicas of the counts
    assert torch.equal(cutoffs_of_16_bit_logits(logits, temperature, top_k, top_p, replicas=1), expected)
    neither = (top_k == 0) & (top_p == 1)
    assert torch.equal(expected[neither], torch.full_like(expected[neither], float("-inf")))
    assert expected[5] == logits[5].max().float()  # p = 0 keeps the most likely token


@triton.jit
def _key_round_trip_kernel(bits_ptr, key_ptr, logit_ptr, n, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    key = _key_of_bits(tl.load(bits_ptr + i, mask=i < n, other=0))
    tl.store(key_ptr + i, key, mask=i < n)
    tl.store(logit_ptr + i, _logit_of_key(key, IS_BF16), mask=i < n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kernel_keys_are_the_documented_order(dtype):
    """Over all 2^16 bit patterns: the counting kernel's key of a 16-bit float is
    ``naive.order_keys``' (-0 as +0), and the key's logit is the float back (NaNs apart)."""
    from fuselm.ops.sampling.naive import order_keys

    bits = torch.arange(1 << 16, dtype=torch.int32)
    values = bits.to(torch.int16).view(dtype)
    key = torch.empty_like(bits, device=DEVICE)
    logit = torch.empty(1 << 16, dtype=torch.float32, device=DEVICE)
    _key_round_trip_kernel[(16,)](bits.to(DEVICE), key, logit, 1 << 16, IS_BF16=dtype == torch.bfloat16, BLOCK=4096)
    finite = ~values.isnan()
    assert torch.equal(key.cpu().long()[finite], order_keys(values)[finite])
    assert torch.equal(logit.cpu()[finite], values.float()[finite] + 0.0)
    assert torch.equal(logit.cpu()[finite].argsort(stable=True), key.cpu()[finite].argsort(stable=True))


def test_geometries_give_the_same_ids():
    """One split with many blocks (ids written directly), many single-block splits, ragged ends."""
    n_rows, n_vocab = 3, 4099
    logits = logits_like_a_model(n_rows, n_vocab)
    temperature, top_k, top_p, seeds, positions = mixed_params(n_rows)
    thresholds = keep_thresholds(logits, temperature, top_k, top_p)
    expected = sample_tokens_ref(logits, temperature, top_k, top_p, seeds, positions)
    for block, target_programs in [(256, 1), (128, 96), (512, 7), (4096, 3)]:
        geometry = split_geometry(n_rows, n_vocab, block, target_programs)
        ids = torch.full((n_rows,), -1, dtype=torch.int64, device=DEVICE)
        sample_tokens_kernel(logits, temperature, thresholds, seeds, positions, ids, geometry)
        assert torch.equal(ids, expected), geometry


def test_geometry_choice(monkeypatch):
    """Splits cover the vocabulary in whole blocks; a lone 248K row is spread over the GPU, a
    batch as wide as the GPU gets one split per row (ids written directly)."""
    import fuselm.ops.sampling.kernels as kernels

    monkeypatch.setattr(kernels, "num_sms", lambda device: 132)
    cuda = torch.device("cuda", 0)
    kernels.choose_geometry.cache_clear()
    cases = [(1, 248320, cuda), (32, 248320, cuda), (528, 248320, cuda), (4, 7, cuda),
             (1, 4099, torch.device("cpu")), (64, 1000, torch.device("cpu"))]
    for n_rows, n_vocab, device in cases:
        geo = kernels.choose_geometry(n_rows, n_vocab, device)
        assert geo.split_size % geo.block == 0
        assert (geo.n_splits - 1) * geo.split_size < n_vocab <= geo.n_splits * geo.split_size, geo
    assert kernels.choose_geometry(1, 248320, cuda).n_splits > 100
    assert kernels.choose_geometry(528, 248320, cuda).n_splits == 1
    kernels.choose_geometry.cache_clear()


# ----------------------------------------------------------------------------- greedy
def test_greedy_is_argmax_first_index_on_ties():
    """Ties resolve to the first index inside a lane (a block apart), across lanes, across splits."""
    n_vocab = 4099
    logits = torch.randn(7, n_vocab).to(torch.float16).to(DEVICE)  # fp16: many equal values
    logits[0, [5, 5 + 1024, 5 + 2048]] = 20.0   # the same lane of consecutive blocks
    logits[1, [701, 700 + 2048, 700]] = 20.0    # across lanes and splits
    logits[2] = 0.0                              # all equal: index 0
    logits[3, -1] = 30.0                         # the last index
    logits[4] = float("-inf")                    # one finite logit among -inf
    logits[4, 333] = -1e4
    logits[5] = float("-inf")                    # all -inf: index 0, as torch.argmax
    logits[6, [4097, 2100, 4098]] = float("inf")
    # Greedy rows ignore top-k / top-p.
    params = row_params([0.0] * 7, [0, 1, 2, 0, 5, 1, 3], [1.0, 0.1, 1.0, 0.01, 1.0, 0.5, 0.2])
    ids = sample_tokens(logits, *params)
    assert ids.tolist() == [5, 700, 0, n_vocab - 1, 333, 0, 2100]
    assert torch.equal(ids, logits.float().argmax(dim=-1))
    assert torch.equal(ids, sample_tokens(logits, *params, filtered=False))
    # Sampled rows tie only on +inf logits (x + T g = inf): the first index as well.
    params = row_params([1.0] * 7, [0] * 7, [1.0] * 7)
    assert sample_tokens(logits, *params)[6] == 2100


# ----------------------------------------------------------------------------- determinism
def test_draw_depends_only_on_seed_and_position():
    """A request gets the same id alone, in row 0 of one batch and row 2 of another, whatever the
    other rows hold; filtered or not."""
    n_vocab = 1000
    request = logits_like_a_model(1, n_vocab)[0]
    seed, position = 987654321987, 41
    for top_k in (0, 30):
        alone = sample_tokens(request[None], *row_params([1.0], [top_k], [1.0], [seed], [position]))
        batch_a = torch.stack([request, *logits_like_a_model(2, n_vocab)])
        params_a = row_params([1.0, 0.5, 0.0], [top_k, 5, 0], [1.0, 0.9, 1.0], [seed, 1, seed], [position, position, 3])
        batch_b = torch.cat([logits_like_a_model(2, n_vocab), request[None], logits_like_a_model(1, n_vocab)])
        params_b = row_params([2.0, 1.0, 1.0, 1.0], [0, 0, top_k, 7], [0.5, 1.0, 1.0, 1.0],
                              [seed, seed + 1, seed, 5], [position + 1, position, position, 0])
        ids_a, ids_b = sample_tokens(batch_a, *params_a), sample_tokens(batch_b, *params_b)
        assert ids_a[0] == alone[0] == ids_b[2]
        if top_k == 0:  # also without the filtering pass
            assert sample_tokens(batch_a, *params_a, filtered=False)[0] == alone[0]


def test_positions_and_seeds_change_the_draw():
    """Flat logits over 1000 tokens: 16 positions (or 16 seeds) of one request draw 16 tokens
    that are nearly all different (the streams are not shifted copies of each other)."""
    logits = torch.zeros(16, 1000, device=DEVICE)
    by_position = sample_tokens(logits, *row_params([1.0] * 16, [0] * 16, [1.0] * 16, [7] * 16, list(range(16))))
    by_seed = sample_tokens(logits, *row_params([1.0] * 16, [0] * 16, [1.0] * 16, list(range(16)), [0] * 16))
    assert len(set(by_position.tolist())) >= 14
    assert len(set(by_seed.tolist())) >= 14
    assert not torch.equal(by_position, by_seed)


def test_rng_is_the_documented_hash():
    """random_bits_ref against the definition in plain Python integers."""
    def mix32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    def bits(seed, position, token):
        words = [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, position & 0xFFFFFFFF, (position >> 32) & 0xFFFFFFFF]
        keys = []
        for state in (0x243F6A88, 0x85A308D3):
            for word in words:
                state = mix32(state ^ word)
            keys.append(state)
        return mix32(mix32(keys[0] ^ token) ^ keys[1])

    seeds, positions = [0, 1, -1, 2**62 + 12345], [0, 7, 2**40 + 3, 123456]
    got = random_bits_ref(torch.tensor(seeds), torch.tensor(positions), 5)
    for r, (seed, position) in enumerate(zip(seeds, positions)):
        assert got[r].tolist() == [bits(seed, position, i) for i in range(5)]


@triton.jit
def _noise_kernel(seed_ptr, position_ptr, noise_ptr, n_vocab, BLOCK: tl.constexpr):
    """noise [B, n_vocab] fp32: the sampling kernel's Gumbel noise, one program per row."""
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row)
    position = tl.load(position_ptr + row)
    key_a = _stream_key(_STREAM_INIT_A, seed, position)
    key_b = _stream_key(_STREAM_INIT_B, seed, position)
    for start in range(0, n_vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        tl.store(noise_ptr + row * n_vocab + cols, _gumbel_noise(cols, key_a, key_b), mask=cols < n_vocab)


def test_kernel_noise_matches_the_definition():
    """The kernel's fp32 Gumbel noise against the float64 definition, over 64K tokens (its tail
    included: the largest g, from the smallest v, is where fp32 precision is hardest to keep)."""
    n_rows, n_vocab = 4, 16384
    seeds = torch.tensor([0, -1, 2**62 + 5, 77], device=DEVICE)
    positions = torch.tensor([0, 1, 2**33, 12345], device=DEVICE)
    noise = torch.empty(n_rows, n_vocab, device=DEVICE)
    _noise_kernel[(n_rows,)](seeds, positions, noise, n_vocab, BLOCK=4096)
    expected = gumbel_noise_ref(seeds, positions, n_vocab)
    error = (noise.double() - expected).abs() / (1 + expected.abs())
    assert error.max() < 1e-6, error.max().item()
    assert expected.max() > 9  # the sample reaches deep into the tail (P(g > 9) ~ 1.2e-4)


def test_random_bits_are_uniform_and_uncorrelated():
    h = random_bits_ref(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096).double() / 2**32
    counts = torch.histc(h, 64, 0, 1)
    expected = h.numel() / 64
    assert ((counts - expected) ** 2 / expected).sum() < 103.4  # chi-square, 63 dof, p = 0.001
    by_position = random_bits_ref(torch.full((64,), 5), torch.arange(64), 4096).double() / 2**32
    for a, b in [(h[:-1], h[1:]), (by_position[:-1], by_position[1:]), (h[:, :-1], h[:, 1:])]:
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < 0.01


# ----------------------------------------------------------------------------- distribution
SMALL_LOGITS = [1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2]


def draw_many(n, temperature, top_k, top_p, kernel_rows=48):
    """n draws of one request at positions 0 .. n-1 (reference, vectorised); the kernel must give
    the same ids on the first ``kernel_rows``."""
    logits = torch.tensor([SMALL_LOGITS] * n, device=DEVICE)
    params = row_params([temperature] * n, [top_k] * n, [top_p] * n, [20240601] * n, list(range(n)))
    ids = sample_tokens_ref(logits, *params)
    head = [p[:kernel_rows] for p in params]
    assert torch.equal(sample_tokens(logits[:kernel_rows], *head), ids[:kernel_rows])
    return torch.bincount(ids.cpu(), minlength=len(SMALL_LOGITS)).double()


def assert_follows(counts, probs):
    """Zero counts where probs is 0; a chi-square test (p = 0.001) on the rest."""
    kept = probs > 0
    assert counts[~kept].sum() == 0, f"dropped tokens were drawn: {counts.tolist()}"
    expected = probs[kept] * counts.sum()
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum().item()
    assert chi2 < CHI2_CRITICAL[int(kept.sum()) - 1], (chi2, counts.tolist(), expected.tolist())


def test_distribution_is_softmax_over_temperature():
    probs = torch.softmax(torch.tensor(SMALL_LOGITS, dtype=torch.float64) / 0.8, dim=0)
    assert_follows(draw_many(20000, 0.8, 0, 1.0), probs)


def test_top_k_distribution():
    x = torch.tensor(SMALL_LOGITS, dtype=torch.float64)
    top3 = x >= x.topk(3).values[-1]  # tokens 5, 0, 1
    probs = torch.softmax(x.masked_fill(~top3, -math.inf), dim=0)
    assert_follows(draw_many(20000, 1.0, 3, 1.0), probs)


def test_top_p_distribution():
    x = torch.tensor(SMALL_LOGITS, dtype=torch.float64)
    full = torch.softmax(x, dim=0)
    order = full.argsort(descending=True)
    mass_before = full[order].cumsum(0) - full[order]
    kept = torch.zeros(7, dtype=torch.bool)
    kept[order[mass_before < 0.75]] = True
    assert 1 < kept.sum() < 7
    assert_follows(draw_many(20000, 1.0, 0, 0.75), torch.softmax(x.masked_fill(~kept, -math.inf), dim=0))


# ----------------------------------------------------------------------------- cut-offs
def kept_by_definition(x, temperature, top_k, top_p):
    """The keep mask of one row, by the definition (O(V^2), float64): top-k keeps a token when
    fewer than k tokens are strictly larger; top-p when the top-k distribution's mass of the
    strictly more likely tokens is < p."""
    x = x.double()
    n = x.numel()
    strictly_larger = x[None, :] > x[:, None]  # [i, j]: x_j > x_i
    keep = strictly_larger.sum(1) < top_k if 0 < top_k < n else torch.ones(n, dtype=torch.bool)
    if top_p < 1:
        q = torch.softmax((x / temperature).masked_fill(~keep, -math.inf), dim=0)
        mass_above = (strictly_larger * q[None, :]).sum(1)
        keep &= mass_above < top_p
    return keep


def test_cutoffs_match_the_definition():
    gen = torch.Generator().manual_seed(5)
    n_rows, n_vocab = 300, 12
    # Values on a coarse grid: many ties, at the k-th value and at the top-p boundary.
    logits = (torch.randint(0, 6, (n_rows, n_vocab), generator=gen) * 0.5).to(DEVICE)
    temperature = (torch.rand(n_rows, generator=gen) * 2 + 0.2).tolist()
    top_k = torch.randint(0, n_vocab + 2, (n_rows,), generator=gen).tolist()
    top_p = torch.rand(n_rows, generator=gen).clamp(0.05, 1.0).tolist()
    top_p = [1.0 if r % 5 == 0 else p for r, p in enumerate(top_p)]
    params = row_params(temperature, top_k, top_p)
    thresholds = keep_thresholds(logits, *params[:3])
    for r in range(n_rows):
        expected = kept_by_definition(logits[r].cpu(), temperature[r], top_k[r], torch.tensor(top_p[r]).item())
        assert torch.equal((logits[r] >= thresholds[r]).cpu(), expected), r


def test_min_p_cutoffs_match_the_definition():
    """min-p after top-k and top-p (HF's order): a token is kept when top-k / top-p keep it and it
    is at least min_p times as likely as the most likely token (float64 definition); the 16-bit
    key counts give the sort's cut-offs with min-p too; min_p 0 changes nothing, 1 keeps the
    maximum's ties."""
    from fuselm.ops.sampling.kernels import cutoffs_of_16_bit_logits

    gen = torch.Generator().manual_seed(9)
    n_rows, n_vocab = 120, 12
    logits = (torch.randint(0, 8, (n_rows, n_vocab), generator=gen) * 0.25).to(DEVICE)
    temperature = (torch.rand(n_rows, generator=gen) * 2 + 0.2).tolist()
    top_k = [0 if r % 3 else int(k) for r, k in enumerate(torch.randint(1, n_vocab, (n_rows,), generator=gen))]
    top_p = [1.0 if r % 4 else float(p) for r, p in enumerate(torch.rand(n_rows, generator=gen).clamp(0.05, 1.0))]
    min_p = torch.rand(n_rows, generator=gen) ** 2
    min_p[::5], min_p[1::7] = 0.0, 1.0
    params = row_params(temperature, top_k, top_p)
    thresholds = keep_thresholds(logits, *params[:3], min_p.to(DEVICE))
    for r in range(n_rows):
        x = logits[r].cpu().double()
        expected = kept_by_definition(logits[r].cpu(), temperature[r], top_k[r], torch.tensor(top_p[r]).item())
        if min_p[r] > 0:
            expected &= torch.exp((x - x.max()) / temperature[r]) >= min_p[r].double()
        assert torch.equal((logits[r] >= thresholds[r]).cpu(), expected), r
    unset = keep_thresholds(logits, *params[:3])
    assert torch.equal(thresholds[min_p == 0], unset[min_p == 0])
    for dtype in (torch.bfloat16, torch.float16):
        x16 = (torch.randn(8, 1001, generator=gen) * 3).to(DEVICE, dtype)
        p16 = row_params([0.0, 0.7, 1.3, 2.0] * 2, [0, 20, 0, 5] * 2, [1.0, 0.9, 0.5, 1.0] * 2)
        m16 = torch.tensor([0.0, 0.05, 0.2, 0.9, 1.0, 1e-6, 0.5, 0.01], device=DEVICE)
        expected = keep_thresholds(x16, *p16[:3], m16)
        assert torch.equal(cutoffs(x16, *p16[:3], m16), expected)
        assert torch.equal(cutoffs_of_16_bit_logits(x16, *p16[:3], m16, replicas=1), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_top_k_cut_offs_equal_the_sort(dtype):
    """``max_top_k``: cut-offs from the K largest logits equal the sort's for rows with top-k in
    [1, K] (top-p, min-p on or off), rows with only min-p, rows with nothing; ties with the k-th
    value past the K candidates (a row of 300 equal values) are counted in."""
    from fuselm.ops.sampling.cutoffs import small_top_k_thresholds

    gen = torch.Generator().manual_seed(11)
    n_rows, n_vocab, K = 64, 700, 16
    logits = (torch.randint(0, 40, (n_rows, n_vocab), generator=gen) * 0.25).to(DEVICE, dtype)
    logits[3, :300] = logits[3].max()  # 300 ties at the top: every top-k value is the max
    logits[4, :] = 1.0
    temperature = (torch.rand(n_rows, generator=gen) * 2 + 0.2).tolist()
    top_k = [int(k) for k in torch.randint(1, K + 1, (n_rows,), generator=gen)]
    top_p = [float(p) for p in torch.rand(n_rows, generator=gen).clamp(0.02, 1.0)]
    for r in range(0, n_rows, 8):  # nothing, and min-p alone
        top_k[r], top_p[r] = 0, 1.0
    params = row_params(temperature, top_k, top_p)
    min_p = torch.where(torch.rand(n_rows, generator=gen) < 0.5, torch.rand(n_rows, generator=gen), 0.0).to(DEVICE)
    min_p[::16] = 0.0
    for m in (None, min_p):
        expected = keep_thresholds(logits, *params[:3], m)
        assert torch.equal(small_top_k_thresholds(logits, *params[:3], m, K), expected)
        assert torch.equal(cutoffs(logits, *params[:3], m, max_top_k=K), expected)
    ids = sample_tokens(logits.float(), *params, min_p=min_p, max_top_k=K)
    assert torch.equal(ids, sample_tokens_ref(logits.float(), *params, min_p=min_p))
    with pytest.raises(ValueError, match="max_top_k"):
        sample_tokens(logits.float(), *params, max_top_k=0)


def test_min_p_distribution_and_kernel_ids():
    """min_p 0.3 at T 1 keeps the tokens with p >= 0.3 p_max; the kernel draws the reference's
    ids with min-p on (fp32 logits: the sort's cut-offs; bf16: the key counts')."""
    x = torch.tensor(SMALL_LOGITS, dtype=torch.float64)
    kept = torch.exp(x - x.max()) >= 0.3
    assert 1 < kept.sum() < 7
    n = 20000
    logits = torch.tensor([SMALL_LOGITS] * n, device=DEVICE)
    params = row_params([1.0] * n, [0] * n, [1.0] * n, [7] * n, list(range(n)))
    min_p = torch.full((n,), 0.3, device=DEVICE)
    ids = sample_tokens_ref(logits, *params, min_p=min_p)
    assert_follows(torch.bincount(ids.cpu(), minlength=7).double(), torch.softmax(x.masked_fill(~kept, -math.inf), 0))
    for dtype in (torch.float32, torch.bfloat16):
        rows = logits_like_a_model(6, 4099, dtype)
        mixed = mixed_params(6)
        row_min_p = torch.tensor([0.0, 0.1, 0.02, 0.5, 0.0, 0.9], device=DEVICE)
        got = sample_tokens(rows, *mixed, min_p=row_min_p)
        assert torch.equal(got, sample_tokens_ref(rows, *mixed, min_p=row_min_p))


@pytest.mark.parametrize("fill", [float("nan"), float("-inf"), float("inf")])
def test_rows_of_nan_or_inf_draw_ids_in_range(fill):
    """A row of NaNs (or of infinities) draws an id in [0, V), over one split or several, greedy,
    sampled and filtered: never an index past the vocabulary (the next step's embedding read)."""
    n_vocab = 5000
    logits = logits_like_a_model(7, n_vocab)
    logits[1:4] = fill
    logits[5, ::2] = fill
    params = mixed_params(7)
    for geometry in (split_geometry(7, n_vocab, 1024, 7), split_geometry(7, n_vocab, 1024, 70)):
        for thresholds in (None, cutoffs(logits, *params[:3])):
            ids = torch.empty(7, dtype=torch.int64, device=DEVICE)
            sample_tokens_kernel(logits, params[0], thresholds, params[3], params[4], ids, geometry)
            assert ((ids >= 0) & (ids < n_vocab)).all(), ids
    ids = sample_tokens(logits, *params)
    assert ((ids >= 0) & (ids < n_vocab)).all(), ids


@pytest.mark.parametrize("n_vocab", [1, 511, 512, 1000, 4099])
def test_exclusive_prefix_sums(n_vocab):
    """The chunked scan equals a plain one, at and around chunk boundaries, and never decreases."""
    weight = torch.rand(3, n_vocab, dtype=torch.float64, device=DEVICE)
    got = exclusive_prefix_sums(weight)
    expected = torch.cat([torch.zeros(3, 1, dtype=torch.float64, device=DEVICE), weight.cumsum(-1)[:, :-1]], dim=1)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert (got.diff(dim=-1) >= 0).all()


def draws_over_positions(logits_row, temperature, top_k, top_p, n=48):
    logits = torch.tensor([logits_row] * n, device=DEVICE)
    params = row_params([temperature] * n, [top_k] * n, [top_p] * n, [11] * n, list(range(n)))
    ids = sample_tokens(logits, *params)
    assert torch.equal(ids, sample_tokens_ref(logits, *params))
    return set(ids.tolist())


def test_top_p_edge_cases():
    row = [0.0, 0.3, -0.2, 0.1, 0.05, -0.1, 0.2]
    # top_p = 1 keeps every token: at a high temperature all 7 appear.
    assert draws_over_positions(row, 50.0, 0, 1.0) == set(range(7))
    # A tiny top_p keeps only the most likely token, whatever the temperature.
    assert draws_over_positions(row, 50.0, 0, 1e-6) == {1}
    # Ties at the cut-off are kept together: q = (0.4, 0.4, 0.2), p = 0.3. HF's sorted rule would
    # keep one of the tied pair (which one depends on the sort); here both, and never token 2.
    tied = [math.log(0.4), math.log(0.4), math.log(0.2)]
    assert draws_over_positions(tied, 1.0, 0, 0.3) == {0, 1}
    # top-k ties with the k-th largest are kept: k = 2 keeps 0 and the three 1.0s.
    assert draws_over_positions([3.0, 1.0, 1.0, 1.0, 0.0], 20.0, 2, 1.0) == {0, 1, 2, 3}


# ----------------------------------------------------------------------------- API
def test_out_buffer_is_fully_written():
    logits = logits_like_a_model(7, 1000)
    params = mixed_params(7)
    out = torch.full((7,), -1, dtype=torch.int64, device=DEVICE)
    ids = sample_tokens(logits, *params, out=out)
    assert ids is out and (out >= 0).all() and (out < 1000).all()
    assert torch.equal(out, sample_tokens(logits, *params))


def test_empty_batch():
    ids = sample_tokens(torch.empty(0, 50, device=DEVICE), *row_params([], [], [], [], []))
    assert ids.shape == (0,) and ids.dtype == torch.int64


def _args(n_rows=2, n_vocab=8, **replace):
    args = dict(zip(("logits", "temperature", "top_k", "top_p", "seeds", "positions"),
                    (torch.randn(n_rows, n_vocab, device=DEVICE), *mixed_params(n_rows))))
    args.update(replace)
    return args


def _f32(*shape):
    return torch.ones(*shape, device=DEVICE)


@pytest.mark.parametrize("replace, error, match", [
    (dict(logits=_f32(8)), ValueError, r"logits: expected \[B, V\]"),
    (dict(logits=_f32(2, 8).long()), TypeError, "logits: dtype int64"),
    (dict(logits=_f32(2, 0)), ValueError, "logits: the vocabulary dim"),
    (dict(logits=_f32(8, 2).t()), ValueError, "logits: the last dim must be contiguous"),
    (dict(temperature=_f32(2).double()), TypeError, "temperature: dtype float64"),
    (dict(temperature=_f32(3)), ValueError, r"temperature: expected shape \(2,\)"),
    (dict(temperature=_f32(4)[::2]), ValueError, "temperature: must be contiguous"),
    (dict(top_k=_f32(2).long()), TypeError, "top_k: dtype int64"),
    (dict(top_p=_f32(2, 1)), ValueError, "top_p: expected shape"),
    (dict(seeds=_f32(2).int()), TypeError, "seeds: dtype int32"),
    (dict(positions=_f32(1).long()), ValueError, "positions: expected shape"),
    (dict(seeds=[1, 2]), TypeError, "seeds: expected a torch.Tensor"),
    (dict(filtered=1), TypeError, "filtered: expected a bool"),
    (dict(out=_f32(2).int()), TypeError, "out: dtype int32"),
    (dict(out=_f32(3).long()), ValueError, r"out: expected shape \(2,\)"),
    (dict(out=_f32(4).long()[::2]), ValueError, "out: must be contiguous"),
    (dict(positions=torch.zeros(2, dtype=torch.int64, device="meta")), ValueError, "one device: .*positions on meta"),
])
def test_bad_input_names_the_argument(replace, error, match):
    args = _args()
    keywords = {name: replace.pop(name) for name in ("filtered", "out") if name in replace}
    args.update(replace)
    with pytest.raises(error, match=match):
        sample_tokens(*args.values(), **keywords)


def test_cpu_without_interpreter_uses_reference(monkeypatch):
    import fuselm.ops.sampling.op as op

    args = _args(3, 300)
    logits, params = args["logits"].cpu(), [t.cpu() for t in list(args.values())[1:]]
    expected = sample_tokens(logits, *params)
    monkeypatch.setattr(op, "use_triton", lambda t: False)
    assert torch.equal(sample_tokens(logits, *params), expected)


def test_opcheck():
    """Schema, fake implementation and AOT dispatch of the custom op."""
    args = _args(3, 40)
    torch.library.opcheck(torch.ops.fuselm.sample_tokens, (*args.values(), True))
    torch.library.opcheck(torch.ops.fuselm.sample_tokens, (*args.values(), False))
    bf16 = _args(3, 40, logits=torch.randn(3, 40, device=DEVICE).bfloat16())  # the key-count cut-offs
    torch.library.opcheck(torch.ops.fuselm.sample_tokens, (*bf16.values(), True))
    min_p = torch.tensor([0.0, 0.1, 0.5], device=DEVICE)
    torch.library.opcheck(torch.ops.fuselm.sample_tokens, (*bf16.values(), True, min_p))


def test_compile_fullgraph():
    def step(logits, temperature, top_k, top_p, seeds, positions, out):
        scaled = logits * 2.0  # something around the op, in the same graph
        return sample_tokens(scaled, temperature, top_k, top_p, seeds, positions, out=out), positions + 1

    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    args = _args(3, 200)
    out = torch.empty(3, dtype=torch.int64, device=DEVICE)
    ids, next_positions = compiled(*args.values(), out)
    assert torch.equal(ids, step(*args.values(), None)[0])
    assert torch.equal(next_positions, args["positions"] + 1)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("n_rows", [1, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_full_vocabulary_on_gpu(n_rows, dtype):
    """Qwen3.5's vocabulary: kernel == reference, filtered and not."""
    n_vocab = 248320
    logits = logits_like_a_model(n_rows, n_vocab, dtype, scale=2.5)
    params = mixed_params(n_rows)
    assert torch.equal(sample_tokens(logits, *params), sample_tokens_ref(logits, *params))
    unfiltered = (params[0], torch.zeros_like(params[1]), torch.ones_like(params[2]), *params[3:])
    assert torch.equal(sample_tokens(logits, *unfiltered, filtered=False), sample_tokens_ref(logits, *unfiltered))
    # Qwen3.5's generation_config: top-k 20 and top-p 0.95 together
    qwen = (torch.full((n_rows,), 0.6, device=DEVICE), torch.full((n_rows,), 20, dtype=torch.int32, device=DEVICE),
            torch.full((n_rows,), 0.95, device=DEVICE), *params[3:])
    assert torch.equal(sample_tokens(logits, *qwen), sample_tokens_ref(logits, *qwen))
    min_p = torch.linspace(0.0, 0.3, n_rows, device=DEVICE)
    assert torch.equal(sample_tokens(logits, *params, min_p=min_p), sample_tokens_ref(logits, *params, min_p=min_p))
    nan = logits.clone()
    nan[::2] = float("nan")
    assert ((sample_tokens(nan, *params) >= 0) & (sample_tokens(nan, *params) < n_vocab)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("filtered", [True, False])
def test_cuda_graph_replay_with_new_parameters(filtered):
    """One captured graph; every replay after new logits and parameters are copied into its
    static inputs gives the eager ids."""
    n_rows, n_vocab = 8, 248320
    static = [logits_like_a_model(n_rows, n_vocab, torch.bfloat16), *mixed_params(n_rows)]
    out = torch.empty(n_rows, dtype=torch.int64, device=DEVICE)
    graph, _ = capture_graph(lambda: sample_tokens(*static, filtered=filtered, out=out))
    for replay in range(3):
        fresh = [logits_like_a_model(n_rows, n_vocab, torch.bfloat16), *mixed_params(n_rows)]
        if not filtered:
            fresh[2].zero_()
            fresh[3].fill_(1.0)
        fresh[1][replay] = 0.0  # a different row is greedy each time
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        assert torch.equal(out, sample_tokens(*fresh, filtered=filtered))
        assert torch.equal(out, sample_tokens_ref(*fresh, filtered=filtered))


# ----------------------------------------------------------------------------- advance_slots
def slot_counters(S=7, stops=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    active = torch.tensor([True, True, False, True, True, True, False])[:S]
    positions = torch.randint(0, 50, (S,), generator=g)
    remaining = torch.tensor([5, 1, 4, 3, 2, 9, 1])[:S]
    stop_ids = torch.full((S, stops), -1, dtype=torch.int64)
    stop_ids[0, :2] = torch.tensor([11, 12])
    stop_ids[3, 0] = 13
    stop_ids[4] = torch.tensor([7, 8, 9])
    return [t.to(DEVICE) for t in (active, positions, remaining, stop_ids)]


@pytest.mark.parametrize("with_slots", [False, True])
@pytest.mark.parametrize("with_next", [False, True])
def test_advance_slots_equals_the_reference(monkeypatch, with_slots, with_next):
    """Stops by id (rows 0: its second stop id; 3: not its stop id), by the last allowed token (1),
    inactive slots untouched (2, 6), with the first n slots or listed slots, several programs."""
    from fuselm.ops.sampling import advance_slots, advance_slots_ref
    from fuselm.ops.sampling import op as sampling_op
    monkeypatch.setattr(sampling_op, "ADVANCE_ROWS", 2)
    ids = torch.tensor([12, 40, 11, 14, 9, 3], device=DEVICE)
    slots = torch.tensor([0, 1, 2, 3, 4, 6], device=DEVICE)[torch.tensor([5, 1, 0, 3, 2, 4])] if with_slots else None
    got = slot_counters()
    want = [t.clone() for t in got]
    next_got = torch.full((7,), -5, dtype=torch.int64, device=DEVICE) if with_next else None
    next_want = None if next_got is None else next_got.clone()
    # the penalties' counts: random, a prompt bit here and there, with the next_inputs case only
    counts_got = ((torch.randint(0, 3, (7, 41)) + PROMPT_BIT * torch.randint(0, 2, (7, 41))).int().to(DEVICE)
                  if with_next else None)
    counts_want = None if counts_got is None else counts_got.clone()
    advance_slots(ids, *got, slots=slots, next_inputs=next_got, counts=counts_got)
    advance_slots_ref(ids, *want, slots=slots, next_inputs=next_want, counts=counts_want)
    for name, a, b in zip(("active", "positions", "remaining", "stop_ids"), got, want):
        assert torch.equal(a, b), name
    if with_next:
        assert torch.equal(next_got, next_want)
        assert torch.equal(counts_got, counts_want)
    if not with_slots:  # spelled out
        active, positions, remaining, _ = got
        start = slot_counters()
        assert active.tolist() == [False, False, False, True, False, True, False]  # 4: 9 is a stop id
        assert torch.equal(positions - start[1], torch.tensor([1, 1, 0, 1, 1, 1, 0], device=DEVICE))
        assert remaining.tolist() == [4, 0, 4, 2, 1, 8, 1]
        if with_next:
            assert next_got.tolist() == [12, 40, 11, 14, 9, 3, -5]


def test_advance_slots_counts_the_drawn_ids_of_active_slots():
    """counts[slot, id] += 1 for each active slot's draw (the prompt bit kept); inactive slots and
    ids outside [0, V) count nothing."""
    from fuselm.ops.sampling import advance_slots
    active, positions, remaining, stop_ids = slot_counters()
    counts = torch.zeros(7, 13, dtype=torch.int32, device=DEVICE)
    counts[0, 12] = PROMPT_BIT + 2
    ids = torch.tensor([12, 5, 11, 13, 5, 3], device=DEVICE)  # 13: outside V = 13
    advance_slots(ids, active, positions, remaining, stop_ids, counts=counts)
    expected = torch.zeros(7, 13, dtype=torch.int32)
    expected[0, 12] = PROMPT_BIT + 3
    expected[1, 5] = 1
    expected[4, 5] = 1
    expected[5, 3] = 1  # slot 2 is inactive, slot 3's id 13 is out of range
    assert torch.equal(counts.cpu(), expected)


def test_advance_slots_without_rows_or_stop_ids():
    """No rows: nothing changes. Stop ids of width 0: only the last allowed token stops a slot."""
    from fuselm.ops.sampling import advance_slots
    counters = slot_counters()
    start = [t.clone() for t in counters]
    advance_slots(torch.zeros(0, dtype=torch.int64, device=DEVICE), *counters)
    assert all(torch.equal(a, b) for a, b in zip(counters, start))
    active, positions, remaining, _ = counters
    advance_slots(torch.tensor([12, 40, 11], device=DEVICE), active, positions, remaining,
                  torch.zeros(7, 0, dtype=torch.int64, device=DEVICE))
    assert active.tolist() == [True, False, False, True, True, True, False]  # slot 1 drew its last token
    assert remaining.tolist() == [4, 0, 4, 3, 2, 9, 1]


@pytest.mark.parametrize("change,match", [
    (lambda a: {**a, "ids": a["ids"].int()}, "ids"),
    (lambda a: {**a, "ids": torch.zeros(8, dtype=torch.int64, device=DEVICE)}, "ids: expected"),
    (lambda a: {**a, "remaining": a["remaining"][:5]}, "remaining: expected"),
    (lambda a: {**a, "stop_ids": a["stop_ids"][:, 0]}, "stop_ids: expected"),
    (lambda a: {**a, "slots": torch.zeros(2, dtype=torch.int64, device=DEVICE)}, "slots: expected"),
    (lambda a: {**a, "next_inputs": torch.zeros(3, dtype=torch.int64, device=DEVICE)}, "next_inputs: expected"),
])
def test_advance_slots_bad_input(change, match):
    from fuselm.ops.sampling import advance_slots
    active, positions, remaining, stop_ids = slot_counters()
    args = change(dict(ids=torch.tensor([1, 2, 3], device=DEVICE), active=active, positions=positions,
                       remaining=remaining, stop_ids=stop_ids))
    with pytest.raises((TypeError, ValueError), match=match):
        advance_slots(**args)


# ----------------------------------------------------------------------------- token_logprobs
def check_token_logprobs(logits, ids, num_top, atol=1e-5):
    """token_logprobs against float64: the drawn ids' log_softmax of the logits upcast to fp32, their
    rank (1 + the logits strictly above), the k most likely in descending order (ties to the lower
    id), k = min(num_top, V); the reference too."""
    k = min(num_top, logits.shape[1])
    x = logits.double()
    exact = x.log_softmax(-1)
    expected_rank = [1 + int((row > row[i]).sum()) for row, i in zip(x.cpu(), ids.tolist())]
    order = sorted(range(x.shape[1]), key=lambda i: i)  # ties to the lower id: a stable sort by value
    for op in (token_logprobs, token_logprobs_ref):
        logprob, rank, top, top_ids = op(logits, ids, num_top)
        assert logprob.dtype == top.dtype == torch.float32 and rank.dtype == top_ids.dtype == torch.int64
        assert top.shape == top_ids.shape == (logits.shape[0], k)
        torch.testing.assert_close(logprob.double(), exact.gather(1, ids[:, None])[:, 0], rtol=0, atol=atol)
        assert rank.tolist() == expected_rank
        torch.testing.assert_close(top.double(), exact.topk(k, -1).values, rtol=0, atol=atol)
        torch.testing.assert_close(exact.gather(1, top_ids), top.double(), rtol=0, atol=atol)
        if op is token_logprobs:  # the kernel's ties: the lower id first
            for row, ids_row in zip(x.cpu(), top_ids.tolist()):
                stable = sorted(order, key=lambda i: -row[i].item())[:k]
                assert ids_row == stable


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_vocab, num_top", [(37, 5), (37, 0), (37, 37), (37, 50), (5000, 20), (1, 3)])
def test_token_logprobs_are_the_float64_log_softmax(dtype, n_vocab, num_top):
    logits = logits_like_a_model(3, n_vocab, dtype)
    ids = torch.tensor([0, n_vocab - 1, n_vocab // 2], device=DEVICE)
    check_token_logprobs(logits, ids, num_top)


def test_token_logprobs_over_splits_with_ties_across_them(monkeypatch):
    """Several splits a row (a small split block): ties of the drawn logit and of the top values
    in different splits, a strided view of wider rows."""
    import fuselm.ops.sampling.logprobs as logprobs

    monkeypatch.setattr(logprobs, "SPLIT_BLOCK", 16)
    wide = logits_like_a_model(4, 64)
    logits = wide[:, :53]  # 4 splits of 16, the last of 5; row stride 64
    logits[0, 3] = logits[0, 40] = logits[0, 50] = logits[0].max() + 1
    logits[1, 7] = logits[1, 30] = logits[1].min() - 1  # the drawn one tied with another, in the last place
    ids = torch.tensor([40, 30, 52, 0], device=DEVICE)
    check_token_logprobs(logits, ids, 6)
    assert token_logprobs(logits, ids, 6)[1][:2].tolist() == [1, 52]


def test_token_logprobs_of_rows_with_nan_or_inf_stay_in_range(monkeypatch):
    """A row of NaNs or of -infs (a model that overflowed) gives values that mean nothing but ids in
    [0, V), and leaves the other rows exact: nothing is read out of range (compute-sanitizer on the
    GPU)."""
    import fuselm.ops.sampling.logprobs as logprobs

    monkeypatch.setattr(logprobs, "SPLIT_BLOCK", 16)
    logits = logits_like_a_model(4, 37)
    logits[1] = float("nan")
    logits[2, 5:] = float("-inf")  # 5 finite logits, 8 asked for
    ids = torch.tensor([3, 0, 1, 36], device=DEVICE)
    logprob, rank, top, top_ids = token_logprobs(logits, ids, 8)
    assert ((top_ids >= 0) & (top_ids < 37)).all() and (rank >= 1).all()
    check_token_logprobs(logits[[0, 3]], ids[[0, 3]], 8)
    torch.testing.assert_close(logprob[[0, 3]], token_logprobs(logits[[0, 3]], ids[[0, 3]], 8)[0])
    assert top_ids[2, :5].tolist() == logits[2, :5].float().argsort(descending=True, stable=True).tolist()


def test_token_logprobs_of_an_empty_batch_and_bad_input():
    logprob, rank, top, top_ids = token_logprobs(torch.empty(0, 9, device=DEVICE), torch.empty(0, dtype=torch.int64,
                                                                                              device=DEVICE), 3)
    assert logprob.shape == rank.shape == (0,) and top.shape == top_ids.shape == (0, 3)
    logits, ids = torch.randn(2, 9, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)
    for args, error, match in [((logits[0], ids, 1), ValueError, r"logits: expected \[B, V\]"),
                               ((logits.long(), ids, 1), TypeError, "logits: dtype int64"),
                               ((torch.ones(9, 2, device=DEVICE).t(), ids, 1), ValueError, "last dim must be contig"),
                               ((logits, ids.int(), 1), TypeError, "ids: dtype int32"),
                               ((logits, ids[:1], 1), ValueError, r"ids: expected a contiguous \(2,\)"),
                               ((logits, ids, -1), ValueError, "num_top: expected an int >= 0"),
                               ((logits, ids, True), ValueError, "num_top"),
                               ((logits, ids.to("meta"), 1), ValueError, "one device")]:
        with pytest.raises(error, match=match):
            token_logprobs(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("n_rows", [1, 32])
def test_token_logprobs_at_the_full_vocabulary_on_gpu(n_rows):
    logits = logits_like_a_model(n_rows, 248320, torch.bfloat16, scale=2.5)
    ids = torch.randint(0, 248320, (n_rows,), device=DEVICE)
    check_token_logprobs(logits, ids, 20, atol=2e-5)


# ----------------------------------------------------------------------------- apply_penalties
def penalty_case(n_rows, n_vocab, n_slots, dtype, seed=0):
    """Logits, counts (generated counts up to 3, prompt bits), per-row penalties (row 0 neutral)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n_rows, n_vocab, generator=g) * 4).to(DEVICE, dtype)
    counts = torch.randint(0, 4, (n_slots, n_vocab), generator=g) * (torch.rand(n_slots, n_vocab, generator=g) < 0.3)
    counts = (counts + PROMPT_BIT * (torch.rand(n_slots, n_vocab, generator=g) < 0.2)).int().to(DEVICE)
    repetition = (torch.rand(n_rows, generator=g) * 1.5 + 0.5).to(DEVICE)
    frequency = (torch.rand(n_rows, generator=g) * 4 - 2).to(DEVICE)
    presence = (torch.rand(n_rows, generator=g) * 4 - 2).to(DEVICE)
    repetition[0], frequency[0], presence[0] = 1.0, 0.0, 0.0
    return logits, counts, repetition, frequency, presence


def logit_bias_case(n_slots, n_vocab, width=6, seed=0):
    """Per slot: distinct biased ids (a count of 0 to width entries in use, an id past V, stale
    entries past the count), biases in [-100, 100]."""
    g = torch.Generator().manual_seed(seed)
    width = min(width, n_vocab + 2)
    ids = torch.stack([torch.randperm(n_vocab + 2, generator=g)[:width] for _ in range(n_slots)]).int()
    values = (torch.rand(n_slots, width, generator=g) * 200 - 100)
    counts = torch.randint(0, width + 1, (n_slots,), generator=g).int()
    counts[0] = 0
    return ids.to(DEVICE), values.to(DEVICE), counts.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_vocab", [1, 37, 5000])
@pytest.mark.parametrize("with_slots", [False, True])
def test_apply_penalties_equals_the_reference_to_the_bit(dtype, n_vocab, with_slots):
    logits, counts, repetition, frequency, presence = penalty_case(5, n_vocab, 7, dtype)
    slots = torch.tensor([6, 0, 3, 2, 5], device=DEVICE) if with_slots else None
    out = torch.full((5, n_vocab), float("nan"), device=DEVICE)  # poisoned: every entry written
    got = apply_penalties(logits, counts, repetition, frequency, presence, slots, out=out)
    assert got is out
    expected = apply_penalties_ref(logits, counts, repetition, frequency, presence, slots)
    assert torch.equal(got, expected)
    assert torch.equal(got[0], logits[0].float())  # neutral row: the logits, whatever its counts
    bias = logit_bias_case(7, n_vocab)
    biased = apply_penalties(logits, counts, repetition, frequency, presence, slots, bias_ids=bias[0],
                             bias_values=bias[1], bias_counts=bias[2])
    assert torch.equal(biased, apply_penalties_ref(logits, counts, repetition, frequency, presence, slots, *bias))
    assert n_vocab == 1 or not torch.equal(biased, got)  # some listed id is in range and in use


def ban_case(n_slots, n_vocab, seed=0):
    """Per slot: banned ids (-1 pads, an id past V, repeats), positions and ban lengths (some slots
    under their ban, some past it, some without one)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, n_vocab + 1, (n_slots, 8), generator=g)
    positions = torch.randint(0, 6, (n_slots,), generator=g)
    until = torch.randint(0, 6, (n_slots,), generator=g)
    return ids.to(DEVICE), until.to(DEVICE), positions.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_banned_tokens_are_minus_inf_while_under_the_ban(dtype, with_bias):
    """min_tokens' ban: a slot's banned ids come out -inf while its position is under its ban
    length, whatever their bias (the ban is the last write), and are otherwise untouched; the
    kernel equals the reference to the bit, with and without slots."""
    n_vocab = 37
    logits, counts, repetition, frequency, presence = penalty_case(5, n_vocab, 7, dtype)
    bias = logit_bias_case(7, n_vocab) if with_bias else (None, None, None)
    ban = ban_case(7, n_vocab)
    ban[0][2, :3] = torch.tensor([4, 4, 9])  # slot 2: a repeated id, and banned now
    ban[1][2], ban[2][2] = 3, 2
    if with_bias:
        bias[0][2, 0], bias[2][2] = 4, 1  # banned and biased: -inf wins
    for slots in (None, torch.tensor([6, 0, 2, 3, 5], device=DEVICE)):
        rows = torch.arange(5, device=DEVICE) if slots is None else slots
        got = apply_penalties(logits, counts, repetition, frequency, presence, slots, bias_ids=bias[0],
                              bias_values=bias[1], bias_counts=bias[2], banned_ids=ban[0], banned_until=ban[1],
                              positions=ban[2])
        expected = apply_penalties_ref(logits, counts, repetition, frequency, presence, slots, *bias, *ban)
        assert torch.equal(got, expected)
        free = apply_penalties(logits, counts, repetition, frequency, presence, slots, bias_ids=bias[0],
                               bias_values=bias[1], bias_counts=bias[2])
        for row, slot in enumerate(rows.tolist()):
            banned = {t for t in ban[0][slot].tolist() if 0 <= t < n_vocab} if ban[2][slot] < ban[1][slot] else set()
            minus_inf = {t for t in range(n_vocab) if got[row, t] == float("-inf")}
            assert minus_inf == banned, (row, slot)
            kept = [t for t in range(n_vocab) if t not in banned]
            assert torch.equal(got[row, kept], free[row, kept])
        assert got[2, 4] == float("-inf")  # row 2: slot 2 either way, banned now
    assert bool((ban[2] < ban[1]).any()) and bool((ban[2] >= ban[1]).any())  # both cases occur


def test_logit_bias_is_added_before_the_penalties():
    """vLLM's order: a biased token is penalised with its bias in (repetition divides x + b)."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]], device=DEVICE)
    counts = torch.tensor([[PROMPT_BIT, 1, 0, 0]], dtype=torch.int32, device=DEVICE)
    r, f, p = (torch.tensor([v], device=DEVICE) for v in (2.0, 0.5, 0.25))
    ids = torch.tensor([[0, 1, 3, -1]], dtype=torch.int32, device=DEVICE)
    values = torch.tensor([[4.0, -3.0, 0.0, 9.0]], device=DEVICE)
    got = apply_penalties(logits, counts, r, f, p, bias_ids=ids, bias_values=values,
                          bias_counts=torch.tensor([3], dtype=torch.int32, device=DEVICE))
    # token 0: (2 + 4) / 2; token 1: (-1 - 3) * 2 - 0.5 - 0.25; token 2: untouched; token 3: bias 0
    assert got.cpu().tolist() == [[3.0, -8.75, 0.5, 3.0]]


def test_apply_penalties_follow_the_definition():
    """Element by element in float64 (vLLM's formulas), on a strided view of the logits: the
    repetition penalty on prompt or generated tokens, divided when positive, multiplied when not;
    frequency per generated occurrence; presence once."""
    buffer = torch.randn(3, 60, device=DEVICE) * 3
    logits = buffer[:, 5:45]
    counts = torch.zeros(4, 40, dtype=torch.int32, device=DEVICE)
    counts[1, :10] = torch.arange(10, dtype=torch.int32)
    counts[1, 5:15:2] += PROMPT_BIT
    counts[3, 20:30] = 2
    counts[0, :] = PROMPT_BIT + 1  # row slots never read slot 0
    slots = torch.tensor([1, 3, 2], device=DEVICE)
    r, f, p = (torch.tensor(v, device=DEVICE) for v in ([1.3, 0.8, 2.0], [0.5, -0.25, 1.0], [1.5, 0.75, -1.0]))
    got = apply_penalties(logits, counts, r, f, p, slots).cpu().double()
    for row in range(3):
        for v in range(40):
            x = float(logits[row, v])
            c = int(counts[slots[row], v])
            generated, in_prompt = c % PROMPT_BIT, c >= PROMPT_BIT
            if generated or in_prompt:
                x = x / float(r[row]) if x > 0 else x * float(r[row])
            x = x - float(f[row]) * generated - (float(p[row]) if generated else 0.0)
            assert got[row, v] == pytest.approx(x, rel=1e-6, abs=1e-6), (row, v)


def test_apply_penalties_bad_input_names_the_argument():
    logits, counts, repetition, frequency, presence = penalty_case(3, 20, 4, torch.float32)
    ok = dict(logits=logits, counts=counts, repetition=repetition, frequency=frequency, presence=presence)
    bias = logit_bias_case(4, 20)
    cases = [({"counts": counts.long()}, "counts"), ({"counts": counts[:, :10]}, "counts"),
             ({"bias_ids": bias[0]}, "all three"), ({"bias_ids": bias[0].long(), "bias_values": bias[1],
                                                    "bias_counts": bias[2]}, "bias_ids"),
             ({"bias_ids": bias[0], "bias_values": bias[1][:, :3], "bias_counts": bias[2]}, "bias_values"),
             ({"bias_ids": bias[0], "bias_values": bias[1], "bias_counts": bias[2][:3]}, "bias_counts"),
             ({"frequency": frequency[:2]}, "frequency"), ({"presence": presence.double()}, "presence"),
             ({"logits": logits[:, ::2]}, "logits"), ({"slots": torch.zeros(2, dtype=torch.int64, device=DEVICE)},
                                                      "slots"),
             ({"logits": torch.randn(5, 20, device=DEVICE), "repetition": torch.ones(5, device=DEVICE),
               "frequency": torch.zeros(5, device=DEVICE), "presence": torch.zeros(5, device=DEVICE)}, "logits"),
             ({"out": torch.empty(3, 20, dtype=torch.float16, device=DEVICE)}, "out")]
    for change, name in cases:
        with pytest.raises((ValueError, TypeError), match=name):
            apply_penalties(**{**ok, **change})
    assert apply_penalties(logits[:0], counts, repetition[:0], frequency[:0], presence[:0]).shape == (0, 20)


@pytest.mark.gpu
@pytest.mark.parametrize("n_rows", [1, 32])
def test_apply_penalties_at_the_full_vocabulary_on_gpu(n_rows):
    """Qwen3.5's vocabulary, bf16 logits, rows on permuted slots: the kernel equals the reference
    to the bit (no fused multiply-adds), and in a CUDA graph with new values."""
    logits, counts, repetition, frequency, presence = penalty_case(n_rows, 248320, 48, torch.bfloat16)
    slots = torch.randperm(48, device=DEVICE)[:n_rows]
    expected = apply_penalties_ref(logits, counts, repetition, frequency, presence, slots)
    assert torch.equal(apply_penalties(logits, counts, repetition, frequency, presence, slots), expected)
    bias = logit_bias_case(48, 248320, width=300)
    assert torch.equal(apply_penalties(logits, counts, repetition, frequency, presence, slots, bias_ids=bias[0],
                                       bias_values=bias[1], bias_counts=bias[2]),
                       apply_penalties_ref(logits, counts, repetition, frequency, presence, slots, *bias))
    ban = ban_case(48, 248320)
    ban[0][:, 0] = bias[0][:, 0].long()  # banned and biased: the ban's -inf is the last write
    for with_bias in (bias, (None, None, None)):
        assert torch.equal(apply_penalties(logits, counts, repetition, frequency, presence, slots,
                                           bias_ids=with_bias[0], bias_values=with_bias[1], bias_counts=with_bias[2],
                                           banned_ids=ban[0], banned_until=ban[1], positions=ban[2]),
                           apply_penalties_ref(logits, counts, repetition, frequency, presence, slots, *with_bias,
                                               *ban))
    out = torch.empty(n_rows, 248320, device=DEVICE)
    graph, _ = capture_graph(lambda: apply_penalties(logits, counts, repetition, frequency, presence, slots, out=out))
    fresh = penalty_case(n_rows, 248320, 48, torch.bfloat16, seed=1)
    for static, new in zip((logits, counts, repetition, frequency, presence), fresh):
        static.copy_(new)
    graph.replay()
    assert torch.equal(out, apply_penalties_ref(logits, counts, repetition, frequency, presence, slots))


# ==================================================================================== token bitmasks
def bitmask_case(n_rows, n_vocab, n_masks, n_words, dtype, seed=0, device=DEVICE):
    """Random logits [n_rows, V], random int32 words [n_masks, n_words] (every bit pattern, the
    sign bit included) and distinct rows [n_masks]."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_rows, n_vocab, generator=generator).to(dtype).to(device)
    words = torch.randint(-2**31, 2**31, (n_masks, n_words), generator=generator, dtype=torch.int64)
    rows = torch.randperm(n_rows, generator=generator)[:n_masks]
    return logits, words.to(torch.int32).to(device), rows.to(device)


def allowed_by_definition(words: torch.Tensor, n_vocab: int) -> torch.Tensor:
    """[m, V] bools, token by token from the words as Python ints: bit v % 32 of word v // 32."""
    rows = []
    for row in words.tolist():
        rows.append([v // 32 < len(row) and bool((row[v // 32] >> (v % 32)) & 1) for v in range(n_vocab)])
    return torch.tensor(rows, dtype=torch.bool)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_vocab, n_words", [(77, 3), (77, 2), (4099, 129), (33, 1)])
def test_apply_token_bitmask_equals_the_definition(dtype, n_vocab, n_words):
    """Masked rows are -inf exactly where their words do not allow the token (tokens past the
    words included), every other value and row untouched; the kernel equals the reference."""
    logits, words, rows = bitmask_case(5, n_vocab, 3, n_words, dtype)
    before = logits.clone()
    result = apply_token_bitmask(logits, words, rows)
    assert result is logits
    expected = before.clone()
    expected[rows.cpu()] = before[rows.cpu()].masked_fill(~allowed_by_definition(words.cpu(), n_vocab).to(DEVICE),
                                                          float("-inf"))
    assert torch.equal(logits, expected)
    assert torch.equal(apply_token_bitmask_ref(before.clone(), words, rows), expected)
    assert torch.equal(apply_token_bitmask(before.clone(), words[:0], rows[:0]), before)  # no masks: untouched


def test_apply_token_bitmask_bad_input_names_the_argument():
    logits, words, rows = bitmask_case(4, 40, 2, 2, torch.float32)
    with pytest.raises(TypeError, match="bitmask"):
        apply_token_bitmask(logits, words.long(), rows)
    with pytest.raises(TypeError, match="rows"):
        apply_token_bitmask(logits, words, rows.int())
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask(logits, words, rows[:1])
    with pytest.raises(ValueError, match="logits"):
        apply_token_bitmask(logits[:, ::2], words, rows)
    with pytest.raises(TypeError, match="logits"):
        apply_token_bitmask(logits.int(), words, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("n_masks", [1, 32])
def test_apply_token_bitmask_at_the_full_vocabulary_on_gpu(n_masks):
    """Qwen3.5's vocabulary, bf16 logits of 32 rows: the kernel equals the reference, also in a
    CUDA graph with new masks."""
    logits, words, rows = bitmask_case(32, 248320, n_masks, 7760, torch.bfloat16)
    expected = apply_token_bitmask_ref(logits.clone(), words, rows)
    assert torch.equal(apply_token_bitmask(logits.clone(), words, rows), expected)
    static = logits.clone()
    graph, _ = capture_graph(lambda: apply_token_bitmask(static, words, rows))
    fresh_logits, fresh_words, _ = bitmask_case(32, 248320, n_masks, 7760, torch.bfloat16, seed=1)
    static.copy_(fresh_logits)
    words.copy_(fresh_words)
    graph.replay()
    assert torch.equal(static, apply_token_bitmask_ref(fresh_logits.clone(), fresh_words, rows))
