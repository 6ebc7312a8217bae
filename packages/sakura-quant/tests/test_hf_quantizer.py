"""transformers' quantizer registry: from_pretrained(..., quantization_config=SakuraQuantConfig)
quantizes while loading, save_pretrained / from_pretrained restore the stored tensors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura.options import OptionError
from sakura_quant import QuantizedLinear, SakuraQuantConfig, quantize_model

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
peft = pytest.importorskip("peft")


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


def _load(path: Path, **kwargs: Any) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _assert_same_state(got: Any, want: Any) -> None:
    got_state, want_state = got.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    for key, value in want_state.items():
        assert got_state[key].dtype == value.dtype, key
        assert torch.equal(got_state[key], value), key


CASES = [
    ("nf4", {}),
    ("int8", {"block_size": 128, "double_quant": True}),
    ("fp8", {}),
    ("nvfp4", {"keep_precise": "auto"}),
    # keep_precise and LoftQ together: each weight is fitted in both formats while it loads.
    ("nf4", {"double_quant": True, "keep_precise": 0.3, "error_rank": 4, "error_iters": 2}),
]


@pytest.mark.parametrize(("fmt", "options"), CASES, ids=[f"{f}-{sorted(o)}" for f, o in CASES])
def test_from_pretrained_equals_quantize_model_and_reloads(
    tmp_path: Path, fmt: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _tiny_llama().save_pretrained(tmp_path / "fp")
    loaded = _load(tmp_path / "fp", quantization_config=SakuraQuantConfig(fmt, **options))
    expected = _load(tmp_path / "fp").requires_grad_(False)
    stats = quantize_model(expected, fmt, **options)
    assert sum(isinstance(m, QuantizedLinear) for m in loaded.modules()) == stats["tensors"] == 14
    assert type(loaded.lm_head) is torch.nn.Linear
    if options.get("keep_precise"):
        kept = sum(isinstance(m, QuantizedLinear) and m.format != fmt for m in loaded.modules())
        assert kept == stats["kept_precise"] > 0
    _assert_same_state(loaded, expected)
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        logits = loaded(ids).logits
        assert torch.equal(logits, expected(ids).logits)

    loaded.save_pretrained(tmp_path / "q")
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert saved == SakuraQuantConfig(fmt, **options).to_dict()

    # Reloading reads the stored tensors: nothing is quantized from full precision again.
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a pre-quantized checkpoint was quantized again")

    for name in (
        "hf.quantizer.build_layer",
        "hf.quantizer.encode",
        "linear.encode",
        "linear.fit_error",
        "linear.quantize_weight",
    ):
        monkeypatch.setattr(f"sakura_quant.{name}", refuse)
    reloaded = _load(tmp_path / "q")
    assert reloaded.hf_quantizer.pre_quantized
    _assert_same_state(reloaded, loaded)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, logits)


def test_nf4_equals_bitsandbytes_through_from_pretrained(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    _tiny_llama().save_pretrained(tmp_path / "fp")
    ours = _load(tmp_path / "fp", quantization_config=SakuraQuantConfig("nf4"))
    bnb_config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    theirs = _load(tmp_path / "fp", quantization_config=bnb_config, device_map="cpu")
    layers = [(n, m) for n, m in ours.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 14
    for name, layer in layers:
        weight = theirs.get_submodule(name).weight
        assert torch.equal(weight.data.view(-1), layer.weight), name
        assert torch.equal(weight.quant_state.absmax, layer.weight_scales), name
    ids = torch.randint(0, 64, (2, 10))
    # In training mode: since 0.50, bitsandbytes repacks an eval-mode Linear4bit on a CPU
    # with AVX512-BF16 for a bf16 inference kernel, which changes its logits (not ours).
    ours.train()
    theirs.train()
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_tied_head_bf16_and_targets(tmp_path: Path) -> None:
    _tiny_llama(tie=True).save_pretrained(tmp_path / "fp")
    # skip=[] would quantize lm_head, but it shares the embedding's weight: it is left alone.
    config = SakuraQuantConfig("nf4", skip=[])
    loaded = _load(tmp_path / "fp", quantization_config=config, dtype=torch.bfloat16)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    q = loaded.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedLinear) and q.compute_dtype == torch.bfloat16
    loaded.save_pretrained(tmp_path / "q", max_shard_size="20KB")  # sharded: the layout is in each
    assert len(list((tmp_path / "q").glob("*.safetensors"))) > 1
    reloaded = _load(tmp_path / "q")
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert reloaded.model.layers[0].self_attn.q_proj.compute_dtype == torch.bfloat16
    _assert_same_state(reloaded, loaded)

    only = _load(tmp_path / "fp", quantization_config=SakuraQuantConfig("int8", targets=["q_proj"]))
    names = [n for n, m in only.named_modules() if isinstance(m, QuantizedLinear)]
    assert names == [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
    with pytest.raises(OptionError, match=r"targets=\['lm_head'\].*tied to another module"):
        _load(tmp_path / "fp", quantization_config=SakuraQuantConfig("nf4", targets=["lm_head"]))


def test_config_round_trip_and_bad_options() -> None:
    from transformers.quantizers.auto import AutoQuantizationConfig

    config = SakuraQuantConfig("nf4", block_size=32, double_quant=True, keep_precise=True)
    data = config.to_dict()
    assert data["keep_precise"] == 0.05 and data["skip"] == ["lm_head"]
    again = AutoQuantizationConfig.from_dict(json.loads(json.dumps(data)))
    assert isinstance(again, SakuraQuantConfig) and again.to_dict() == data

    # What device_map="auto" plans with: the bytes of a quantized weight, scales included.
    from sakura_quant.hf import SakuraHfQuantizer

    sizes = [("nf4", {}), ("nf4", {"double_quant": True}), ("fp8", {}), ("nvfp4", {})]
    for fmt, options in [*sizes, ("int8", {"block_size": 128, "double_quant": True})]:
        layer = QuantizedLinear.from_linear(torch.nn.Linear(128, 64), fmt, **options)
        planned = SakuraHfQuantizer(SakuraQuantConfig(fmt, **options)).quantized_element_size
        assert planned * 128 * 64 == pytest.approx(layer.quantized_nbytes, rel=0.01), fmt

    # The errors are quantize_model's, with this owner.
    bad = [
        ({"format": "nf5"}, "format='nf5'"),
        ({"format": "nf4", "block_size": 63}, "block_size=63"),
        ({"format": "fp8", "double_quant": True}, "double_quant=True"),
        ({"format": "int8", "keep_precise": 0.1}, "keep_precise=0.1"),
        ({"format": "nf4", "error_iters": 3}, "error_iters=3"),
        ({"format": "nf4", "skip": "lm_head"}, "skip='lm_head'"),
        ({"format": "nf4", "quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
        ({"format": "nf4", "matmul_dtype": "fp64"}, "matmul_dtype='fp64'"),
    ]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).requires_grad_(False)
    for options, shown in bad:
        with pytest.raises(OptionError) as error:
            SakuraQuantConfig(**options)
        assert str(error.value).startswith(f"SakuraQuantConfig: {shown} is not accepted")
        if "quant_method" not in options:
            fmt = options.pop("format")
            with pytest.raises(OptionError) as reference:
                quantize_model(model, fmt, **options)
            # quantize_model spells the format quantize=, as the reference does
            assert str(error.value).removeprefix("SakuraQuantConfig") == str(
                reference.value
            ).removeprefix("quantize_model").replace(": quantize=", ": format=")
    with pytest.raises(OptionError, match="block_size=3"):
        SakuraQuantConfig.from_dict({**data, "block_size": 3})


def test_matmul_dtype_is_saved_and_applied_on_reload(tmp_path: Path) -> None:
    _tiny_llama().save_pretrained(tmp_path / "fp")
    config = SakuraQuantConfig("nf4", matmul_dtype="bf16")
    model = _load(tmp_path / "fp", quantization_config=config)
    for again in (model, None):
        if again is None:
            model.save_pretrained(tmp_path / "q")
            again = _load(tmp_path / "q")
            assert again.config.quantization_config.matmul_dtype == "bfloat16"
        layers = [m for m in again.modules() if isinstance(m, QuantizedLinear)]
        assert len(layers) == 14 and all(m.matmul_dtype == torch.bfloat16 for m in layers)


def test_dequantize_gives_plain_linears(tmp_path: Path) -> None:
    _tiny_llama().save_pretrained(tmp_path / "fp")
    model = _load(tmp_path / "fp", quantization_config=SakuraQuantConfig("int8"))
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        quantized = model(ids).logits
        model = model.dequantize()
        assert torch.equal(model(ids).logits, quantized)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    assert not hasattr(model.config, "quantization_config")
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    model.save_pretrained(tmp_path / "plain")
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())


def test_checkpoint_without_layout_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _tiny_llama().save_pretrained(tmp_path / "fp")
    _load(tmp_path / "fp", quantization_config=SakuraQuantConfig("nf4")).save_pretrained(
        tmp_path / "q"
    )
    file = tmp_path / "q" / "model.safetensors"
    save_file(load_file(file), file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="carries the 'sakura_quant' layout"):
        _load(tmp_path / "q")


def test_peft_trains_on_the_reloaded_model(tmp_path: Path) -> None:
    _tiny_llama().save_pretrained(tmp_path / "fp")
    _load(tmp_path / "fp", quantization_config=SakuraQuantConfig("nf4")).save_pretrained(
        tmp_path / "q"
    )
    model = _load(tmp_path / "q")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    wrapped = lora.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(wrapped.base_layer, QuantizedLinear)
    trainable = [p for p in lora.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in lora.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(0, 64, (4, 12))
    lora.train()
    losses = []
    for _ in range(8):
        loss = lora(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    after = lora.get_base_model().state_dict()
    for key, value in base.items():
        peft_key = (
            key.replace(".q_proj.", ".q_proj.base_layer.")
            .replace(".v_proj.", ".v_proj.base_layer.")
            .replace(".down_proj.", ".down_proj.base_layer.")
        )
        assert torch.equal(after[peft_key], value), key

    # The adapters alone are saved; on the base reloaded from its folder they give the same model.
    lora.eval()
    lora.save_pretrained(tmp_path / "adapter")
    again = peft.PeftModel.from_pretrained(_load(tmp_path / "q"), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, lora(ids).logits)


def test_under_the_hf_trainer(tmp_path: Path) -> None:
    _tiny_llama().save_pretrained(tmp_path / "fp")
    model = _load(tmp_path / "fp", quantization_config=SakuraQuantConfig("nf4", double_quant=True))
    base = model.model.layers[1].self_attn.v_proj.weight.clone()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    start = {n: p.detach().clone() for n, p in lora.named_parameters() if p.requires_grad}
    ids = torch.randint(0, 64, (8, 12))
    args = transformers.TrainingArguments(
        str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
    )
    data = [{"input_ids": row, "labels": row} for row in ids]
    transformers.Trainer(model=lora, args=args, train_dataset=data).train()
    layer = lora.base_model.model.model.layers[1].self_attn.v_proj
    assert torch.equal(layer.base_layer.weight, base)
    moved = [
        n for n, p in lora.named_parameters() if p.requires_grad and not torch.equal(p, start[n])
    ]
    assert any("lora_B" in n for n in moved)


def test_import_is_cheap() -> None:
    code = (
        "import sys, sakura_quant\n"
        "from sakura_quant import _hf_hook\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "assert sys.meta_path[0] is _hf_hook.FINDER\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_failed_registration_only_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registering runs inside the import of transformers' registry: where it cannot work
    (transformers 4, which has another loading API), that import must still succeed."""
    from sakura_quant import _hf_hook

    monkeypatch.setitem(sys.modules, "sakura_quant.hf", None)  # importing it raises ImportError
    with pytest.warns(UserWarning, match="not in transformers' quantizer registry"):
        _hf_hook._register()


