"""OffloadAdamW's gradient clipping (``max_grad_norm``) over FSDP2 shards, on 2 gloo ranks
(issue 23).  Each rank holds only its shard of every gradient, so the norm to clip by must
be the norm of the whole gradient, all ranks' shards together, not of the local shard.

The file is also its own rank script (``launch_ranks`` runs it with the rank's arguments).
Every variant trains the same net (``fully_shard`` per Linear and at the root) on the same
rows for ``STEPS`` steps; rank 0 also trains the unsharded net with ``torch.optim.AdamW``
and ``torch.nn.utils.clip_grad_norm_`` on the same rows, split as the ranks split them and
the gradients averaged as FSDP2 averages them.

- ``clip``: ``OffloadAdamW(max_grad_norm=MAX_NORM)`` (``eager=None``: off, clipping needs
  every gradient first);
- ``clip-ignored``: the same with the last Linear left out of FSDP2
  (``ignored_params``): plain, replicated parameters whose gradients the loop all-reduces
  itself, counted once in the norm;
- ``clip-hsdp``: HSDP, a 2-D mesh (ranks x 1): every rank holds the whole gradient,
  replicated, which must not be summed over the ranks;
- ``eager`` / ``not-eager``: no clipping, ``eager=True`` against ``eager=None`` (off on
  several ranks): FSDP2
  calls a sharded parameter's post-accumulate-grad hooks after its reduce-scatter, so the
  eager update sees the averaged shard.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS = 4
MAX_NORM = 0.05  # the gradients' norm is about 0.2 to 0.6 here: every step clips
ROWS = 8
LR, WEIGHT_DECAY = 0.01, 0.1


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 4, generator=g)


def gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


# --- the rank side --------------------------------------------------------------------------


def sharded_run(variant: str, rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from sakura_offload import OffloadAdamW

    model = net()
    ignored = set(model[4].parameters()) if variant == "clip-ignored" else set()
    mesh: dict[str, Any] = {}
    if variant == "clip-hsdp":  # replicated across the ranks, "sharded" on a dimension of 1
        from torch.distributed.device_mesh import init_device_mesh

        mesh["mesh"] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rep", "shard"))
    for layer in model:
        if isinstance(layer, nn.Linear) and not (set(layer.parameters()) & ignored):
            fully_shard(layer, **mesh)
    fully_shard(model, ignored_params=ignored or None, **mesh)
    options: dict[str, Any] = {"lr": LR, "weight_decay": WEIGHT_DECAY}
    if variant.startswith("clip"):
        options["max_grad_norm"] = MAX_NORM
    elif variant == "eager":
        options["eager"] = True  # (not-eager: eager=None, which is off on several ranks)
    optimizer = OffloadAdamW(model.parameters(), **options)
    per = ROWS // world
    norms, local_norms, updated_in_backward = [], [], []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        nn.functional.mse_loss(model(x), y).backward()
        for p in ignored:  # FSDP2 leaves ignored parameters to the loop
            dist.all_reduce(p.grad)
            p.grad /= world
        grads = [p.grad for p in model.parameters()]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        local_norms.append(float(torch.linalg.vector_norm(torch.cat([g.view(-1) for g in local]))))
        updated_in_backward.append(len(optimizer._updated))
        optimizer.step()
        norms.append(optimizer.last_grad_norm)
        optimizer.zero_grad()
    optimizer.synchronize()
    stats = optimizer.stats()
    return {
        "weights": gathered(model),
        "norms": norms,
        "local_norms": local_norms,
        "updated_in_backward": updated_in_backward,
        "eager": [stats["eager"], stats["eager_reason"]],
        "steps": stats["steps"],
        "moment_bytes": stats["moment_bytes"],
        "local_numel": sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()
        ),
        "numel": sum(p.numel() for p in model.parameters()),
    }


def reference_run(world: int, clip: bool) -> dict[str, Any]:
    """torch.optim.AdamW (+ clip_grad_norm_) on the unsharded net; the rows split into
    ``world`` chunks, each chunk's gradient computed alone and the chunks averaged."""
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    per = ROWS // world
    norms = []
    for step in range(STEPS):
        x, y = batch(step)
        total = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(world):
            model.zero_grad()
            chunk = slice(r * per, (r + 1) * per)
            nn.functional.mse_loss(model(x[chunk]), y[chunk]).backward()
            for t, p in zip(total, model.parameters(), strict=True):
                t += p.grad
        for p, t in zip(model.parameters(), total, strict=True):
            p.grad = t / world
        if clip:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
    return {"weights": gathered(model), "norms": norms}


