"""sakura-ray's plugin module (entry point ``sakura``): registers the service lazily, so
listing plugins never imports ray or torch."""

from __future__ import annotations

from sakura.hookspecs import Register, hookimpl


@hookimpl
def sakura_register_services(register: Register) -> None:
    register(
        "ray_report",
        "sakura_ray.report:RayReport",
        description="inside a Ray Train worker: AsyncEval's metrics and each durable "
        "AsyncCheckpoint checkpoint reported through ray.train.report",
    )
