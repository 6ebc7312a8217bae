"""One rank of the reference README's raw-DDP quickstart (run by
``test_reference_quickstarts.py`` through ``sakura.testing.launch_ranks``).

``python _quickstart_ddp_rank.py RANK WORLD INIT_FILE OUT_DIR FORM`` with FORM ``payload``
(the reference's ``eval_fn(epoch, payload)``, written as the README writes it) or ``task``
(``pass_task=True``: ``eval_fn(epoch, task)`` with the epoch's weights).  Each rank writes
``OUT_DIR/FORM-rank<R>.json``: the metrics AsyncEval delivered and the metrics a synchronous
evaluation of the same weights gives.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world_size, init_file, out_dir, form = sys.argv[1:6]
torch.set_num_threads(1)
dist.init_process_group(
    "gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=int(world_size)
)

# --- the user's pieces (what the README leaves to the reader) -----------------------------
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))
model = DDP(net)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(10 + dist.get_rank())
train_loader = [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]
gv = torch.Generator().manual_seed(99)
val_payload = {"x": torch.randn(32, 6, generator=gv), "y": torch.randn(32, 2, generator=gv)}
num_epochs = 3


def train_one_step(model: Any, batch: Any, optimizer: Any) -> torch.Tensor:
    x, y = batch
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def val_loss(module: nn.Module, payload: dict[str, torch.Tensor]) -> float:
    with torch.no_grad():
        return nn.functional.mse_loss(module(payload["x"]), payload["y"]).item()


if form == "payload":

    def eval_fn(epoch, payload):  # the reference contract: payload is eval_payload
        return {"val_loss": val_loss(net, payload)}

    options: dict[str, Any] = {}
else:
    from sakura_async import EvalTask

    def eval_fn(epoch: int, task: EvalTask) -> dict[str, float]:  # type: ignore[misc]
        fresh = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))
        return {"val_loss": val_loss(task.load_into(fresh), task.payload)}

    options = {"pass_task": True}

reference: list[float] = []

# --- the README's raw PyTorch DDP quickstart, as written ------------------------------------
from sakura import SakuraRuntime  # noqa: E402
from sakura.adapters import DDPAdapter  # noqa: E402
from sakura.dispatch import InThreadDispatcher  # noqa: E402
from sakura.services import AsyncEval, ZeRO1  # noqa: E402

with SakuraRuntime() as rt:
    rt.install(ZeRO1())
    ae = rt.install(
        AsyncEval(
            eval_fn=eval_fn, eval_payload=val_payload, dispatcher=InThreadDispatcher(), **options
        )
    )

    adapter = DDPAdapter(rt, rank=dist.get_rank(), world_size=dist.get_world_size())
    adapter.on_train_begin(model, optimizer, train_loader)
    for epoch in range(num_epochs):
        adapter.on_epoch_begin(epoch)
        for step, batch in enumerate(train_loader):
            adapter.on_train_step_begin(model, batch, step)
            loss = train_one_step(model, batch, optimizer)
            adapter.on_optimizer_step(optimizer)
        reference.append(val_loss(net, val_payload))  # what a synchronous eval gives
        adapter.on_epoch_end(epoch, model, optimizer, metrics={"train_loss": loss})
    adapter.on_train_end(model)

record = {
    "delivered": [(r.epoch, r.metrics) for r in ae.history],
    "errors": [repr(r.error) for r in ae.errors],
    "runtime_errors": [repr(e) for e in rt.errors],
    "reference": reference,
    "pass_task": ae.pass_task,
}
Path(out_dir, f"{form}-rank{rank}.json").write_text(json.dumps(record))
dist.destroy_process_group()
