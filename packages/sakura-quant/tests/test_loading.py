"""load_model: a safetensors checkpoint read tensor by tensor and quantized while read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sakura.options import OptionError
from sakura_quant import QuantizedLinear, load_model, quantize_model

safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _tiny_llama(tie: bool = False) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(("fmt", "shard"), [("nf4", None), ("int8", "40KB")])
def test_hf_folder_loads_equal_to_quantize_model(tmp_path: Path, fmt: str, shard: Any) -> None:
    original = _tiny_llama()
    kwargs = {"max_shard_size": shard} if shard else {}
    original.save_pretrained(tmp_path, **kwargs)
    if shard:
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(tmp_path, fmt)
    expected = _tiny_llama()
    expected.load_state_dict(original.state_dict())
    expected.requires_grad_(False)
    quantize_model(expected, fmt)
    got_state, want_state = loaded.state_dict(), expected.state_dict()
    assert got_state.keys() == want_state.keys()
    for key, value in want_state.items():
        assert torch.equal(got_state[key], value), key
    assert sum(isinstance(m, QuantizedLinear) for m in loaded.modules()) == 14
    assert not any(p.requires_grad for p in loaded.parameters())
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected(ids).logits)


def test_tied_head_and_dtype(tmp_path: Path) -> None:
    original = _tiny_llama(tie=True)
    original.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, "nf4", dtype=torch.bfloat16, double_quant=True)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    q = loaded.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedLinear) and q.compute_dtype == torch.bfloat16
    assert q.weight_scales.dtype == torch.uint8
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        assert loaded(ids).logits.dtype == torch.bfloat16
    fp32_in_bf16 = load_model(tmp_path, "nf4", matmul_dtype="bf16")
    q = fp32_in_bf16.model.layers[0].self_attn.q_proj
    assert q.compute_dtype == torch.float32 and q.matmul_dtype == torch.bfloat16


def test_unquantized_load_is_exact(tmp_path: Path) -> None:
    original = _tiny_llama()
    original.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, None)
    assert not any(isinstance(m, QuantizedLinear) for m in loaded.modules())
    for key, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_given_skeleton_and_single_file(
    tmp_path: Path, make_tiny_lm: Callable[[], nn.Module]
) -> None:
    source = make_tiny_lm()
    file = tmp_path / "tiny.safetensors"
    safetensors_torch.save_file(source.state_dict(), str(file))
    with torch.device("meta"):
        skeleton = make_tiny_lm()
    loaded = load_model(file, "fp8", model=skeleton)
    assert loaded is skeleton
    expected = make_tiny_lm()
    expected.load_state_dict(source.state_dict())
    quantize_model(expected.requires_grad_(False), "fp8")
    ids = torch.randint(0, 32, (2, 5))
    assert torch.equal(loaded(ids), expected(ids))


def test_missing_key_and_bad_options(tmp_path: Path, make_tiny_lm: Callable[[], nn.Module]) -> None:
    state = make_tiny_lm().state_dict()
    del state["layers.1.norm.weight"]
    file = tmp_path / "partial.safetensors"
    safetensors_torch.save_file(state, str(file))
    with torch.device("meta"):
        skeleton = make_tiny_lm()
    with pytest.raises(KeyError, match=r"lacks \['layers\.1\.norm\.weight'\]"):
        load_model(file, "nf4", model=skeleton)
    with pytest.raises(OptionError, match=r"load_model: quantize='fp4'"):
        load_model(file, "fp4", model=skeleton)
    with pytest.raises(OptionError, match=r"load_model: dtype=torch\.int8"):
        load_model(file, "nf4", model=skeleton, dtype=torch.int8)
    with pytest.raises(OptionError, match=r"load_model: name_or_path=.*nowhere"):
        load_model(tmp_path / "nowhere", "nf4", model=skeleton)
