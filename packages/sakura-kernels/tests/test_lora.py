"""Fused LoRA over plain nn.Linear bases: the same outputs, gradients and trained adapters as
stock PEFT on a tiny Llama, and PEFT's own switches (disable_adapter, merge, set_adapter)
still work on a fused model.

Tolerances (relative, ``|a - b| / |b|`` over the whole tensor):

* fp32: 1e-5 for outputs, gradients and adapters after 5 AdamW steps (the fused function
  rounds its products in another order than PEFT; nothing else differs);
* bf16 (bf16 weights, PEFT's default fp32 adapters): the fused adapter products run in bf16
  (no fp32 copy of the input), so the two differ by bf16 rounding: both are compared with an
  fp32 computation from the same weights, and the fused error may be at most 1.5x PEFT's
  own error plus 1e-3; and fused and PEFT within 2e-2 of each other.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from sakura.options import OptionError
from sakura_kernels.lora import FusedLoraFunction, fuse_lora, is_fused, unfuse_lora

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FP32_TOL = 1e-5
BF16_VS_PEFT = 2e-2
N_LAYERS = 2 * len(PROJECTIONS)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def tiny_llama(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    return LlamaForCausalLM(config).to(dtype)


def lora(model: nn.Module, **config: Any) -> Any:
    """Stock PEFT, r=8 on every projection, lora_B non-zero (so that A gets a gradient)."""
    settings: dict[str, Any] = {"r": 8, "lora_alpha": 16, "target_modules": PROJECTIONS}
    settings.update(config)
    peft_model = get_peft_model(model, LoraConfig(**settings))
    gen = torch.Generator().manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return peft_model


def batch() -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))


def step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits (fp32) and every adapter gradient of one forward/backward."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits.float()
    (logits.square().mean() + logits[..., 0].mean()).backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def pair(dtype: torch.dtype = torch.float32, **config: Any) -> tuple[Any, Any]:
    """(stock PEFT model, fused copy of it)."""
    ref = lora(tiny_llama(dtype), **config)
    fused = copy.deepcopy(ref)
    report = fuse_lora(fused)
    targets = config.get("target_modules", PROJECTIONS)
    assert len(report.fused) == 2 * len(targets) and not report.skipped, report
    return ref, fused


class CountFused:
    """Counts FusedLoraFunction calls (proves the fused path ran, or did not)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = FusedLoraFunction.apply

        def counted(*args: Any) -> Any:
            self.calls += 1
            return original(*args)

        monkeypatch.setattr(FusedLoraFunction, "apply", counted)


def test_fp32_outputs_and_gradients_match_peft(monkeypatch: pytest.MonkeyPatch) -> None:
    ref, fused = pair()
    counter = CountFused(monkeypatch)
    ids = batch()
    ref_logits, ref_grads = step(ref, ids)
    assert counter.calls == 0
    logits, grads = step(fused, ids)
    assert counter.calls == N_LAYERS
    assert rel(logits, ref_logits) <= FP32_TOL
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * N_LAYERS
    for name, grad in grads.items():
        assert rel(grad, ref_grads[name]) <= FP32_TOL, name


