"""Spec strings and registrations: the services and dispatchers by name."""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import Any

import pytest

import sakura.dispatch
import sakura.services
import sakura_async
from sakura import OnTrainBegin, SakuraRuntime, SpecError
from sakura.loop import LoopContext
from sakura.plugins import get_plugin_manager
from sakura_async import AsyncCheckpoint, AsyncEval
from sakura_async.dispatch import (
    ClusterDispatcher,
    InThreadDispatcher,
    LocalDispatcher,
    RemoteDispatcher,
    ThreadDispatcher,
)


def create(kind: str, spec: str) -> Any:
    return get_plugin_manager().create(kind, spec)


def test_facades_resolve_every_class() -> None:
    assert sakura.dispatch.InThreadDispatcher is InThreadDispatcher
    assert sakura.dispatch.ThreadDispatcher is ThreadDispatcher
    assert sakura.dispatch.LocalDispatcher is LocalDispatcher
    assert sakura.dispatch.RemoteDispatcher is RemoteDispatcher
    assert sakura.dispatch.ClusterDispatcher is ClusterDispatcher
    assert sakura.services.AsyncEval is AsyncEval
    assert sakura.services.AsyncCheckpoint is AsyncCheckpoint
    assert sakura_async.AsyncEval is AsyncEval


def test_dispatchers_by_name() -> None:
    assert isinstance(create("dispatcher", "inthread"), InThreadDispatcher)
    thread = create("dispatcher", "thread:threads=2,max_pending=3")
    assert isinstance(thread, ThreadDispatcher) and thread.threads == 2 and thread.max_pending == 3
    process = create("dispatcher", "process:threads=1")
    assert (
        isinstance(process, LocalDispatcher) and process.threads == 1 and process.worker_pid is None
    )
    process.close()
    remote = create("dispatcher", "remote:uri=tcp://127.0.0.1:9,token=a-token-of-16-bytes-or-more")
    with pytest.raises(
        SpecError, match="token is too short \\(3 bytes\\); accepted: a secret of at least 16"
    ):
        create("dispatcher", "remote:uri=tcp://127.0.0.1:9,token=abc")
    assert isinstance(remote, RemoteDispatcher) and remote.port == 9
    cluster = create("dispatcher", "cluster:address=tcp://127.0.0.1:8786")
    assert isinstance(cluster, ClusterDispatcher) and cluster.address == "tcp://127.0.0.1:8786"


def test_async_eval_without_fn_needs_configure(world: Any) -> None:
    service = create("service", "async_eval:thread,every=2,max_pending=2")
    assert isinstance(service, AsyncEval) and service.eval_fn is None
    assert isinstance(service.dispatcher, ThreadDispatcher)
    assert service.every == 2 and service.max_pending == 2
    with pytest.raises(
        ValueError, match=r"no eval_fn: a spec string cannot carry a Python function"
    ):
        SakuraRuntime([service]).start()
    service.configure(world.eval_fn, world.val_payload(), pass_task=True)
    with SakuraRuntime([service], strict=True) as rt:
        world.train(rt, epochs=2)
    assert [r.epoch for r in service.history] == [1]
    assert service.dispatcher is None  # the service built it, the service closed it


def test_async_eval_names_its_function_and_payload() -> None:
    service = create("service", "async_eval:inthread,fn=operator:add,payload=os:getcwd")
    assert service.eval_fn is operator.add and service.eval_payload == os.getcwd()
    assert service.pass_task is False
    service = create("service", "async_eval:inthread,fn=operator:add,pass_task=true")
    assert service.pass_task is True
    assert isinstance(service.dispatcher, InThreadDispatcher)


