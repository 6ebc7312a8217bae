"""``patch_model`` on tiny Llama, Mistral and Qwen2 models built from configs: the patched
model's loss and gradients against the unpatched model's, what is patched and what is
refused (with why), and ``unpatch_model`` restoring the originals exactly."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable

import pytest
import torch
from transformers.models.llama import modeling_llama

from sakura_kernels import PatchReport, patch_model, unpatch_model
from sakura_kernels.blocks import patch as patch_module

FAMILIES = ("llama", "mistral", "qwen2")
# The patched model's loss and gradients against the unpatched model's (largest difference
# relative to the largest value).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 6e-2}


def loss_and_grads(model: torch.nn.Module, seed: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, 12), generator=generator)
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_loss_and_gradients_match_the_unpatched_model(
    make_model: Callable[..., torch.nn.Module], family: str, dtype: torch.dtype
) -> None:
    reference = make_model(family, dtype)
    model = copy.deepcopy(reference)
    report = patch_model(model)
    layers = 2
    # Every RMSNorm (2 per layer + the final norm), every MLP and every attention.
    assert report.count("rms_norm") == 2 * layers + 1, report
    assert report.count("glu") == layers and report.count("rotary") == layers, report
    assert report.skipped == []
    ref_loss, ref_grads = loss_and_grads(reference)
    loss, grads = loss_and_grads(model)
    tol = TOLERANCE[dtype]
    assert abs(loss - ref_loss) <= tol * abs(ref_loss)
    for name, grad in ref_grads.items():
        assert rel(grads[name], grad) <= tol, name
    unpatch_model(model)  # unpatched: the model's own code again, bit for bit
    loss, grads = loss_and_grads(model)
    assert loss == ref_loss and all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def test_the_fused_kernels_run_inside_the_patched_model(
    make_model: Callable[..., torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sakura_kernels.blocks import functions

    model = make_model("llama")
    patch_model(model)
    calls = {"rms": 0, "glu": 0, "rope": 0}
    for cls, key in (
        (functions.FusedRMSNorm, "rms"),
        (functions.FusedGLU, "glu"),
        (functions.FusedRotary, "rope"),
    ):
        forward = cls.forward

        def counting(ctx, *args, _forward=forward, _key=key):  # type: ignore[no-untyped-def]
            calls[_key] += 1
            return _forward(ctx, *args)

        monkeypatch.setattr(cls, "forward", staticmethod(counting))
    loss_and_grads(model)
    # 5 norms, 2 MLPs, q and k in 2 attention layers.
    assert calls == {"rms": 5, "glu": 2, "rope": 4}
    unpatch_model(model)


def test_unpatch_restores_the_originals_exactly(make_model: Callable[..., torch.nn.Module]) -> None:
    model = make_model("qwen2")
    original_rope = modeling_llama.apply_rotary_pos_emb
    qwen2 = importlib.import_module("transformers.models.qwen2.modeling_qwen2")
    original_qwen_rope = qwen2.apply_rotary_pos_emb
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    report = patch_model(model)
    assert report.patched and qwen2.apply_rotary_pos_emb is not original_qwen_rope
    assert patch_model(model).patched == []  # a second call patches nothing more
    unpatch_model(model)
    assert qwen2.apply_rotary_pos_emb is original_qwen_rope
    assert modeling_llama.apply_rotary_pos_emb is original_rope
    for name, module in model.named_modules():
        assert "forward" not in module.__dict__, name
        assert module.__dict__.keys() == before[name].keys(), name
    assert patch_module._ROTARY_GLOBALS == {}


def test_the_rotary_dispatcher_runs_the_original_outside_patched_attention(
    make_model: Callable[..., torch.nn.Module],
) -> None:
    model = make_model("llama")
    patch_model(model, kernels=["rotary"])
    q, k = torch.randn(1, 2, 3, 16), torch.randn(1, 1, 3, 16)
    cos, sin = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
    dispatcher = modeling_llama.apply_rotary_pos_emb
    original = dispatcher._sakura_original  # type: ignore[attr-defined]
    got, want = dispatcher(q, k, cos, sin), original(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    unpatch_model(model)
    assert modeling_llama.apply_rotary_pos_emb is original


class ShiftedRMSNorm(modeling_llama.LlamaRMSNorm):
    """A subclass whose forward differs (Gemma-style ``1 + weight``): must be refused."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states) + hidden_states * 0.5