def test_gradient_checkpointing_matches_peft(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Hugging Face's gradient checkpointing the fused function is run again in
    backward (recomputation) and gives PEFT's gradients."""
    ref, fused = pair()
    for model in (ref, fused):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    counter = CountFused(monkeypatch)
    ids = batch()
    ref_logits, ref_grads = step(ref, ids)
    logits, grads = step(fused, ids)
    assert counter.calls == 2 * N_LAYERS  # forward, and again when backward recomputes
    assert rel(logits, ref_logits) <= FP32_TOL
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * N_LAYERS
    for name, grad in grads.items():
        assert rel(grad, ref_grads[name]) <= FP32_TOL, name


def fp32_twin(model: Any) -> Any:
    """The same model and adapters, every tensor in fp32 (the bf16 runs' yardstick)."""
    return copy.deepcopy(model).float()


def test_bf16_outputs_and_gradients_close_to_peft() -> None:
    ref, fused = pair(torch.bfloat16)
    # PEFT's default (autocast_adapter_dtype=True): fp32 adapters on a bf16 base.
    assert ref.base_model.model.model.layers[0].self_attn.q_proj.lora_A.default.weight.dtype == (
        torch.float32
    )
    exact = fp32_twin(ref)
    ids = batch()
    exact_logits, exact_grads = step(exact, ids)
    ref_logits, ref_grads = step(ref, ids)
    logits, grads = step(fused, ids)
    assert logits.dtype == ref_logits.dtype
    assert rel(logits, ref_logits) <= BF16_VS_PEFT
    assert rel(logits, exact_logits) <= 1.5 * rel(ref_logits, exact_logits) + 1e-3
    for name, grad in grads.items():
        assert ref.get_parameter(name).grad.dtype == torch.float32
        assert rel(grad, ref_grads[name]) <= BF16_VS_PEFT, name
        peft_error = rel(ref_grads[name], exact_grads[name])
        assert rel(grad, exact_grads[name]) <= 1.5 * peft_error + 1e-3, name


def test_autocast_bf16_close_to_peft(monkeypatch: pytest.MonkeyPatch) -> None:
    ref, fused = pair()
    counter = CountFused(monkeypatch)
    ids = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logits, ref_grads = step(ref, ids)
        logits, grads = step(fused, ids)
    assert counter.calls == N_LAYERS
    exact_logits, _ = step(ref, ids)
    assert rel(logits, ref_logits) <= BF16_VS_PEFT
    assert rel(logits, exact_logits) <= 1.5 * rel(ref_logits, exact_logits) + 1e-3
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        assert rel(grad, ref_grads[name]) <= BF16_VS_PEFT, name


def test_fp32_outputs_keep_the_adapter_contribution_out_of_bf16_rounding() -> None:
    """``fp32_outputs=True`` under bf16 autocast: each fused layer returns fp32, the base
    product as bf16 rounds it and the adapter product added in fp32.  Checked on one layer
    against that computation by hand, and on the model: the logits are closer to the fp32
    model's than the 16-bit outputs are, and gradients still flow."""
    ref, fused = pair()
    layer = fused.base_model.model.model.layers[0].self_attn.q_proj
    fuse_lora(fused, fp32_outputs=True)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)
    base = torch.mm(x.detach().bfloat16(), layer.base_layer.weight.bfloat16().t()).float()
    want = base + layer.scaling["default"] * (x.detach() @ a.t() @ b.t())
    assert got.dtype == torch.float32
    assert rel(got.detach(), want) <= 1e-6
    (gx,) = torch.autograd.grad(got.sum(), x)
    assert gx.dtype == torch.float32 and torch.isfinite(gx).all()
    ids = batch()
    exact, _ = step(ref, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wide, grads = step(fused, ids)
        fuse_lora(fused, fp32_outputs=False)  # sets the option on the fused layers
        narrow, _ = step(fused, ids)
    assert rel(wide, exact) < rel(narrow, exact)
    assert len(grads) == 2 * N_LAYERS


def test_fp32_outputs_eval_only_while_the_model_evaluates() -> None:
    _, fused = pair()
    fuse_lora(fused, fp32_outputs="eval")
    ids = batch()[:, :4]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer = fused.base_model.model.model.layers[0].mlp.down_proj
        seen = []
        handle = layer.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        fused.train()
        fused(input_ids=ids)
        fused.eval()
        with torch.no_grad():
            fused(input_ids=ids)
        handle.remove()
    assert seen == [torch.bfloat16, torch.float32]


def train(model: Any, steps: int = 5) -> dict[str, torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 12), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


def flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.flatten() for v in params.values()])