def main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out = Path(out_dir)
    try:
        torch.set_num_threads(1)
        variants = ("clip", "clip-ignored", "clip-hsdp", "eager", "not-eager")
        runs = {v: sharded_run(v, rank, world) for v in variants}
        weights = {v: runs[v].pop("weights") for v in runs}
        (out / f"rank{rank}.json").write_text(json.dumps(runs))
        if rank == 0:
            reference = {"clip": reference_run(world, True), "plain": reference_run(world, False)}
            torch.save({"sharded": weights, "reference": reference}, out / "weights.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


# --- the test side --------------------------------------------------------------------------

if __name__ != "__main__":
    import pytest

    from sakura.testing import launch_ranks

    WORLD = 2

    @pytest.fixture(scope="module")
    def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
        out = tmp_path_factory.mktemp("offload-fsdp2-clip")
        launch_ranks(Path(__file__), WORLD, out, timeout=240)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
        return ranks, torch.load(out / "weights.pt", weights_only=True)

    @pytest.mark.parametrize("variant", ["clip", "clip-ignored", "clip-hsdp"])
    def test_clipping_over_shards_equals_clip_grad_norm_unsharded(runs: Any, variant: str) -> None:
        """Params within 1e-6 of torch's AdamW + clip_grad_norm_ after 4 steps, and the
        norm measured equals clip_grad_norm_'s (rel. 1e-6) on every rank."""
        ranks, saved = runs
        ref = saved["reference"]["clip"]
        for name, value in ref["weights"].items():
            torch.testing.assert_close(
                saved["sharded"][variant][name], value, rtol=0, atol=1e-6, msg=name
            )
        for rank in ranks:
            torch.testing.assert_close(rank[variant]["norms"], ref["norms"], rtol=1e-6, atol=0)
        assert min(ref["norms"]) > 2 * MAX_NORM  # clipping did happen, every step

    def test_the_norm_is_global_not_the_local_shards(runs: Any) -> None:
        """Each rank's shards alone have a smaller norm, different on each rank: a local-only
        norm would clip each rank's shard by another factor (and fail the test above)."""
        ranks, _ = runs
        for step in range(STEPS):
            local = [rank["clip"]["local_norms"][step] for rank in ranks]
            norm = ranks[0]["clip"]["norms"][step]
            assert all(n < norm * (1 - 1e-3) for n in local)
            assert abs(local[0] - local[1]) > 1e-6
            assert abs(sum(n * n for n in local) - norm * norm) <= 1e-5 * norm * norm

    def test_unclipped_steps_equal_torch_adamw_and_clipping_changes_them(runs: Any) -> None:
        _, saved = runs
        plain, clipped = saved["reference"]["plain"], saved["reference"]["clip"]
        for name, value in plain["weights"].items():
            torch.testing.assert_close(
                saved["sharded"]["not-eager"][name], value, rtol=0, atol=1e-6, msg=name
            )
        assert any(
            not torch.allclose(clipped["weights"][n], v, rtol=0, atol=1e-4)
            for n, v in plain["weights"].items()
        )

    def test_eager_updates_over_shards_equal_the_step(runs: Any) -> None:
        """eager=True under FSDP2: every tensor is updated during backward (FSDP2 runs the
        post-accumulate-grad hooks on the reduced shard), bit-identical to the step."""
        ranks, saved = runs
        for name, value in saved["sharded"]["not-eager"].items():
            assert torch.equal(saved["sharded"]["eager"][name], value), name
        for rank in ranks:
            assert rank["eager"]["updated_in_backward"] == [6] * STEPS  # 3 weights, 3 biases
            assert rank["not-eager"]["updated_in_backward"] == [0] * STEPS
            assert rank["eager"]["eager"] == [True, "eager=True"]

    def test_eager_none_stats_and_synchronize_over_shards(runs: Any) -> None:
        ranks, _ = runs
        for rank in ranks:
            clip = rank["clip"]
            assert clip["eager"] == [
                False,
                "max_grad_norm is set: clipping needs every gradient first",
            ]
            assert clip["steps"] == STEPS
            assert clip["moment_bytes"] == 8 * clip["local_numel"]  # two fp32 moments, the shard's
        assert sum(rank["clip"]["local_numel"] for rank in ranks) == ranks[0]["clip"]["numel"]
        for rank in ranks:
            assert rank["not-eager"]["eager"] == [
                False,
                "a process group of several ranks averages the gradients after backward",
            ]
            assert rank["eager"]["steps"] == rank["not-eager"]["steps"] == STEPS
        # the ignored (replicated) Linear's state is whole on each rank
        ignored = [rank["clip-ignored"] for rank in ranks]
        assert all(r["moment_bytes"] == 8 * r["local_numel"] for r in ignored)
        assert sum(r["local_numel"] for r in ignored) == ignored[0]["numel"] + 4 * 32 + 4


if __name__ == "__main__":
    _rank, _world, _init, _out = sys.argv[1:5]
    main(int(_rank), int(_world), _init, _out)
