"""``fuselm.patch_hf`` on tiny HF models (fp32, the kernels in the interpreter on a CPU): a patched
deep copy gives the HF model's loss (1e-4 relative) and every parameter's gradient (1e-3 relative)
for Qwen3.5 dense and MoE, Qwen3 and Llama; the logits without labels; the parts switched off
stay HF's; patching twice is harmless; an unsupported model is refused; 3 AdamW steps on a
patched Qwen3.5 (a plain loop, and HF's Trainer) give the unpatched model's parameters. The Gated DeltaNet gradient cases run only
where ``chunk_gated_delta_rule`` has a backward (probed at collection)."""

import copy
import inspect

import pytest
import torch

from conftest import DEVICE
from fuselm import patch_hf
from fuselm.patch import SUPPORTED, patch_llama, patched_parts

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3_5Config, Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe  # noqa: E402

VOCAB = 256
LOSS_RTOL, GRAD_RTOL = 1e-4, 1e-3


def _gdn_has_backward() -> bool:
    """Whether fuselm's ``chunk_gated_delta_rule`` differentiates (its backward may not have landed)."""
    from fuselm.ops.gated_delta_rule import chunk_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 5, 1, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(2))
    v = torch.randn(1, 5, 2, 16, generator=g).to(DEVICE).requires_grad_()
    gate = (-torch.rand(1, 5, 2, generator=g)).to(DEVICE).requires_grad_()
    beta = torch.rand(1, 5, 2, generator=g).to(DEVICE).requires_grad_()
    try:
        o, _ = chunk_gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)
        o.sum().backward()
    except Exception:  # noqa: BLE001 - any failure means "no backward yet"
        return False
    return all(t.grad is not None for t in (q, k, v, gate, beta))


GDN_BACKWARD = _gdn_has_backward()
needs_gdn_backward = pytest.mark.skipif(not GDN_BACKWARD, reason="chunk_gated_delta_rule has no backward yet")


@pytest.fixture(autouse=True)
def hf_torch_path():
    """HF's own PyTorch Gated DeltaNet and conv1d for both models: with fla-core installed (GPU runs)
    HF would call fla's kernels, not the fp32 reference this file compares against."""
    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
             "causal_conv1d_update")
    saved = [(module, name, getattr(module, name)) for module in (modeling_qwen3_5, modeling_qwen3_5_moe)
             for name in names]
    try:
        for module, name, fn in saved:
            setattr(module, name, getattr(fn, "__wrapped__", fn))
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


# ----------------------------------------------------------------------------- tiny models
QWEN35 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
              layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
QWEN35_MOE = dict(QWEN35, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  output_router_logits=True)
DENSE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def randomize_(model, seed: int):
    """Every weight away from its init (zero-centered norm weights off 0, plain ones off 1)."""
    zero_centered = type(model).__name__.startswith("Qwen3_5")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                value = torch.rand(p.shape, generator=g) * 2 - 1  # decay rates exp(A_log) in [0.37, 2.7]
            elif name.endswith("linear_attn.norm.weight") or (name.endswith("norm.weight") and not zero_centered):
                value = 1.0 + 0.3 * torch.randn(p.shape, generator=g)  # plain RMSNorm weights
            elif "embed_tokens" in name:  # tied to the lm_head: logits of a few units, not tens
                value = torch.randn(p.shape, generator=g) * (0.3 if model.config.tie_word_embeddings else 1.0)
            elif p.dim() >= 2:
                value = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5  # unit-variance outputs
            else:  # zero-centered norm weights, dt_bias, biases
                value = 0.3 * torch.randn(p.shape, generator=g)
            p.copy_(value)
    return model.to(DEVICE).train()


def build(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "qwen3_5":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN35))
    elif family == "qwen3_5_moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**QWEN35_MOE))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**DENSE))
    elif family == "llama":  # MLP biases and tied embeddings: both kept by the patch
        model = LlamaForCausalLM(LlamaConfig(**DENSE, mlp_bias=True, tie_word_embeddings=True))
    else:
        raise ValueError(family)
    return randomize_(model, seed)


