"""Old public names kept for one release: each use warns (DeprecationWarning) and names the new one.

Renamed keywords (old -> new): ``DistributedOptimizer(reduce=)`` -> ``reducer=``;
``AdasumState(process_group=)`` -> ``group=``; ``SlowMo(sync_every=)`` -> ``local_steps=``;
``SimulatedWorkers(combine="gradients"/"deltas")`` -> ``"gradient"/"delta"``;
``SlowMo.skipped_syncs`` -> ``skipped_steps``.
"""

from __future__ import annotations

import warnings
from typing import Any

_UNSET: Any = object()
"""Default of a keyword that has a deprecated alias, so that "not given" is told from any value."""


def warn(message: str, stacklevel: int = 3) -> None:
    """A DeprecationWarning pointing at the caller of the public function."""
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)


def renamed(where: str, old: str, new: str, old_value: Any, new_value: Any, default: Any = _UNSET) -> Any:
    """The value for keyword `new`: `new_value`, or `old_value` of its deprecated alias `old` (with a
    DeprecationWarning). Both given is a TypeError. `old_value` is `_UNSET` when the alias was not
    passed; `new_value` falls back to `default` when it is `_UNSET` too.

    >>> renamed("SlowMo", "sync_every", "local_steps", _UNSET, 4)
    4
    """
    if old_value is _UNSET:
        return default if new_value is _UNSET else new_value
    warn(f"{where}: {old}= is deprecated, use {new}=", stacklevel=4)
    if new_value is not _UNSET:
        raise TypeError(f"{where}: pass {new}= only ({old}= is its deprecated alias)")
    return old_value
