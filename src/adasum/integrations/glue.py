"""What the framework integrations (`adasum.lightning`, `adasum.accelerate`) share: registering the
DDP hook on a wrapped model, and the warning when doing so would change nothing."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from adasum.integrations.ddp import AdasumState, adasum_hook
from adasum.options import user_stacklevel
from adasum.transport.alone import quiet_one_rank

FRAMEWORKS = ("lightning", "pytorch_lightning")
"""The frameworks whose own frames lie between the user's line and a warning of the glue (`user_stacklevel`)."""


def world_size() -> int:
    """Processes in the default group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def warn_one_process(user: str, launch: str) -> bool:
    """Warn (and return True) when this is the only process: nothing to combine, so Adasum does nothing."""
    if world_size() > 1:
        return False
    quiet_one_rank(None)  # this warning counts for the group: the entry points under the glue say nothing more
    warnings.warn(
        f"{user}: only one process, so Adasum has nothing to combine and training runs as on a single worker; "
        f"start several processes ({launch})",
        UserWarning,
        stacklevel=user_stacklevel(*FRAMEWORKS),
    )
    return True


def check_state(state: object, user: str, name: str = "state") -> None:
    """Raise TypeError unless `state` (the argument `name` of `user`) is an `AdasumState` or None: anything else
    would be handed to the hook, which fails at the first backward pass (or, on one process, be ignored)."""
    if state is not None and not isinstance(state, AdasumState):
        raise TypeError(
            f"{user}: {name} must be an adasum.ddp.AdasumState or None, got {type(state).__name__} ({state!r}); "
            "for another reducer pass AdasumState(reducer=...)"
        )


def register_hook(
    model: torch.nn.Module | None,
    state: AdasumState | None,
    named_parameters: Iterable[tuple[str, torch.Tensor]],
    *,
    user: str,
    launch: str,
    not_ddp: str,
) -> AdasumState | None:
    """Register `adasum_hook` on `model` with `state` (default: an `AdasumState` that names the
    parameters) and return the state; warn and return None when the model is not wrapped in
    DistributedDataParallel (`not_ddp` says what to do) or runs in one process (`launch` says how to
    start several). A `state` that is not an `AdasumState` raises TypeError (`check_state`), also on one process."""
    check_state(state, user)
    if warn_one_process(user, launch):
        return None
    if not isinstance(model, DistributedDataParallel):
        warnings.warn(
            f"{user}: the model is a {type(model).__name__}, not DistributedDataParallel, so the Adasum hook "
            f"is not registered and Adasum does nothing; {not_ddp}",
            UserWarning,
            stacklevel=user_stacklevel(*FRAMEWORKS),
        )
        return None
    state = state if state is not None else AdasumState(named_parameters=named_parameters)
    model.register_comm_hook(state, adasum_hook)
    return state