def test_registered_when_the_registry_is_imported(tmp_path: Path) -> None:
    from transformers.quantizers import auto

    from sakura_quant import _hf_hook
    from sakura_quant.hf import SakuraHfQuantizer

    # The registry is imported already: install() registers at once.
    del auto.AUTO_QUANTIZER_MAPPING["sakura_quant"]
    del auto.AUTO_QUANTIZATION_CONFIG_MAPPING["sakura_quant"]
    _hf_hook.install()
    assert auto.AUTO_QUANTIZER_MAPPING["sakura_quant"] is SakuraHfQuantizer
    assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING["sakura_quant"] is SakuraQuantConfig
    _hf_hook.install()  # a second time changes nothing

    # Not imported yet: the finder waits for that import, lets it run, then calls back once.
    (tmp_path / "fake_registry_pkg").mkdir()
    (tmp_path / "fake_registry_pkg" / "__init__.py").write_text("")
    (tmp_path / "fake_registry_pkg" / "auto.py").write_text("MAPPING = {}\n")
    calls: list[dict[str, Any]] = []

    def callback() -> None:
        calls.append(dict(sys.modules["fake_registry_pkg.auto"].MAPPING, done=True))

    finder = _hf_hook.PostImportFinder("fake_registry_pkg.auto", callback)
    sys.path.insert(0, str(tmp_path))
    try:
        finder.install()
        assert finder in sys.meta_path and not calls
        import fake_registry_pkg.auto as fake

        assert calls == [{"done": True}] and finder not in sys.meta_path
        assert fake.__loader__.get_filename("fake_registry_pkg.auto").endswith("auto.py")
    finally:
        finder.remove()
        sys.path.remove(str(tmp_path))
        for name in ("fake_registry_pkg.auto", "fake_registry_pkg"):
            sys.modules.pop(name, None)
