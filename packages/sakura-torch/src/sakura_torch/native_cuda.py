"""CUDA kernels for plugin packages: a ``.cu`` source with a plain C ABI (``extern "C"``
launch functions taking raw device pointers, sizes and a ``cudaStream_t``; no torch
headers), compiled with ``nvcc`` on first use, cached, and called through :mod:`ctypes`.

The sibling of :class:`sakura_torch.native.NativeLibrary`, with which it shares the cache
root (``$SAKURA_<PACKAGE>_CACHE``, else ``$XDG_CACHE_HOME/<package>``, else
``~/.cache/<package>``), the disabling variable ``SAKURA_<PACKAGE>_NO_KERNEL`` (which turns
off a package's CPU and CUDA kernels alike), the ABI check, the logging and the warned-once
fallback::

    NF4_CUDA = CudaLibrary(
        package="sakura-quant",
        name="sakura_quant_nf4_cuda",
        sources=[Path(__file__).with_name("csrc") / "nf4_cuda.cu"],
        abi_symbol="sakura_quant_cuda_abi_version",
        abi_version=1,
        probe_symbol="sakura_quant_cuda_probe",
        declare=_declare,
        what="CUDA NF4 kernel",
    )
    lib = NF4_CUDA.load()  # None without a CUDA device, or when it cannot be built

Why ``nvcc`` directly rather than ``torch.utils.cpp_extension``: a source without torch
headers needs no CUDA build of torch to compile, so the same file is compiled (and its
exports checked) on a machine without a GPU, and it builds in seconds.

* :meth:`CudaLibrary.load` builds only when ``torch.cuda.is_available()``; without a
  device it returns None quietly (``required=True`` raises).
* The code is compiled for the current device's architecture (``sm_XY`` from
  ``torch.cuda.get_device_capability()``, plus its PTX), or for ``arch`` when given.
* The build folder is keyed by torch's and Python's versions, nvcc's version, the
  architecture and the flags; the file name carries a hash of the sources and of the
  headers beside them, so an edited source or header is rebuilt.  ``nvcc`` writes under a temporary name that is then renamed, so a
  concurrent build never leaves a half-written library.
* The runtime is linked statically (nvcc's default): the library needs no ``libcudart`` of
  its own version at run time, only a driver recent enough for this nvcc.  ``probe_symbol``
  (an exported ``int fn(void)`` returning a ``cudaError_t``) is called after loading, so an
  old driver is a warned-once fallback rather than a failure at the first launch.
* Default flags are ``-O3 -std=c++17 --fmad=false -Xcompiler -ffp-contract=off``: no
  fused multiply-adds in device or host code, so every operation rounds as the CPU and
  torch paths do.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sakura_torch.native import NativeLibrary

__all__ = ["DEFAULT_NVCC_FLAGS", "CudaLibrary", "compile_cuda", "find_nvcc", "nvcc_version"]

HEADERS = (".h", ".cuh", ".hpp")

DEFAULT_NVCC_FLAGS = ("-O3", "-std=c++17", "--fmad=false", "-Xcompiler", "-ffp-contract=off")


def find_nvcc() -> str | None:
    """``nvcc`` under ``$CUDA_HOME`` / ``$CUDA_PATH``, else on ``PATH``, else in
    ``/usr/local/cuda/bin``; None when there is none."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(variable)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def nvcc_version(nvcc: str) -> str:
    """``"13.0.88"`` from ``nvcc --version``."""
    out = subprocess.run(
        [nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    found = re.search(r"V(\d+(?:\.\d+)+)", out)
    if found is None:
        raise RuntimeError(f"cannot read the version of {nvcc} from: {out[-200:]!r}")
    return found.group(1)


def _gencode(arch: str) -> list[str]:
    found = re.fullmatch(r"sm_(\d+[a-z]?)", arch)
    if found is None:
        raise ValueError(f"arch={arch!r} is not accepted; accepted: 'sm_XY' such as 'sm_90'")
    number = found.group(1)
    return [f"-gencode=arch=compute_{number},code=[sm_{number},compute_{number}]"]


def compile_cuda(
    sources: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    arch: str | None,
    flags: Sequence[str] = DEFAULT_NVCC_FLAGS,
    nvcc: str | None = None,
    timeout: float = 600.0,
) -> Path:
    """Compile ``sources`` with nvcc into the shared library ``output`` (for ``arch``, e.g.
    ``"sm_90"``; None: nvcc's default).  Raises RuntimeError with the compiler's output
    when it fails."""
    compiler = nvcc or find_nvcc()
    if compiler is None:
        raise RuntimeError("nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    target = Path(output)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    command = [
        compiler,
        *flags,
        "-shared",
        "-Xcompiler",
        "-fPIC",
        *(_gencode(arch) if arch else []),
        "-o",
        str(partial),
        *(str(s) for s in sources),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(
            f"nvcc failed (exit {done.returncode}): {' '.join(command)}\n"
            + (done.stderr or done.stdout)[-4000:]
        )
    os.replace(partial, target)
    return target


class CudaLibrary(NativeLibrary):
    """One CUDA library of a package (see the module docstring).

    Takes :class:`~sakura_torch.native.NativeLibrary`'s arguments (``cflags`` are nvcc's
    flags; ``ldflags`` are appended to them), and:

    Args:
        arch: the architecture to compile for (``"sm_90"``); None: the current device's.
        probe_symbol: an exported ``int fn(void)`` returning a ``cudaError_t``, called
            after loading; a non-zero result makes the library unavailable (warned once).
    """

    def __init__(
        self, *, arch: str | None = None, probe_symbol: str | None = None, **options: Any
    ) -> None:
        options.setdefault("what", "CUDA kernel")
        options.setdefault("cflags", DEFAULT_NVCC_FLAGS)
        options.setdefault("ldflags", ())
        options.setdefault("fallback", "the pure-torch path")
        super().__init__(**options)
        if arch is not None:
            _gencode(arch)  # validates the spelling
        self.arch = arch
        self.probe_symbol = probe_symbol

    def _arguments(self) -> dict[str, Any]:
        return {**super()._arguments(), "arch": self.arch, "probe_symbol": self.probe_symbol}

    def unavailable(self) -> str | None:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        return None

    def target_arch(self) -> str:
        """``arch`` if given, else the current CUDA device's ``sm_XY``."""
        if self.arch is not None:
            return self.arch
        import torch

        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"

    def build_directory(self) -> Path:
        """Where the library is built and cached for this torch, Python, nvcc and GPU
        architecture."""
        import torch

        from sakura.env import cache_dir

        nvcc = find_nvcc()
        if nvcc is None:
            raise RuntimeError("nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
        root = cache_dir(self.package, override=self.cache_env)
        flags = hashlib.sha256(" ".join(self.cflags + self.ldflags).encode()).hexdigest()[:8]
        tag = f"torch{torch.__version__.split('+')[0]}-py{platform.python_version()}"
        return root / f"{tag}-cuda{nvcc_version(nvcc)}-{self.target_arch()}-f{flags}"

    def compile(self, directory: str | os.PathLike[str] | None = None) -> Path:
        """Build the library into ``directory`` (default :meth:`build_directory`) unless an
        up-to-date build is there; its path.  Needs nvcc, not a GPU when ``arch`` is given."""
        folder = Path(directory) if directory is not None else self.build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        return self._compile(folder)

    def _compile(self, directory: Path) -> Path:
        digest = hashlib.sha256()
        for source in self.sources:
            digest.update(source.read_bytes())
        # The headers beside the sources (a quoted #include finds them there) count too.
        folders = sorted({source.parent for source in self.sources})
        for header in sorted(h for d in folders for e in HEADERS for h in d.glob(f"*{e}")):
            digest.update(header.name.encode() + header.read_bytes())
        digest.update(" ".join(self.cflags + self.ldflags + (self.arch or "",)).encode())
        output = directory / f"{self.name}-{digest.hexdigest()[:12]}.so"
        if output.exists():
            return output
        self.logger.info("%s: compiling the %s with nvcc into %s", self.package, self.what, output)
        arch = self.target_arch()
        return compile_cuda(self.sources, output, arch=arch, flags=self.cflags + self.ldflags)

    def _build(self) -> ctypes.CDLL:
        library = super()._build()
        if self.probe_symbol is not None:
            probe = getattr(library, self.probe_symbol)
            probe.restype = ctypes.c_int
            probe.argtypes = []
            status = probe()
            if status != 0:
                raise RuntimeError(
                    f"{self.probe_symbol}() returned CUDA error {status} (35 means the "
                    "driver is older than the CUDA runtime this nvcc links)"
                )
        return library