# Modules each part patches in the tiny models (cross_entropy: the model and its lm_head).
EXPECTED_PARTS = {
    "qwen3_5": {"rms_norm": 4 * 2 + 1 + 2 + 3, "swiglu": 4, "gated_delta_net": 3, "cross_entropy": 2, "add_rms_norm": 4},
    "qwen3_5_moe": {"rms_norm": 2 * 2 + 1 + 2 + 1, "swiglu": 2, "gated_delta_net": 1, "cross_entropy": 2, "add_rms_norm": 2},
    "qwen3": {"rms_norm": 2 * 4 + 1, "swiglu": 2, "cross_entropy": 2, "add_rms_norm": 2},
    "llama": {"rms_norm": 2 * 2 + 1, "swiglu": 2, "cross_entropy": 2, "add_rms_norm": 2},
}


def batch(B: int = 2, T: int = 27, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :6] = -100  # a masked prompt
    labels[-1, T // 2] = -100
    return ids.to(DEVICE), labels.to(DEVICE)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def loss_and_grads(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------- parity with HF
CASES = [
    pytest.param("qwen3_5", True, marks=needs_gdn_backward, id="qwen3_5"),
    pytest.param("qwen3_5", False, marks=pytest.mark.skipif(GDN_BACKWARD, reason="the gdn case runs"),
                 id="qwen3_5-hf-gdn"),
    pytest.param("qwen3_5_moe", True, marks=needs_gdn_backward, id="qwen3_5_moe"),
    pytest.param("qwen3_5_moe", False, marks=pytest.mark.skipif(GDN_BACKWARD, reason="the gdn case runs"),
                 id="qwen3_5_moe-hf-gdn"),
    pytest.param("qwen3", False, id="qwen3"),
    pytest.param("llama", False, id="llama"),
]


@pytest.mark.parametrize("family, gdn", CASES)
def test_loss_gradients_and_logits_match_hf(family, gdn):
    ref = build(family)
    model = copy.deepcopy(ref)
    params = [id(p) for p in model.parameters()]
    state_keys = list(model.state_dict())
    assert patch_hf(model, gated_delta_net=gdn) is model
    patch_hf(model, gated_delta_net=gdn)  # twice: harmless
    expected = dict(EXPECTED_PARTS[family])
    if not gdn:
        expected.pop("gated_delta_net", None)
    assert patched_parts(model) == expected
    assert [id(p) for p in model.parameters()] == params and list(model.state_dict()) == state_keys

    ids, labels = batch()
    ref_out, ref_grads = loss_and_grads(ref, ids, labels)
    out, grads = loss_and_grads(model, ids, labels)
    assert out.logits is None and ref_out.logits is not None  # the fused loss: no logits
    assert ref_out.loss.dtype == out.loss.dtype == torch.float32
    assert rel(out.loss, ref_out.loss) <= LOSS_RTOL, (out.loss.item(), ref_out.loss.item())
    for name, ref_grad in ref_grads.items():
        assert ref_grad is not None and grads[name] is not None, name
        assert rel(grads[name], ref_grad) <= GRAD_RTOL, (name, rel(grads[name], ref_grad))
    if family == "qwen3_5_moe":  # HF's router aux loss is still added
        assert out.aux_loss is not None and rel(out.aux_loss, ref_out.aux_loss) <= LOSS_RTOL

    with torch.no_grad():  # without labels: HF's forward, the patched modules inside
        logits, ref_logits = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert ref_logits.abs().max() > 1.0
    assert (logits - ref_logits).abs().max() <= 1e-4 * ref_logits.abs().max()


def test_qwen35_moe_routed_experts_stay_hf():
    model = patch_hf(build("qwen3_5_moe"))
    for layer in model.model.layers:
        assert getattr(layer.mlp.shared_expert, "_fuselm_patch", None) == "swiglu"
        for module in (layer.mlp, layer.mlp.experts, layer.mlp.gate):
            assert "forward" not in module.__dict__


def test_vision_language_wrapper_patches_its_language_model():
    config = Qwen3_5Config(text_config=dict(QWEN35), vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, num_position_embeddings=16, out_hidden_size=64))
    torch.manual_seed(0)
    ref = randomize_(Qwen3_5ForConditionalGeneration(config), 3)
    model = patch_hf(copy.deepcopy(ref), gated_delta_net=GDN_BACKWARD)
    expected = dict(EXPECTED_PARTS["qwen3_5"])
    if not GDN_BACKWARD:
        expected.pop("gated_delta_net")
    assert patched_parts(model) == expected
    assert not patched_parts(model.model.visual)
    ids, labels = batch(1, 21)
    with torch.no_grad():
        loss, ref_loss = model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss
    assert rel(loss, ref_loss) <= LOSS_RTOL


@needs_gdn_backward
def test_padded_batch_with_gradient_checkpointing_matches_hf():
    """Right padding (the GDN layers zero the padded positions, as HF) and HF's gradient
    checkpointing (the patched forwards recomputed in the backward; no cache)."""
    ref = build("qwen3_5", seed=6)
    model = patch_hf(copy.deepcopy(ref))
    for m in (ref, model):
        m.gradient_checkpointing_enable()
    ids, labels = batch(2, 25, seed=7)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    labels = labels.masked_fill(mask == 0, -100)
    ref_out, ref_grads = loss_and_grads(ref, ids, labels, attention_mask=mask)
    out, grads = loss_and_grads(model, ids, labels, attention_mask=mask)
    assert rel(out.loss, ref_out.loss) <= LOSS_RTOL
    for name, ref_grad in ref_grads.items():
        assert rel(grads[name], ref_grad) <= GRAD_RTOL, name


def test_autocast_bf16_runs_and_stays_close():
    """CPU autocast to bf16 (mixed-precision training with fp32 weights): the loss's hidden states
    and weight are cast as the lm_head's GEMM would be; the result is within bf16 rounding of HF's."""
    ref = build("llama", seed=8)
    model = patch_hf(copy.deepcopy(ref))
    ids, labels = batch(2, 19, seed=9)
    device_type = torch.device(DEVICE).type
    with torch.autocast(device_type, dtype=torch.bfloat16):
        ref_out, ref_grads = loss_and_grads(ref, ids, labels)
        out, grads = loss_and_grads(model, ids, labels)
    assert out.loss.dtype == torch.float32 and rel(out.loss, ref_out.loss) <= 2e-2
    for name, ref_grad in ref_grads.items():
        assert grads[name].dtype == torch.float32 and rel(grads[name], ref_grad) <= 5e-2, name


# ----------------------------------------------------------------------------- the cross-entropy path
@pytest.fixture(scope="module")
def llama_pair():
    ref = build("llama", seed=2)
    return ref, patch_hf(copy.deepcopy(ref))


def test_loss_kwargs_tuple_output_and_logits_to_keep(llama_pair):
    ref, model = llama_pair
    ids, labels = batch(2, 23)
    with torch.no_grad():
        # HF Trainer's gradient accumulation: the sum over the batch / num_items_in_batch
        n = torch.tensor(31, device=DEVICE)
        assert rel(model(input_ids=ids, labels=labels, num_items_in_batch=n).loss,
                   ref(input_ids=ids, labels=labels, num_items_in_batch=n).loss) <= LOSS_RTOL
        out, ref_out = (m(ids, None, None, None, None, labels, return_dict=False) for m in (model, ref))  # positional
        assert isinstance(out, tuple) and len(out) == len(ref_out) - 1  # no logits
        assert rel(out[0], ref_out[0]) <= LOSS_RTOL
        # logits_to_keep: the loss over the kept positions, labels of the kept length (as HF)
        kept = labels[:, -9:]
        assert rel(model(input_ids=ids, labels=kept, logits_to_keep=9).loss,
                   ref(input_ids=ids, labels=kept, logits_to_keep=9).loss) <= LOSS_RTOL
        with pytest.raises(ValueError, match="logits_to_keep"):
            model(input_ids=ids, labels=labels, logits_to_keep=9)


def test_eval_mode_and_custom_loss_run_hf_forward(llama_pair):
    ref, model = llama_pair
    ids, labels = batch(1, 17)
    try:
        model.eval()
        ref.eval()
        with torch.no_grad():
            out, ref_out = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
        assert out.logits is not None and (out.logits - ref_out.logits).abs().max() <= 1e-4
        assert rel(out.loss, ref_out.loss) <= LOSS_RTOL
    finally:
        model.train()
        ref.train()
    custom = copy.deepcopy(model)
    custom.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().mean()
    with torch.no_grad():
        out = custom(input_ids=ids, labels=labels)
    assert out.logits is not None and torch.allclose(out.loss, out.logits.mean())


def test_trainer_sees_hf_signature_and_deepcopy_rebinds(llama_pair):
    _, model = llama_pair
    parameters = inspect.signature(model.forward).parameters
    assert {"input_ids", "labels", "attention_mask"} <= set(parameters) and "self" not in parameters
    clone = copy.deepcopy(model)
    assert clone.forward.__self__ is clone and clone.model.norm.forward.__self__ is clone.model.norm
    assert clone.lm_head._fuselm_original_forward.__self__ is clone.lm_head


# ----------------------------------------------------------------------------- options, idempotence, refusal
@pytest.fixture(scope="module")
def qwen35():
    return build("qwen3_5")


PART_CLASSES = {"rms_norm": ("Qwen3_5RMSNorm", "Qwen3_5RMSNormGated"), "swiglu": ("Qwen3_5MLP",),
                "gated_delta_net": ("Qwen3_5GatedDeltaNet",), "cross_entropy": ("Qwen3_5ForCausalLM", "Linear")}


@pytest.mark.parametrize("off", list(PART_CLASSES))
def test_each_option_off_leaves_its_part_hf(qwen35, off):
    model = patch_hf(copy.deepcopy(qwen35), **{off: False})
    expected = {part: n for part, n in EXPECTED_PARTS["qwen3_5"].items() if part != off}
    assert patched_parts(model) == expected
    for module in model.modules():
        if type(module).__name__ in PART_CLASSES[off] and (off != "cross_entropy" or module in (model, model.lm_head)):
            assert "forward" not in module.__dict__ and not hasattr(module, "_fuselm_patch")
    for name in ("Qwen3_5Attention", "Qwen3_5TextRotaryEmbedding", "Embedding"):
        assert all("forward" not in m.__dict__ for m in model.modules() if type(m).__name__ == name)
    patch_hf(model)  # the part switched on later
    assert patched_parts(model) == EXPECTED_PARTS["qwen3_5"]


def test_patching_twice_does_not_wrap_twice(qwen35):
    model = patch_hf(patch_hf(copy.deepcopy(qwen35)))
    assert patched_parts(model) == EXPECTED_PARTS["qwen3_5"]
    for module in model.modules():
        if hasattr(module, "_fuselm_patch"):  # the saved forward is HF's own, bound to the module
            original = module._fuselm_original_forward
            assert original.__func__ is type(module).forward and original.__self__ is module


def test_unsupported_models_are_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as error:
        patch_hf(gpt2)
    for name in ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                 "Qwen3ForCausalLM", "LlamaForCausalLM"):
        assert name in str(error.value) and name in SUPPORTED
    with pytest.raises(ValueError, match="not supported"):
        patch_hf(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="qwen3_5 model, not llama"):
        patch_llama(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN35)))


