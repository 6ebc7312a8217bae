"""sakura-ray: Sakura-enabled training loops inside Ray Train.

:class:`~sakura_ray.report.RayReport` (spec ``ray_report``) runs in each Ray Train worker
(``ray.train.torch.TorchTrainer``'s training function) and hands Ray what the Sakura
services produce: AsyncEval's validation metrics and the loop's logs as ``ray.train.report``
metrics, and each AsyncCheckpoint checkpoint, once its write is durable, as a
``ray.train.Checkpoint``.  Importing this package does not import ray.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["RayReport", "__version__"]


def __getattr__(name: str) -> object:
    if name == "RayReport":
        from sakura_ray.report import RayReport

        return RayReport
    raise AttributeError(f"module 'sakura_ray' has no attribute {name!r}")
