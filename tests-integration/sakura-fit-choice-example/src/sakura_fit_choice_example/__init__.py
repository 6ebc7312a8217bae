"""sakura-fit-choice-example: the ``bf16_base`` fit choice for sakura-offload's ``fit``
(:class:`sakura_fit_choice_example.choice.BF16Base`).  Nothing is imported here: the plugin
module is imported whenever sakura lists plugins, and that must not import torch."""
