"""Train the tiny reference model with the services named in ./sakura.toml."""

from sakura import SakuraRuntime
from sakura.testing import run_tiny_loop

with SakuraRuntime.from_config() as rt:
    print("services:", ", ".join(service.name for service in rt.services))
    result = run_tiny_loop(rt, epochs=2, steps_per_epoch=3, val_batches=2)
print(f"trained {result.steps} steps")
