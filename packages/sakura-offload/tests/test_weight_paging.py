"""Frozen-weight paging: bit-identical training, at most prefetch + 1 blocks materialised
(checked on the tensors' real lifetimes), saved weights as tokens, bad input."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura import marks
from sakura.options import OptionError
from sakura_offload.paging.activations import ActivationPaging
from sakura_offload.paging.weights import WeightPaging, frozen_block_bytes

WIDTH = 24


class Block(torch.nn.Module):
    """Frozen projections (one used through a transposed view) and a trainable adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Parameter(torch.randn(WIDTH, 2 * WIDTH) * 0.2)
        self.adapter = torch.nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(self.norm(x)))
        return x + h @ self.down.t() + self.adapter(x)  # down.t(): a view autograd saves


class Net(torch.nn.Module):
    def __init__(self, blocks: int = 5) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.head = torch.nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def net() -> Net:
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        for p in (*block.up.parameters(), block.down):
            p.requires_grad_(False)
    return model


def data(step: int = 0) -> torch.Tensor:
    return torch.randn(4, 7, 8, generator=torch.Generator().manual_seed(step))


def train(model: torch.nn.Module, steps: int = 3, device: str = "cpu") -> list[Any]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    record: list[Any] = []
    for step in range(steps):
        x = data(step).to(device).requires_grad_(True)
        out = model(x)
        loss = out.pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        record.append((out.detach().clone(), x.grad))
        record.extend(p.grad.clone() for p in model.parameters() if p.requires_grad)
        optimizer.step()
    return record


def assert_identical(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, tuple):
            assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
        else:
            assert torch.equal(x, y)


