"""sakura-zero's plugin module (entry point ``sakura``): registers the services lazily, so
listing plugins never imports torch."""

from __future__ import annotations

from sakura.hookspecs import Register, hookimpl


@hookimpl
def sakura_register_services(register: Register) -> None:
    register(
        "zero1",
        "sakura_zero.service:ZeRO1",
        description="ZeRO-1: optimizer state sharded across data-parallel ranks",
    )
    register(
        "zero2",
        "sakura_zero.service:ZeRO2",
        description="ZeRO-2: optimizer state and gradients sharded across data-parallel ranks",
    )
