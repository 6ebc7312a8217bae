"""The services' state in Hugging Face checkpoint folders.

One file per process beside the Trainer's own files (``sakura_state.pt``, or
``sakura_state_<rank>.pt`` with several processes, as the Trainer names its RNG state),
written atomically with :func:`sakura.fileio.atomic_writer` and loaded with
``weights_only=True``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from sakura.errors import add_note
from sakura.fileio import atomic_writer
from sakura.resume import ServiceStateError
from sakura.runtime import SakuraRuntime

__all__ = ["STATE_FILE", "checkpoint_dir", "find_checkpoint", "load_state", "save_state"]

logger = logging.getLogger("sakura.adapters.hf")

STATE_FILE = "sakura_state.pt"
"""Name of the services' state file in a single-process checkpoint folder."""


def state_file_name(rank: int = 0, world_size: int = 1) -> str:
    """The services' state file of ``rank`` in a checkpoint folder (as the Trainer names its
    RNG state: one file for a single process, one per process otherwise)."""
    return STATE_FILE if world_size <= 1 else f"sakura_state_{rank}.pt"


def checkpoint_dir(args: Any, global_step: int) -> str:
    """The folder the Trainer writes the checkpoint of ``global_step`` to."""
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")


def save_state(rt: SakuraRuntime, path: str) -> None:
    """Write the services' state into the checkpoint folder ``path`` (nothing when no
    service has state)."""
    services_state = rt.state_dict()
    if not services_state:
        return
    os.makedirs(path, exist_ok=True)
    with atomic_writer(os.path.join(path, state_file_name(rt.rank, rt.world_size))) as f:
        torch.save(services_state, f)


def find_checkpoint(rt: SakuraRuntime, args: Any, state: Any) -> str | None:
    """Stock Trainer: the folder this run resumed from.

    A callback is not told the path, but the resumed ``state.global_step`` names it: the
    Trainer writes ``<output_dir>/checkpoint-<global_step>``.  ``args.resume_from_checkpoint``
    (the field the Trainer leaves to scripts) wins when set.
    """
    if state.global_step <= 0:
        return None  # a fresh run: the Trainer only loads a state when resuming
    candidates = []
    explicit = getattr(args, "resume_from_checkpoint", None)
    if isinstance(explicit, (str, os.PathLike)):
        candidates.append(os.fspath(explicit))
    candidates.append(checkpoint_dir(args, state.global_step))
    for path in candidates:
        if os.path.isdir(path):
            return path
    stateful = rt.implements("load_state_dict")
    if stateful:
        logger.warning(
            "sakura: training resumes at step %d but HFAdapter cannot tell from which "
            "checkpoint (looked in %s); services %s start with fresh state. Use "
            "SakuraTrainer, or set TrainingArguments.resume_from_checkpoint to the folder.",
            state.global_step,
            candidates,
            list(stateful),
        )
    return None


def load_state(rt: SakuraRuntime, path: str, *, strict: bool) -> bool:
    """Give the services their state from the checkpoint folder ``path``; False when the
    folder holds no state file.

    ``strict`` is passed to ``rt.load_state_dict``.  Without it (the default of the
    adapters) an installed stateful service that the checkpoint has no state for starts
    fresh with a warning, and state for a service that is not installed is kept and saved
    again (see :mod:`sakura.resume`); with it either case is a
    :class:`~sakura.resume.ServiceStateError`, also when the folder holds no state file at
    all while stateful services are installed.
    """
    file = os.path.join(path, state_file_name(rt.rank, rt.world_size))
    if not os.path.isfile(file):
        stateful = rt.implements("load_state_dict")
        if stateful and strict:
            try:
                rt.load_state_dict({}, strict=True)
            except ServiceStateError as exc:
                add_note(exc, f"the checkpoint {path} holds no {os.path.basename(file)}")
                raise
        if stateful:
            logger.warning(
                "sakura: the checkpoint %s holds no %s; services %s start with fresh state",
                path,
                os.path.basename(file),
                list(stateful),
            )
        return False
    services_state = torch.load(file, map_location="cpu", weights_only=True)
    rt.load_state_dict(services_state, strict=strict)
    return True
