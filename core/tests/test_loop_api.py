"""sakura.loop, sakura.proxies and sakura.marks: the public doors between adapters and
services."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from sakura import OnTrainBegin, SakuraRuntime, Service, marks
from sakura.loop import LoopContext
from sakura.proxies import (
    register_optimizer_proxy,
    registered_optimizer_proxies,
    unwrap_optimizer,
)


def test_loop_context_is_frozen_and_everything_is_optional() -> None:
    ctx = LoopContext()
    assert (ctx.framework, ctx.output_dir, ctx.checkpoint_state) == ("raw", None, None)
    assert ctx.report_metrics is None and ctx.wrapped_model is None
    assert ctx.gradient_clipping is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.output_dir = "x"  # type: ignore[misc]


def test_on_train_begin_carries_the_loop_context_to_services() -> None:
    got = []

    class Reader(Service):
        def on_train_begin(self, event: OnTrainBegin) -> None:
            got.append(event.loop)

    ctx = LoopContext(framework="toy", output_dir="/tmp/run")
    with SakuraRuntime(strict=True) as rt:
        rt.install(Reader())
        rt.emit(OnTrainBegin, loop=ctx)
    assert got == [ctx]


class _Real:
    pass


class _Proxy:
    def __init__(self, inner: object) -> None:
        self.inner = inner


class _SubProxy(_Proxy):
    pass


class _Other:
    def __init__(self, wrapped: object) -> None:
        self._wrapped = wrapped


def test_unwrap_follows_every_registered_layer_and_subclasses() -> None:
    register_optimizer_proxy(_Proxy, "inner")
    register_optimizer_proxy(_Other, lambda p: p._wrapped)
    real = _Real()
    assert unwrap_optimizer(real) is real
    assert unwrap_optimizer(_Proxy(real)) is real
    assert unwrap_optimizer(_SubProxy(_Other(_Proxy(real)))) is real
    assert _Proxy in registered_optimizer_proxies()


def test_a_proxy_loop_is_an_error_not_a_hang() -> None:
    class Loop:
        pass

    register_optimizer_proxy(Loop, lambda p: Loop())
    with pytest.raises(RuntimeError, match="proxy layers"):
        unwrap_optimizer(Loop())


@pytest.mark.parametrize("inner", ["not an attribute", 3, None])
def test_register_optimizer_proxy_rejects_bad_arguments(inner: object) -> None:
    with pytest.raises((TypeError, ValueError), match="inner must be"):
        register_optimizer_proxy(_Real, inner)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cls must be a class"):
        register_optimizer_proxy("_Real", "x")  # type: ignore[arg-type]


def test_marks_set_read_clear_and_survive_deepcopy() -> None:
    class Block:
        pass

    block = Block()
    assert not marks.has_mark(block, marks.RECOMPUTED)
    assert marks.get_mark(block, marks.RECOMPUTED, "no") == "no"
    marks.set_mark(block, marks.RECOMPUTED, "activation_checkpoint")
    marks.set_mark(block, "acme.pinned")
    clone = copy.deepcopy(block)
    assert marks.get_mark(clone, marks.RECOMPUTED) == "activation_checkpoint"
    assert marks.get_mark(clone, "acme.pinned") is True
    marks.clear_mark(block, marks.RECOMPUTED)
    assert not marks.has_mark(block, marks.RECOMPUTED)
    assert marks.has_mark(clone, marks.RECOMPUTED)  # the copy has its own marks
    marks.clear_mark(Block(), "anything")  # nothing to clear: no error
    with pytest.raises(ValueError, match="non-empty string"):
        marks.set_mark(block, "")