def test_five_adamw_steps_train_the_same_adapters_fp32() -> None:
    ref, fused = pair()
    start = {n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    ref_after, after = train(ref), train(fused)
    assert after.keys() == ref_after.keys() and len(after) == 2 * N_LAYERS
    for name, value in after.items():
        assert not torch.equal(value, start[name]), name  # it trained
        assert rel(value, ref_after[name]) <= FP32_TOL, name


def test_five_adamw_steps_bf16_as_close_to_fp32_as_peft() -> None:
    """bf16 base, fp32 adapters in both.  Adam turns bf16 rounding of the gradients into
    visible differences (its update is about lr * sign), so: each adapter within 1e-2 of
    PEFT's, and the fused run's adapter updates (after - start) no farther from an fp32 run's
    than 1.5x PEFT's own distance from it, plus 0.01 (measured: 0.045 against 0.043)."""
    ref, fused = pair(torch.bfloat16)
    exact = fp32_twin(ref)
    start = flat({n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad})
    exact_after, ref_after, after = train(exact), train(ref), train(fused)
    for name, value in after.items():
        assert rel(value, ref_after[name]) <= 1e-2, name
    peft_distance = rel(flat(ref_after) - start, flat(exact_after) - start)
    assert rel(flat(after) - start, flat(exact_after) - start) <= 1.5 * peft_distance + 0.01


def test_disable_adapter_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    ref, fused = pair()
    ids = batch()
    counter = CountFused(monkeypatch)
    with torch.no_grad():
        with ref.disable_adapter():
            base_ref = ref(input_ids=ids).logits
        with fused.disable_adapter():
            base = fused(input_ids=ids).logits
        assert counter.calls == 0  # PEFT's own forward ran: base only
        adapted = fused(input_ids=ids).logits  # back on after the context
        assert counter.calls == N_LAYERS
        adapted_ref = ref(input_ids=ids).logits
    assert torch.equal(base, base_ref)
    assert rel(base, adapted_ref) > 1e-3  # the adapters do change the output
    assert rel(adapted, adapted_ref) <= FP32_TOL


def test_unfuse_restores_the_stock_layers() -> None:
    ref, fused = pair()
    ids = batch()
    restored = unfuse_lora(fused)
    assert len(restored) == N_LAYERS
    assert not any(is_fused(m) for m in fused.modules())
    assert not any("forward" in m.__dict__ for m in fused.modules())
    ref_sd, sd = ref.state_dict(), fused.state_dict()
    assert sd.keys() == ref_sd.keys()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    with torch.no_grad():
        assert torch.equal(fused(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert unfuse_lora(fused) == []
    again = fuse_lora(fused)
    assert len(again.fused) == N_LAYERS
    assert fuse_lora(fused).fused == again.fused  # idempotent


def test_a_fused_model_deep_copies_and_pickles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy's layers are fused and read the copy's own adapters."""
    ref, fused = pair()
    ids = batch()
    clone = copy.deepcopy(fused)
    restored = pickle.loads(pickle.dumps(fused))
    with torch.no_grad():
        for model in (ref, fused):  # the originals change; the copies must not follow
            model.base_model.model.model.layers[0].self_attn.q_proj.lora_B.default.weight.mul_(3)
        expected = ref(input_ids=ids).logits
        assert rel(fused(input_ids=ids).logits, expected) <= FP32_TOL
        plain = copy.deepcopy(clone)
        unfuse_lora(plain)
        unchanged = plain(input_ids=ids).logits
        counter = CountFused(monkeypatch)
        for other in (clone, restored):
            assert sum(is_fused(m) for m in other.modules()) == N_LAYERS
            assert rel(other(input_ids=ids).logits, unchanged) <= FP32_TOL
        assert counter.calls == 2 * N_LAYERS
    assert rel(unchanged, expected) > 1e-4


def test_merge_falls_back_to_peft(monkeypatch: pytest.MonkeyPatch) -> None:
    """A merged layer runs PEFT's forward (the merged base); unmerged, the fused one again."""
    ref, fused = pair()
    ids = batch()
    counter = CountFused(monkeypatch)
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        fused.merge_adapter()
        merged = fused(input_ids=ids).logits
        assert counter.calls == 0
        fused.unmerge_adapter()
        unmerged = fused(input_ids=ids).logits
        assert counter.calls == N_LAYERS
    assert rel(merged, expected) <= 1e-5
    assert rel(unmerged, expected) <= FP32_TOL


def test_second_adapter_and_set_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused with adapter 'default'; switching to another runs PEFT's path for it."""
    ref, fused = pair()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, init_lora_weights=False)
    for model in (ref, fused):
        torch.manual_seed(5)
        model.add_adapter("other", config)
    ids = batch()
    counter = CountFused(monkeypatch)
    with torch.no_grad():
        ref.set_adapter("other")
        fused.set_adapter("other")
        assert torch.equal(fused(input_ids=ids).logits, ref(input_ids=ids).logits)
        assert counter.calls == 0
        ref.set_adapter("default")
        fused.set_adapter("default")
        assert rel(fused(input_ids=ids).logits, ref(input_ids=ids).logits) <= FP32_TOL
        assert counter.calls == N_LAYERS


def test_base_unfrozen_after_fusing_runs_peft(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused function gives the base weight no gradient: a base made trainable after
    fusing runs PEFT's forward, so its weight gets its gradient."""
    ref, fused = pair()
    for model in (ref, fused):
        model.base_model.model.model.layers[1].mlp.down_proj.base_layer.weight.requires_grad_()
    counter = CountFused(monkeypatch)
    ids = batch()
    ref_logits, ref_grads = step(ref, ids)
    logits, grads = step(fused, ids)
    assert counter.calls == N_LAYERS - 1
    name = "base_model.model.model.layers.1.mlp.down_proj.base_layer.weight"
    assert name in grads and grads.keys() == ref_grads.keys()
    assert rel(grads[name], ref_grads[name]) <= FP32_TOL
    assert rel(logits, ref_logits) <= FP32_TOL


def test_merge_and_unload_of_a_fused_model() -> None:
    ref, fused = pair()
    ids = batch()
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        merged = fused.merge_and_unload()
        assert not any(is_fused(m) for m in merged.modules())
        assert rel(merged(input_ids=ids).logits, expected) <= 1e-5


def test_two_active_adapters_are_skipped() -> None:
    model = lora(tiny_llama())
    config = LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS)
    model.add_adapter("other", config)
    model.base_model.set_adapter(["default", "other"])
    report = fuse_lora(model)
    assert report.fused == [] and len(report.skipped) == N_LAYERS
    assert all("2 active adapters" in why for _, why in report.skipped)


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"lora_dropout": 0.1}, "lora_dropout=0.1"),
        ({"use_dora": True}, "DoRA"),
        ({"lora_bias": True}, "adapter bias"),
    ],
    ids=["dropout", "dora", "adapter-bias"],
)
def test_ineligible_layers_are_skipped_with_the_reason(config: dict[str, Any], why: str) -> None:
    model = lora(tiny_llama(), **config)
    report = fuse_lora(model)
    assert report.fused == []
    assert len(report.skipped) == N_LAYERS
    assert all(why in reason for _, reason in report.skipped), report.skipped
    assert not any(is_fused(m) for m in model.modules())


