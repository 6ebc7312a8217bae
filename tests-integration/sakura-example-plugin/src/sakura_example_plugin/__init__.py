"""sakura-example-plugin: an example Sakura plugin that provides the ``event_log`` service."""

from sakura_example_plugin.service import EventLog

__all__ = ["EventLog"]