# ----------------------------------------------------------------------------- inference and training
def test_generate_with_cache_matches_hf(qwen35):
    """With a cache: the prefill takes the fuselm path and fills the cache, the decode steps
    run HF's forward (a cache holding the layer's state)."""
    ref = copy.deepcopy(qwen35).eval()
    model = patch_hf(copy.deepcopy(qwen35)).eval()
    ids = batch(2, 13, seed=4)[0]
    with torch.no_grad():
        kwargs = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
        out, ref_out = model.generate(ids, **kwargs), ref.generate(ids, **kwargs)
    assert torch.equal(out.sequences, ref_out.sequences)
    assert (torch.stack(out.logits) - torch.stack(ref_out.logits)).abs().max() <= 1e-4


def test_three_adamw_steps_match_hf():
    ref = build("qwen3_5", seed=5)
    model = patch_hf(copy.deepcopy(ref), gated_delta_net=GDN_BACKWARD)
    losses = {}
    for name, m in (("hf", ref), ("fuselm", model)):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
        losses[name] = []
        for step in range(3):
            ids, labels = batch(1, 24, seed=10 + step)
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    assert max(abs(a - b) / b for a, b in zip(losses["fuselm"], losses["hf"])) <= LOSS_RTOL
    for (name, p), ref_p in zip(model.named_parameters(), ref.parameters()):
        assert (p - ref_p).abs().max() <= 1e-4, name


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_add_rms_norm_part_runs_the_fused_op_and_switches_off(family, monkeypatch):
    """Each decoder layer's residual add + post-attention norm goes through one add_rms_norm call
    (counted), the loss stays HF's; add_rms_norm=False leaves the layers' forwards HF's."""
    import fuselm.ops.rms_norm as rms_norm_ops

    calls = []
    fused = rms_norm_ops.add_rms_norm
    monkeypatch.setattr(rms_norm_ops, "add_rms_norm", lambda *args: calls.append(1) or fused(*args))
    ref = build(family)
    model = patch_hf(copy.deepcopy(ref), gated_delta_net=False)
    ids, labels = batch()
    with torch.no_grad():
        loss, ref_loss = model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss
    layers = EXPECTED_PARTS[family]["add_rms_norm"]
    assert len(calls) == layers and rel(loss, ref_loss) <= LOSS_RTOL
    off = patch_hf(copy.deepcopy(ref), gated_delta_net=False, add_rms_norm=False)
    assert "add_rms_norm" not in patched_parts(off)
    assert all("forward" not in layer.__dict__ for layer in _layers(off))