class TimesTwoMLP(modeling_llama.LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class ReluMLP(modeling_llama.LlamaMLP):
    def __init__(self, config: object) -> None:
        super().__init__(config)
        self.act_fn = torch.nn.ReLU()


def test_modules_that_do_not_match_are_refused_and_reported(
    make_model: Callable[..., torch.nn.Module],
) -> None:
    model = make_model("llama")
    layer0, layer1 = model.model.layers
    old = layer0.input_layernorm
    shifted = ShiftedRMSNorm(old.weight.shape[0], eps=old.variance_epsilon)
    shifted.weight = old.weight
    layer0.input_layernorm = shifted
    odd = TimesTwoMLP(model.config)
    odd.load_state_dict(layer0.mlp.state_dict())
    layer0.mlp = odd
    relu = ReluMLP(model.config)
    relu.load_state_dict(layer1.mlp.state_dict())
    layer1.mlp = relu
    reference = copy.deepcopy(model)
    report = patch_model(model)
    assert isinstance(report, PatchReport)
    skipped = dict(report.skipped)
    assert set(skipped) == {
        "model.layers.0.input_layernorm",
        "model.layers.0.mlp",
        "model.layers.1.mlp",
    }
    assert "disagrees" in skipped["model.layers.0.input_layernorm"]
    assert "disagrees" in skipped["model.layers.0.mlp"]
    assert "neither silu nor gelu-tanh" in skipped["model.layers.1.mlp"]
    assert "forward" not in shifted.__dict__ and "forward" not in odd.__dict__
    assert report.count("rms_norm") == 4 and report.count("rotary") == 2
    ref_loss, _ = loss_and_grads(reference)
    loss, _ = loss_and_grads(model)
    assert abs(loss - ref_loss) <= 2e-5 * abs(ref_loss)
    assert "skipped model.layers.1.mlp" in str(report)
    unpatch_model(model)


def test_kernels_option_is_validated(make_model: Callable[..., torch.nn.Module]) -> None:
    model = make_model("llama")
    with pytest.raises(ValueError, match=r"kernels.*'swiglu'.*rms_norm"):
        patch_model(model, kernels=["swiglu"])
    with pytest.raises(ValueError, match="model"):
        patch_model("not a model")  # type: ignore[arg-type]
    report = patch_model(model, kernels="rms_norm")
    assert {k for _, k in report.patched} == {"rms_norm"}
    unpatch_model(model)


def test_patched_model_under_gradient_checkpointing(
    make_model: Callable[..., torch.nn.Module],
) -> None:
    reference = make_model("llama")
    model = copy.deepcopy(reference)
    for m in (reference, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    report = patch_model(model)
    assert report.count("rotary") == 2 and report.count("rms_norm") == 5
    ref_loss, ref_grads = loss_and_grads(reference)
    loss, grads = loss_and_grads(model)
    assert abs(loss - ref_loss) <= 2e-5 * abs(ref_loss)
    for name, grad in ref_grads.items():
        assert rel(grads[name], grad) <= 2e-5, name
    unpatch_model(model)


def test_rotary_is_patched_in_attention_whose_projections_are_all_quantized(
    make_model: Callable[..., torch.nn.Module],
) -> None:
    """An attention module whose q/k/v/o are all quantized holds no floating-point parameter
    of its own: the rotary check probes in fp32 and bf16 instead of skipping the module (it
    was skipped with "no floating-point parameter" before)."""
    from sakura_quant import quantize_model

    reference = make_model("llama", torch.float32)
    quantize_model(reference.requires_grad_(False), "int8")
    attention = reference.model.layers[0].self_attn
    assert not any(p.is_floating_point() for p in attention.parameters())
    model = copy.deepcopy(reference)
    report = patch_model(model)
    assert report.count("rotary") == 2, report
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        got = model(input_ids=ids).logits
    assert rel(got, want) <= TOLERANCE[torch.float32]
