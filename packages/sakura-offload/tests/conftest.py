from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sakura_offload.host_optimizer import kernel as _kernel

# The shared helpers (_offload_models.py) import by name under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    # The machine is shared; the kernel's results do not depend on the thread count.
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def vector() -> _kernel.Kernel:
    """The host AdamW kernel as built for this CPU (its vector paths)."""
    kernel = _kernel.load_kernel(required=True)
    assert kernel is not None
    return kernel


@pytest.fixture(scope="module")
def portable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_kernel.Kernel]:
    """The same source built without AVX-512: the portable loops only."""
    library = _kernel.LIBRARY.replace(cflags=(*_kernel.CFLAGS, "-mno-avx512f"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_kernel.CACHE_ENV, str(tmp_path_factory.mktemp("portable")))
        lib = library.load(required=True)
        assert lib is not None and library.path is not None
        yield _kernel.Kernel(lib, Path(library.path))
