"""Services such as MixedPrecision or Telemetry, resolved by name through the installed plugins.

``from sakura.services import X`` imports the class a plugin registered as a service; if the
package that provides it is not installed, the ImportError names the package to install.
"""

from __future__ import annotations

from typing import Any

from sakura._facade import facade_dir, resolve_export


def __getattr__(name: str) -> Any:
    return resolve_export("service", __name__, name)


def __dir__() -> list[str]:
    return facade_dir("service", list(globals()))
