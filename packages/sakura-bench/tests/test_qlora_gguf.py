"""smollm2-qlora's model path, without the real model file: a tiny Llama written as GGUF here
(with the gguf package) is converted once into the cached transformers folder, which loads
the same weights and tokenizer, and the workload trains LoRA on it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sakura_bench.registry import get_registry


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (what a "gpt2" GGUF tokenizer's tokens are made of)."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def write_tiny_gguf(path: Path, hidden: int = 32, heads: int = 4, kv: int = 2) -> None:
    """A one-layer Llama in GGUF (f32 tensors) with a byte-level BPE tokenizer whose id 0
    is ``<|endoftext|>``, as SmolLM2's is."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    tokens = ["<|endoftext|>", *_bytes_to_unicode().values()]
    n, inter, head_dim = len(tokens), 2 * hidden, hidden // heads
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(n)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (n - 1))
    writer.add_token_scores([0.0] * n)
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    shapes = {
        "token_embd.weight": (n, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (kv * head_dim, hidden),
        "blk.0.attn_v.weight": (kv * head_dim, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (inter, hidden),
        "blk.0.ffn_up.weight": (inter, hidden),
        "blk.0.ffn_down.weight": (hidden, inter),
    }
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_smollm2_reads_a_gguf_once_into_a_cached_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GGUF file is converted once into a transformers folder (model, tokenizer, no
    quantization_config); the folder loads the same weights and tokenizes the same; a second
    use reads the cache; the smollm2-qlora workload trains on it with PEFT."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sakura_bench.workloads import qlora

    gguf_path = tmp_path / "model" / "tiny.gguf"
    gguf_path.parent.mkdir()
    write_tiny_gguf(gguf_path)
    monkeypatch.setenv("SAKURA_BENCH_CACHE", str(tmp_path / "cache"))
    folder = qlora.smollm2_folder(gguf_path)
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("tiny-")
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no temporaries
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    direct = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    cached = AutoModelForCausalLM.from_pretrained(folder)
    expected = direct.state_dict()
    assert cached.state_dict().keys() == expected.keys()
    for key, value in cached.state_dict().items():
        assert torch.equal(value, expected[key]), key
    text = "def f(x):\n    return x + 1\n"
    tok_direct = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert AutoTokenizer.from_pretrained(folder)(text).input_ids == tok_direct(text).input_ids
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert qlora.smollm2_folder(gguf_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp

    monkeypatch.setattr(qlora, "_gguf_file", lambda: gguf_path)
    workload = get_registry().workload("smollm2-qlora")("tiny", seed=0)
    split = workload.train_split()
    assert split["input_ids"].shape == (4, 64) and workload.tokens(split) > 0.9 * 4 * 64
    model = workload.make_model()
    batch = {k: v[:2] for k, v in split.items()}
    loss = workload.loss(model, batch)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
