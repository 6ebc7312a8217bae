"""The plugin module: registered under the ``sakura`` entry-point group in pyproject.toml."""

from sakura import hookimpl
from sakura.hookspecs import Register


@hookimpl
def sakura_register_dispatchers(register: Register) -> None:
    # A "module:Name" target is imported only when the dispatcher is built, so listing
    # plugins (`sakura plugins`) does not import sakura_async and torch.
    register(
        "journal",
        "sakura_example_dispatcher.dispatcher:JournalDispatcher",
        description="runs tasks one at a time on a background thread and journals each one",
    )
