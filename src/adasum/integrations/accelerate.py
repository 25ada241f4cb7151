"""Adasum with Hugging Face Accelerate: one call on the prepared model.

``accelerator.prepare`` wraps the model in DistributedDataParallel when there are several
processes; `enable` registers `adasum.ddp.adasum_hook` on it, before the first backward pass.
(Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` knows only torch's built-in hooks.)
Gradient accumulation (``accelerator.accumulate``), ``accelerator.backward``, clipping and mixed
precision work as usual.

>>> model, opt, data = accelerator.prepare(model, opt, data)  # doctest: +SKIP
>>> state = adasum.accelerate.enable(model)                     # doctest: +SKIP
"""

from __future__ import annotations

from adasum.extras import require

require("accelerate", extra="accelerate", user="adasum.accelerate")

import torch  # noqa: E402

from adasum.integrations.ddp import AdasumState  # noqa: E402
from adasum.integrations.glue import register_hook  # noqa: E402

__all__ = ["enable"]

LAUNCH = (
    "torchrun --nproc-per-node N script.py, or accelerate launch --multi_gpu --num_processes N on GPUs; "
    "accelerate launch --cpu starts one process whatever --num_processes says"
)


def enable(model: torch.nn.Module, state: AdasumState | None = None) -> AdasumState | None:
    """Register `adasum.ddp.adasum_hook` on the model that ``accelerator.prepare`` returned.

    Args:
        model: the prepared model (DistributedDataParallel when there are several processes).
        state: the hook's state (default: ``AdasumState(named_parameters=...)`` of the model, so that
            errors name parameters); any reducer or option of `adasum.ddp.AdasumState`.

    Returns:
        The hook's state (``state.iteration`` counts the combined iterations), or None when there
        is nothing to do: one process, or a model that is not DistributedDataParallel (both warn).

    Raises:
        TypeError: `state` is not an `adasum.ddp.AdasumState` (or None), also on one process.

    >>> state = adasum.accelerate.enable(model, AdasumState(reducer="adacons"))  # doctest: +SKIP
    """
    inner = getattr(model, "module", model)
    return register_hook(
        model,
        state,
        inner.named_parameters(),
        user="adasum.accelerate.enable",
        launch=LAUNCH,
        not_ddp="pass the model that accelerator.prepare returned",
    )
