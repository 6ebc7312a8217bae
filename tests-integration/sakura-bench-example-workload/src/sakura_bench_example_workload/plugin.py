"""The plugin module: registers the workload with sakura-bench's hook.

``optionalhook=True``: the hook is declared by sakura-bench, so where sakura-bench's own
plugin is disabled this module still loads (and offers nothing).  The target is a lazy
``"module:Class"`` string: ``sakura-bench list`` imports it, ``sakura plugins`` does not.
"""

from __future__ import annotations

from typing import Any

from sakura import hookimpl


@hookimpl(optionalhook=True)
def sakura_register_workloads(register: Any) -> None:
    register(
        "example-xor",
        "sakura_bench_example_workload.workload:XorWorkload",
        description="noisy XOR of two inputs, learned by a small MLP",
    )
