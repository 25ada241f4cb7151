"""The string options of the public API as types: each a `Literal` that the signatures carry (type checkers and
editors show the choices), and `check_option`, the one runtime test of a value against it (callers need not run a
type checker); and the runtime tests of the other kinds of option, counts (`check_count`), numbers in a range
(`check_number`) and flags (`check_flag`), each raising the same message wherever the option is taken, and of a
saved state's options against an object's (`check_saved_settings`); Horovod's ``op=`` read as a reducer
(`reducer_of_op`); the error of a call before ``init_process_group`` (`not_initialised`); and the
``stacklevel`` that makes a warning name the user's line (`user_stacklevel`).

>>> check_option("nonfinite", "skip", Nonfinite)
>>> check_option("mode", "deltas", Mode)
Traceback (most recent call last):
...
ValueError: mode must be one of ['delta', 'gradient'], got 'deltas'; pass one of them
"""

from __future__ import annotations

import numbers
import os
import sys
from collections.abc import Callable, Iterable
from types import FrameType, MappingProxyType
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
        raise ValueError(f"{name} must be one of {values}, got {value!r}; pass one of them")


def check_count(operation: str, name: str, value: object) -> None:
    """Raise unless `value` is an integer >= 1 (not a bool): TypeError for another type, ValueError below 1.

    >>> check_count("adasum.SlowMo", "local_steps", 1.5)
    Traceback (most recent call last):
    TypeError: adasum.SlowMo: local_steps must be an integer >= 1, got 1.5; pass local_steps= a whole number
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{operation}: {name} must be an integer >= 1, got {value!r}; pass {name}= a whole number")
    if value < 1:
        raise ValueError(f"{operation}: {name} must be an integer >= 1, got {value!r}; pass {name}=1 or more")


def check_number(operation: str, name: str, value: object, allowed: str, ok: Callable[[float], bool]) -> None:
    """Raise unless `value` is a real number (not a bool) for which `ok` holds; `allowed` says which in the message:
    TypeError for another type, ValueError for a number `ok` refuses (NaN fails every comparison).

    >>> check_number("adasum.SlowMo", "slow_lr", float("nan"), "a finite number > 0", lambda v: 0 < v < float("inf"))
    Traceback (most recent call last):
    ValueError: adasum.SlowMo: slow_lr must be a finite number > 0, got nan; pass slow_lr= a finite number > 0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{operation}: {name} must be {allowed}, got {value!r}; pass a number")
    if not ok(float(value)):
        raise ValueError(f"{operation}: {name} must be {allowed}, got {value!r}; pass {name}= {allowed}")


def check_flag(operation: str, name: str, value: object) -> None:
    """Raise TypeError unless `value` is True or False (a string such as "no" would count as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{operation}: {name} must be True or False, got {value!r}; pass a bool")


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


HOROVOD_OPS = MappingProxyType({"adasum": "adasum", "average": "mean", "sum": "sum"})
"""Horovod's reduction ops (``op=hvd.Adasum``, ``hvd.Average``, ``hvd.Sum``) by the reducer name each maps to."""


def reducer_of_op(operation: str, op: object, reducer: object) -> object:
    """The reducer that Horovod's keyword ``op=`` asks for: ``"Adasum"``, ``"Average"`` or ``"Sum"`` (any case;
    Horovod's own constants where ``horovod.torch`` is imported), or a reducer name or object as ``reducer=``
    takes; `reducer` itself where `op` is None. Naming a reducer both ways is a ValueError; any other op a
    ValueError that names the ``reducer=`` spelling (an unknown name: `adasum.get_reducer`'s ValueError).

    >>> reducer_of_op("adasum.DistributedOptimizer", "Average", "adasum")
    'mean'
    >>> reducer_of_op("adasum.DistributedOptimizer", 3, "adasum")
    Traceback (most recent call last):
    ValueError: adasum.DistributedOptimizer: op=3 has no reducer; pass reducer='adasum', 'mean' or 'sum' (Horovod's \
Adasum, Average, Sum)
    """
    if op is None:
        return reducer
    if reducer != "adasum":
        raise ValueError(f"{operation}: pass reducer= or Horovod's op=, not both (got reducer={reducer!r}, op={op!r})")
    horovod = sys.modules.get("horovod.torch")
    for name in ("Adasum", "Average", "Sum"):
        if horovod is not None and not isinstance(op, str) and getattr(horovod, name, object()) is op:
            return HOROVOD_OPS[name.lower()]
    if isinstance(op, str) and op.lower() in HOROVOD_OPS:
        return HOROVOD_OPS[op.lower()]
    if isinstance(op, str) or hasattr(op, "reduce"):
        return op  # a reducer name or object, as reducer= takes (get_reducer refuses an unknown name)
    raise ValueError(
        f"{operation}: op={op!r} has no reducer; pass reducer='adasum', 'mean' or 'sum' "
        "(Horovod's Adasum, Average, Sum)"
    )


def not_initialised(operation: str) -> RuntimeError:
    """The error of a call that needs a process group before ``init_process_group`` ran, with how to start one."""
    return RuntimeError(
        f"{operation} needs torch.distributed to be initialised: call "
        "torch.distributed.init_process_group('nccl') (or 'gloo' on CPUs) first, with the script under torchrun"
    )


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel(*through: str) -> int:
    """The ``stacklevel`` that makes a warning, raised by the function that calls this one, name the user's line:
    the first caller outside adasum and outside the packages named in `through` (such as ``"lightning"``, whose
    own frames lie between the user's ``trainer.fit(...)`` and adasum's code).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warnings.warn("here", UserWarning, stacklevel=user_stacklevel())
    >>> caught[0].filename.endswith("options.py")     # a doctest's line has no file: the caller outside it
    False
    """
    prefixes = [_PACKAGE]
    for name in through:
        module = sys.modules.get(name)
        prefixes += [os.path.join(os.path.abspath(p), "") for p in getattr(module, "__path__", ())]
    frame: FrameType | None = sys._getframe(1)  # the function that warns: stacklevel 1
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(tuple(prefixes)):
        frame, level = frame.f_back, level + 1
    return level
