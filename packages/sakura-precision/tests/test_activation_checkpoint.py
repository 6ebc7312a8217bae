"""ActivationCheckpoint: block detection, bit-identical gradients, saved-tensor bytes,
selective policies, and the public ``RECOMPUTED`` mark on every checkpointed block."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from precision_helpers import Block, TinyStack, count_saved_bytes, loss_fn, make_batches, make_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sakura import SakuraRuntime
from sakura.options import OptionError
from sakura.testing import ServiceConformance
from sakura_precision import ActivationCheckpoint, find_blocks


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int = 3) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both runs
    loss_fn(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# --- block detection ---------------------------------------------------------------------


class Nested(nn.Module):
    """A small stack inside each block of a bigger stack: the bigger one is the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 8))
            )
            for _ in range(3)
        )


def test_auto_detection_finds_the_repeated_blocks() -> None:
    assert [n for n, _ in find_blocks(make_model(depth=4))] == [f"blocks.{i}" for i in range(4)]
    seq = nn.Sequential(nn.Linear(4, 16), Block(), Block(), nn.Linear(16, 2))
    assert [n for n, _ in find_blocks(seq)] == ["1", "2"]
    assert [n for n, _ in find_blocks(Nested())] == ["layers.0", "layers.1", "layers.2"]
    with pytest.raises(
        ValueError, match=r"accepted: a block class.*found no repeated block stack in Sequential"
    ):
        find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))


@pytest.mark.parametrize(
    "selector",
    [
        Block,
        (Block,),
        "Block",
        lambda name, module: name.startswith("blocks.") and name.count(".") == 1,
    ],
)
def test_explicit_selectors(selector: Any) -> None:
    assert [n for n, _ in find_blocks(make_model(), selector)] == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
    ]


def test_outermost_match_wins_and_bad_selectors() -> None:
    # the ModuleList is selected, so the Linear layers inside its blocks are not
    names = [n for n, _ in find_blocks(make_model(), (nn.Linear, nn.ModuleList))]
    assert names == ["proj", "blocks", "head"]
    with pytest.raises(
        ValueError,
        match=r"blocks='Linear3' is not accepted.*Linear3 matched no module of TinyStack",
    ):
        find_blocks(make_model(), "Linear3")
    with pytest.raises(
        ValueError, match=r"sub-blocks of TinyStack; TinyStack selects the whole model"
    ):
        find_blocks(make_model(), TinyStack)
    with pytest.raises(OptionError, match=r"blocks=<class 'int'> is not accepted; accepted: None"):
        ActivationCheckpoint(blocks=int)
    with pytest.raises(ValueError, match=r"blocks=3 is not accepted"):
        ActivationCheckpoint(blocks=3)


# --- correctness ---------------------------------------------------------------------------


def test_gradients_are_bit_identical_to_no_checkpointing() -> None:
    x, y = make_batches(1, batch=8)[0]
    plain = make_model(dropout=0.2)
    expected = _grads(plain, x, y)
    model = make_model(dropout=0.2)
    service = ActivationCheckpoint()
    with SakuraRuntime([service], strict=True) as rt:
        model = rt.wrap_model(model)
        got = _grads(model, x, y)
    assert service.checkpointed == ["blocks.0", "blocks.1", "blocks.2"]
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert set(model.state_dict()) == set(plain.state_dict())  # structure untouched


