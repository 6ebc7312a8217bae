"""sakura-torch: the torch-side helpers that several Sakura packages share.

* :mod:`sakura_torch.native` — a C/C++ kernel with a plain C ABI, compiled on first use with
  torch's ``cpp_extension``, cached, called through :mod:`ctypes`, with a pure-torch
  fallback; :mod:`sakura_torch.native_cuda` does the same for ``.cu`` sources with ``nvcc``.
* :mod:`sakura_torch.blocks` — the repeated block stack of a model (transformer layers), the
  one meaning of a service's ``blocks=`` option.
* :mod:`sakura_torch.disk` — :class:`~sakura_torch.disk.TensorFileStore`, tensors in
  memory-mapped files under a private folder (the disk tier of frozen weights).
* :mod:`sakura_torch.heap` — :func:`~sakura_torch.heap.reuse_freed_memory`, glibc told to
  keep the memory a training step frees for the next one.

The core (``sakura``) is the event bus and the plugin system and needs only pluggy; these
helpers need torch, so they live in this distribution, which the packages using them
declare. No module here imports torch at import time: torch is imported when a kernel is
built or a model is looked at, so a plugin module that uses them is still listed by
``sakura plugins`` without importing torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
