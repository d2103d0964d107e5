from fuselm.ops.sampling.bitmask import apply_token_bitmask
from fuselm.ops.sampling.cutoffs import cutoffs
from fuselm.ops.sampling.kernels import SamplingGeometry, choose_geometry
from fuselm.ops.sampling.logprobs import token_logprobs
from fuselm.ops.sampling.naive import (PROMPT_BIT, advance_slots_ref, apply_penalties_ref, apply_token_bitmask_ref,
                                       gumbel_noise_ref, keep_thresholds, random_bits_ref, sample_tokens_ref,
                                       token_logprobs_ref)
from fuselm.ops.sampling.op import advance_slots, sample_tokens
from fuselm.ops.sampling.penalties import apply_penalties

__all__ = [
    "sample_tokens", "sample_tokens_ref", "advance_slots", "advance_slots_ref", "keep_thresholds", "cutoffs",
    "random_bits_ref", "gumbel_noise_ref", "token_logprobs", "token_logprobs_ref",
    "apply_penalties", "apply_penalties_ref", "PROMPT_BIT", "apply_token_bitmask", "apply_token_bitmask_ref",
    "SamplingGeometry", "choose_geometry",
]
