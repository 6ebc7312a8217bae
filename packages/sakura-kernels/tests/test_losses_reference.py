"""reference_logprobs: the policy with its adapters off equals a separate base model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sakura.options import OptionError
from sakura_kernels.losses.reference import (
    ReferenceLogprobs,
    preference_logprobs,
    reference_logprobs,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 256, 12


def base_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )
    return transformers.LlamaForCausalLM(config).eval()


def policy() -> torch.nn.Module:
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model = peft.get_peft_model(base_model(), config)
    model.train()
    return model


def examples(count: int) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(count):
        chosen = torch.randint(0, VOCAB, (SEQ,), generator=g)
        rejected = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels_c, labels_r = chosen.clone(), rejected.clone()
        labels_c[:4] = -100  # a shared-length prompt, not scored
        labels_r[:4] = -100
        out.append(
            {
                "id": f"pair-{i}",
                "chosen_input_ids": chosen,
                "chosen_labels": labels_c,
                "rejected_input_ids": rejected,
                "rejected_labels": labels_r,
            }
        )
    return out


def full_logprobs(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The unfused form on the base model: its logits, log-softmax, gather, sum."""
    logits = model(input_ids=ids).logits.float()
    logps = logits[:, :-1].log_softmax(-1)
    targets = labels[:, 1:]
    picked = logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != -100)).sum(-1)


def test_reference_equals_a_separate_base_model_and_adapters_come_back() -> None:
    model = policy()
    data = examples(5)
    ref = reference_logprobs(model, data, chunk_size=7)
    assert isinstance(ref, ReferenceLogprobs) and len(ref) == 5
    assert ref.keys == tuple(f"pair-{i}" for i in range(5))
    assert model.training  # the mode is restored
    base = base_model()  # same seed: the policy's base weights, built separately
    with torch.no_grad():
        for side in ("chosen", "rejected"):
            ids = torch.stack([e[f"{side}_input_ids"] for e in data])  # type: ignore[misc]
            labels = torch.stack([e[f"{side}_labels"] for e in data])  # type: ignore[misc]
            expected = full_logprobs(base, ids, labels)
            got = getattr(ref, side)
            assert got.dtype == torch.float32
            assert torch.allclose(got, expected, rtol=0, atol=1e-4)
    # The adapters are on again after the pass: the policy differs from the reference.
    with torch.no_grad():
        batch = {k: torch.stack([e[k] for e in data[:2]]) for k in data[0] if k != "id"}  # type: ignore[misc]
        policy_c, _ = preference_logprobs(model.eval(), batch)
    assert (policy_c - ref.chosen[:2]).abs().min() > 1e-3
    # disable_adapters=False: the policy as it is (the reference of DPO continued from an
    # adapter), adapters included.
    as_is = reference_logprobs(model, data[:2], disable_adapters=False)
    assert torch.allclose(as_is.chosen, policy_c, rtol=0, atol=1e-5)
    assert not model.training  # eval before the call, eval after it
    chosen, rejected = ref.lookup(["pair-3", "pair-0"])
    assert torch.equal(chosen, ref.chosen[[3, 0]]) and torch.equal(rejected, ref.rejected[[3, 0]])


def test_batches_without_ids_are_keyed_by_position_and_default_labels_use_the_mask() -> None:
    model = policy()
    data = examples(4)
    batches = []
    for start in (0, 2):
        part = data[start : start + 2]
        batch = {
            f"{side}_{name}": torch.stack([e[f"{side}_input_ids"] for e in part])  # type: ignore[misc]
            for side in ("chosen", "rejected")
            for name in ("input_ids",)
        }
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[:, -3:] = 0  # right padding: not scored when no labels are given
        batch["chosen_attention_mask"] = mask
        batch["rejected_attention_mask"] = mask
        batches.append(batch)
    ref = reference_logprobs(model, batches)
    assert ref.keys == (0, 1, 2, 3)
    base = base_model()
    ids = torch.stack([e["chosen_input_ids"] for e in data])  # type: ignore[misc]
    labels = ids.masked_fill(torch.cat([batches[0]["chosen_attention_mask"]] * 2) == 0, -100)
    with torch.no_grad():
        mask = torch.cat([batches[0]["chosen_attention_mask"]] * 2)
        logits = base(input_ids=ids, attention_mask=mask).logits
        logps = F.log_softmax(logits[:, :-1].float(), -1)
        targets = labels[:, 1:]
        picked = logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        expected = (picked * (targets != -100)).sum(-1)
    assert torch.allclose(ref.chosen, expected, rtol=0, atol=1e-4)
    with pytest.raises(KeyError, match="no example keyed 9"):
        ref.lookup([9])


def test_reference_options_are_validated() -> None:
    model = policy()
    with pytest.raises(OptionError, match="reference_logprobs: chunk_size=0"):
        reference_logprobs(model, examples(1), chunk_size=0)
    with pytest.raises(OptionError, match=r"batches_or_dataset=.*without chosen_input_ids"):
        reference_logprobs(model, [{"rejected_input_ids": torch.zeros(3, dtype=torch.long)}])
    with pytest.raises(OptionError, match="batches_or_dataset='dict'"):
        reference_logprobs(model, examples(1)[0])  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="disable_adapters='no'"):
        reference_logprobs(model, examples(1), disable_adapters="no")  # type: ignore[arg-type]
    twice = examples(1) * 2
    with pytest.raises(OptionError, match="id='repeated ids'"):
        reference_logprobs(model, twice)


def test_chosen_and_rejected_of_different_lengths_run_apart() -> None:
    model = base_model()
    data = examples(2)
    batch = {
        "chosen_input_ids": torch.stack([e["chosen_input_ids"] for e in data]),  # type: ignore[misc]
        "rejected_input_ids": torch.stack([e["rejected_input_ids"][:-3] for e in data]),  # type: ignore[index,misc]
    }
    with torch.no_grad():
        chosen, rejected = preference_logprobs(model, batch, chunk_size=5)
        ids_r = batch["rejected_input_ids"]
        expected = full_logprobs(model, ids_r, ids_r)
    assert rejected.shape == (2,) and torch.allclose(rejected, expected, rtol=0, atol=1e-4)
    ids_c = batch["chosen_input_ids"]
    with torch.no_grad():
        assert torch.allclose(chosen, full_logprobs(model, ids_c, ids_c), rtol=0, atol=1e-4)
