"""Packing: best-fit decreasing against brute force and first-fit, the packed rows' layout,
and a packed batch against its documents one by one on a Llama-architecture model."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from sakura.options import OptionError
from sakura_adapters.packing import IGNORE_INDEX, PackedCollator, best_fit, pack_sequences

transformers = pytest.importorskip("transformers")


# --- best_fit -----------------------------------------------------------------------------


def first_fit(lengths: list[int], capacity: int) -> int:
    """Bins first-fit uses, items in the given order (the simple rival)."""
    loads: list[int] = []
    for size in lengths:
        for k, load in enumerate(loads):
            if load + size <= capacity:
                loads[k] += size
                break
        else:
            loads.append(size)
    return len(loads)


def optimum(lengths: list[int], capacity: int) -> int:
    """The fewest bins, by exhaustive search (small lists only)."""
    items = sorted(lengths, reverse=True)
    best = [len(items)]

    def place(i: int, loads: list[int]) -> None:
        if len(loads) >= best[0]:
            return
        if i == len(items):
            best[0] = len(loads)
            return
        tried = set()
        for k, load in enumerate(loads):
            if load + items[i] <= capacity and load not in tried:
                tried.add(load)
                loads[k] += items[i]
                place(i + 1, loads)
                loads[k] -= items[i]
        loads.append(items[i])
        place(i + 1, loads)
        loads.pop()

    place(0, [])
    return best[0]


def check_bins(bins: list[list[int]], lengths: list[int], capacity: int) -> None:
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # each item once
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert all(0 < load <= capacity for load in loads)
    assert all(b == sorted(b) for b in bins)
    # Any-fit: a bin is opened only when the item fits nowhere, so two bins never fit in one.
    for a in range(len(loads)):
        for b in range(a + 1, len(loads)):
            assert loads[a] + loads[b] > capacity
    assert len(bins) >= math.ceil(sum(lengths) / capacity)


def test_best_fit_known_cases() -> None:
    assert best_fit([5, 4, 3, 3, 2, 2, 1], 10) == [[0, 1, 6], [2, 3, 4, 5]]
    # First-fit in this order needs 3 bins ([1, 1], [9], [9]); best fit decreasing 2.
    assert best_fit([1, 1, 9, 9], 10) == [[0, 2], [1, 3]]
    assert first_fit([1, 1, 9, 9], 10) == 3
    # Best fit, not first fit: the 1 goes to the bin with 2 left ([4, 4]), not to the first
    # bin that has room ([7], 3 left).
    assert best_fit([7, 4, 4, 1], 10) == [[0], [1, 2, 3]]
    assert best_fit([10], 10) == [[0]]
    assert best_fit([], 4) == []
    assert best_fit([1] * 6, 2) == [[0, 1], [2, 3], [4, 5]]


def test_best_fit_against_the_optimum_and_first_fit() -> None:
    rng = random.Random(1234)
    ours = theirs = 0
    for _ in range(400):
        capacity = rng.randint(5, 40)
        lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 8))]
        bins = best_fit(lengths, capacity)
        check_bins(bins, lengths, capacity)
        best = optimum(lengths, capacity)
        assert len(bins) <= 11 / 9 * best + 6 / 9, (lengths, capacity)
        assert len(bins) <= best + 1
        ours += len(bins)
        theirs += first_fit(lengths, capacity)
    assert ours < theirs  # fewer bins in total than first-fit in the given order


def test_best_fit_many_items() -> None:
    rng = random.Random(7)
    lengths = [rng.randint(1, 2048) for _ in range(5000)]
    bins = best_fit(lengths, 2048)
    check_bins(bins, lengths, 2048)
    assert len(bins) <= math.ceil(sum(lengths) / 2048) * 1.02 + 1  # rows over 98 % full
    assert len(bins) <= first_fit(lengths, 2048)


@pytest.mark.parametrize(
    ("lengths", "capacity", "option"),
    [
        ([1], 0, "capacity"),
        ([1], True, "capacity"),
        ([0, 1], 4, "lengths[0]"),
        ([1, 5], 4, "lengths[1]"),
        ([2.0], 4, "lengths[0]"),
        ([False], 4, "lengths[0]"),
    ],
)
def test_best_fit_rejects(lengths: list[Any], capacity: Any, option: str) -> None:
    with pytest.raises(OptionError, match=r"best_fit: " + option.replace("[", r"\[")) as info:
        best_fit(lengths, capacity)
    assert info.value.option == option


# --- pack_sequences ------------------------------------------------------------------------


def test_pack_sequences_layout() -> None:
    rows = pack_sequences([[1, 2, 3], [4, 5], [6]], 4, pad_token_id=9)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 6], [4, 5, 9, 9]]
    assert rows["labels"].tolist() == [[-100, 2, 3, -100], [-100, 5, -100, -100]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 1]]
    assert all(t.dtype == torch.long for t in rows.values())


def test_pack_sequences_labels_pad_and_overflow() -> None:
    prompt = {"input_ids": torch.tensor([1, 2, 3, 4]), "labels": [-100, -100, 3, 4]}
    rows = pack_sequences([prompt, (5, 6)], 8, pad_to="longest")
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6]]
    assert rows["labels"].tolist() == [[-100, -100, 3, 4, -100, 6]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1]]

    long = list(range(1, 11))
    split = pack_sequences([long], 4, pad_to="longest")
    assert split["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]
    assert split["labels"].tolist() == [[-100, 2, 3, 4], [-100, 6, 7, 8], [-100, 10, -100, -100]]
    split = pack_sequences([long, [11]], 4)  # a piece of a split document shares a row
    assert split["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 0]]
    assert split["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 0, 0]]
    truncated = pack_sequences([long], 4, overflow="truncate")
    assert truncated["input_ids"].tolist() == [[1, 2, 3, 4]]
    with pytest.raises(OptionError, match=r"sequences\[0\]=.*max_length=4"):
        pack_sequences([long], 4, overflow="error")


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"sequences": [[1]], "max_length": 0}, "max_length"),
        ({"sequences": [[1]], "max_length": 4, "overflow": "drop"}, "overflow"),
        ({"sequences": [[1]], "max_length": 4, "pad_to": "multiple"}, "pad_to"),
        ({"sequences": [[1]], "max_length": 4, "pad_token_id": 0.5}, "pad_token_id"),
        ({"sequences": [[1.5, 2.0]], "max_length": 4}, "sequences[0]"),
        ({"sequences": [[[1, 2]]], "max_length": 4}, "sequences[0]"),
        ({"sequences": [{"ids": [1]}], "max_length": 4}, "sequences[0]"),
        (
            {"sequences": [{"input_ids": [1, 2], "labels": [1]}], "max_length": 4},
            "sequences[0]['labels']",
        ),
        ({"sequences": [[], torch.tensor([], dtype=torch.long)], "max_length": 4}, "sequences"),
    ],
)
def test_pack_sequences_rejects(kwargs: dict[str, Any], option: str) -> None:
    with pytest.raises(OptionError) as info:
        pack_sequences(**kwargs)
    assert info.value.option == option
    assert str(info.value).startswith("pack_sequences: ")


@pytest.mark.parametrize(
    ("kwargs", "option", "value"),
    [
        ({"pad_token_id": -1}, "pad_token_id", -1),
        ({"pad_token_id": True}, "pad_token_id", True),
        ({"pad_token_id": 2**40}, "pad_token_id", 2**40),
        ({"sequences": [[1, 2], [3, -5]]}, "sequences[1][1]", -5),
        ({"sequences": [[1, 2**40]]}, "sequences[0][1]", 2**40),
        ({"sequences": [[True, False]]}, "sequences[0]", [True, False]),
        ({"sequences": [torch.tensor([1, 2, 2**31])]}, "sequences[0][2]", 2**31),
        ({"sequences": [torch.tensor([3, 1], dtype=torch.int8)]}, None, None),
        (
            {"sequences": [{"input_ids": [1, 2, 3], "labels": [-100, 2, -1]}]},
            "sequences[0]['labels'][2]",
            -1,
        ),
    ],
)
def test_pack_sequences_rejects_bad_token_ids(
    kwargs: dict[str, Any], option: str | None, value: Any
) -> None:
    # These were packed silently: a pad id of -1 or 2**40, bool ids, negative ids.
    arguments = {"sequences": [[1, 2]], "max_length": 4, **kwargs}
    if option is None:  # small int dtypes are ids too
        assert pack_sequences(**arguments)["input_ids"].tolist() == [[3, 1, 0, 0]]
        return
    with pytest.raises(OptionError) as info:
        pack_sequences(**arguments)
    assert info.value.option == option
    assert info.value.value == value and type(info.value.value) is type(value)
    assert str(info.value).startswith(f"pack_sequences: {option}=")
    assert "int" in info.value.accepted


def test_packed_collator_rejects_a_negative_pad_id() -> None:
    with pytest.raises(
        OptionError, match=r"PackedCollator: pad_token_id=-1 .*>= 0 and <= 2147483647"
    ):
        PackedCollator(4, pad_token_id=-1)


def test_packed_collator_rejects() -> None:
    for kwargs, option in (
        ({"max_length": 0}, "max_length"),
        ({"use_cache": "no"}, "use_cache"),
        ({"pad_to": "all"}, "pad_to"),
        ({"overflow": 1}, "overflow"),
    ):
        with pytest.raises(OptionError, match="PackedCollator: ") as info:
            PackedCollator(**kwargs)
        assert info.value.option == option


# --- on a Llama-architecture model ---------------------------------------------------------


def tiny_llama(attn: str = "sdpa", dtype: torch.dtype = torch.float64) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(config).to(dtype)


def documents(n: int = 9, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 21, (n,), generator=g).tolist()
    return [torch.randint(0, 97, (length,), generator=g) for length in lengths]


def summed_loss(model: Any, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Any:
    """Summed next-token cross-entropy, computed in the model's dtype."""
    logits = model(input_ids=input_ids, **kwargs).logits
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(
        shifted, labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def one_by_one(model: Any, docs: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    total = sum(summed_loss(model, d[None], d[None]) for d in docs)
    total.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return total.detach(), grads


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_equal_documents_one_by_one(attn: str) -> None:
    torch.set_num_threads(1)
    model = tiny_llama(attn)
    docs = documents()
    reference, ref_grads = one_by_one(model, docs)
    rows = pack_sequences(docs, 32)
    assert rows["input_ids"].shape[0] < len(docs)  # documents really share rows
    assert (rows["position_ids"] == 0).sum() > rows["input_ids"].shape[0]
    packed = summed_loss(
        model, rows["input_ids"], rows["labels"], position_ids=rows["position_ids"], use_cache=False
    )
    packed.backward()
    torch.testing.assert_close(packed.detach(), reference, rtol=1e-5, atol=1e-5)
    for p, ref in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-5)


def test_the_model_loss_of_packed_rows() -> None:
    """The model's own loss (labels passed) is the token mean over all documents."""
    torch.set_num_threads(1)
    model = tiny_llama("sdpa", torch.float32)
    docs = documents(seed=3)
    reference, _ = one_by_one(model, docs)
    tokens = sum(len(d) - 1 for d in docs)
    batch = PackedCollator(24)([{"input_ids": d.tolist()} for d in docs])
    loss = model(**batch).loss
    torch.testing.assert_close(loss.double() * tokens, reference.double(), rtol=1e-5, atol=1e-5)


def test_a_kv_cache_lets_documents_see_each_other() -> None:
    """Why PackedCollator passes use_cache=False: with the model's default (a cache is built
    on every forward), transformers ignores the position ids' document boundaries."""
    model = tiny_llama("sdpa")
    docs = documents(seed=5)
    reference, _ = one_by_one(model, docs)
    rows = pack_sequences(docs, 40)
    assert model.config.use_cache
    leaky = summed_loss(model, rows["input_ids"], rows["labels"], position_ids=rows["position_ids"])
    assert abs(float(leaky) - float(reference)) > 1e-3


@pytest.mark.parametrize("max_length", [None, 24])
def test_packed_collator_under_the_hf_trainer(tmp_path: Any, max_length: int | None) -> None:
    """One SGD step of a real transformers.Trainer on packed batches moves the weights as the
    gradient of the token-mean loss of the documents one by one does; its eval_loss is that
    mean."""
    torch.set_num_threads(1)
    model = tiny_llama("sdpa", torch.float32)
    docs = documents(seed=11)
    tokens = sum(len(d) - 1 for d in docs)
    reference, ref_grads = one_by_one(model, docs)
    lr = 0.5
    expected = [
        p.detach() - lr * g / tokens for p, g in zip(model.parameters(), ref_grads, strict=True)
    ]
    features = [{"input_ids": d.tolist()} for d in docs]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=len(docs),
        per_device_eval_batch_size=len(docs),
        max_steps=1,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=features,
        eval_dataset=features,
        data_collator=PackedCollator(max_length),
        optimizers=(torch.optim.SGD(model.parameters(), lr=lr), None),
    )
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(float(reference) / tokens, rel=1e-5)
    trainer.train()
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-5)
