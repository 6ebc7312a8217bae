"""(being built: see the sakura-kernels README)."""
