"""Train the tiny reference model with event_log installed in code, without a config file."""

from sakura import SakuraRuntime
from sakura.testing import run_tiny_loop
from sakura_example_plugin import EventLog

with SakuraRuntime() as rt:
    rt.install(EventLog(path="events.json"))  # or by spec: rt.install("event_log:path=events.json")
    result = run_tiny_loop(rt, epochs=2, steps_per_epoch=3, val_batches=2)
print(f"trained {result.steps} steps")