def test_trainable_base_and_foreign_base_are_skipped() -> None:
    class Scaled(nn.Linear):  # an nn.Linear subclass with its own forward, no dequantize
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = tiny_llama()
    layer = model.model.layers[0]
    old = layer.mlp.up_proj
    layer.mlp.up_proj = Scaled(old.in_features, old.out_features, bias=False)
    peft_model = lora(model)
    peft_model.base_model.model.model.layers[1].self_attn.q_proj.base_layer.weight.requires_grad_()
    report = fuse_lora(peft_model)
    skipped = dict(report.skipped)
    assert len(report.fused) == N_LAYERS - 2
    assert "neither a plain nn.Linear" in skipped["base_model.model.model.layers.0.mlp.up_proj"]
    assert "trainable" in skipped["base_model.model.model.layers.1.self_attn.q_proj"]


class ExpandedLinear(nn.Linear):
    """A base with the quantized-base protocol but no sakura-quant: it stores its weight as
    int8 codes and one scale per row, and expands them with dequantize(dtype) and
    dequantize_into(out) (``into_calls`` counts the latter)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        w = linear.weight.detach()
        scale = w.abs().amax(1, keepdim=True) / 127
        self.register_buffer("scale", scale)
        self.weight = nn.Parameter((w / scale).round().to(torch.int8), requires_grad=False)
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.matmul_dtype: torch.dtype | None = None

    into_calls = 0

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.weight.float() * self.scale).to(dtype or torch.float32)

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        ExpandedLinear.into_calls += 1
        return out.copy_(self.weight.float() * self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantize(x.dtype), self.bias)


def test_duck_typed_quantized_base_with_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any base offering dequantize(dtype) is fused (the protocol, not sakura-quant); its
    bias and a PEFT bias="all" (trainable base biases) get the same gradients."""
    model = tiny_llama()
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj"):
            old = getattr(layer.self_attn, name)
            with_bias = nn.Linear(old.in_features, old.out_features, bias=True)
            with torch.no_grad():
                with_bias.weight.copy_(old.weight)
                with_bias.bias.normal_()
            setattr(layer.self_attn, name, ExpandedLinear(with_bias))
    ref = lora(model, bias="all")
    fused = copy.deepcopy(ref)
    report = fuse_lora(fused)
    assert len(report.fused) == N_LAYERS and not report.skipped
    counter = CountFused(monkeypatch)
    ids = batch()
    ref_logits, ref_grads = step(ref, ids)
    ExpandedLinear.into_calls = 0
    logits, grads = step(fused, ids)
    assert counter.calls == N_LAYERS
    # The buffer path: 4 forward expansions, 2 backward (layer 0 reads the frozen embeddings).
    assert ExpandedLinear.into_calls == 6
    assert rel(logits, ref_logits) <= FP32_TOL
    assert any(".bias" in name for name in grads)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert rel(grad, ref_grads[name]) <= FP32_TOL, name


