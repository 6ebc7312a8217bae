"""load_model's options as a user needs them: keep_precise, LoftQ and double quantization
streamed (equal to quantize_model on the same weights), random_weights, config overrides,
quantize="auto" against a forced RAM budget, and a model name resolved from a local
Hugging Face cache laid out in tmp_path."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sakura.options import OptionError
from sakura_quant import QuantizedLinear, load_model, quantize_model
from sakura_quant.codec import encode
from sakura_quant.load.budget import quantized_nbytes
from sakura_quant.options import WeightSpec

safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _config(**extra: Any) -> Any:
    fields: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    return transformers.LlamaConfig(**{**fields, **extra})


def _saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    original = transformers.LlamaForCausalLM(_config()).eval()
    original.save_pretrained(tmp_path)
    return tmp_path, original.state_dict()


def _quantized_by_hand(state: dict[str, torch.Tensor], fmt: str, **options: Any) -> Any:
    expected = transformers.LlamaForCausalLM(_config()).eval()
    expected.load_state_dict(state)
    expected.requires_grad_(False)
    stats = quantize_model(expected, fmt, **options)
    return expected, stats


def _assert_same_state(got: nn.Module, want: nn.Module) -> None:
    got_state, want_state = got.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    for key, value in want_state.items():
        assert got_state[key].dtype == value.dtype, key
        assert torch.equal(got_state[key], value), key


def _formats(model: nn.Module) -> dict[str, str]:
    return {n: m.format for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


@pytest.mark.parametrize(
    ("fmt", "options"),
    [
        ("nf4", {"keep_precise": 0.3}),
        ("nvfp4", {"keep_precise": "auto"}),
        ("nf4", {"double_quant": True, "keep_precise": 0.3, "error_rank": 4, "error_iters": 2}),
        ("int8", {"double_quant": True, "block_size": 32}),
        ("nf4", {"error_rank": 3}),
    ],
)
def test_streamed_options_equal_quantize_model(
    tmp_path: Path, fmt: str, options: dict[str, Any]
) -> None:
    path, state = _saved(tmp_path)
    loaded = load_model(path, fmt, **options)
    expected, stats = _quantized_by_hand(state, fmt, **options)
    _assert_same_state(loaded, expected)  # codes, scales, statistics, LoftQ factors
    formats = _formats(loaded)
    assert formats == _formats(expected) and len(formats) == 14
    kept = sum(f != fmt for f in formats.values())
    assert kept == stats["kept_precise"]
    if options.get("keep_precise"):
        assert 0 < kept < 14  # some chosen, within the share: the choice is exercised
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected(ids).logits)
    assert loaded.sakura_quant_load.quantize == fmt


def test_random_weights_without_a_checkpoint(tmp_path: Path) -> None:
    _config().save_pretrained(tmp_path)  # config.json only: no safetensors
    assert not list(tmp_path.glob("*.safetensors"))
    torch.manual_seed(1)
    first = load_model(tmp_path, "nf4", random_weights=True)
    torch.manual_seed(1)
    again = load_model(tmp_path, "nf4", random_weights=True)
    _assert_same_state(first, again)  # deterministic under torch.manual_seed
    torch.manual_seed(2)
    other = load_model(tmp_path, "nf4", random_weights=True)
    q, q_other = first.model.layers[0].self_attn.q_proj, other.model.layers[0].self_attn.q_proj
    assert not torch.equal(q.weight, q_other.weight)
    # the model's own initialisation: normal(0, initializer_range) matrices, unit norms
    std = _config().initializer_range
    embed = first.model.embed_tokens.weight
    assert abs(float(embed.std()) - std) < 0.1 * std
    assert abs(float(q.dequantize(torch.float32).std()) - std) < 0.1 * std
    assert torch.equal(first.model.norm.weight, torch.ones(64))
    assert len(_formats(first)) == 14 and not any(p.is_meta for p in first.parameters())
    with torch.no_grad():
        assert torch.isfinite(first(torch.randint(0, 64, (1, 6))).logits).all()


def test_random_weights_quantized_equal_the_same_weights_quantized_by_hand(tmp_path: Path) -> None:
    """Each module's values depend only on the seed and its name: the unquantized random
    model quantized by hand equals the random model quantized while it is built (keep_precise
    measures in a first pass and builds again: the two passes saw the same values)."""
    _config().save_pretrained(tmp_path)
    torch.manual_seed(3)
    plain = load_model(tmp_path, None, random_weights=True, dtype=torch.bfloat16)
    assert plain.model.layers[1].mlp.up_proj.weight.dtype == torch.bfloat16
    stats = quantize_model(plain, "nf4", keep_precise=0.3)
    torch.manual_seed(3)
    loaded = load_model(
        tmp_path, "nf4", random_weights=True, dtype=torch.bfloat16, keep_precise=0.3
    )
    _assert_same_state(loaded, plain)
    assert 0 < stats["kept_precise"] < 14


def test_config_overrides(tmp_path: Path) -> None:
    path, state = _saved(tmp_path)
    loaded = load_model(path, "int8", num_hidden_layers=1, rms_norm_eps=1e-5)
    assert len(loaded.model.layers) == 1 and loaded.config.num_hidden_layers == 1
    assert loaded.config.rms_norm_eps == 1e-5
    q = loaded.model.layers[0].self_attn.q_proj
    expected = encode(
        state["model.layers.0.self_attn.q_proj.weight"], WeightSpec("int8", 64, False)
    )
    assert torch.equal(q.weight, expected.tensors["data"])
    with pytest.raises(OptionError, match=r"load_model: num_hiden_layers=1 .*'num_hidden_layers'"):
        load_model(path, "nf4", num_hiden_layers=1)
    with pytest.raises(OptionError, match=r"load_model: keep_presise=0\.1 .*'keep_precise'"):
        load_model(path, "nf4", keep_presise=0.1)
    with pytest.raises(OptionError, match=r"load_model: num_hidden_layers=1 .*model="):
        load_model(path, "nf4", model=nn.Linear(2, 2), num_hidden_layers=1)


def _stored_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_auto_chooses_by_budget(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, _ = _saved(tmp_path)
    sizes = load_model(path, "auto", host_budget=2**40).sakura_quant_load.sizes
    assert sizes["none"] > sizes["int8"] > sizes["nf4"]
    for fmt in ("int8", "nf4"):  # the estimate is the loaded model's bytes, exactly
        assert sizes[fmt] == _stored_bytes(load_model(path, fmt)), fmt
    assert sizes["none"] == _stored_bytes(load_model(path, None))
    for budget, want in [
        (sizes["none"], "none"),
        (sizes["none"] - 1, "int8"),
        (sizes["int8"], "int8"),
        (sizes["int8"] - 1, "nf4"),
        (sizes["nf4"], "nf4"),
    ]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="sakura_quant"):
            loaded = load_model(path, "auto", host_budget=budget)
        choice = loaded.sakura_quant_load
        assert (choice.quantize, choice.budget) == (want, budget)
        said = [r.getMessage() for r in caplog.records if "quantize='auto'" in r.getMessage()]
        assert len(said) == 1 and f"chose {want!r}" in said[0]
        formats = set(_formats(loaded).values())
        assert formats == (set() if want == "none" else {want})
        if want != "none":
            _assert_same_state(loaded, load_model(path, want))
    with pytest.raises(
        MemoryError, match=rf"host_budget={sizes['nf4'] - 1} .*at least {sizes['nf4']} bytes"
    ):
        load_model(path, "auto", host_budget=sizes["nf4"] - 1)
    # the default budget is ram_fraction of the RAM available now
    with pytest.raises(MemoryError, match=r"at least \d+ bytes"):
        load_model(path, "auto", ram_fraction=1e-12)


def test_auto_with_keep_precise_and_dtype(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)
    options: dict[str, Any] = {"keep_precise": 0.3, "dtype": torch.bfloat16}
    sizes = load_model(path, "auto", host_budget=2**40, **options).sakura_quant_load.sizes
    assert sizes["none"] == _stored_bytes(load_model(path, None, dtype=torch.bfloat16))
    int8 = load_model(path, "auto", host_budget=sizes["int8"], **options)
    assert set(_formats(int8).values()) == {"int8"}  # keep_precise applies to nf4 only
    nf4 = load_model(path, "auto", host_budget=sizes["nf4"], **options)
    assert set(_formats(nf4).values()) == {"nf4", "int8"}
    # keep_precise is counted as its whole share: an upper bound of what it keeps
    plain_nf4 = _stored_bytes(load_model(path, "nf4", dtype=torch.bfloat16))
    assert plain_nf4 < _stored_bytes(nf4) <= sizes["nf4"]


def test_quantized_nbytes_matches_the_codec() -> None:
    for fmt in ("int8", "nf4"):
        for block in (2, 64, 256):
            for dq in (False, True):
                for shape in ((3, 5), (64, 64), (130, 70), (7, 4099)):
                    spec = WeightSpec(fmt, block, dq)
                    got = quantized_nbytes(shape[0] * shape[1], spec)
                    assert got == encode(torch.randn(shape), spec).nbytes, (spec, shape)


def _fake_hub(cache: Path, repo: str, source: Path) -> Path:
    """The hub cache layout: models--org--name/{refs/main, snapshots/<rev>/...}."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    entry = cache / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(revision)
    for file in source.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    return snapshot


