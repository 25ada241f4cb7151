"""The string options of the public API as types: each a `Literal` that the signatures carry (type checkers and
editors show the choices), and `check_option`, the one runtime test of a value against it (callers need not run a
type checker).

>>> check_option("nonfinite", "skip", Nonfinite)
>>> check_option("mode", "deltas", Mode)
Traceback (most recent call last):
...
ValueError: mode must be one of ['delta', 'gradient'], got 'deltas'
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, get_args

Nonfinite = Literal["propagate", "raise", "skip"]
"""What to do about a NaN or Inf: let it through, raise on every rank, or skip the step on every rank."""

Mode = Literal["delta", "gradient"]
"""What is combined across workers: each worker's change of the parameters over its step (delta), or its
gradients (`adasum.DistributedOptimizer`'s ``mode``, the simulator's ``combine``)."""

Buffers = Literal["local", "reset", "average"]
"""What `adasum.SlowMo` does with the base optimizer's buffers at each outer step."""

Scale = Literal["mean_norm", "unit"]
"""How AdaCons scales the weighted consensus direction."""

TransportName = Literal["p2p", "collectives", "symmetric", "slices", "one-shot"]
"""The transports a caller may name (``transport=``)."""


def choices(option: Any) -> tuple[str, ...]:
    """The values of an option type, in order."""
    return get_args(option)


def check_option(name: str, value: object, option: Any, allowed: Iterable[str] | None = None) -> None:
    """Raise ValueError unless `value` is one of `option`'s values (or of `allowed`, a part of them)."""
    values = list(choices(option) if allowed is None else allowed)
    if value not in values:
        raise ValueError(f"{name} must be one of {values}, got {value!r}")
