"""The plugin hooks sakura-bench adds to sakura (through ``sakura_add_hookspecs``).

A plugin module (registered under the ``sakura`` entry-point group, like any sakura
plugin) implements them to offer benchmark workloads and frameworks by name.  They take
the same ``register`` callback style as the core's ``sakura_register_services``::

    from sakura import hookimpl


    @hookimpl(optionalhook=True)  # optional: the plugin still loads without sakura-bench
    def sakura_register_workloads(register):
        register("my-workload", "my_package.bench:MyWorkload", description="...")

``target`` is a :class:`~sakura_bench.workload.Workload` (or
:class:`~sakura_bench.framework.Framework`) subclass, or a lazy ``"module.path:Name"``
string imported only when the workload is used, so ``sakura-bench list`` stays cheap.
sakura-bench's own workloads and frameworks are registered by its plugin module
(``sakura_bench.plugin``) through exactly these hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sakura.hookspecs import hookspec

Register = Callable[..., None]

HOOKS = ("sakura_register_workloads", "sakura_register_frameworks")


def add_to(pluginmanager: Any) -> None:
    """Add the hooks of this module that ``pluginmanager`` does not declare yet (another
    package may declare a hook of the same name first: the first declaration stands)."""
    missing = {
        name: globals()[name]
        for name in HOOKS
        if getattr(getattr(pluginmanager.hook, name, None), "spec", None) is None
    }
    if missing:
        pluginmanager.add_hookspecs(type("SakuraBenchHooks", (), missing))


@hookspec
def sakura_register_workloads(register: Register) -> None:
    """Offer benchmark workloads.  Call ``register(name, target, *, description="")`` once
    per workload: ``name`` is what ``sakura-bench run --workload NAME`` takes; ``target``
    a :class:`~sakura_bench.workload.Workload` subclass or a ``"module:Class"`` string."""


@hookspec
def sakura_register_frameworks(register: Register) -> None:
    """Offer training frameworks (loops).  Call ``register(name, target, *,
    description="")`` once per framework: ``name`` is what ``--framework NAME`` takes;
    ``target`` a :class:`~sakura_bench.framework.Framework` subclass or a
    ``"module:Class"`` string."""