def _layers(model):
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return inner.layers


def test_add_rms_norm_keeps_hf_steps_for_an_unpatched_or_hooked_norm(monkeypatch):
    """rms_norm=False (the post-attention norm stays HF's) or a hook on the norm: the fused op is
    not called, the hooked norm's forward runs, the loss is HF's."""
    import fuselm.ops.rms_norm as rms_norm_ops

    calls = []
    fused = rms_norm_ops.add_rms_norm
    monkeypatch.setattr(rms_norm_ops, "add_rms_norm", lambda *args: calls.append(1) or fused(*args))
    ref = build("llama")
    ids, labels = batch()
    with torch.no_grad():
        ref_loss = ref(input_ids=ids, labels=labels).loss
        model = patch_hf(copy.deepcopy(ref), rms_norm=False)
        assert rel(model(input_ids=ids, labels=labels).loss, ref_loss) <= LOSS_RTOL and not calls
        model = patch_hf(copy.deepcopy(ref))
        seen = []
        _layers(model)[0].post_attention_layernorm.register_forward_hook(lambda *args: seen.append(1))
        assert rel(model(input_ids=ids, labels=labels).loss, ref_loss) <= LOSS_RTOL
    assert seen == [1] and len(calls) == EXPECTED_PARTS["llama"]["add_rms_norm"] - 1


