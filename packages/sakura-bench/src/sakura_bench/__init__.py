"""sakura-bench: side-by-side training benchmarks for sakura (the ``sakura-bench`` command).

``import sakura_bench`` imports neither torch nor a framework; the workload and framework
base classes are importable from their modules::

    from sakura_bench.workload import Workload, classification_sums
    from sakura_bench.framework import Framework, TrialContext
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