def test_saved_tensor_bytes_drop_by_the_expected_factor() -> None:
    """A checkpointed block keeps only its input (non-reentrant checkpointing saves it for
    the recomputation); a plain block keeps every activation its backward needs."""
    depth, batch = 4, 64
    x, _ = make_batches(1, batch=batch)[0]
    block = Block()
    with count_saved_bytes(block) as per_block:
        block(torch.randn(batch, 16, requires_grad=True)).sum()
    block_input = batch * 16 * 4  # fp32 bytes of one block's input
    model = make_model(depth=depth)
    with count_saved_bytes(model) as plain:
        model(x).sum()
    outside = plain[0] - depth * per_block[0]  # what the projection and the head save
    assert per_block[0] > 4 * block_input and outside > 0

    for every, checkpointed_blocks in ((1, depth), (2, depth // 2)):
        model = make_model(depth=depth)
        ActivationCheckpoint(every=every).wrap_model(model)
        with count_saved_bytes(model) as measured:
            model(x).sum()
        plain_blocks = depth - checkpointed_blocks
        expected = outside + checkpointed_blocks * block_input + plain_blocks * per_block[0]
        assert measured[0] == expected
        if every == 1:
            factor = plain[0] / measured[0]
            expected_factor = (outside + depth * per_block[0]) / (outside + depth * block_input)
            assert factor == pytest.approx(expected_factor) and factor > 3


class CountOps(TorchDispatchMode):
    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in self.names:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _backward_matmuls(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    loss = loss_fn(model(x), y)
    with CountOps(("mm", "addmm")) as counter:
        loss.backward()
    return counter.count


def test_save_matmuls_policy_recomputes_no_matmul_and_keeps_gradients() -> None:
    x, y = make_batches(1, batch=8)[0]
    baseline = _backward_matmuls(make_model(), x, y)
    full = make_model()
    ActivationCheckpoint().wrap_model(full)
    selective = make_model()
    ActivationCheckpoint(policy="save_matmuls").wrap_model(selective)
    custom = make_model()
    ActivationCheckpoint(policy={torch.ops.aten.addmm, "aten.mm"}).wrap_model(custom)
    # full checkpointing recomputes fc1 of each of the 3 blocks (the recomputation stops
    # early once fc2's input, the last tensor backward needs, is rebuilt)
    assert _backward_matmuls(full, x, y) == baseline + 3
    assert _backward_matmuls(selective, x, y) == baseline
    assert _backward_matmuls(custom, x, y) == baseline
    expected = _grads(make_model(), x, y)
    for model in (selective, custom):
        got = _grads(model, x, y)
        for name in expected:
            assert torch.equal(got[name], expected[name]), name


def test_callable_policy() -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    seen: set[str] = set()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        seen.add(op.overloadpacket.__name__)
        return CheckpointPolicy.PREFER_RECOMPUTE

    model = make_model()
    ActivationCheckpoint(policy=policy).wrap_model(model)
    x, y = make_batches(1)[0]
    loss_fn(model(x), y).backward()
    assert "addmm" in seen and "native_layer_norm" in seen


def test_no_grad_and_hooks_and_idempotence() -> None:
    model = make_model()
    service = ActivationCheckpoint()
    calls: list[str] = []
    model.blocks[0].register_forward_hook(lambda *_: calls.append("hook"))
    service.wrap_model(model)
    service.wrap_model(model)  # a second wrap_model does not checkpoint twice
    assert service.checkpointed == ["blocks.0", "blocks.1", "blocks.2"]
    x, _ = make_batches(1)[0]
    with torch.no_grad():
        eager = make_model()(x)
        torch.testing.assert_close(model(x), eager, rtol=0, atol=0)
    assert calls == ["hook"]


def test_checkpointed_models_copy_and_pickle() -> None:
    x, y = make_batches(1)[0]
    model = make_model(dropout=0.2)
    ActivationCheckpoint().wrap_model(model)
    expected = _grads(model, x, y)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.blocks[0].forward.module is clone.blocks[0]  # not the original's block
        got = _grads(clone, x, y)
        for name in expected:
            assert torch.equal(got[name], expected[name]), name


def test_framework_gradient_checkpointing_conflicts() -> None:
    model = make_model()
    ActivationCheckpoint().wrap_model(model)
    model.blocks[1].gradient_checkpointing = True  # what transformers sets on its layers
    x, y = make_batches(1)[0]
    with pytest.raises(
        RuntimeError, match=r"Block also has the framework's own gradient checkpointing"
    ):
        loss_fn(model(x), y).backward()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "save_all"}, r"policy='save_all' is not accepted; accepted: None"),
        ({"policy": {"aten.not_an_op"}}, r"policy names 'aten.not_an_op', which is not an aten op"),
        ({"policy": {3}}, r"policy ops must be aten ops"),
        ({"policy": 3.5}, r"policy=3.5 is not accepted"),
        ({"every": 0}, r"ActivationCheckpoint: every=0 is not accepted; accepted: an int >= 1"),
        (
            {"preserve_rng_state": "yes"},
            r"preserve_rng_state='yes' is not accepted; accepted: True or False",
        ),
    ],
)
def test_bad_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ActivationCheckpoint(**kwargs)


class TestActivationCheckpointConformance(ServiceConformance):
    def make_service(self) -> Any:
        # the tiny loop's model is an MLP without repeated blocks: select its Linear layers
        return ActivationCheckpoint(blocks=nn.Linear)


def test_checkpointed_blocks_carry_the_public_recomputed_mark() -> None:
    """Other services (a memory planner) read sakura.marks.RECOMPUTED, not a private name;
    a block already marked is not wrapped twice."""
    from sakura import marks

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    service = ActivationCheckpoint(blocks=nn.Linear)
    service.wrap_model(model)
    assert service.checkpointed == ["0", "2"]
    assert marks.get_mark(model[0], marks.RECOMPUTED) == "activation_checkpoint"
    assert marks.get_mark(model[2], marks.RECOMPUTED) == "activation_checkpoint"
    assert not marks.has_mark(model[1], marks.RECOMPUTED)
    assert "_sakura_activation_checkpoint" not in vars(model[0])
    again = ActivationCheckpoint(blocks=nn.Linear)
    again.wrap_model(model)
    assert again.checkpointed == []
