"""``Compile``: ``torch.compile`` through ``wrap_model``, in place, with an on-disk cache.

Compiling in place: the module (or each block, with ``target="blocks"``) keeps its identity
and gets a compiled ``__call__``, as ``nn.Module.compile()`` does.  The compiled callable is
a small function of this package that calls ``module._call_impl``, rather than
``_call_impl`` itself: Dynamo does not trace a top-level frame that lives in ``torch.nn``,
so ``nn.Sequential(...).compile()`` silently stays eager in torch 2.13 (pytorch#150915);
through our function every module compiles.  Forward hooks run inside the compiled region,
as with ``nn.Module.compile()``.

The cache: compiled artifacts (Inductor's FX graph cache, the AOTAutograd cache, C++/Triton
kernels) are written to ``cache_dir``.  A second process that compiles the same model with
the same settings loads them instead of generating and compiling code again; Dynamo still
traces the Python code, so the start is faster, not free.  The service turns both caches on
and points ``TORCHINDUCTOR_CACHE_DIR`` at ``cache_dir`` while the runtime runs (from
``setup`` or the first ``wrap_model`` to ``teardown``), restoring what was there after.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sakura import Service
from sakura.env import cache_dir as user_cache_dir
from sakura.events import OnTrainStepBegin
from sakura.options import check_bool, check_choice, option_error
from sakura_torch.blocks import find_blocks, validate_selector

__all__ = ["MODES", "TARGETS", "Compile", "default_cache_dir"]

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
TARGETS = ("model", "blocks")
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
_ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$TORCHINDUCTOR_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/sakura/torch-compile``
    (``~/.cache/sakura/torch-compile``): persistent across reboots, unlike torch's default
    under ``/tmp``."""
    return user_cache_dir("sakura", "torch-compile", override=_ENV)


def _run_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The function that is compiled: one module call, hooks included."""
    return module._call_impl(*args, **kwargs)


def _already_compiled(module: nn.Module) -> str | None:
    """Why ``module`` is already compiled by someone else, or None."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return "it is a torch.compile()'d module (OptimizedModule)"
    if getattr(module, "_compiler_ctx", None):
        return "Lightning compiled it (trainer.fit was given a torch.compile()'d module)"
    call = module.__dict__.get("_compiled_call_impl")
    if call is not None and not isinstance(call, _CompiledCall):
        return "nn.Module.compile() was called on it"
    return None


class _CompiledCall(functools.partial):  # type: ignore[type-arg]
    """``partial(compiled _run_module, module)``, marked as ours."""


