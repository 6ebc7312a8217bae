"""One rank of ``test_fsdp2_policy.py``: MixedPrecision under FSDP2 on gloo.

A tiny Llama is sharded per decoder layer and at the root, and trained for ``STEPS`` steps
of ``torch.optim.AdamW`` through a ``SakuraRuntime`` with ``MixedPrecision`` installed:

- ``policy``: ``fully_shard(mp_policy=fsdp_mp_policy(mode))``, the service sees the policy
  and does not autocast (bf16-mixed, and 16-mixed with its loss scaling);
- ``autocast``: ``fully_shard`` without a policy, the service autocasts (bf16-mixed).

The ranks also train the unsharded model with the same precision on the same rows, split as
the ranks split them and the gradients averaged like FSDP2 averages them:

- ``ref-policy``: what the policy does, by hand: forward and backward on a bf16 copy of the
  parameters, its gradients summed in fp32 (``reduce_dtype``), the step on the fp32 weights;
- ``ref-autocast``: the unsharded model under bf16 autocast.

- ``ref-policy-16-mixed``: the same in fp16, the loss scaled by the scaler's first scale.

With ``errors`` in the arguments it also records the service's refusals and decisions.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from sakura import SakuraRuntime
from sakura_precision import MixedPrecision, fsdp_mp_policy

ROWS = 6
STEPS = 3
LR = 0.01


def build() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    return LlamaForCausalLM(config)


def rows(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (ROWS, 12), generator=torch.Generator().manual_seed(step))


def shard(model: nn.Module, policy: Any) -> None:
    kwargs = {} if policy is None else {"mp_policy": policy}
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def sharded_run(variant: str, mode: str, rank: int, world: int) -> dict[str, Any]:
    model: Any = build()
    shard(model, fsdp_mp_policy(mode) if variant == "policy" else None)
    service = MixedPrecision(mode)
    losses: list[float] = []
    autocasting: list[bool] = []
    per = ROWS // world
    with SakuraRuntime([service], strict=True) as rt:
        model, optimizer = rt.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
        for step in range(STEPS):
            ids = rows(step)[rank * per : (rank + 1) * per]
            with rt.autocast():
                autocasting.append(torch.is_autocast_enabled("cpu"))
                loss = model(input_ids=ids, labels=ids).loss
            rt.backward(loss)
            if not rt.optimizer_step(optimizer):
                optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    return {
        "weights": gathered(model),
        "losses": losses,
        "autocasting": autocasting,
        "fsdp_reason": service.fsdp_reason,
        "skipped": getattr(service, "skipped_steps", 0),
    }


def reference_run(variant: str, world: int) -> dict[str, Any]:
    """The unsharded model, the rows split into ``world`` chunks as the ranks split them."""
    model = build()
    compute = copy.deepcopy(model)
    low = {"ref-policy": torch.bfloat16, "ref-policy-16-mixed": torch.float16}.get(variant)
    if low is not None:  # FSDP2's param_dtype casts the parameters, not the buffers
        for p in compute.parameters():
            p.data = p.data.to(low)
    # 16-mixed: the loss scaler's first scale (no step is skipped: the test checks it).
    scale = 2.0**16 if variant == "ref-policy-16-mixed" else 1.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    per = ROWS // world
    losses: list[list[float]] = []
    for step in range(STEPS):
        total = [torch.zeros_like(p) for p in model.parameters()]
        chunk_losses = []
        for r in range(world):
            ids = rows(step)[r * per : (r + 1) * per]
            compute.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "ref-autocast"):
                loss = compute(input_ids=ids, labels=ids).loss
            (loss * scale).backward()
            for t, p in zip(total, compute.parameters(), strict=True):
                t += p.grad.float()  # reduce_dtype=float32: each rank's gradient, summed
            chunk_losses.append(float(loss.detach()))
        for p, t in zip(model.parameters(), total, strict=True):
            p.grad = t / world * (1.0 / scale)
        optimizer.step()
        with torch.no_grad():
            for c, p in zip(compute.parameters(), model.parameters(), strict=True):
                c.copy_(p)  # the fp32 weights, all-gathered as param_dtype
        losses.append(chunk_losses)
    return {"weights": gathered(model), "losses": losses}


def refusal(case: str) -> str:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    policies = {
        "fp16-service-bf16-policy": ("16-mixed", "bf16-mixed"),
        "bf16-service-fp16-policy": ("bf16-mixed", "16-mixed"),
        "32-true-service-bf16-policy": ("32-true", "bf16-mixed"),
        "fp8-service": ("fp8", "bf16-mixed"),
        "bf16-true-after-forward": ("bf16-true", ""),  # (no policy)
    }
    service_mode, policy_mode = policies[case]
    policy = {} if case == "bf16-true-after-forward" else {"mp_policy": fsdp_mp_policy(policy_mode)}
    fully_shard(model[0], **policy)
    fully_shard(model, **policy)
    if case == "bf16-true-after-forward":  # FSDP2's lazy init has sized its fp32 buffers
        model(torch.randn(2, 8))
    options = {"emulate": True} if service_mode == "fp8" else {}
    service = MixedPrecision(service_mode, **options)
    try:
        with SakuraRuntime([service], strict=True) as rt:
            rt.prepare(model)
    except (ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def accepted_cases() -> dict[str, Any]:
    """Setups the service accepts: what it decides about autocast."""
    out: dict[str, Any] = {}
    # Only the first layer has a policy: the rest still needs autocast.
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fully_shard(model[0], mp_policy=fsdp_mp_policy("bf16-mixed"))
    fully_shard(model)
    service = MixedPrecision("bf16-mixed")
    with SakuraRuntime([service], strict=True) as rt:
        rt.prepare(model)
        with rt.autocast():
            out["partial"] = [torch.is_autocast_enabled("cpu"), service.fsdp_reason]
    # bf16-true: rt.prepare casts before fully_shard, then the "-true" policy adds no cast.
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    service = MixedPrecision("bf16-true")
    with SakuraRuntime([service], strict=True) as rt:
        model = rt.wrap_model(model)
        fully_shard(model, mp_policy=service.fsdp_mp_policy())
        rt.wrap_model(model)
        with rt.autocast():
            y = model(torch.randn(4, 8))
        out["bf16-true"] = [str(y.dtype), sorted({str(p.dtype) for p in model.parameters()})]
    # bf16-true after fully_shard but before the first forward: FSDP2's _apply casts.
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fully_shard(model)
    with SakuraRuntime([MixedPrecision("bf16-true")], strict=True) as rt:
        rt.wrap_model(model)
        with rt.autocast():
            y = model(torch.randn(4, 8))
        y.float().sum().backward()
        grads = {str(p.grad.dtype) for p in model.parameters()}
        out["bf16-true-sharded"] = [str(y.dtype), sorted(grads)]
    return out


def main(rank: int, world: int, init_file: str, out_dir: str, *extra: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out = Path(out_dir)
    try:
        torch.set_num_threads(1)
        if "errors" in extra:
            cases = [
                "fp16-service-bf16-policy",
                "bf16-service-fp16-policy",
                "32-true-service-bf16-policy",
                "fp8-service",
                "bf16-true-after-forward",
            ]
            result: dict[str, Any] = {case: refusal(case) for case in cases}
            result.update(accepted_cases())
            (out / f"errors.rank{rank}.json").write_text(json.dumps(result))
        runs = {
            "policy": sharded_run("policy", "bf16-mixed", rank, world),
            "autocast": sharded_run("autocast", "bf16-mixed", rank, world),
        }
        references = ["ref-policy", "ref-autocast"]
        if world == 2:
            runs["policy-16-mixed"] = sharded_run("policy", "16-mixed", rank, world)
            references.append("ref-policy-16-mixed")
        # The unsharded references are spread over the ranks (each rank's own share).
        mine = {n: reference_run(n, world) for i, n in enumerate(references) if i % world == rank}
        torch.save(mine, out / f"references.rank{rank}.pt")
        if rank == 0:
            torch.save(runs, out / "runs.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank, _world, _init, _out, *_extra = sys.argv[1:]
    main(int(_rank), int(_world), _init, _out, *_extra)
