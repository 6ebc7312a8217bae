"""The built-in workloads, registered by :mod:`sakura_bench.plugin`."""