def test_model_name_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, state = _saved(tmp_path / "saved")
    cache = tmp_path / "hub"
    _fake_hub(cache, "tiny-org/tiny-llama", path)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model("tiny-org/tiny-llama", "nf4")
    expected, _ = _quantized_by_hand(state, "nf4")
    _assert_same_state(loaded, expected)
    with pytest.raises(
        FileNotFoundError, match=rf"'tiny-org/absent' is not in .* at {cache}.*hf download"
    ):
        load_model("tiny-org/absent", "nf4")
    with pytest.raises(OptionError, match=r"load_model: name_or_path='not a name/x/y'"):
        load_model("not a name/x/y", "nf4")


def test_load_option_errors(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"random_weights": "yes"}, r"random_weights='yes'"),
        ({"ram_fraction": 0}, r"ram_fraction=0"),
        ({"ram_fraction": 1.5}, r"ram_fraction=1\.5"),
        ({"host_budget": -1}, r"host_budget=-1"),
        ({"host_budget": 1.5}, r"host_budget=1\.5"),
        ({"quantize": "int8", "keep_precise": 0.1}, r"keep_precise=0\.1"),
        ({"quantize": None, "keep_precise": 2}, r"keep_precise=2"),
        ({"quantize": "auto", "block_size": 3}, r"block_size=3"),
    ]
    for kwargs, text in cases:
        kwargs = {"quantize": "nf4", **kwargs}
        with pytest.raises(OptionError, match=rf"load_model: {text}"):
            load_model(path, **kwargs)


def test_random_weights_for_a_given_module(
    tmp_path: Path, make_tiny_lm: Callable[[], nn.Module]
) -> None:
    """A plain module is initialised by each layer's own reset_parameters()."""
    with torch.device("meta"):
        skeleton = make_tiny_lm()
    torch.manual_seed(0)
    loaded = load_model(tmp_path, "int8", model=skeleton, random_weights=True)
    assert not any(t.is_meta for t in loaded.state_dict().values())
    assert set(_formats(loaded).values()) == {"int8"} and len(_formats(loaded)) == 4
    assert torch.equal(loaded.layers[0].norm.weight, torch.ones(64))  # LayerNorm's reset
    bound = 1 / 64**0.5  # nn.Linear's reset: uniform within 1/sqrt(in_features)
    assert float(loaded.lm_head.weight.abs().max()) <= bound

    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.empty(3, device="meta"))

    with pytest.raises(ValueError, match=r"cannot initialise the model \(Bare\)"):
        load_model(tmp_path, None, model=Bare(), random_weights=True)
