"""sakura-example-dispatcher: an example Sakura dispatcher, ``journal``."""

from sakura_example_dispatcher.dispatcher import JournalDispatcher

__version__ = "0.1.0"

__all__ = ["JournalDispatcher", "__version__"]
