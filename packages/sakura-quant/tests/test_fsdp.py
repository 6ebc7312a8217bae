"""sakura-quant under FSDP2 (``fully_shard``) on gloo groups of 2, 3 and 1 ranks (CPU).

A tiny Llama (from a config), quantized (int8; NF4 with double quant; NF4 with LoftQ
factors), with stock PEFT LoRA on every projection, sharded per decoder layer and at the
root after :func:`sakura_quant.fsdp.shardable`.  This file is also the rank script: the
fixtures launch it as separate processes (``launch_ranks``: 2 ranks run
``train,extras,save,errors``,
3 ranks ``train,load``, 1 rank ``load``); each rank writes what it measured to
``<out>/<phase>-ws<W>-rank<R>.json`` and the tests below assert on it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from sakura import SakuraRuntime
from sakura_quant import Quantization, quantize_model
from sakura_quant.fsdp import (
    ShardableQuantizedLinear,
    check_sharded,
    local_quantized_nbytes,
    shardable,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

STEPS = 4
FORMATS: dict[str, dict[str, Any]] = {
    "int8": {"quantize": "int8"},
    "nf4-dq": {"quantize": "nf4", "double_quant": True},
    "nf4-loftq": {"quantize": "nf4", "error_rank": 2},
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).requires_grad_(False)


def qlora(fmt: str, seed: int = 0) -> nn.Module:
    model = tiny_llama(seed)
    quantize_model(model, **FORMATS[fmt])
    torch.manual_seed(seed + 100)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    lora = peft.get_peft_model(model, config)
    for name, param in lora.named_parameters():  # LoRA B off zero, so every factor trains
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return lora


def peft_then_service(fsdp: bool) -> tuple[nn.Module, Any]:
    """The ``quant`` service's flow: LoRA first, then ``rt.prepare`` quantizes the base."""
    model = tiny_llama(0)
    torch.manual_seed(100)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    lora = peft.get_peft_model(model, config)
    for name, param in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    rt = SakuraRuntime(strict=True)
    rt.install(Quantization("nf4", double_quant=True, fsdp=fsdp))
    rt.prepare(lora)
    return lora, rt


def shard(
    lora: nn.Module, mp: MixedPrecisionPolicy | None = None, *, reshard: bool = True
) -> nn.Module:
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for layer in lora.get_base_model().model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(lora, **kwargs)
    return lora


def batch() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))


def train(model: nn.Module, steps: int) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = batch()
    losses = []
    for _ in range(steps):
        logits = model(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()) for n, p in model.named_parameters() if p.requires_grad}


def logits_of(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch()).logits.float()


