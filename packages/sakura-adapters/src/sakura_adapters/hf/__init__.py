"""Hugging Face Transformers integration: a real ``TrainerCallback`` and a ``Trainer`` subclass.

``HFAdapter(rt)`` is a :class:`transformers.TrainerCallback` that maps every callback event
to a sakura event (the table is in ``docs/events.md``).  Passed to the stock Trainer
(``Trainer(..., callbacks=[HFAdapter(rt)])``) it also makes the installed services take
effect wherever a callback can:

================================  ===========================================================
Service call                      Under the stock ``transformers.Trainer`` + ``HFAdapter``
================================  ===========================================================
``autocast()``                    entered around every forward pass: the model's ``forward``
                                  is wrapped once (as accelerate does for its own mixed
                                  precision), when the Trainer is built or at train start
``wrap_model(model)``             applied when the Trainer is built; it must modify the model
                                  in place, a new object is an error
``wrap_optimizer(optimizer)``     applied at train start; in place only, as above
``wrap_loss``,                    impossible from a callback: an error when the Trainer is
``unscale_gradients``,            built (or, for services installed later, when training
``optimizer_step``                starts) that names the services and says to use
                                  :class:`SakuraTrainer`
``state_dict`` / ``load_...``     saved in every checkpoint folder; restored on resume when
                                  the checkpoint is ``<output_dir>/checkpoint-<step>`` or
                                  ``args.resume_from_checkpoint``
================================  ===========================================================

:class:`SakuraTrainer` is a drop-in :class:`transformers.Trainer` (same constructor, plus
``runtime=``) that routes the whole step through the runtime:

================================  ===========================================================
Trainer moment                    SakuraTrainer does
================================  ===========================================================
construction                      ``rt.wrap_model`` once, after the Trainer placed the model
                                  (any ``nn.Module`` may come back); again for ``model_init``
``create_optimizer``              the Trainer's optimizer, then ``rt.wrap_optimizer``, then a
                                  thin proxy whose ``step()`` unscales and offers the step to
                                  ``rt.optimizer_step`` (falling back to ``optimizer.step()``)
``compute_loss_context_manager``  the Trainer's contexts plus ``rt.autocast()`` (training
                                  and evaluation forwards)
``accelerator.backward(loss)``    ``OnBeforeBackward``, backward of ``rt.scale_loss(loss)``,
                                  ``OnAfterBackward``; the logged loss stays unscaled
``accelerator.clip_grad_norm_``   ``rt.unscale_gradients`` first (also for the logged norm)
``train(resume_from_checkpoint)`` the services' state comes back from that checkpoint
``evaluate`` / ``predict``        ``OnValidationBegin`` / ``OnPredictBegin`` first
exceptions from ``train``         ``OnError(source="transformers")``, then re-raised
================================  ===========================================================

Service state is written to ``sakura_state.pt`` (``sakura_state_<rank>.pt`` when there are
several processes) in each checkpoint folder, atomically, and loaded with
``weights_only=True``.

The modules: :mod:`.callback` (``HFAdapter``), :mod:`.trainer` (``SakuraTrainer``),
:mod:`.optimizer` (the step proxy), :mod:`.state` (the state files), :mod:`.wrapping`
(in-place wraps and autocast under the stock Trainer), :mod:`.checks` (what the Trainer
cannot honour).
"""

from __future__ import annotations

from sakura_adapters.hf.callback import HFAdapter
from sakura_adapters.hf.checks import SakuraTrainerRequiredError
from sakura_adapters.hf.state import STATE_FILE, state_file_name
from sakura_adapters.hf.trainer import SakuraTrainer

__all__ = [
    "STATE_FILE",
    "HFAdapter",
    "SakuraTrainer",
    "SakuraTrainerRequiredError",
    "state_file_name",
]