class LiveCopies:
    """Counts the blocks whose device copies are alive, from the copies' own lifetimes:
    every ``torch.empty_like`` of a host-store tensor is a device copy of that block."""

    def __init__(self, paging: WeightPaging, monkeypatch: pytest.MonkeyPatch) -> None:
        self.owner = {
            id(host): block.index for block in paging._blocks for host in block.host.values()
        }
        self.copies: list[tuple[int, weakref.ref[torch.UntypedStorage]]] = []
        self.max_live = 0
        self.samples = 0
        original = torch.empty_like

        def empty_like(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = original(t, *args, **kwargs)
            if id(t) in self.owner:
                self.copies.append((self.owner[id(t)], weakref.ref(out.untyped_storage())))
            return out

        monkeypatch.setattr(torch, "empty_like", empty_like)

    def live(self) -> set[int]:
        return {block for block, ref in self.copies if ref() is not None}

    def sample(self, *_: Any) -> None:
        self.samples += 1
        self.max_live = max(self.max_live, len(self.live()))

    def watch(self, model: Net) -> None:
        """Sample in every inner module's forward and before its backward."""
        for block in model.blocks:
            for module in (block.norm, block.up, block.adapter):
                module.register_forward_pre_hook(self.sample)
                module.register_forward_hook(self._watch_output)

    def _watch_output(self, _module: Any, _args: Any, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(self.sample)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_training_is_bit_identical_and_at_most_prefetch_plus_one_blocks_live(
    prefetch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = train(net())
    model = net()
    paging = WeightPaging(model, prefetch=prefetch)
    assert paging.paged_names == [f"blocks.{i}" for i in range(5)]
    assert paging.stats.paged_params == 15  # up.weight, up.bias, down in each block
    live = LiveCopies(paging, monkeypatch)
    live.watch(model)
    assert_identical(train(model), reference)
    assert live.samples > 50 and len(live.copies) > 0
    assert live.max_live == min(prefetch + 1, 5)
    assert paging.stats.max_live_blocks == min(prefetch + 1, 5)
    per_block = (2 * WIDTH * WIDTH + 2 * WIDTH + 2 * WIDTH * WIDTH) * 4
    assert paging.paged_bytes == {f"blocks.{i}": per_block for i in range(5)}
    assert paging.stats.max_live_bytes == min(prefetch + 1, 5) * per_block
    assert paging.stats.live_bytes == 0
    # After each backward every copy is gone; between steps the weights are the host store.
    gc.collect()
    paging.check_released()
    assert live.live() == set() and paging.stats.live_blocks == 0
    assert paging.stats.still_referenced == 0 and paging.stats.on_demand == 0
    assert paging.stats.saved_tokens > 0 and paging.stats.saved_kept == 0
    if prefetch:
        assert paging.stats.prefetched > 0
    block = model.blocks[2]
    assert block.down.data_ptr() == paging._blocks[2].host["down"].data_ptr()
    assert block.adapter.weight.requires_grad  # trainable parameters are not paged


def test_streamed_blocks_carry_the_public_mark_until_removed() -> None:
    model = net()
    paging = WeightPaging(model, indices=[3, 1])
    streamed = [i for i, b in enumerate(model.blocks) if marks.has_mark(b, marks.WEIGHTS_STREAMED)]
    assert streamed == [1, 3]
    assert marks.get_mark(model.blocks[1], marks.WEIGHTS_STREAMED) == "weight_paging"
    paging.remove()
    assert not any(marks.has_mark(b, marks.WEIGHTS_STREAMED) for b in model.blocks)


def test_forward_and_backward_each_materialise_every_block_once() -> None:
    model = net()
    paging = WeightPaging(model, prefetch=1)
    model(data()).sum().backward()
    # Forward: 5 blocks (4 of them prefetched); backward: 5 again (4 prefetched).
    assert paging.stats.materialised == 10 and paging.stats.prefetched == 8


def test_only_the_selected_blocks_are_paged() -> None:
    reference = train(net(), steps=2)
    model = net()
    sizes = frozen_block_bytes(model)
    assert [name for name, _ in sizes] == [f"blocks.{i}" for i in range(5)]
    assert {size for _, size in sizes} == {(4 * WIDTH * WIDTH + 2 * WIDTH) * 4}
    paging = WeightPaging(model, indices=[3, 1], prefetch=1)
    assert paging.paged_names == ["blocks.1", "blocks.3"]
    assert paging.stats.paged_params == 6
    assert_identical(train(model, steps=2), reference)
    assert paging.stats.max_live_blocks == 2


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_forward_that_raises_leaves_nothing_installed(error: type[BaseException]) -> None:
    reference = train(net(), steps=1)
    model = net()
    paging = WeightPaging(model, prefetch=1)

    def fail(*_: Any) -> None:
        raise error

    handle = model.blocks[2].up.register_forward_pre_hook(fail)
    with pytest.raises(error):
        model(data())
    handle.remove()
    if error is KeyboardInterrupt:  # torch's always-call forward hooks do not run for it
        paging.release_all()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert model.blocks[2].down.data_ptr() == paging._blocks[2].host["down"].data_ptr()
    assert_identical(train(model, steps=1), reference)
    assert paging.stats.live_blocks == 0


def test_an_interrupted_forward_is_unwound_by_the_next_one() -> None:
    reference = train(net(), steps=1)
    model = net()
    paging = WeightPaging(model, prefetch=1)

    def fail(*_: Any) -> None:
        raise KeyboardInterrupt

    handle = model.blocks[2].up.register_forward_pre_hook(fail)
    with pytest.raises(KeyboardInterrupt):
        model(data())
    handle.remove()
    assert_identical(train(model, steps=1), reference)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert paging.stats.live_blocks == 0


def test_retained_graph_runs_backward_twice() -> None:
    model = net()
    paging = WeightPaging(model)
    x = data().requires_grad_(True)
    loss = model(x).pow(2).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    loss.backward()
    assert torch.equal(x.grad, first)  # type: ignore[arg-type]
    assert paging.stats.live_blocks == 0


def test_a_graph_that_outlives_remove_still_runs_backward() -> None:
    reference = net()
    x = data().requires_grad_(True)
    reference(x).pow(2).sum().backward()
    model = net()
    paging = WeightPaging(model)
    y = data().requires_grad_(True)
    loss = model(y).pow(2).sum()
    paging.remove()
    loss.backward()
    assert torch.equal(y.grad, x.grad)  # type: ignore[arg-type]
    assert all(not p.is_pinned() for p in model.parameters())


def test_no_grad_forward_and_remove() -> None:
    model = net()
    expected = model(data()).detach()
    paging = WeightPaging(model, prefetch=2)
    with torch.no_grad():
        assert torch.equal(model(data()), expected)
    assert paging.stats.live_blocks == 0
    host = paging._blocks[0].host["down"]
    paging.remove()
    assert model.blocks[0].down.data_ptr() != host.data_ptr()
    assert torch.equal(model.blocks[0].down, host)
    assert torch.equal(model(data()), expected)
    assert paging.stats.materialised == 5  # the hooks are gone


def test_a_kept_reference_to_a_device_copy_is_reported() -> None:
    model = net()
    kept: list[torch.Tensor] = []
    model.blocks[1].up.register_forward_hook(lambda m, a, o: kept.append(m.weight.detach()))
    paging = WeightPaging(model)
    with pytest.warns(RuntimeWarning, match=r"block blocks\.1's weights is still referenced"):
        model(data()).sum().backward()
    assert paging.stats.still_referenced >= 1
    assert kept[0].data_ptr() != paging._blocks[1].host["up.weight"].data_ptr()


def test_composes_with_activation_paging(tmp_path: Path) -> None:
    def run(weights: bool) -> tuple[list[Any], ActivationPaging, WeightPaging | None]:
        model = net()
        paging = WeightPaging(model) if weights else None
        activations = ActivationPaging("disk", directory=tmp_path, min_bytes=0)
        with activations:
            record = train(model, steps=2)
        return record, activations, paging

    reference, plain, _ = run(False)
    got, activations, paging = run(True)
    assert_identical(got, reference)
    assert paging is not None and paging.stats.saved_tokens == 20  # up.weight, down.t()
    # Every other saved tensor still reached ActivationPaging (the hooks below ours); the
    # frozen weights became tokens instead of files.
    assert activations.stats.paged == plain.stats.paged - paging.stats.saved_tokens > 0
    assert activations.stats.restored == activations.stats.paged


def test_recomputation_inside_paged_blocks() -> None:
    precision = pytest.importorskip("sakura_precision")
    reference = train(net(), steps=2)
    model = net()
    precision.ActivationCheckpoint().wrap_model(model)
    paging = WeightPaging(model)
    assert_identical(train(model, steps=2), reference)
    assert paging.stats.on_demand == 0 and paging.stats.live_blocks == 0


def test_blocks_are_selected_as_the_core_selects_them() -> None:
    from sakura_torch.blocks import find_blocks

    model = tiny_lora_llama()
    for selector in (None, "LlamaDecoderLayer", lambda name, m: name.endswith("mlp")):
        expected = [name for name, _ in find_blocks(model, selector)]
        paging = WeightPaging(copy.deepcopy(model), blocks=selector)
        assert paging.block_names == expected


def tiny_lora_llama() -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    model = get_peft_model(
        LlamaForCausalLM(config),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def test_peft_lora_llama_is_bit_identical() -> None:
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(2))

    def step(model: Any) -> list[torch.Tensor]:
        loss = model(input_ids=ids, labels=ids).loss
        trainable = [p for p in model.parameters() if p.requires_grad]
        return [loss.detach(), *torch.autograd.grad(loss, trainable)]

    base = tiny_lora_llama()
    paged = copy.deepcopy(base)
    paging = WeightPaging(paged, prefetch=1)
    assert paging.paged_names == [f"base_model.model.model.layers.{i}" for i in range(3)]
    # q/k/v/o, gate/up/down and the two norms of each layer; the adapters stay.
    assert paging.stats.paged_params == 3 * 9
    assert_identical(step(paged), step(base))
    paging.check_released()
    assert paging.stats.max_live_blocks == 2 and paging.stats.live_blocks == 0
    assert paging.stats.still_referenced == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_peft_lora_llama_with_transformers_gradient_checkpointing(reentrant: bool) -> None:
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(3))

    def step(model: Any) -> list[torch.Tensor]:
        model.train()
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
        model.enable_input_require_grads()  # reentrant checkpointing needs a grad input
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # (reentrant checkpointing does not support autograd.grad)
        return [loss.detach(), *(p.grad for p in model.parameters() if p.requires_grad)]

    base = tiny_lora_llama()
    paged = copy.deepcopy(base)
    paging = WeightPaging(paged, prefetch=1)
    assert_identical(step(paged), step(base))
    paging.check_released()  # the graph is gone: its recomputed aliases went with it
    assert paging.stats.saved_tokens == 0  # under checkpointing nothing is saved
    assert paging.stats.on_demand == 0 and paging.stats.live_blocks == 0
    assert paging.stats.max_live_blocks == 2 and paging.stats.still_referenced == 0


def test_options_are_validated() -> None:
    with pytest.raises(OptionError, match="prefetch=-1 is not accepted; accepted: an int >= 0"):
        WeightPaging(net(), prefetch=-1)
    with pytest.raises(OptionError, match="pin_memory='yes'"):
        WeightPaging(net(), pin_memory="yes")  # type: ignore[arg-type]
    for bad in ([5], [0, 0], "01", [True]):
        with pytest.raises(
            OptionError, match=r"indices=.*distinct block positions, ints in \[0, 5\)"
        ):
            WeightPaging(net(), indices=bad)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="blocks=3 is not accepted"):
        WeightPaging(net(), blocks=3)
    with pytest.raises(
        OptionError, match=r"blocks='Conv2d' is not accepted.*Conv2d matched no module of"
    ):
        WeightPaging(net(), blocks="Conv2d")
    with pytest.raises(OptionError, match="found no repeated block stack"):
        WeightPaging(torch.nn.Linear(2, 2))
    with pytest.raises(OptionError, match="model='str' is not accepted"):
        WeightPaging("model")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(OptionError, match=r"pin_memory=True .*page-locking needs CUDA"):
            WeightPaging(net(), pin_memory=True)
        with pytest.raises(OptionError, match=r"device='cuda' .*a device that exists here"):
            WeightPaging(net(), device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_weights_stream_from_pinned_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    reference = [t.cpu() for t in _flat(train(net().cuda(), device="cuda"))]
    model = net()  # on the CPU: WeightPaging moves the rest to the GPU
    paging = WeightPaging(model, device="cuda", prefetch=1)
    assert paging.device == torch.device("cuda", torch.cuda.current_device())
    assert paging._blocks[0].host["down"].is_pinned()
    assert model.embed.weight.is_cuda and not model.blocks[0].down.is_cuda
    live = LiveCopies(paging, monkeypatch)
    live.watch(model)
    got = [t.cpu() for t in _flat(train(model, device="cuda"))]
    for a, b in zip(got, reference, strict=True):
        assert torch.equal(a, b)
    assert paging.stats.max_live_blocks == 2 and paging.stats.prefetched > 0
    assert live.max_live == 2
    torch.cuda.synchronize()
    gc.collect()
    assert live.live() == set() and paging.stats.still_referenced == 0


def _flat(record: list[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for item in record:
        out.extend(item if isinstance(item, tuple) else (item,))
    return out


@pytest.mark.parametrize("first", ["planner", "weight_paging"])
@pytest.mark.parametrize("choice", ["keep", "page_host", "page_disk", "recompute"])
def test_composes_with_the_memory_planner(first: str, choice: str, tmp_path: Path) -> None:
    """The planner's hooks inside a block pass its weights on to WeightPaging (tokens, not
    activations): the measured activation bytes are the unpaged model's, no device copy is
    kept alive, and training is bit-identical under every choice."""
    from sakura_offload.planner import MemoryPlanner

    def planner(model: Net) -> tuple[MemoryPlanner, Any]:
        made = MemoryPlanner(10**12, blocks=Block, min_bytes=0, directory=tmp_path, cost_trials=1)
        x = data(0)
        return made, made.plan(model, lambda: model(x).pow(2).mean())

    _, unpaged = planner(net())
    model = net()
    if first == "planner":
        plan_maker, plan = planner(model)
        paging = WeightPaging(model)
    else:
        paging = WeightPaging(model)
        plan_maker, plan = planner(model)
    assert [d.activation_bytes for d in plan.decisions] == [
        d.activation_bytes for d in unpaged.decisions
    ]
    plan_maker.decide(choice)
    tokens = paging.stats.saved_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a device copy kept alive would warn
        assert_identical(train(model, steps=2), train(net(), steps=2))
    assert paging.stats.still_referenced == 0 and paging.stats.live_blocks == 0
    # inside checkpoint nothing is saved; otherwise the two frozen weights of each of the
    # 5 blocks in each of the 2 steps are tokens
    assert paging.stats.saved_tokens - tokens == (0 if choice == "recompute" else 20)
