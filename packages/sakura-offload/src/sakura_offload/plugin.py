"""sakura-offload's plugin module (entry point ``sakura``): registers the services lazily, so
listing plugins never imports torch, and declares the fit-choices hook
(:mod:`sakura_offload.fit.choices`)."""

from __future__ import annotations

from typing import Any

from sakura.hookspecs import Register, hookimpl


@hookimpl
def sakura_add_hookspecs(pluginmanager: Any) -> None:
    from sakura_offload.fit import choices

    choices.add_to(pluginmanager)


@hookimpl
def sakura_register_services(register: Register) -> None:
    register(
        "offload_adamw",
        "sakura_offload.host_optimizer.service:OffloadAdamWService",
        description="AdamW with moments and fp32 master weights in host RAM (C++ kernel)",
    )
    register(
        "memory_plan",
        "sakura_offload.planner.service:MemoryPlannerService",
        description="per block keep / page / recompute of saved activations to fit a memory budget",
    )
    register(
        "fit",
        "sakura_offload.fit.service:Fit",
        description="decides where optimizer, frozen weights and activations live to fit the "
        "device and host budgets",
    )
