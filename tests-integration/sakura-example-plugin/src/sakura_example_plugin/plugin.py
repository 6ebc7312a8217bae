"""The plugin module: registered under the ``sakura`` entry-point group in pyproject.toml."""

from sakura import hookimpl
from sakura.hookspecs import Register
from sakura_example_plugin.service import EventLog


@hookimpl
def sakura_register_services(register: Register) -> None:
    register(
        "event_log",
        EventLog,
        description="Record the order of training events into a JSON file",
    )