class Compile(Service):
    """``torch.compile`` of the model (or of its repeated blocks) with an on-disk cache.

    Args:
        mode: ``"default"``, ``"reduce-overhead"`` (CUDA graphs, on CUDA only: graphs on
            the CPU compile as in ``"default"``), ``"max-autotune"`` (autotuned kernels and
            CUDA graphs) or ``"max-autotune-no-cudagraphs"``.  Every mode runs on the CPU.
        cache_dir: where compiled artifacts are kept (see :func:`default_cache_dir`).
        target: ``"model"`` compiles the whole module's call; ``"blocks"`` compiles each
            repeated block on its own (regional compilation: identical blocks share one
            compiled graph, so compiling is much faster for deep models).  For a
            LightningModule, ``"model"`` compiles its ``__call__``, i.e. what
            ``self(batch)`` runs in ``training_step``.
        blocks: the block selector for ``target="blocks"`` (see
            :mod:`sakura_torch.blocks`); auto-detected by default.
        backend: a ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` to trace
            without generating code).  A non-default ``mode`` needs ``"inductor"``.
        fullgraph: fail on graph breaks instead of falling back to Python.
        dynamic: ``torch.compile``'s ``dynamic`` (None: automatic).

    ``wrap_model`` changes the module in place and returns it; ``compiled`` lists the
    names of the compiled modules (``""`` for the whole model).  A model that something
    else compiled already is an error (one compiler at a time).
    """

    name = "compile"
    priority = 900  # last among wrap_model services: it compiles their final modules

    def __init__(
        self,
        mode: str = "default",
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        target: str = "model",
        blocks: Any = None,
        backend: str = "inductor",
        fullgraph: bool = False,
        dynamic: bool | None = None,
    ) -> None:
        owner = "Compile"
        self.mode = check_choice("mode", mode, MODES, owner=owner)
        self.target = check_choice("target", target, TARGETS, owner=owner)
        if blocks is not None and target != "blocks":
            raise ValueError(
                f"{owner}: blocks= applies to target='blocks' only (target={target!r})"
            )
        self.blocks = validate_selector(blocks, owner=owner)
        if not isinstance(backend, str) or not backend:
            raise option_error(
                "backend", backend, "a torch.compile backend name such as 'inductor'", owner=owner
            )
        if backend != "inductor" and mode != "default":
            raise ValueError(
                f"{owner}: mode={mode!r} configures the 'inductor' backend; with "
                f"backend={backend!r} only mode='default' is accepted"
            )
        self.backend = backend
        self.fullgraph = check_bool("fullgraph", fullgraph, owner=owner)
        if dynamic is not None:
            check_bool("dynamic", dynamic, owner=owner)
        self.dynamic = dynamic
        if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
            raise option_error(
                "cache_dir", cache_dir, "a path (str or os.PathLike) or None", owner=owner
            )
        self._cache_dir_option = cache_dir
        self.cache_dir: Path = (
            Path(cache_dir).expanduser().resolve() if cache_dir is not None else default_cache_dir()
        )
        self.compiled: list[str] = []
        self._compiled_fn: Any = None
        self._saved: dict[str, Any] | None = None
        # CUDA graphs reuse their output buffers: with them, each step's start is marked so
        # cudagraph trees know last step's outputs are dead.  Without them (the default
        # modes, other backends) the service handles no event at all.
        uses_cudagraphs = backend == "inductor" and mode in _CUDAGRAPH_MODES
        self.event_types: frozenset[type] = (
            frozenset({OnTrainStepBegin}) if uses_cudagraphs else frozenset()
        )

    def __repr__(self) -> str:
        return (
            f"Compile(mode={self.mode!r}, target={self.target!r}, backend={self.backend!r}, "
            f"cache_dir={str(self.cache_dir)!r})"
        )

    # --- the cache ---------------------------------------------------------------------

    def _enable_cache(self) -> None:
        if self._saved is not None:
            return
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._saved = {
            "env": os.environ.get(_ENV),
            "fx_graph_cache": inductor_config.fx_graph_cache,
            "autograd_cache": getattr(functorch_config, "enable_autograd_cache", None),
        }
        os.environ[_ENV] = str(self.cache_dir)
        inductor_config.fx_graph_cache = True
        if hasattr(functorch_config, "enable_autograd_cache"):
            functorch_config.enable_autograd_cache = True

    def _restore_cache(self) -> None:
        saved, self._saved = self._saved, None
        if saved is None:
            return
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        if saved["env"] is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = saved["env"]
        inductor_config.fx_graph_cache = saved["fx_graph_cache"]
        if saved["autograd_cache"] is not None:
            functorch_config.enable_autograd_cache = saved["autograd_cache"]

    # --- lifecycle and coordinated calls -------------------------------------------------

    def setup(self, runtime: Any) -> None:
        self._enable_cache()

    def teardown(self) -> None:
        self._restore_cache()

    def _compiler(self) -> Any:
        if self._compiled_fn is None:
            options: dict[str, Any] = {
                "backend": self.backend,
                "fullgraph": self.fullgraph,
                "dynamic": self.dynamic,
            }
            if self.backend == "inductor":
                options["mode"] = self.mode
            self._compiled_fn = torch.compile(_run_module, **options)
        return self._compiled_fn

    def _compile_in_place(self, name: str, module: nn.Module) -> None:
        current = module.__dict__.get("_compiled_call_impl")
        if isinstance(current, _CompiledCall):
            return  # compiled by a Compile service already
        reason = _already_compiled(module)
        if reason is not None:
            where = f"block {name!r}" if name else f"the model ({type(module).__name__})"
            raise ValueError(
                f"Compile: {where} is already compiled: {reason}; use one: pass the uncompiled "
                f"module, or uninstall the Compile service"
            )
        module._compiled_call_impl = _CompiledCall(self._compiler(), module)
        self.compiled.append(name)

    def wrap_model(self, model: Any) -> Any:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Compile needs a torch.nn.Module, got {type(model).__name__}")
        self._enable_cache()
        if self.target == "model":
            self._compile_in_place("", model)
        else:
            reason = _already_compiled(model)
            if reason is not None:
                raise ValueError(
                    f"Compile: the model ({type(model).__name__}) is already compiled: {reason}; "
                    f"use one: pass the uncompiled module, or uninstall the Compile service"
                )
            for name, block in find_blocks(model, self.blocks, owner="Compile"):
                self._compile_in_place(name, block)
        return model

    def on_event(self, event: Any) -> None:
        """``OnTrainStepBegin`` with a CUDA-graph mode: mark the step (CUDA only)."""
        if torch.cuda.is_available():
            torch.compiler.cudagraph_mark_step_begin()
