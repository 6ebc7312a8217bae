"""The host-update pipeline of CUDA parameters and its event waits, on a machine without a
GPU: a stand-in DeviceTransfer copies synchronously and hands back events that complete only
after a few queries, so the pipeline's ordering, waits and errors run for real."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from _offload_models import batches, loss_of, mlp

from sakura import ConfigError
from sakura.options import OptionError
from sakura_offload import OffloadAdamW
from sakura_offload.host_optimizer.device_stream import HostPipeline
from sakura_offload.host_optimizer.event_wait import EventWait

HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}


class LateEvent:
    """Completes on its ``late``-th query."""

    def __init__(self, late: int) -> None:
        self.late = late
        self.queries = 0
        self.synchronized = False

    def query(self) -> bool:
        self.queries += 1
        return self.queries >= self.late

    def synchronize(self) -> None:
        self.synchronized = True


# --- EventWait --------------------------------------------------------------------------


def test_poll_checks_then_sleeps_between_checks() -> None:
    event = LateEvent(5)
    assert EventWait("poll", spin_us=0, sleep_us=1).wait(event) == 4  # a sleep per miss
    assert event.queries == 5 and not event.synchronized
    event = LateEvent(5)
    assert EventWait("poll", spin_us=10_000_000, sleep_us=1).wait(event) == 0  # within spin
    event = LateEvent(50)
    assert EventWait("spin").wait(event) == 0 and event.queries == 50
    event = LateEvent(10**9)
    assert EventWait("block").wait(event) == 0
    assert event.synchronized and event.queries == 0


def test_a_hung_event_is_reported_not_waited_on_forever() -> None:
    start = time.perf_counter()
    for mode in ("poll", "spin"):
        with pytest.raises(TimeoutError, match=r"the gradient copy of x did not complete"):
            EventWait(mode, sleep_us=100, timeout_s=0.05).wait(
                LateEvent(10**12), "the gradient copy of x"
            )
    assert time.perf_counter() - start < 5


def test_policy_from_the_environment_and_bad_values() -> None:
    assert EventWait.from_env(environ={}) == EventWait("poll", 50, 100)
    env = {
        "SAKURA_OFFLOAD_EVENT_WAIT": "Spin",
        "SAKURA_OFFLOAD_EVENT_SPIN_US": "0",
        "SAKURA_OFFLOAD_EVENT_SLEEP_US": "20",
    }
    assert EventWait.from_env(environ=env) == EventWait("spin", 0, 20)
    with pytest.raises(ConfigError, match=r"SAKURA_OFFLOAD_EVENT_WAIT='yield'.*'poll'"):
        EventWait.from_env(environ={"SAKURA_OFFLOAD_EVENT_WAIT": "yield"})
    with pytest.raises(ConfigError, match=r"SAKURA_OFFLOAD_EVENT_SLEEP_US='0'.*>= 1"):
        EventWait.from_env(environ={"SAKURA_OFFLOAD_EVENT_SLEEP_US": "0"})
    with pytest.raises(OptionError, match=r"EventWait: mode='busy'"):
        EventWait("busy")
    with pytest.raises(OptionError, match=r"EventWait: timeout_s=0"):
        EventWait(timeout_s=0)


def test_the_optimizer_reads_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAKURA_OFFLOAD_EVENT_SLEEP_US", "250")
    opt = OffloadAdamW([torch.nn.Parameter(torch.zeros(4))])
    assert opt.event_wait == EventWait("poll", 50, 250)
    monkeypatch.setenv("SAKURA_OFFLOAD_EVENT_WAIT", "sleep")
    with pytest.raises(ConfigError, match="SAKURA_OFFLOAD_EVENT_WAIT='sleep'"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(4))])


# --- HostPipeline -----------------------------------------------------------------------


def test_pipeline_runs_in_order_off_the_caller_thread_and_drains() -> None:
    pipeline = HostPipeline(timeout_s=10)
    seen: list[tuple[int, str]] = []
    for i in range(20):
        pipeline.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    pipeline.drain()
    assert [i for i, _ in seen] == list(range(20))
    assert {name for _, name in seen} == {"sakura-offload-host"}
    pipeline.close()


def test_pipeline_reraises_a_failed_job_and_bounds_its_wait() -> None:
    pipeline = HostPipeline(timeout_s=0.2)
    ran: list[int] = []

    def fail() -> None:
        raise ValueError("kernel exploded")

    pipeline.submit(fail)
    pipeline.submit(lambda: ran.append(1))  # dropped: the pipeline stopped at the failure
    with pytest.raises(RuntimeError, match="a host update failed") as error:
        pipeline.drain()
    assert isinstance(error.value.__cause__, ValueError) and ran == []
    pipeline.drain()  # the error is reported once; the pipeline works again
    release = threading.Event()
    pipeline.submit(lambda: release.wait(5))
    with pytest.raises(TimeoutError, match=r"1 host update\(s\) did not finish within 0.2 s"):
        pipeline.drain()
    release.set()
    pipeline.drain()
    pipeline.close()


# --- OffloadAdamW through the pipeline ----------------------------------------------------


class StandInTransfer:
    """A DeviceTransfer for CPU tensors: every parameter goes through the pipeline, copies
    happen at once, events complete on their third query."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.events: list[LateEvent] = []
        self.to_device_threads: set[str] = set()
        self.ordered = 0
        self.copies_back = 0
        self.fail_after = fail_after

    def handles(self, p: torch.Tensor) -> bool:
        return True

    def pin(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def to_host(self, grad: torch.Tensor, buffer: torch.Tensor) -> LateEvent:
        buffer.copy_(grad.detach().reshape(-1).float())
        self.events.append(LateEvent(3))
        return self.events[-1]

    def to_device(self, master: torch.Tensor, p: torch.Tensor) -> None:
        self.copies_back += 1
        if self.fail_after is not None and self.copies_back > self.fail_after:
            raise RuntimeError("copy failed")
        self.to_device_threads.add(threading.current_thread().name)
        p.detach().copy_(master.view(p.shape))

    def order_compute(self) -> None:
        self.ordered += 1


def _train(make: Any, steps: int = 6) -> tuple[torch.nn.Module, OffloadAdamW]:
    model = mlp(torch.bfloat16)  # bf16 parameters: fp32 masters, as a device parameter has
    optimizer = make(model.parameters())
    for batch in batches(steps):
        loss_of(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("moment_dtype", ["float32", "int8"])
def test_pipeline_updates_equal_the_direct_ones(eager: bool, moment_dtype: str) -> None:
    transfer = StandInTransfer()

    def piped(params: Any) -> OffloadAdamW:
        opt = OffloadAdamW(params, **HYPER, moment_dtype=moment_dtype, eager=eager)
        opt._transfer = transfer
        return opt

    direct_model, direct = _train(
        lambda p: OffloadAdamW(p, **HYPER, moment_dtype=moment_dtype, eager=eager)
    )
    model, optimizer = _train(piped)
    for a, b in zip(model.parameters(), direct_model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(optimizer.state[a]["master"], direct.state[b]["master"])
    assert len(transfer.events) == 6 * 4  # every tensor, every step, through the pipeline
    assert all(e.queries == 3 for e in transfer.events)  # each copy waited for
    assert transfer.to_device_threads == {"sakura-offload-host"}
    assert transfer.ordered >= 6  # the compute side ordered after every step
    # state_dict after a step sees finished updates, in torch.optim.AdamW's layout
    assert set(optimizer.state_dict()["state"][0]) >= {"step", "exp_avg", "exp_avg_sq"}


def test_a_failed_host_update_surfaces_at_step() -> None:
    transfer = StandInTransfer(fail_after=2)
    model = mlp(torch.bfloat16)
    optimizer = OffloadAdamW(model.parameters(), **HYPER)
    optimizer._transfer = transfer
    loss_of(model, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="a host update failed") as error:
        optimizer.step()
    assert "copy failed" in str(error.value.__cause__)


def test_close_does_not_wait_on_a_stuck_worker() -> None:
    pipeline = HostPipeline(timeout_s=600)
    release = threading.Event()
    pipeline.submit(lambda: release.wait(30))
    start = time.perf_counter()
    pipeline.close(timeout_s=0.1)
    assert time.perf_counter() - start < 5
    release.set()
