"""The built-in frameworks, registered by :mod:`sakura_bench.plugin`."""