def test_bf16_keeps_the_input_not_an_fp32_copy() -> None:
    """One bf16 layer with fp32 adapters: PEFT saves an fp32 copy of the input for A's
    gradient; the fused function saves the bf16 input itself and nothing of its size more."""
    torch.manual_seed(0)
    holder = nn.Sequential(nn.Linear(64, 96, bias=False)).to(torch.bfloat16)
    ref = get_peft_model(holder, LoraConfig(r=8, target_modules=["0"]))
    fused = copy.deepcopy(ref)
    assert fuse_lora(fused).fused == ["base_model.model.0"]
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16, requires_grad=True)

    def saved(model: nn.Module) -> list[torch.Tensor]:
        kept: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).sum().backward()
        return kept

    input_sized = [t for t in saved(ref) if t.numel() == x.numel()]
    assert any(t.dtype == torch.float32 for t in input_sized)  # PEFT's fp32 copy
    kept = saved(fused)
    input_sized = [t for t in kept if t.numel() == x.numel()]
    assert len(input_sized) == 1 and input_sized[0].data_ptr() == x.data_ptr()


def test_options_are_validated() -> None:
    model = lora(tiny_llama())
    with pytest.raises(OptionError, match=r"keep_expanded='yes'.*True or False"):
        fuse_lora(model, keep_expanded="yes")  # type: ignore[arg-type]
    with pytest.raises(OptionError, match=r"fp32_outputs='train'.*False, True, 'eval'"):
        fuse_lora(model, fp32_outputs="train")
    with pytest.raises(OptionError, match=r"model=3.*torch.nn.Module"):
        fuse_lora(3)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="unfuse_lora: model=None"):
        unfuse_lora(None)  # type: ignore[arg-type]
    assert not any(is_fused(m) for m in model.modules())


def test_model_without_lora_layers() -> None:
    report = fuse_lora(tiny_llama())
    assert report.fused == [] and report.skipped == []
    assert "0 layers fused" in str(report)


def test_fp32_outputs_leave_a_bf16_model_without_autocast_16_bit() -> None:
    """Without autocast a bf16 model's next layers take bf16 only: fp32 outputs there would
    break the next projection (``nn.Linear`` refuses an fp32 input for a bf16 weight)."""
    ref, fused = pair(torch.bfloat16, target_modules=["q_proj", "v_proj", "down_proj"])
    fuse_lora(fused, fp32_outputs=True)
    ids = batch()
    with torch.no_grad():
        got = fused(input_ids=ids).logits
        want = ref(input_ids=ids).logits
    assert got.dtype == torch.bfloat16
    assert rel(got.float(), want.float()) <= BF16_VS_PEFT


def test_fp32_outputs_under_autocast_with_some_projections_adapted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LoRA on q/v/down only (PEFT's usual choice): in eval under autocast, q and v come out
    fp32 while k stays bf16; attention (eager, SDPA and sakura's) and the next layers take
    the mix, and the logits are closer to the fp32 model's than with 16-bit outputs."""
    from sakura_kernels.blocks import attention as fused_attention
    from sakura_kernels.blocks.attention import ATTENTION_NAME, register_attention

    register_attention()
    calls = []
    original = fused_attention.FusedAttention.apply
    monkeypatch.setattr(
        fused_attention.FusedAttention, "apply", lambda *a: calls.append(1) or original(*a)
    )
    ref, fused = pair(target_modules=["q_proj", "v_proj", "down_proj"])
    ids = batch()
    with torch.no_grad():
        exact = ref(input_ids=ids).logits.double()
    fused.eval()
    for attention in ("eager", "sdpa", ATTENTION_NAME):
        fused.base_model.model.set_attn_implementation(attention)
        errors = []
        for wide in (False, "eval"):
            fuse_lora(fused, fp32_outputs=wide)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                logits = fused(input_ids=ids).logits
            errors.append(rel(logits.double(), exact))
        assert errors[1] < errors[0], (attention, errors)
    assert len(calls) == 2 * 2  # both layers, both settings: the mix stays on the fused path
