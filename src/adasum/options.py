"""The string options of the public API as types: each a `Literal` that the signatures carry (type checkers and
editors show the choices), and `check_option`, the one runtime test of a value against it (callers need not run a
type checker); and the runtime tests of the other kinds of option, counts (`check_count`), numbers in a range
(`check_number`) and flags (`check_flag`), each raising the same message wherever the option is taken, and of a
saved state's options against an object's (`check_saved_settings`).

>>> check_option("nonfinite", "skip", Nonfinite)
>>> check_option("mode", "deltas", Mode)
Traceback (most recent call last):
...
ValueError: mode must be one of ['delta', 'gradient'], got 'deltas'
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
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


def check_count(operation: str, name: str, value: object) -> None:
    """Raise unless `value` is an integer >= 1 (not a bool): TypeError for another type, ValueError below 1.

    >>> check_count("adasum.SlowMo", "local_steps", 1.5)
    Traceback (most recent call last):
    TypeError: adasum.SlowMo: local_steps must be an integer >= 1, got 1.5
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{operation}: {name} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{operation}: {name} must be an integer >= 1, got {value!r}")


def check_number(operation: str, name: str, value: object, allowed: str, ok: Callable[[float], bool]) -> None:
    """Raise unless `value` is a real number (not a bool) for which `ok` holds; `allowed` says which in the message:
    TypeError for another type, ValueError for a number `ok` refuses (NaN fails every comparison).

    >>> check_number("adasum.SlowMo", "slow_lr", float("nan"), "a finite number > 0", lambda v: 0 < v < float("inf"))
    Traceback (most recent call last):
    ValueError: adasum.SlowMo: slow_lr must be a finite number > 0, got nan
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{operation}: {name} must be {allowed}, got {value!r}")
    if not ok(float(value)):
        raise ValueError(f"{operation}: {name} must be {allowed}, got {value!r}")


def check_flag(operation: str, name: str, value: object) -> None:
    """Raise TypeError unless `value` is True or False (a string such as "no" would count as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{operation}: {name} must be True or False, got {value!r}")


def check_saved_settings(operation: str, what: str, saved: dict[str, Any] | None, mine: dict[str, Any]) -> None:
    """ValueError naming every setting whose value in `saved` (a state's record of the settings it was made with;
    None or a missing name: not recorded, taken as it is) differs from `mine` (those of `what`, the object loading
    the state).

    >>> check_saved_settings("adasum.SlowMo.load_state_dict", "SlowMo", {"local_steps": 4}, {"local_steps": 8})
    Traceback (most recent call last):
    ValueError: adasum.SlowMo.load_state_dict: the state was saved with local_steps=4, but this SlowMo has \
local_steps=8; build it with the settings the state was saved with
    """
    if not saved:
        return
    differ = [name for name in mine if name in saved and saved[name] != mine[name]]
    if differ:
        was = ", ".join(f"{name}={saved[name]!r}" for name in differ)
        has = ", ".join(f"{name}={mine[name]!r}" for name in differ)
        raise ValueError(
            f"{operation}: the state was saved with {was}, but this {what} has {has}; build it with the settings the "
            "state was saved with"
        )
