"""sakura-fit-choice-example: the ``bf16_base`` fit choice for sakura-offload's ``fit``."""

from sakura_fit_choice_example.choice import BF16Base

__all__ = ["BF16Base"]