def test_options_the_service_does_not_take_go_to_the_dispatcher() -> None:
    service = create("service", "async_eval:process,threads=2,every=3")
    assert isinstance(service.dispatcher, LocalDispatcher) and service.dispatcher.threads == 2
    assert service.every == 3
    service.dispatcher.close()


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            "async_eval:gpu",
            "unknown dispatcher 'gpu'; accepted: cluster, inthread, (.*, )?process, remote, thread",
        ),
        ("async_eval:thread,process", "only one positional value"),
        ("async_eval:thread,bogus=1", "bogus"),
        ("async_eval:thread,fn=json", "fn must be written package.module:name"),
        ("async_eval:thread,fn=json:nope", "has no attribute 'nope'"),
        ("async_eval:thread,fn=no_such_module_xyz:f", "cannot import"),
        ("async_eval:thread,eval_fn=x", "eval_fn cannot be given in a spec string"),
        ("async_eval:thread,every=0", "every=0 is not accepted; accepted: an int >= 1"),
        ("async_eval:thread,fn=json:dumps", "cannot be called with two positional"),
        ("async_checkpoint:thread,every=often", "every='often' is not accepted"),
        ("async_checkpoint:thread,state_provider=x", "state_provider cannot be given"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, match: str) -> None:
    with pytest.raises((SpecError, ValueError, TypeError), match=match):
        create("service", spec)


@pytest.mark.parametrize(
    ("spec", "hint"),
    [
        ("async_eval:thred", "thread"),
        ("async_eval:dispatcher=prcess", "process"),
        ("async_checkpoint:inthred,dir=x", "inthread"),
    ],
)
def test_a_misspelt_dispatcher_is_rejected_at_parse_time_with_the_nearest_name(
    spec: str, hint: str
) -> None:
    with pytest.raises(SpecError, match=rf"accepted: cluster, .*thread; did you mean '{hint}'\?"):
        create("service", spec)


def test_check_dispatcher_rejects_a_misspelt_name_without_building_anything() -> None:
    """For a service constructor (``AsyncEval(dispatcher="thred")``): the error names the
    option, the value, the accepted names and the nearest one, before install."""
    from sakura_async.dispatch.resolve import check_dispatcher, resolve_dispatcher

    with pytest.raises(
        ValueError,
        match=r"AsyncEval: dispatcher='thred' is not accepted; accepted: a registered "
        r"dispatcher: cluster, .*thread; did you mean 'thread'\?",
    ):
        check_dispatcher("thred", owner="AsyncEval")
    with pytest.raises(ValueError, match="did you mean 'remote'"):
        resolve_dispatcher("remot:uri=tls://h:1")
    with pytest.raises(TypeError, match="dispatcher must be a sakura_async dispatcher"):
        check_dispatcher(3)
    for fine in (None, "thread", "process:threads=2", InThreadDispatcher()):
        check_dispatcher(fine)


def test_async_checkpoint_by_name(tmp_path: Path) -> None:
    service = create(
        "service",
        f"async_checkpoint:thread,dir={tmp_path},every=500steps,keep=none,format=safetensors",
    )
    assert isinstance(service, AsyncCheckpoint) and isinstance(service.dispatcher, ThreadDispatcher)
    assert (service.unit, service.amount, service.keep, service.format) == (
        "steps",
        500,
        None,
        "safetensors",
    )
    assert service.dir == str(tmp_path)
    default = create("service", "async_checkpoint")  # no silent ./checkpoints
    assert default.dir is None and default.unit == "epochs"
    with SakuraRuntime([default], strict=True) as rt:  # the loop's output dir is the default
        rt.emit(OnTrainBegin, loop=LoopContext(output_dir=str(tmp_path / "run")))
    assert default.dir == str(tmp_path / "run" / default.name)
    best = create(
        "service", f"async_checkpoint:inthread,dir={tmp_path},every=best,metric=val_loss,mode=max"
    )
    assert (best.unit, best.metric, best.mode) == ("best", "val_loss", "max")


def test_from_config_installs_by_spec(world: Any, tmp_path: Path) -> None:
    rt = SakuraRuntime.from_config(
        services=[f"async_checkpoint:inthread,dir={tmp_path},every=1,keep=1"]
    )
    with rt:
        world.train(rt, epochs=2)
    assert sakura_async.load_latest(tmp_path).epoch == 1


@pytest.mark.parametrize("service", ["AsyncEval", "AsyncCheckpoint"])
def test_a_misspelt_dispatcher_name_is_rejected_at_construction(
    service: str, tmp_path: Path
) -> None:
    from sakura.options import OptionError

    with pytest.raises(OptionError, match=r"dispatcher='thred'.*thread") as caught:
        if service == "AsyncEval":
            AsyncEval(eval_fn=lambda epoch, payload: {}, dispatcher="thred")
        else:
            AsyncCheckpoint(dir=str(tmp_path), dispatcher="thred")
    assert service in str(caught.value)
