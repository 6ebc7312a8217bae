"""Models of the built-in workloads, built from code or from transformers configs (random
initialisation: nothing is downloaded)."""
