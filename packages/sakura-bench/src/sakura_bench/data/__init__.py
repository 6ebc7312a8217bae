"""Readers of the real dataset files and generators of synthetic data with the same shapes.

No function here downloads anything: ``--data DIR`` points at files you already have.
"""
