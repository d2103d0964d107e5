"""Qwen3.5 text model (Hugging Face ``Qwen3_5ForCausalLM``, transformers >= 5.2) on fuselm kernels.

Architecture (HF ``transformers/models/qwen3_5/modeling_qwen3_5.py``):
    h = embed(ids)
    per layer:  h = h + mixer(norm1(h));  h = h + mlp(norm2(h))
    logits = lm_head(norm(h))
- every decoder norm is zero-centered RMSNorm, ``x_normed * (1 + w)`` (``Qwen3_5RMSNorm``),
  here ``add_rms_norm(..., offset=1.0)`` fused with the residual add before it;
- ``mixer`` is, per ``config.layer_types``, a Gated DeltaNet (``linear_attention``) or gated
  full attention (``full_attention``); ``mlp`` is SwiGLU through ``swiglu_mlp`` (``layers.py``).

The model computes logits; it knows nothing of generation loops, sampling or requests (those are
``fuselm.engine``'s). Its API: ``model(ids)`` (logits for every position), and the cache-based
pair the engine drives: ``prefill_step`` (one prompt chunk per row into cache slots),
``decode_step`` (one token for each slot of a row -> slot table, default every slot) and
``mixed_step`` (both in one pass over the weights), all CUDA-graph safe; ``prefill`` is the
checked, chunking front of ``prefill_step`` for direct use.

Numerics: fp32 everywhere reproduces HF to summation order (the tests hold 1e-3 absolute on the
logits; measured <= 1.1e-5 on the tiny test model). In bf16/fp16 every op rounds where HF's eager
op rounds (``swiglu_mlp`` included: its gate/up products are rounded before the activation, as
HF's projections are); the fused projections are single GEMMs over concatenated weights (same
products, per-column results as HF's separate GEMMs up to the BLAS's blocking), and the Gated
DeltaNet kernels round at fla-core's points with their own fp32/tf32 sums (the one bf16
difference from HF that matters: benchmarks/results/<gpu>/README.md, "Where the gap comes from").

Cache and batching (``Qwen35Cache``): slot r holds one request's state (its attention K/V in the
pages its block-table row names). Prompts of different lengths are RIGHT-padded
(``attention_mask`` rows are ones then zeros): every row's tokens sit at positions 0 .. n_r - 1,
so a row's next position is its length. Slots with ``cache.active`` False write no state in
``decode_step``.

Not implemented (HF has them): RoPE scaling types other than "default" (Qwen3.5 ships
"default"); multimodal (vision) inputs and the 3-D M-RoPE positions they need (text-only
positions make M-RoPE plain RoPE: all three position rows are equal); training.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fuselm.models.qwen35.cache import PAGE_SIZE, Qwen35Cache
from fuselm.models.qwen35.config import Qwen35Config
from fuselm.models.qwen35.layers import (DecodeStep, DecoderLayer, PrefillStep, TakeTensor, _assign, _param, linear,
                                         prefixed, rotary_inv_freq)
from fuselm.ops.decode_inputs import decode_inputs, rotary_table
from fuselm.ops.rms_norm import add_rms_norm, rms_norm
from fuselm.runtime import check_positive_int, side_stream


class Qwen35(nn.Module):
    """Qwen3.5 causal LM for inference. Build it with :meth:`from_hf` or :meth:`from_pretrained`
    (a bare ``Qwen35(config)`` holds meta tensors until weights are loaded).

    - ``model(input_ids, attention_mask=None)`` -> logits [B, T, vocab] (no cache kept);
    - ``cache = model.new_cache(max_batch, max_len)``;
      ``model.prefill(input_ids, cache, attention_mask, slots)`` -> last-token logits [B, vocab];
      ``model.prefill_step(ids, cache, slots, starts, lengths)`` -> the same for one chunk per row
      (device tensors only, CUDA-graph-safe);
      ``model.decode_step(token_ids, cache, slots=None)`` -> logits [B, vocab] of the B slots of a
      row -> slot table (default every slot) (CUDA-graph-safe);
      ``model.mixed_step(token_ids, cache, ids, slots, starts, lengths, decode_slots=None)`` -> both
      at once;
    - ``model.generate(input_ids, max_new_tokens, ...)``: HF-style convenience over the engine.
    """

    moe = False  # Qwen35Moe: sparse MoE MLPs

    def __init__(self, config: Qwen35Config):
        if config.is_moe != self.moe:
            raise ValueError(f"config: {'an MoE' if config.is_moe else 'a dense'} config (num_experts = "
                             f"{config.num_experts}) needs {'Qwen35Moe' if config.is_moe else 'Qwen35'} "
                             f"(Qwen35.for_config picks it)")
        super().__init__()
        self.config = config
        self.embed_tokens = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, t) for t in config.layer_types)
        self.norm = _param(config.hidden_size)
        self.lm_head = None if config.tie_word_embeddings else _param(config.vocab_size, config.hidden_size)
        # fp32 always (a plain attribute, so ``model.to(dtype)`` cannot round it); follows the device.
        self.inv_freq = rotary_inv_freq(config)

    @staticmethod
    def for_config(config: Qwen35Config) -> "Qwen35":
        """A bare model (meta weights) of ``config``'s class: ``Qwen35Moe`` for an MoE config."""
        return (Qwen35Moe if config.is_moe else Qwen35)(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def new_cache(self, max_batch: int, max_len: int, num_pages: int | None = None,
                  page_size: int = PAGE_SIZE, state_dtype: torch.dtype | str = torch.float32) -> Qwen35Cache:
        """A cache of ``max_batch`` slots of ``max_len`` tokens each (prompt + generated); every
        slot starts inactive. Attention K/V in ``num_pages`` pages of ``page_size`` tokens
        (default: every slot's max_len, slot r owning its own; ``Qwen35Cache.allocate``); the Gated
        DeltaNet states in ``state_dtype`` (fp32: HF's numerics; bf16 halves a decode step's state
        traffic, as vLLM keeps it by default)."""
        check_positive_int("max_len", max_len)
        if self.inv_freq.device != self.device:
            self.inv_freq = self.inv_freq.to(self.device)
        rotary = rotary_table(max_len, self.inv_freq, self.dtype)  # every step's cos / sin rows
        return Qwen35Cache.allocate(self.config, max_batch, max_len, self.dtype, self.device, rotary, num_pages,
                                    page_size, state_dtype)

    # ------------------------------------------------------------------------ HF weights
    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of an HF ``Qwen3_5ForCausalLM`` state dict and its shape."""
        c = self.config
        shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
        if self.lm_head is not None:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        for i, layer in enumerate(self.layers):
            shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.hf_shapes().items()})
        return shapes

    def load_hf(self, take: TakeTensor) -> None:
        _assign(self, "embed_tokens", take("model.embed_tokens.weight"))
        _assign(self, "norm", take("model.norm.weight"))
        if self.lm_head is not None:
            _assign(self, "lm_head", take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            layer.load_hf(prefixed(take, f"model.layers.{i}."))

    @classmethod
    def from_hf(cls, hf_model: nn.Module, dtype: torch.dtype | None = None, device=None) -> "Qwen35":
        """From a live HF ``Qwen3_5ForCausalLM`` (or ``Qwen3_5ForConditionalGeneration``: its
        text model); dtype and device default to the HF model's. Weights are re-laid once."""
        from fuselm.models.qwen35.weights import load_from_hf_model

        return load_from_hf_model(hf_model, dtype, device)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | str | None = None, device=None,
                        progress: bool = False) -> "Qwen35":
        """From a local checkpoint directory (``fuselm.models.qwen35.weights.load_checkpoint``):
        ``config.json`` (causal LM or the vision-language wrapper) and sharded ``*.safetensors``,
        read tensor by tensor straight to ``device`` in ``dtype`` (default: the checkpoint's)."""
        from fuselm.models.qwen35.weights import load_checkpoint

        return load_checkpoint(path, dtype, device, progress=progress)

    # ------------------------------------------------------------------------ the layer stack
    def _layers(self, x: torch.Tensor, mix) -> torch.Tensor:
        """The decoder stack on embeddings x [B, T, D]; ``mix(mixer, normed, layer_index)`` runs a
        token mixer. Each residual add is fused with the norm after it: ``add_rms_norm`` rounds
        s = x + residual to the model dtype (as HF's ``residual + hidden_states``) and normalises
        that rounded s (fp32 statistics, zero-centered weight, one rounding). Returns the final
        normed hidden states."""
        eps = self.config.rms_norm_eps
        residual = x
        normed = rms_norm(x, self.layers[0].input_norm, eps, 1.0)
        for i, layer in enumerate(self.layers):
            normed, residual = add_rms_norm(mix(layer.mixer, normed, i), residual, layer.post_attention_norm, eps, 1.0)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            normed, residual = add_rms_norm(layer.mlp(normed), residual, next_norm, eps, 1.0)
        return normed

    def _prefill_inputs(self, input_ids: torch.Tensor, cache: Qwen35Cache, slots: torch.Tensor,
                        starts: torch.Tensor, lengths: torch.Tensor, fresh: bool):
        """Embeddings [B, T, D] and the ``PrefillStep`` of B rows' next T (right-padded) prompt
        tokens into cache slots ``slots`` [B] after the ``starts`` [B] tokens each already has
        there; ``lengths`` [B] real tokens per row (device tensors; ``fresh``: host-known
        ``starts == 0``)."""
        T = input_ids.shape[1]
        positions = starts[:, None] + torch.arange(T, device=input_ids.device)
        token_mask = positions < (starts + lengths)[:, None]
        input_ids = input_ids.masked_fill(~token_mask, 0)  # padding ids may be anything
        # each position's cos / sin: rows of the cache's table, as the decode steps read them (the
        # same bits); padding past max_len reads the last row (its values reach no real token)
        rotary = cache.rotary[positions.clamp(max=cache.max_len - 1)]  # [B, T, 2, R]
        pages = cache.block_table[slots]
        # positions past the block-table row (only padding gets there) write to the scratch page
        write_page, write_column = cache.kv_write_targets(positions, pages,
                                                          positions < cache.pages_per_slot * cache.page_size)
        # a padding row repeats an earlier row's slot: it must not write that slot's recurrent state
        rows = torch.arange(slots.shape[0], device=slots.device)
        first_with_slot = (slots[:, None] == slots[None, :]).to(torch.int8).argmax(dim=1) == rows
        step = PrefillStep(slots, torch.where(first_with_slot, slots, -1), starts, starts > 0, lengths, token_mask,
                           positions, fresh, pages, write_page, write_column, cos=rotary[:, :, None, 0],
                           sin=rotary[:, :, None, 1])
        return F.embedding(input_ids, self.embed_tokens), step

    def _decode_inputs(self, token_ids: torch.Tensor, cache: Qwen35Cache, slots: torch.Tensor | None):
        """Embeddings [B, 1, D] and the ``DecodeStep`` of one token for each of the B cache slots
        ``slots`` (default: every slot, in order) at its position ``cache.lengths[slot]``;
        ``token_ids`` [max_batch]: each slot's token."""
        if token_ids.shape != (cache.max_batch,):  # metadata only: no sync
            raise ValueError(f"token_ids: expected [max_batch] = ({cache.max_batch},), got {tuple(token_ids.shape)}")
        # one launch; inactive rows write to the scratch page (an index with no branch) and attend to nothing
        x, cos, sin, write_page, write_column, kv_lengths, state_slots, positions, pages = decode_inputs(
            token_ids, cache.lengths, cache.active, cache.slots if slots is None else slots, cache.block_table,
            self.embed_tokens, cache.rotary, page_size=cache.page_size, scratch_page=cache.num_pages)
        step = DecodeStep(
            cos=cos[:, None, None], sin=sin[:, None, None], write_page=write_page, write_column=write_column,
            kv_lengths=kv_lengths, block_table=pages, state_slots=state_slots, positions=positions)
        return x[:, None], step

    @staticmethod
    def _advance(cache: Qwen35Cache, slots: torch.Tensor | None, step: DecodeStep) -> None:
        """The decoded slots' lengths += 1 where active (kv_lengths > 0)."""
        if slots is None:
            cache.lengths.add_(cache.active)  # bool promotes: one kernel
        else:
            cache.lengths.index_add_(0, slots, step.kv_lengths.clamp(max=1))

    def _prefill(self, input_ids: torch.Tensor, cache: Qwen35Cache, slots: torch.Tensor, starts: torch.Tensor,
                 lengths: torch.Tensor, fresh: bool) -> torch.Tensor:
        """Prefill (see ``_prefill_inputs``); returns the final normed hidden states [B, T, D]; sets
        the slots' lengths to starts + lengths and marks them active. Other slots are untouched.
        No host sync, static shapes (CUDA-graph safe)."""
        x, step = self._prefill_inputs(input_ids, cache, slots, starts, lengths, fresh)
        hidden = self._layers(x, lambda mixer, x, i: mixer.prefill(x, cache.layers[i], step))
        cache.lengths.index_copy_(0, slots, starts + lengths)
        cache.active.index_fill_(0, slots, True)
        return hidden

    # ------------------------------------------------------------------------ public entry points
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] in the model dtype for every position (HF ``Qwen3_5ForCausalLM``
        logits). ``attention_mask`` [B, T]: 1 for real tokens, 0 for right padding; logits at
        padded positions are not meaningful."""
        return F.linear(self.hidden_states(input_ids, attention_mask), self.lm_head_weight)

    @torch.no_grad()
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The final normed hidden states [B, T, D] that ``forward``'s logits come from (the LM head
        left to the caller: e.g. a few positions at a time over a long prompt), in a cache of its
        own."""
        lengths = self.check_prompt(input_ids, attention_mask)
        B, T = input_ids.shape
        cache = self.new_cache(B, T)
        slots = torch.arange(B, device=self.device)
        lengths = torch.tensor(lengths, device=self.device)
        return self._prefill(input_ids, cache, slots, torch.zeros_like(slots), lengths, True)

    @torch.no_grad()
    def prefill_step(self, input_ids: torch.Tensor, cache: Qwen35Cache, slots: torch.Tensor, starts: torch.Tensor,
                     lengths: torch.Tensor, fresh: bool = False) -> torch.Tensor:
        """One prompt chunk per row, CUDA-graph safe (the engine's prefill graphs hold it):
        ``input_ids`` [B, T] right-padded, row r's ``lengths[r]`` (>= 1) real tokens continue slot
        ``slots[r]`` after its ``starts[r]`` cached tokens; ``fresh``: every start is 0 (a cheaper
        attention; the result is the same). Returns the logits of each row's last real token
        [B, vocab]; the slots become active at starts + lengths. No checks but metadata: the
        caller keeps ids in the vocabulary, slots distinct (or a repeated row identical: it writes
        the same values), and starts + lengths <= cache.max_len."""
        hidden = self._prefill(input_ids, cache, slots, starts, lengths, fresh)
        return F.linear(self._last_tokens(hidden, lengths), self.lm_head_weight)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: Qwen35Cache, attention_mask: torch.Tensor | None = None,
                slots: Sequence[int] | torch.Tensor | None = None, chunk_size: int | None = None,
                start: int = 0) -> torch.Tensor:
        """Start B fresh requests: row i of the right-padded prompts (``attention_mask`` as in
        :meth:`forward`) goes into cache slot ``slots[i]`` (default: slots 0 .. B-1), which
        becomes active at the prompt's length. Other slots are untouched: requests already
        decoding in them go on. Returns the logits of each row's last real token [B, vocab].

        ``chunk_size``: process the prompts ``chunk_size`` tokens at a time (each chunk continues
        from the GDN recurrent and conv state and the K/V its earlier chunks left in the cache;
        rows whose prompt has ended drop out), which bounds one call's work and temporaries.
        ``start``: the slots already hold the first ``start`` tokens of these prompts (an earlier
        call's), and ``input_ids`` are the tokens after them: a prompt prefilled over several calls
        (a server interleaving a long prompt with decode steps). Either way the result is the
        one-call one up to summation order. Host-side checks and lengths (not graph-captured:
        :meth:`prefill_step` is)."""
        lengths = self.check_prompt(input_ids, attention_mask)
        B = input_ids.shape[0]
        slots = self._check_slots(cache, B, slots)
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ValueError(f"start: expected an int >= 0, got {start!r}")
        self.check_cache(cache, start + max(lengths), 0)
        longest = max(lengths)
        if chunk_size is None:
            chunk_size = longest
        elif not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected None or an int >= 1, got {chunk_size!r}")
        logits = torch.empty(B, self.config.vocab_size, dtype=self.dtype, device=self.device)
        for offset in range(0, longest, chunk_size):
            rows = [r for r in range(B) if lengths[r] > offset]
            chunk_lengths = [min(chunk_size, lengths[r] - offset) for r in rows]
            index = torch.tensor(rows, device=self.device)
            chunk = input_ids[index, offset:offset + max(chunk_lengths)]
            starts = torch.full((len(rows),), start + offset, device=self.device)
            chunk_logits = self.prefill_step(chunk, cache, slots[index], starts,
                                             torch.tensor(chunk_lengths, device=self.device), start + offset == 0)
            ending = [i for i, r in enumerate(rows) if lengths[r] <= offset + chunk_size]  # last chunk of these rows
            if ending:
                picked = torch.tensor(ending, device=self.device)
                logits[index[picked]] = chunk_logits[picked]
        return logits

    @torch.no_grad()
    def decode_step(self, token_ids: torch.Tensor, cache: Qwen35Cache,
                    slots: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each cache slot in ``slots`` [B] (int64, distinct, in [0, max_batch); the
        decode batch's row -> slot table; default: every slot, row = slot), at its position
        ``cache.lengths[slot]``; ``token_ids`` [max_batch] int64: each slot's token. Returns
        logits [B, vocab], row n slot ``slots[n]``'s, and advances the active ones' lengths by
        one. The state is read and written where it lies (the recurrent and conv pools, the K/V
        pages through each slot's block-table row): a batch of any slots, with nothing moved.

        CUDA-graph-safe: no host sync, no data-dependent shape (its temporaries have fixed shapes, so
        a graph's private memory pool serves them on replay); its inputs are ``token_ids``,
        ``slots`` and the cache tensors (``lengths``, ``active`` and the per-layer state), all
        updated in place. Inactive slots write no recurrent or conv state and put their K/V in
        the scratch page; their logits are meaningless. The caller keeps every active slot's
        length < ``cache.max_len`` and its block-table row holding its positions.
        """
        x, step = self._decode_inputs(token_ids, cache, slots)
        hidden = self._layers(x, lambda mixer, x, i: mixer.decode(x, cache.layers[i], step))
        self._advance(cache, slots, step)
        return linear(hidden[:, 0], self.lm_head_weight)  # batch 1: the vector kernel, after the norm's start

    @torch.no_grad()
    def mixed_step(self, token_ids: torch.Tensor, cache: Qwen35Cache, input_ids: torch.Tensor, slots: torch.Tensor,
                   starts: torch.Tensor, lengths: torch.Tensor, fresh: bool = False,
                   decode_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step of the b cache slots ``decode_slots`` (``token_ids`` [max_batch], as
        :meth:`decode_step`) and a prompt chunk per row (``input_ids`` [R, T] into ``slots``, as
        :meth:`prefill_step`) in one pass, as vLLM's mixed batches: their b + R T tokens share the
        norms, the token mixers' input projections, the MLP GEMMs and the LM head (most of the
        weight bytes: read once for both), and each half goes through its own token mixing
        (decode kernels; chunked prefill; on CUDA the chunk's on a high-priority side stream beside
        the decode rows', ``runtime.side_stream``) before one output projection for all. Returns
        (decode logits [b, vocab], the logits of each prefill row's last real token [R, vocab]).

        Decode rows advance as in :meth:`decode_step`; the prefill slots get lengths
        starts + lengths but keep their ``active`` flag (they must be inactive in the decode half,
        if among ``decode_slots``: the caller activates a slot once its whole prompt is in). Same
        results as the two calls up to the GEMMs' summation order (inactive rows' logits,
        meaningless, apart). CUDA-graph safe, no host sync."""
        decode_x, decode = self._decode_inputs(token_ids, cache, decode_slots)
        b = decode_x.shape[0]
        prefill_x, prefill = self._prefill_inputs(input_ids, cache, slots, starts, lengths, fresh)
        R, T = input_ids.shape

        side = side_stream(self.device)
        main = torch.cuda.current_stream(self.device) if side is not None else None

        def mix(mixer, x, i):  # x [b + R T, 1, D]: the decode rows, then the prompt tokens
            projected = mixer.project(x)  # one input-projection GEMM for both halves
            heads = projected.new_empty(b + R * T, 1, mixer.heads_dim)  # both halves' outputs, one buffer
            # The halves' token mixing write disjoint slots and rows of ``heads`` (both write padding
            # into the scratch page, never read; an inactive decode row's read of its slot while the
            # chunk fills it gives logits nobody reads): on CUDA the prompt chunk's (short,
            # latency-bound kernels: a few programs a head) runs on a side stream beside the decode
            # rows' (bandwidth-bound: the recurrent states), joined before out_proj. Each half gates
            # its own rows (the chunk's: its GDN output kernel, or a prologue launch after its
            # attention; the decode rows': a prologue launch after the GDN step kernel, or
            # attention's split-K combine), so only the plain GEMM follows the join.
            if side is not None:
                side.wait_stream(main)
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                mixer.prefill_heads(projected[b:].view(R, T, -1), cache.layers[i], prefill,
                                    out=heads[b:].view(R, T, -1))
            mixer.decode_heads(projected[:b], cache.layers[i], decode, out=heads[:b], gated=True)
            if side is not None:
                main.wait_stream(side)
            return mixer.project_out(heads)  # one GEMM

        hidden = self._layers(torch.cat([decode_x, prefill_x.view(R * T, 1, -1)]), mix)
        self._advance(cache, decode_slots, decode)
        cache.lengths.index_copy_(0, slots, starts + lengths)
        last = self._last_tokens(hidden[b:, 0].view(R, T, -1), lengths)
        logits = F.linear(torch.cat([hidden[:b, 0], last]), self.lm_head_weight)  # one LM-head GEMM
        return logits[:b], logits[b:]

    @staticmethod
    def _last_tokens(hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Each row's last real token of right-padded hidden states [B, T, D] -> [B, D]."""
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs):
        """HF-style convenience: ``fuselm.engine.reference.generate(self, input_ids, max_new_tokens,
        **kwargs)`` (the engine's eager loop; see there for the arguments). Generation itself
        lives in the engine: this method only forwards to it."""
        from fuselm.engine.reference import generate

        return generate(self, input_ids, max_new_tokens, **kwargs)

    # ------------------------------------------------------------------------ argument checks
    def check_prompt(self, input_ids, attention_mask=None) -> list[int]:
        """Real tokens per row (host ints) of a right-padded prompt batch; ValueError/TypeError
        naming the argument otherwise. Reads the ids on the host (prefill is not graph-captured)."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids: expected a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids: expected integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [batch, tokens], got shape {tuple(input_ids.shape)}")
        if input_ids.device != self.device:
            raise ValueError(f"input_ids: on {input_ids.device}, the model is on {self.device}")
        B, T = input_ids.shape
        if B == 0:
            raise ValueError("input_ids: empty batch (0 rows)")
        if T == 0:
            raise ValueError("input_ids: empty prompt (0 tokens); every row needs at least one token")
        if attention_mask is None:
            lengths = [T] * B
            real = input_ids
        else:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask: expected a tensor of input_ids' shape {(B, T)}, got "
                                 f"{tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask!r}")
            mask = attention_mask.to(device=input_ids.device)
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError("attention_mask: values must be 0 or 1")
            mask = mask.to(torch.bool)
            if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
                raise ValueError("attention_mask: prompts must be right-padded (each row ones, then zeros); "
                                 "left-padded batches are not supported (tokenizer padding_side='right')")
            lengths = mask.sum(dim=1).tolist()
            if min(lengths) == 0:
                raise ValueError(f"attention_mask: row {lengths.index(0)} is an empty prompt (0 tokens)")
            real = input_ids[mask]
        low, high = int(real.min()), int(real.max())
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(f"input_ids: token ids must be in [0, {self.config.vocab_size}) (vocab_size); "
                             f"got values in [{low}, {high}]")
        return lengths

    def check_cache(self, cache, longest_prompt: int, max_new_tokens: int) -> None:
        """ValueError/TypeError naming the argument unless ``cache`` is this model's and holds
        ``longest_prompt + max_new_tokens`` tokens per slot."""
        if not isinstance(cache, Qwen35Cache):
            raise TypeError(f"cache: expected a Qwen35Cache from new_cache(), got {type(cache).__name__}")
        if cache.config != self.config or cache.lengths.device != self.device:
            raise ValueError("cache: made for another model (config or device differs); use this model's new_cache()")
        if longest_prompt > cache.max_len:
            raise ValueError(f"input_ids: a prompt of {longest_prompt} tokens is longer than the cache "
                             f"(max_len = {cache.max_len})")
        if longest_prompt + max_new_tokens > cache.max_len:
            raise ValueError(f"max_new_tokens: {longest_prompt} prompt tokens + {max_new_tokens} new tokens exceed "
                             f"the cache (max_len = {cache.max_len})")

    def _check_slots(self, cache: Qwen35Cache, batch: int, slots) -> torch.Tensor:
        """``slots`` as a device int64 tensor [batch] of distinct slots of ``cache``."""
        if slots is None:
            if batch > cache.max_batch:
                raise ValueError(f"input_ids: {batch} rows exceed the cache's max_batch = {cache.max_batch}")
            return torch.arange(batch, device=self.device)
        values = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        if len(values) != batch or any(not isinstance(s, int) or isinstance(s, bool) for s in values):
            raise ValueError(f"slots: expected {batch} int slot indices (one per prompt row), got {slots!r}")
        if len(set(values)) != batch or not all(0 <= s < cache.max_batch for s in values):
            raise ValueError(f"slots: expected distinct slots in [0, {cache.max_batch}), got {values}")
        return torch.tensor(values, dtype=torch.int64, device=self.device)


class Qwen35Moe(Qwen35):
    """Qwen3.5-MoE (HF ``Qwen3_5MoeForCausalLM``: 35B-A3B, 122B-A10B, 397B-A17B): the same
    Gated DeltaNet / gated attention hybrid with every MLP a sparse MoE block (``layers.MoE``:
    routing and grouped expert GEMMs, ``fuselm.ops.moe``). Everything else, the cache, prefill,
    decode and mixed steps, the engine and its graphs, is ``Qwen35``'s. Build it as the dense
    model: ``from_hf``, ``from_pretrained``, ``presets.random_qwen35``."""

    moe = True
