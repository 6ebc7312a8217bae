"""An example third-party sakura-bench workload (``example-xor``)."""

__version__ = "0.1.0"
