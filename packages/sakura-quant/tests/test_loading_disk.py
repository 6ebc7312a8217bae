"""load_model(disk_offload=DIR): the decoder layers' matrices that are not quantized are
written to memory-mapped files as they are read (sakura_torch.disk.TensorFileStore); the
model computes what the one loaded into RAM does; the folder goes away on close and after a
failed load; a folder that cannot be used is an error naming disk_offload."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura.options import OptionError
from sakura_quant import QuantizedLinear, load_model

safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    original = transformers.LlamaForCausalLM(_config()).eval()
    original.save_pretrained(folder)
    return original.state_dict()


_MATRICES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _layer_keys(names: list[str]) -> set[str]:
    return {
        f"model.layers.{i}.{'self_attn' if n.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{n}.weight"
        for i in range(2)
        for n in names
    }


def test_unquantized_matrices_live_in_mapped_files(tmp_path: Path) -> None:
    state = _saved(tmp_path / "ckpt")
    disk = tmp_path / "disk"
    loaded = load_model(tmp_path / "ckpt", None, dtype=torch.bfloat16, disk_offload=disk)
    store = loaded.sakura_disk_offload
    stored = store.keys()
    assert set(stored) == _layer_keys(_MATRICES)  # norms, embeddings, head stay in RAM
    assert store.root.parent == disk and len(list(store.root.iterdir())) == 14
    assert store.nbytes == sum(state[k].numel() * 2 for k in stored)
    in_ram = load_model(tmp_path / "ckpt", None, dtype=torch.bfloat16)
    got, want = loaded.state_dict(), in_ram.state_dict()
    for key in stored:
        mapped = store.get(key)
        assert torch.equal(got[key], want[key]) and torch.equal(mapped, want[key]), key
        assert got[key].untyped_storage().data_ptr() != want[key].untyped_storage().data_ptr()
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, in_ram(ids).logits)
    root = store.root
    store.close()
    assert not root.exists() and not disk.exists()  # made by the store, removed with it


def test_quantized_targets_stay_in_ram_and_the_rest_go_to_disk(tmp_path: Path) -> None:
    _saved(tmp_path / "ckpt")
    loaded = load_model(
        tmp_path / "ckpt", "nf4", targets=["q_proj", "k_proj"], disk_offload=tmp_path / "disk"
    )
    store = loaded.sakura_disk_offload
    assert set(store.keys()) == _layer_keys(
        ["v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, QuantizedLinear)
    root = store.root
    del loaded, store
    gc.collect()  # the store goes with the model: its folder too
    assert not root.exists()


def test_random_weights_to_disk(tmp_path: Path) -> None:
    _config().save_pretrained(tmp_path / "cfg")
    torch.manual_seed(0)
    loaded = load_model(tmp_path / "cfg", None, random_weights=True, disk_offload=tmp_path / "d")
    torch.manual_seed(0)
    in_ram = load_model(tmp_path / "cfg", None, random_weights=True)
    assert len(loaded.sakura_disk_offload.keys()) == 14
    for key, value in in_ram.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    loaded.sakura_disk_offload.close()


def test_failed_load_leaves_nothing_and_bad_folders_are_named(tmp_path: Path) -> None:
    state = _saved(tmp_path / "ckpt")
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)  # untrusted: wrong shape
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    safetensors_torch.save_file(state, str(tmp_path / "ckpt" / "model.safetensors"))
    disk = tmp_path / "disk"
    with pytest.raises(ValueError, match=r"down_proj\.weight as \(3, 3\)"):
        load_model(tmp_path / "ckpt", None, disk_offload=disk)
    assert not disk.exists() or not list(disk.iterdir())  # the private folder is gone
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(OptionError, match=r"load_model: disk_offload=.*a_file"):
        load_model(tmp_path / "ckpt", None, disk_offload=a_file)
    with pytest.raises(OptionError, match=r"load_model: disk_offload=3 .*None or a directory"):
        load_model(tmp_path / "ckpt", None, disk_offload=3)