def compare(sharded: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    assert sharded.keys() == ref.keys(), (sorted(sharded), sorted(ref))
    return {
        "count": len(ref),
        "equal": all(torch.equal(sharded[k], ref[k]) for k in ref),
        "max_abs": max(float((sharded[k] - ref[k]).abs().max()) for k in ref),
        "max_ref": max(float(ref[k].abs().max()) for k in ref),
    }


def phase_train(rank: int, world: int, out: Path) -> list[dict[str, Any]]:
    records = []
    for fmt in FORMATS:
        ref = qlora(fmt)
        ref_bytes = local_quantized_nbytes(ref)
        ref_losses = train(ref, STEPS)
        model = shard(shardable(qlora(fmt)))
        local = local_quantized_nbytes(model)
        checked = check_sharded(model)
        losses = train(model, STEPS)
        records.append(
            {
                "case": fmt,
                "losses": losses,
                "ref_losses": ref_losses,
                "lora": compare(lora_state(model), lora_state(ref)),
                "local_bytes": local,
                "ref_bytes": ref_bytes,
                "checked": checked,
            }
        )
    return records


def phase_extras(rank: int, world: int, out: Path) -> list[dict[str, Any]]:
    records = []
    # The quant service with fsdp=True, prepared before fully_shard and again after it.
    ref, _ = peft_then_service(fsdp=False)
    ref_losses = train(ref, STEPS)
    model, rt = peft_then_service(fsdp=True)
    shard(model)
    rt.wrap_model(model)
    local = local_quantized_nbytes(model)
    losses = train(model, STEPS)
    records.append(
        {
            "case": "service",
            "losses": losses,
            "ref_losses": ref_losses,
            "lora": compare(lora_state(model), lora_state(ref)),
            "local_bytes": local,
            "ref_bytes": local_quantized_nbytes(ref),
            "checked": check_sharded(model),
        }
    )
    # The blocks' gathered tensors kept from forward to backward (no reshard in between).
    ref = qlora("nf4-dq")
    ref_losses = train(ref, STEPS)
    model = shard(shardable(qlora("nf4-dq")), reshard=False)
    local = local_quantized_nbytes(model)
    losses = train(model, STEPS)
    records.append(
        {
            "case": "no-reshard",
            "losses": losses,
            "ref_losses": ref_losses,
            "lora": compare(lora_state(model), lora_state(ref)),
            "local_bytes": local,
            "ref_bytes": local_quantized_nbytes(ref),
            "checked": check_sharded(model),
        }
    )
    # Mixed precision: param_dtype=bf16 casts the LoRA weights, never the byte storage.
    ref = qlora("nf4-dq")
    model = shard(shardable(qlora("nf4-dq")), MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    checked = check_sharded(model)
    sharded_logits = logits_of(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logits = logits_of(ref)
    losses = train(model, STEPS)
    records.append(
        {
            "case": "nf4-dq/bf16-param",
            "checked": checked,
            "finite": bool(torch.isfinite(sharded_logits).all()) and all(map(_finite, losses)),
            "losses": losses,
            "logits_max_abs": float((sharded_logits - ref_logits).abs().max()),
            "logits_max_ref": float(ref_logits.abs().max()),
        }
    )
    return records


def _finite(x: float) -> bool:
    return bool(torch.isfinite(torch.tensor(x)))


def phase_save(rank: int, world: int, out: Path) -> list[dict[str, Any]]:
    model = shard(shardable(qlora("nf4-dq")))
    train(model, 2)
    dcp.save(model.state_dict(), checkpoint_id=str(out / "ckpt"))
    logits = logits_of(model)
    if rank == 0:
        torch.save(logits, out / "saved-logits.pt")
    return [{"case": "save", "logits_sum": float(logits.double().sum())}]


def phase_load(rank: int, world: int, out: Path) -> list[dict[str, Any]]:
    model = shard(shardable(qlora("nf4-dq", seed=7)))  # other base and adapters
    before = logits_of(model)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(out / "ckpt"))
    model.load_state_dict(state)
    logits = logits_of(model)
    saved = torch.load(out / "saved-logits.pt", weights_only=True)
    return [
        {
            "case": "load",
            "equal": bool(torch.equal(logits, saved)),
            "max_abs": float((logits - saved).abs().max()),
            "differed_before": not torch.equal(before, saved),
            "local_bytes": local_quantized_nbytes(model),
        }
    ]


def _refusal(action: Callable[[], Any]) -> str:
    try:
        action()
    except ValueError as exc:
        return str(exc)
    return ""


def phase_errors(rank: int, world: int, out: Path) -> list[dict[str, Any]]:
    records = []
    # 1. quantized, never made shardable: buffers under fully_shard.
    model = shard(qlora("nf4-dq"))
    records.append({"case": "buffers/check", "error": _refusal(lambda: check_sharded(model))})
    records.append({"case": "buffers/forward", "error": _refusal(lambda: logits_of(model))})
    # 2. shardable after fully_shard.
    model = shard(qlora("int8"))
    records.append({"case": "shardable-late", "error": _refusal(lambda: shardable(model))})
    # 3. the peers' failure: the quantized tensors turned into parameters of their own dtype,
    # under a bf16 param_dtype that would cast the fp32 scales.
    model = qlora("nf4-dq")
    for layer in model.modules():
        if type(layer).__name__ == "QuantizedLinear":
            for attr in [n for n in layer._buffers if n.startswith("weight")]:
                if layer._buffers[attr].dim():  # fully_shard refuses 0-d parameters itself
                    tensor = layer._buffers.pop(attr)
                    layer.register_parameter(attr, nn.Parameter(tensor, requires_grad=False))
    shard(model, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    records.append({"case": "native-params/cast", "error": _refusal(lambda: logits_of(model))})
    # 4. a layer's tensors kept out of every group (ignored_params) inside a wrapped model.
    model = shardable(qlora("int8"))
    base = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    fully_shard(model, ignored_params={base.weight_scales})
    records.append({"case": "ignored", "error": _refusal(lambda: check_sharded(model))})
    # 5. the quant service without fsdp=True, prepared again after fully_shard.
    model, rt = peft_then_service(fsdp=False)
    shard(model)
    records.append({"case": "service-unsharded", "error": _refusal(lambda: rt.wrap_model(model))})
    # 6. quantizing a model whose weights fully_shard already sharded.
    plain = tiny_llama(0)
    fully_shard(plain)
    records.append({"case": "quantize-sharded", "error": _refusal(lambda: quantize_model(plain))})
    return records


PHASES = {
    "train": phase_train,
    "extras": phase_extras,
    "save": phase_save,
    "load": phase_load,
    "errors": phase_errors,
}


def main() -> None:
    rank, world, init, out, phases = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        Path(sys.argv[4]),
        sys.argv[5].split(","),
    )
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        for phase in phases:
            records = PHASES[phase](rank, world, out)
            (out / f"{phase}-ws{world}-rank{rank}.json").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


# --- the tests (in the pytest process) ------------------------------------------------

HERE = Path(__file__)
EXTRAS = ("service", "no-reshard")  # on 2 ranks only
TRAINED = [(world, case) for world in (2, 3) for case in FORMATS] + [(2, c) for c in EXTRAS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sakura.testing import launch_ranks

    out = tmp_path_factory.mktemp("fsdp-quant")
    launch_ranks(HERE, 2, out, "train,extras,save,errors", timeout=240)
    launch_ranks(HERE, 3, out, "train,load", timeout=240, init_name="init3")
    launch_ranks(HERE, 1, out, "load", timeout=240, init_name="init1")
    return out


def records(out: Path, phase: str, world: int) -> list[dict[str, dict[str, Any]]]:
    return [
        {r["case"]: r for r in json.loads((out / f"{phase}-ws{world}-rank{rank}.json").read_text())}
        for rank in range(world)
    ]


@pytest.mark.parametrize(("world", "case"), TRAINED)
def test_lora_after_steps_equals_the_unsharded_run(runs: Path, world: int, case: str) -> None:
    """Every LoRA factor after 4 AdamW steps, gathered, against the same model trained
    unsharded: bit for bit on 2 ranks; on 3 ranks FSDP2 averages three equal gradients
    ((g + g + g) / 3 rounds), so within 1e-6 (the factors are about 0.16)."""
    phase = "extras" if case in EXTRAS else "train"
    for rank_records in records(runs, phase, world):
        r = rank_records[case]
        assert r["checked"] == 14, "every quantized projection is in an FSDP2 group"
        assert r["lora"]["count"] == 28
        if world == 2:
            assert r["lora"]["equal"], r["lora"]
            assert r["losses"] == r["ref_losses"]
        else:
            assert r["lora"]["max_abs"] <= 1e-6, r["lora"]
            assert r["losses"][0] == r["ref_losses"][0]  # the first forward is exact
            assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-6)


@pytest.mark.parametrize(("world", "case"), TRAINED)
def test_each_rank_holds_its_share_of_the_quantized_base(runs: Path, world: int, case: str) -> None:
    """Bytes of the codes, scales, double-quant statistics and LoftQ factors, measured from
    each rank's local shards: they add up to the unsharded layers' bytes, and no rank holds
    more than 1/N of them plus FSDP2's rounding of each flat tensor to N chunks (2 %)."""
    ranks = [r[case] for r in records(runs, "extras" if case in EXTRAS else "train", world)]
    total = ranks[0]["ref_bytes"]
    assert sum(r["local_bytes"] for r in ranks) == total
    assert all(r["local_bytes"] <= total / world * 1.02 for r in ranks), ranks


def test_bf16_param_dtype_never_casts_the_quantized_storage(runs: Path) -> None:
    """MixedPrecisionPolicy(param_dtype=bf16): the byte storage passes the wrap-time check
    (nothing of it is cast), the sharded logits match the unsharded model under bf16
    autocast within bf16 rounding (0.03 on logits of about 0.6), and training stays finite."""
    for rank_records in records(runs, "extras", 2):
        r = rank_records["nf4-dq/bf16-param"]
        assert r["checked"] == 14 and r["finite"]
        assert r["logits_max_abs"] <= 0.03, r


@pytest.mark.parametrize("world", [3, 1])
def test_dcp_checkpoint_saved_on_2_ranks_loads_on_other_world_sizes(runs: Path, world: int) -> None:
    """A model trained 2 steps on 2 ranks, saved with torch.distributed.checkpoint, loaded
    into a model with another base and other adapters (seed 7) sharded on 3 ranks and on 1:
    its logits equal, bit for bit, the ones the saving model gave."""
    for rank, rank_records in enumerate(records(runs, "load", world)):
        r = rank_records["load"]
        assert r["differed_before"], "the fresh model must differ before loading"
        assert r["equal"], (rank, r["max_abs"])


REFUSALS = {
    "buffers/check": r"QuantizedLinear inside a fully_shard-wrapped model whose quantized "
    r"tensors are buffers, which FSDP2 does not shard.*shardable\(model\)",
    "buffers/forward": r"tensors are buffers, which FSDP2 does not shard",
    "shardable-late": r"shardable: this model is already wrapped by fully_shard",
    "native-params/cast": r"\['weight_scales_scale'\] are FSDP2 parameters that its "
    r"MixedPrecisionPolicy.param_dtype would cast",
    "ignored": r"q_proj.base_layer.weight_scales is in no FSDP2 group",
    "service-unsharded": r"tensors are buffers.*quant service fsdp=True",
    "quantize-sharded": r"quantize_model: model.layers.0.self_attn.q_proj.weight is sharded "
    r"by fully_shard",
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_would_corrupt_or_replicate_is_refused_at_wrap_time(runs: Path, case: str) -> None:
    """On 2 ranks: buffers under fully_shard (by check_sharded, and on the first forward
    before any product), shardable after fully_shard, quantized tensors turned into
    parameters of their own dtype under a bf16 param_dtype (the peers' failure), a layer's
    tensor left out of every group (ignored_params), the quant service without fsdp=True
    prepared again after fully_shard, quantize_model on sharded weights."""
    import re

    for rank_records in records(runs, "errors", 2):
        message = rank_records[case]["error"]
        assert re.search(REFUSALS[case], message), message


# --- in this process, no ranks ---------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_shardable_layers_compute_exactly_as_before_and_keep_their_bytes(fmt: str) -> None:
    """Without fully_shard a shardable model gives the same logits and gradients bit for bit;
    its quantized tensors are flat uint8 parameters that model.to(bf16) leaves alone; its
    state dict round-trips, and a tensor of another dtype is refused, not cast."""
    import copy

    model = qlora(fmt)
    ids = batch()
    before = model(input_ids=ids).logits
    before.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    shardable(model)
    layers = [m for m in model.modules() if isinstance(m, ShardableQuantizedLinear)]
    assert len(layers) == 14
    stored = [p for layer in layers for n, p in layer.named_parameters() if n != "bias"]
    assert stored and all(p.dtype == torch.uint8 and p.dim() == 1 for p in stored)
    assert not any(p.requires_grad for p in stored)
    after = model(input_ids=ids).logits
    after.sum().backward()
    assert torch.equal(after, before)
    assert all(torch.equal(model.get_parameter(n).grad, g) for n, g in grads.items())
    state = copy.deepcopy(model.state_dict())
    other = copy.deepcopy(model).to(torch.bfloat16)
    assert all(
        torch.equal(p, q)
        for p, q in zip(
            stored,
            [
                p
                for m in other.modules()
                if isinstance(m, ShardableQuantizedLinear)
                for n, p in m.named_parameters()
                if n != "bias"
            ],
            strict=True,
        )
    )
    fresh = shardable(qlora(fmt, seed=5))
    fresh.load_state_dict(state)
    assert torch.equal(fresh(input_ids=ids).logits, before)
    key = next(k for k in state if k.endswith("q_proj.base_layer.weight_scales"))
    state[key] = state[key].float()
    with pytest.raises(RuntimeError, match=r"weight_scales: a shardable quantized layer stores"):
        fresh.load_state_dict(state)


def test_a_plain_quantized_checkpoint_loads_into_a_shardable_model() -> None:
    """A state dict saved before shardable (each tensor in its own dtype and shape) loads
    into a shardable model as bytes: same logits, bit for bit."""
    saved = qlora("nf4-dq")
    ids = batch()
    with torch.no_grad():
        expected = saved(input_ids=ids).logits
    fresh = shardable(qlora("nf4-dq", seed=9))
    fresh.load_state_dict(saved.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, expected)


def test_quant_service_fsdp_option() -> None:
    """``quant:nf4,fsdp=true`` builds a service that makes the base shardable when it
    quantizes; a wrong value names the option."""
    from sakura.errors import SpecError
    from sakura.options import OptionError
    from sakura.plugins import get_plugin_manager

    service = get_plugin_manager().create("service", "quant:nf4,double_quant=true,fsdp=true")
    assert service.fsdp is True and "fsdp=True" in repr(service)
    model = tiny_llama(0)
    service.wrap_model(model)
    layers = [m for m in model.modules() if isinstance(m, ShardableQuantizedLinear)]
    assert len(layers) == 14
    assert Quantization("nf4").fsdp is False
    with pytest.raises(OptionError, match=r"Quantization: fsdp='yes'"):
        Quantization("nf4", fsdp="yes")
    with pytest.raises(SpecError, match=r"fsdp"):
        get_plugin_manager().create("service", "quant:nf4,fsdp=maybe")


def test_shardable_needs_a_module() -> None:
    with pytest.raises(ValueError, match=r"model.*torch.nn.Module"):
        shardable("not a model")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
