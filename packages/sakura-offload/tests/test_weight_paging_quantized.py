"""WeightPaging streams a quantized base: a tiny Llama quantized by sakura-quant (int8, NF4,
NF4 + double quantization, NF4 + LoftQ factors), its frozen tensors (codes, scales,
double-quant statistics, LoftQ factors: buffers; the norms: frozen parameters) paged, and
PEFT LoRA training bit-identical to the unpaged quantized model.  Buffers a forward writes
stay on the device by the documented rule."""

from __future__ import annotations

import copy
import gc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura_offload.paging.weights import WeightPaging, frozen_block_bytes

pytest.importorskip("peft")
pytest.importorskip("transformers")
sakura_quant = pytest.importorskip("sakura_quant")

LAYERS = 3
FORMATS = {
    "int8": ({"quantize": "int8"}, 2),  # codes, scales per quantized layer
    "nf4": ({"quantize": "nf4"}, 2),
    "nf4-double-quant": ({"quantize": "nf4", "double_quant": True}, 4),  # + scale, offset
    "nf4-loftq": ({"quantize": "nf4", "error_rank": 4}, 4),  # + error_a, error_b
}


def quantized_lora_llama(options: dict[str, Any]) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=61,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).requires_grad_(False)
    report = sakura_quant.quantize_model(model, **options)
    assert report["tensors"] == 7 * LAYERS  # q, k, v, o, gate, up, down of each layer
    model = get_peft_model(
        model,
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    if options.get("error_rank"):
        assert sakura_quant.init_lora_from_error(model) == 2 * LAYERS
    else:
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
    return model


def train(model: Any, steps: int = 3) -> list[torch.Tensor]:
    """Logits, loss and the LoRA gradients of each step (AdamW steps in between)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    record: list[torch.Tensor] = []
    for step in range(steps):
        ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(step))
        out = model(input_ids=ids, labels=ids)
        optimizer.zero_grad()
        out.loss.backward()
        record += [out.logits.detach(), out.loss.detach()]
        record += [p.grad.clone() for p in trainable]  # type: ignore[union-attr]
        optimizer.step()
    return record


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_quantized_base_streams_bit_identically(fmt: str) -> None:
    options, per_layer = FORMATS[fmt]
    base = quantized_lora_llama(options)
    paged = copy.deepcopy(base)
    expected_bytes = frozen_block_bytes(paged)
    paging = WeightPaging(paged, prefetch=1)
    assert paging.paged_names == [f"base_model.model.model.layers.{i}" for i in range(LAYERS)]
    assert paging.stats.paged_buffers == 7 * per_layer * LAYERS
    assert paging.stats.paged_params == 2 * LAYERS  # the two RMSNorm weights of each layer
    assert list(paging.paged_bytes.items()) == expected_bytes
    layer = paged.base_model.model.model.layers[1]
    codes = layer.self_attn.q_proj.base_layer.weight
    assert not codes.is_floating_point() and not isinstance(codes, torch.nn.Parameter)
    host = paging._blocks[1].host["self_attn.q_proj.base_layer.weight"]
    assert codes.data_ptr() == host.data_ptr()  # between passes the buffer is the host copy

    # Every expansion of the weight (forward, and backward's again) reads device copies.
    # (quantized_weight() is what every expansion reads the stored tensors through.)
    seen: list[int] = []
    quantized = layer.self_attn.q_proj.base_layer
    read = quantized.quantized_weight

    def quantized_weight() -> Any:
        seen.append(quantized.weight.data_ptr())
        return read()

    quantized.quantized_weight = quantized_weight
    got, want = train(paged), train(base)
    assert len(seen) >= 3 * 2 and host.data_ptr() not in seen  # (each expansion reads)
    assert len(got) == len(want) == 3 * (2 + 4 * LAYERS)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    gc.collect()
    paging.check_released()
    assert paging.stats.max_live_blocks == 2 and paging.stats.live_blocks == 0
    assert paging.stats.still_referenced == 0 and paging.stats.written == 0
    # forward and backward of each layer in each of the 3 steps
    assert paging.stats.materialised == 3 * 2 * LAYERS
    assert codes.data_ptr() == host.data_ptr()
    if fmt == "nf4-loftq":  # the factors are paged with the codes, and come back intact
        quantized = layer.mlp.down_proj
        assert paging._blocks[1].host["mlp.down_proj.error_a"].data_ptr() == (
            quantized.error_a.data_ptr()
        )

    paging.remove()
    assert codes.data_ptr() != host.data_ptr() and torch.equal(codes, host)
    ids = torch.arange(9).reshape(1, 9)
    assert torch.equal(paged(input_ids=ids).logits, base(input_ids=ids).logits)


WIDTH = 16


class Counter(torch.nn.Module):
    """A buffer written in place by each forward (the version counter sees it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.full((WIDTH,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x * self.scale


class Cache(torch.nn.Module):
    """A buffer the forward replaces with a new tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x.detach().mean(dim=(0, 1))
        return x


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(WIDTH)  # running stats: never paged (the rule)
        self.counter = Counter()
        self.cache = Cache()
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.proj.requires_grad_(False)
        self.adapter = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x.transpose(1, 2)).transpose(1, 2)
        h = self.cache(self.counter(h))
        return x + self.proj(h) + self.adapter(h)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(Block(), Block(), Block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.blocks(x)
        return out


def test_buffers_a_forward_writes_stay_on_the_device_and_training_matches() -> None:
    torch.manual_seed(0)
    base = Net()
    paged = copy.deepcopy(base)
    paging = WeightPaging(paged)
    # per block: proj weight and bias (parameters), counter.calls and counter.scale
    # (buffers); not the BatchNorm's running stats; cache.last is paged until replaced
    assert paging.stats.paged_params == 6 and paging.stats.paged_buffers == 9
    assert "norm.running_mean" not in paging._blocks[0].host

    def run(model: Net) -> list[torch.Tensor]:
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        record = []
        for step in range(3):
            x = torch.randn(4, 5, WIDTH, generator=torch.Generator().manual_seed(step))
            out = model(x)
            optimizer.zero_grad()
            out.square().mean().backward()
            optimizer.step()
            record += [out.detach(), *(b.clone() for b in model.buffers())]
        return record

    want = run(base)
    with pytest.warns(RuntimeWarning) as caught:
        got = run(paged)
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 6  # once per written tensor: counter.calls, cache.last x 3
    assert "block blocks.0's forward wrote counter.calls in place: it stays on cpu" in messages[1]
    assert "block blocks.0's forward replaced cache.last: it is left to the module" in messages[0]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert paging.stats.written == 6 and paging.stats.live_bytes == 0
    assert paging.stats.paged_buffers == 3 and paging.stats.paged_params == 6  # scale stays
    assert paged.blocks[2].counter.calls.item() == 3
    assert all(
        block.host.keys() == {"proj.weight", "proj.bias", "counter.scale"}
        for block in paging._blocks
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left to take out: no more warnings
        got = run(paged)
    for a, b in zip(got, run(base), strict=True):
        assert torch.equal(a, b)
    paging.remove()
    assert all(torch.equal(a, b) for a, b in zip(paged.buffers(), base.buffers(), strict=True))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_quantized_base_streams_under_gradient_checkpointing(reentrant: bool) -> None:
    """Recomputation in backward expands the codes again: they are installed then."""
    base = quantized_lora_llama(FORMATS["nf4-double-quant"][0])
    base.gradient_checkpointing_enable({"use_reentrant": reentrant})
    base.enable_input_require_grads()  # reentrant checkpointing needs a grad input
    paged = copy.deepcopy(base)  # checkpointed too
    paging = WeightPaging(paged, prefetch=1)
    base.train()
    paged.train()
    for a, b in zip(train(paged), train(base), strict=True):
        assert torch.equal(a, b)
    gc.collect()
    paging.check_released()
    # nothing is saved inside checkpointed blocks (unchecked, the norms' weights would be)
    assert paging.stats.saved_tokens == 0 and paging.stats.on_demand == 0
    assert paging.stats.max_live_blocks == 2 and paging.stats.still_referenced == 0


def test_a_quantized_base_streams_from_disk(tmp_path: Path) -> None:
    base = quantized_lora_llama(FORMATS["nf4-loftq"][0])
    paged = copy.deepcopy(base)
    paging = WeightPaging(paged, disk_offload=tmp_path, host_budget=0)
    assert set(paging.tiers.values()) == {"disk"}
    assert (
        paging.stats.disk_bytes
        == paging.stats.paged_bytes
        == sum(size for _, size in frozen_block_bytes(base))
    )
    root = paging.disk_root
    assert root is not None and len(list(root.iterdir())) == (7 * 4 + 2) * LAYERS
    for a, b in zip(train(paged), train(base), strict=True):
        assert torch.equal(a, b)
    paging.remove()
    assert not root.exists() and list(tmp_path.iterdir()) == []