@needs_gdn_backward
def test_hf_trainer_trains_a_patched_model_as_the_unpatched_one(tmp_path):
    """HF's Trainer, unchanged, on a patched Qwen3.5 (every part on): the same logged losses and,
    after 3 AdamW steps, the same parameters as on the unpatched model (the patched forward keeps
    HF's signature, which the Trainer reads to drop unused dataset columns)."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    ids, labels = batch(4, 19)
    data = [{"input_ids": ids[i].cpu(), "labels": labels[i].cpu(), "unused": i} for i in range(4)]

    def train(model, name):
        args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=2, max_steps=3,
                                 learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                                 use_cpu=DEVICE == "cpu", seed=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        return [log["loss"] for log in trainer.state.log_history if "loss" in log], dict(model.named_parameters())

    ref = build("qwen3_5")
    patched = patch_hf(copy.deepcopy(ref))
    ref_losses, ref_params = train(ref, "hf")
    losses, params = train(patched, "fuselm")
    assert len(losses) == len(ref_losses) == 3
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-4 * abs(want) + 1e-4, (losses, ref_losses)
    for name, want in ref_params.items():
        assert rel(params[name].detach(), want.detach()) <= GRAD_RTOL, name


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_gdn_conv_runs_short_conv_silu_and_matches_hf(family, monkeypatch):
    """Each Gated DeltaNet layer's conv1d + SiLU goes through one short_conv_silu call (counted),
    gradients included; packed sequences (cu_seq_lens_q) keep HF's conv."""
    import fuselm.ops.causal_conv1d as conv_ops

    calls = []
    fused = conv_ops.short_conv_silu
    monkeypatch.setattr(conv_ops, "short_conv_silu", lambda *args: calls.append(1) or fused(*args))
    ref = build(family)
    model = patch_hf(copy.deepcopy(ref))
    ids, labels = batch()
    loss, ref_loss = model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss
    loss.backward()
    ref_loss.backward()
    assert len(calls) == EXPECTED_PARTS[family]["gated_delta_net"] and rel(loss, ref_loss) <= LOSS_RTOL
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if "conv1d" in name:
            assert rel(p.grad, q.grad) <= 1e-3, name
    layer = next(m for m in model.modules() if hasattr(m, "conv1d"))
    calls.clear()
    with torch.no_grad():
        hidden = torch.randn(1, 9, layer.in_proj_qkv.in_features, device=ids.device)
        layer(hidden, cu_seq_lens_q=torch.tensor([0, 4, 9], dtype=torch.int32, device=ids.device))
    assert not calls
