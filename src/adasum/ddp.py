"""Public path of the DDP communication hook: ``from adasum.ddp import AdasumState, adasum_hook``
(implemented in `adasum.integrations.ddp`)."""

from adasum.integrations.ddp import BATCH_MB, AdasumState, adasum_hook

__all__ = ["BATCH_MB", "AdasumState", "adasum_hook"]
