"""The plugin module: registered under the ``sakura`` entry-point group in pyproject.toml.
It implements sakura-offload's hook (optional: the plugin loads without sakura-offload)."""

from sakura import hookimpl
from sakura.hookspecs import Register


@hookimpl(optionalhook=True)
def sakura_register_fit_choices(register: Register) -> None:
    register(
        "bf16_base",
        "sakura_fit_choice_example.choice:BF16Base",
        description="frozen Linear layers stored in bfloat16",
    )
