"""``fit``: one call that decides how a model trains in the memory it has.

:func:`~sakura_offload.fit.wrap.wrap` / :func:`~sakura_offload.fit.wrap.unwrap` for plain
loops, the ``fit`` service (:class:`~sakura_offload.fit.service.Fit`) under
``rt.prepare``; decisions in :mod:`.decide` (pure, from measured sizes and budgets), the
plugin hook for fit choices (a quantized base: sakura-quant's) in :mod:`.choices`, the plan's
table and :func:`~sakura_offload.fit.report.memory_report` in :mod:`.report`.  Guide:
``docs/offload.md``, "fit".
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sakura_offload.fit.choices import FitChoice, FitChoiceError, FitOption, fit_choices
    from sakura_offload.fit.decide import Budgets, FitError, FitPlan, ModelSizes, decide
    from sakura_offload.fit.report import memory_report, plan_table
    from sakura_offload.fit.service import Fit
    from sakura_offload.fit.wrap import FitState, measure, unwrap, wrap

# Exports load on first use: the plugin module adds the choices hook through
# sakura_offload.fit.choices, which must not import torch.
_EXPORTS = {
    "FitChoice": "sakura_offload.fit.choices",
    "FitChoiceError": "sakura_offload.fit.choices",
    "FitOption": "sakura_offload.fit.choices",
    "fit_choices": "sakura_offload.fit.choices",
    "Budgets": "sakura_offload.fit.decide",
    "FitError": "sakura_offload.fit.decide",
    "FitPlan": "sakura_offload.fit.decide",
    "ModelSizes": "sakura_offload.fit.decide",
    "decide": "sakura_offload.fit.decide",
    "memory_report": "sakura_offload.fit.report",
    "plan_table": "sakura_offload.fit.report",
    "Fit": "sakura_offload.fit.service",
    "FitState": "sakura_offload.fit.wrap",
    "measure": "sakura_offload.fit.wrap",
    "unwrap": "sakura_offload.fit.wrap",
    "wrap": "sakura_offload.fit.wrap",
}

__all__ = [
    "Budgets",
    "Fit",
    "FitChoice",
    "FitChoiceError",
    "FitError",
    "FitOption",
    "FitPlan",
    "FitState",
    "ModelSizes",
    "decide",
    "fit_choices",
    "measure",
    "memory_report",
    "plan_table",
    "unwrap",
    "wrap",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sakura_offload.fit' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
