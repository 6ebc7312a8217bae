"""Where ``load_model``'s model and tensors come from.

* :func:`resolve`: a path as given, or a Hugging Face model name (``"org/name"``) looked up
  in the local cache only (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``): ``load_model`` never downloads.
* :func:`build_skeleton`: the transformers model of a ``config.json`` with the caller's
  config overrides applied before it is built, its parameters on the meta device.
* :class:`RandomWeights`: ``random_weights=True``: each module is initialised where it is
  needed by the model's own initialisation (transformers' ``_init_weights``; a plain module's
  ``reset_parameters``), one module at a time, under a seed of its own drawn from torch's
  global generator and the module's name, so the values depend only on
  ``torch.manual_seed`` and the module, not on the order they are made in.
"""

from __future__ import annotations

import copy
import json
import os
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sakura.errors import nearest
from sakura.options import option_error

__all__ = ["RandomWeights", "build_skeleton", "hub_cache_dir", "resolve"]

_OWNER = "load_model"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as the environment names it now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def resolve(name_or_path: Any) -> Path:
    """A local file or folder as given; otherwise a model name's snapshot folder in the
    local Hugging Face cache (offline: ``local_files_only``)."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise option_error(
            "name_or_path", name_or_path, "a path or a Hugging Face model name", owner=_OWNER
        )
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    text = os.fspath(name_or_path)
    if not _REPO_ID.match(text) or ".." in text:
        raise option_error(
            "name_or_path",
            text,
            "an existing .safetensors file or folder, or a Hugging Face model name "
            "('org/name') in the local cache",
            owner=_OWNER,
        )
    cache = hub_cache_dir()
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - transformers installs it
        raise ImportError(
            "load_model resolves model names with huggingface_hub: pip install 'sakura-quant[hf]'"
        ) from exc
    try:
        folder = snapshot_download(text, cache_dir=str(cache), local_files_only=True)
    except Exception as exc:  # LocalEntryNotFoundError and kin: not in this cache
        raise FileNotFoundError(
            f"load_model: the model {text!r} is not in the local Hugging Face cache at "
            f"{cache} (load_model reads the cache only, it never downloads): fetch it "
            f"where there is a network with `hf download {text}` (or "
            f"huggingface_hub.snapshot_download({text!r})), or point HF_HUB_CACHE at the "
            "cache that holds it"
        ) from exc
    return Path(folder)


def build_skeleton(
    folder: Path, trust_remote_code: bool, overrides: dict[str, Any], known: tuple[str, ...]
) -> nn.Module:
    """The causal LM of ``folder/config.json`` with ``overrides`` applied to the config's
    fields before it is built; its parameters on the meta device, its non-persistent
    buffers (rotary tables) real.  An override that is no field of the config is an error
    naming the nearest field (or ``load_model`` option, ``known``)."""
    try:
        from accelerate import init_empty_weights  # type: ignore[import-untyped]
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover - the hf extra installs them
        raise ImportError(
            "load_model without model= builds a transformers model: "
            "pip install 'sakura-quant[hf]' (transformers, accelerate)"
        ) from exc
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"load_model: {folder} has no config.json (pass model= to fill a module of yours)"
        )
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if overrides:
        fields = config.to_dict()
        for key in sorted(overrides):
            if key not in fields and not hasattr(config, key):
                close = nearest(key, [*fields, *known])
                hint = f"; did you mean {close!r}?" if close else ""
                raise option_error(
                    key,
                    overrides[key],
                    f"a field of {type(config).__name__} (load_model passes unknown keyword "
                    f"arguments to the config as overrides){hint}",
                    owner=_OWNER,
                )
        # Rebuilt from config.json with the overrides, so fields derived in __init__
        # (per-layer lists sized by num_hidden_layers, ...) follow them.
        raw = json.loads((folder / "config.json").read_text())
        config = type(config).from_dict({**raw, **overrides})
    with init_empty_weights(include_buffers=False):
        model: nn.Module = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, trust_remote_code=trust_remote_code
        )
    return model


class RandomWeights:
    """``random_weights=True``: tensors made by the model's own initialisation, module by
    module, instead of read (see the module docstring for the seeding)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._base = int(torch.randint(0, 2**62, ()).item())
        init = getattr(model, "_init_weights", None)
        self._init: Callable[[nn.Module], Any] | None = init if callable(init) else None

    def materialize(self, name: str, module: nn.Module) -> bool:
        """``module``'s own meta parameters and buffers made real (CPU) and initialised;
        False when it had none."""
        if not any(
            t is not None and t.is_meta
            for t in (*module._parameters.values(), *module._buffers.values())
        ):
            return False
        module.to_empty(device="cpu", recurse=False)
        seed = (self._base + zlib.crc32(name.encode())) % 2**63
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            if self._init is not None:
                self._init(module)
            else:
                reset = getattr(module, "reset_parameters", None)
                if not callable(reset):
                    raise ValueError(
                        f"load_model: random_weights=True cannot initialise {name or 'the model'} "
                        f"({type(module).__name__}): it has no reset_parameters() and the model "
                        "no _init_weights()"
                    )
                reset()
        return True

    def element_size(self, key: str, expected: torch.Tensor) -> int:
        """Bytes per element a tensor will have: the model's own."""
        return expected.element_size()

    def weight(
        self, name: str, linear: nn.Linear, *, bias: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A target ``nn.Linear``'s weight and (with ``bias``) bias, initialised in a
        shallow copy of the layer: the model's layer stays on the meta device, so asking
        twice (``keep_precise``'s measuring pass, then the load pass) costs no memory and
        gives the same values."""
        twin = copy.copy(linear)
        twin._parameters = dict(linear._parameters)
        twin._buffers = dict(linear._buffers)
        self.materialize(name, twin)
        made: torch.Tensor | None = twin.bias
        weight: torch.Tensor = twin.weight
        return weight.detach(), None if made is None or not bias else made.detach()

    def fill(
        self,
        model: nn.Module,
        dtype: torch.dtype | None,
        offload: Callable[[str, torch.Tensor], torch.Tensor] | None,
    ) -> None:
        """Every module still on the meta device initialised (quantized layers are not:
        they hold no meta tensor), its floating tensors cast to ``dtype`` and passed
        through ``offload`` (given the tensor's key), one module at a time."""
        for name, module in model.named_modules():
            if not self.materialize(name, module):
                continue
            prefix = f"{name}." if name else ""
            for attr, value in module._parameters.items():
                if value is not None and value.is_floating_point():
                    tensor = value.detach() if dtype is None else value.detach().to(dtype)
                    if offload is not None:
                        tensor = offload(prefix + attr, tensor)
                    module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
            for attr, value in module._buffers.items():
                if value is not None and value.is_floating_point() and dtype is not None:
                    module._buffers[attr] = value.to(dtype)
