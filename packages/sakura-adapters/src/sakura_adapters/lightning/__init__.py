"""Lightning integration: a real ``lightning.pytorch.Callback`` plus a precision plugin.

``LightningAdapter(rt)`` maps every callback hook to a sakura event.  Services that own part
of the step (autocast, loss scaling, unscaling before clipping, the optimizer step, model
and optimizer wrapping) act through Lightning's own extension point for exactly that, the
``Precision`` plugin API: at ``setup`` the adapter hands the strategy a
:class:`SakuraPrecision` that wraps the precision plugin the Trainer configured.

================================  ===========================================================
Lightning calls                   SakuraPrecision does
================================  ===========================================================
``convert_module(module)``        the inner plugin's conversion, then ``rt.wrap_model``
``connect(model, optimizers, …)`` the inner plugin's, then ``rt.wrap_optimizer`` on each
``forward_context()``             the inner context and ``rt.autocast()``
``pre_backward(loss)``            the inner hook (callbacks see the unscaled loss), then
                                  ``rt.scale_loss``
``clip_gradients(...)``           ``rt.unscale_gradients`` (idempotent), then clipping
``optimizer_step(...)``           when a service owns the step: closure, unscale, Lightning's
                                  before-step hooks and clipping, ``rt.optimizer_step``;
                                  then ``OnOptimizerStep``
================================  ===========================================================

The modules: :mod:`.callback` (``LightningAdapter``) and :mod:`.precision`
(``SakuraPrecision``).

Service state is saved in Lightning checkpoints under the ``"sakura"`` key and restored
on resume (``trainer.fit(..., ckpt_path=...)``).
"""

from __future__ import annotations

from sakura_adapters.lightning.callback import CHECKPOINT_KEY, LightningAdapter
from sakura_adapters.lightning.precision import SakuraPrecision

__all__ = ["CHECKPOINT_KEY", "LightningAdapter", "SakuraPrecision"]
