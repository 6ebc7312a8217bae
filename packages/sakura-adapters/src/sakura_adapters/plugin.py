"""sakura-adapters' plugin module (entry point ``sakura``): registers the adapters lazily,
so listing plugins never imports Lightning or transformers."""

from __future__ import annotations

from sakura.hookspecs import Register, hookimpl


@hookimpl
def sakura_register_adapters(register: Register) -> None:
    register(
        "lightning",
        "sakura_adapters.lightning:LightningAdapter",
        description="lightning.Callback that drives the runtime, plus its precision plugin",
    )
    register(
        "hf",
        "sakura_adapters.hf:HFAdapter",
        description="transformers.TrainerCallback mapping every callback event",
    )
    register(
        "hf_trainer",
        "sakura_adapters.hf:SakuraTrainer",
        description="transformers.Trainer subclass for services that own the step",
    )
    register(
        "ddp",
        "sakura_adapters.ddp:DDPAdapter",
        description="explicit calls for raw torch.distributed loops",
    )
