"""Every setting of the library in one frozen object, read from the environment once.

`current()` returns the settings in force: the process's (read from the environment on first use),
or those of the innermost `override` block of the calling thread. Nothing else in the library reads
``os.environ``; docs/settings.md lists every variable.

>>> current().cuda_graphs
True
>>> with override(cuda_graphs=False):
...     current().cuda_graphs
False
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import functools
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
SPELLINGS = "0/1, false/true, no/yes, off/on (any case)"
"""The spellings of a boolean variable."""

TRITON_VECTORS = ("1", "2-byte", "0")
"""The values of ``triton_vectors`` (``ADASUM_TRITON_VECTORS`` also takes the boolean spellings for 1 and 0)."""

TRANSPORT_NAMES = ("p2p", "collectives", "symmetric", "slices", "one-shot")
"""The values of ``transport_first`` besides empty: the names ``transport=`` takes (`adasum.options.TransportName`;
this module imports nothing of adasum)."""

VARIABLES: Mapping[str, str] = MappingProxyType({
    "cuda_graphs": "ADASUM_CUDA_GRAPHS",
    "transport_first": "ADASUM_TEST_TRANSPORT",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "local_rank": "LOCAL_RANK",
    "group_rank": "GROUP_RANK",
    "symmetric": "ADASUM_SYMMETRIC",
    "symmetric_push": "ADASUM_SYMMETRIC_PUSH",
    "symmetric_chunks": "ADASUM_SYMMETRIC_CHUNKS",
    "symmetric_chunk_bytes": "ADASUM_SYMMETRIC_CHUNK_BYTES",
    "symmetric_max_chunks": "ADASUM_SYMMETRIC_MAX_CHUNKS",
    "triton_vectors": "ADASUM_TRITON_VECTORS",
    "one_shot_bytes": "ADASUM_ONE_SHOT_BYTES",
    "memory_mb": "ADASUM_MEMORY_MB",
})
"""The environment variable of each field that has one (docs/settings.md)."""

READ_ELSEWHERE = ("ADASUM_CACHE", "ADASUM_WORD2VEC_EVAL", "ADASUM_TEST_BACKEND", "ADASUM_JAX_TESTS")
"""``ADASUM_*`` variables that are not settings: the experiment harness's data cache and word2vec evaluation files
(`adasum.experiments.embeddings.ENV`), and the test suite's own."""


def _flag(env: Mapping[str, str], name: str, default: bool = True) -> bool:
    value = env.get(name)
    if value is None or value == "":
        return default
    spelled = value.strip().lower()
    if spelled in _TRUE or spelled in _FALSE:
        return spelled in _TRUE
    raise ValueError(f"adasum.settings: {name}={value!r} is not a boolean; use {SPELLINGS}")


_Default = TypeVar("_Default", int, None)


def _parsed(env: Mapping[str, str], name: str, default, parse, what: str):
    """`name`'s value read by `parse` (`default` where unset or empty); refused, naming it, where `parse` fails."""
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return parse(value)
    except ValueError:
        raise ValueError(f"adasum.settings: {name}={value!r} is not {what}; set {name} to {what} or unset it") from None


def _int(env: Mapping[str, str], name: str, default: _Default) -> int | _Default:
    return _parsed(env, name, default, int, "an integer")


def _rank(env: Mapping[str, str], name: str) -> int | None:
    """A rank variable: unset, empty or -1 (the usual "not distributed") is None."""
    value = _int(env, name, None)
    return None if value == -1 else value


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    return _parsed(env, name, default, float, "a number")


def _vectors(env: Mapping[str, str]) -> str:
    name = VARIABLES["triton_vectors"]
    value = env.get(name)
    if value is None or value == "":
        return "1"
    spelled = value.strip().lower()
    if spelled in TRITON_VECTORS:
        return spelled
    if spelled in _TRUE or spelled in _FALSE:
        return "1" if spelled in _TRUE else "0"
    raise ValueError(f"adasum.settings: {name}={value!r} is not one of {', '.join(TRITON_VECTORS)} (or {SPELLINGS}); "
                     "set one of them")


def _warn_unknown(env: Mapping[str, str]) -> None:
    """One warning for each ``ADASUM_*`` variable that no setting reads, with the closest known name."""
    known = [*(v for v in VARIABLES.values() if v.startswith("ADASUM_")), *READ_ELSEWHERE]
    for name in sorted(n for n in env if n.startswith("ADASUM_") and n not in known):
        prefix = len("ADASUM_")  # compared without the prefix they all share
        close = difflib.get_close_matches(name[prefix:], [k[prefix:] for k in known], n=1, cutoff=0.6)
        hint = f"did you mean ADASUM_{close[0]}?" if close else "docs/settings.md lists the variables"
        warnings.warn(
            f"adasum.settings: the environment variable {name} is not a setting of adasum and is ignored ({hint}); "
            "remove or rename it",
            UserWarning,
            stacklevel=3,
        )


def _name(field: str) -> str:
    variable = VARIABLES.get(field)
    return f"{field} ({variable})" if variable else field


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Settings:
    """The library's settings (docs/settings.md names the environment variable of each)."""

    cuda_graphs: bool = True
    """Capture repeated GPU collectives into CUDA graphs (``ADASUM_CUDA_GRAPHS``)."""
    transport_first: str = ""
    """A transport put first in the NCCL default order where the group can run it (``ADASUM_TEST_TRANSPORT``): one
    of `TRANSPORT_NAMES`, or empty for none."""
    piece_elements: tuple[int, int] = (1 << 20, 1 << 25)
    """Largest piece of a level's point-to-point exchange, in 4-byte elements: (gloo, NCCL)."""
    local_world_size: int | None = None
    """Ranks per node for hierarchical mode, as torchrun sets it (``LOCAL_WORLD_SIZE``)."""
    local_rank: int | None = None
    """This process's rank on its node, as torchrun sets it (``LOCAL_RANK``)."""
    group_rank: int | None = None
    """This process's node, as torchrun sets it (``GROUP_RANK``)."""
    deferred_checks: bool | None = None
    """Compare a repeated call's fingerprint on the group's guard thread instead of before its data (None: on NCCL
    only, where the host must not wait; `adasum.checks.plan`)."""
    symmetric: bool = True
    """Symmetric memory may be chosen on NCCL (``ADASUM_SYMMETRIC``)."""
    symmetric_push: bool = True
    """Two-rank symmetric levels push instead of pull (``ADASUM_SYMMETRIC_PUSH``)."""
    symmetric_chunks: bool = True
    """Two-rank symmetric levels are cut into chunks (``ADASUM_SYMMETRIC_CHUNKS``)."""
    symmetric_chunk_bytes: int = 32 << 20
    """Smallest chunk of a chunked symmetric level (``ADASUM_SYMMETRIC_CHUNK_BYTES``)."""
    symmetric_max_chunks: int = 4
    """Most chunks of a chunked symmetric level (``ADASUM_SYMMETRIC_MAX_CHUNKS``)."""
    triton_vectors: str = "1"
    """The Triton kernels' 16-byte vector accesses: "1" where aligned, "2-byte" only for 2-byte dtypes, "0" never
    (``ADASUM_TRITON_VECTORS``)."""
    one_shot_bytes: int = 4 << 20
    """The default's one-shot limit on NCCL inside one host (``ADASUM_ONE_SHOT_BYTES``), in the group sizes of
    `adasum.transport.ONE_SHOT_WORLDS`: a buffer whose copies from every peer take at most this many bytes
    (``(P - 1) x`` its bytes) runs one-shot, every rank taking every copy whole and running the tree itself
    (`adasum.collectives.slices`); 0: never."""
    memory_mb: float = 512.0
    """Memory adasum may keep per process, in MiB (``ADASUM_MEMORY_MB``): the buffers of the symmetric and
    slice-parallel transports (the symmetric transports' staging, the slice-parallel movers' rows and ring, on
    symmetric memory or c10d, on the host on gloo) fit in it, a layout larger than they hold running in rounds
    (`adasum.transport.slices.memory_budget_bytes`); "p2p" and "collectives" have no budget (workspaces up to the
    fused buffer's size)."""

    def __post_init__(self) -> None:
        """Refuse a value of the wrong type (TypeError) or out of its field's range (ValueError), naming the field,
        its environment variable and the value: from the environment and from `override` alike."""
        for field in ("cuda_graphs", "symmetric", "symmetric_push", "symmetric_chunks"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"adasum.settings: {_name(field)} must be a bool, got {getattr(self, field)!r}; set "
                                "True or False")
        if self.deferred_checks is not None and not isinstance(self.deferred_checks, bool):
            raise TypeError(f"adasum.settings: deferred_checks must be a bool or None, got {self.deferred_checks!r}; "
                            "set one")
        if not isinstance(self.transport_first, str):
            raise TypeError(f"adasum.settings: {_name('transport_first')} must be a str, got "
                            f"{self.transport_first!r}; set a name")
        if self.transport_first and self.transport_first not in TRANSPORT_NAMES:
            raise ValueError(
                f"adasum.settings: {_name('transport_first')} must be one of {list(TRANSPORT_NAMES)} or empty, "
                f"got {self.transport_first!r}; set one of them"
            )
        if self.triton_vectors not in TRITON_VECTORS:
            raise ValueError(
                f"adasum.settings: {_name('triton_vectors')} must be one of {list(TRITON_VECTORS)}, "
                f"got {self.triton_vectors!r}; set one of them"
            )
        pieces = self.piece_elements
        if not (isinstance(pieces, tuple) and len(pieces) == 2 and all(_is_int(p) for p in pieces)):
            raise TypeError("adasum.settings: piece_elements must be a tuple of two ints (gloo, NCCL), got "
                            f"{pieces!r}; set one")
        if min(pieces) < 1:
            raise ValueError(f"adasum.settings: piece_elements must be >= 1 element each, got {pieces!r}; set larger "
                             "ones")
        minimum = {
            "local_world_size": 1, "local_rank": 0, "group_rank": 0, "symmetric_chunk_bytes": 1,
            "symmetric_max_chunks": 1, "one_shot_bytes": 0,
        }
        for field, least in minimum.items():
            value = getattr(self, field)
            if value is None and field in ("local_world_size", "local_rank", "group_rank"):
                continue
            if not _is_int(value):
                raise TypeError(f"adasum.settings: {_name(field)} must be an int, got {value!r}; set an int")
            if value < least:
                raise ValueError(
                    f"adasum.settings: {_name(field)} must be >= {least}, got {value}; set {least} or more"
                )
        memory = self.memory_mb
        if not isinstance(memory, (int, float)) or isinstance(memory, bool):
            raise TypeError(f"adasum.settings: {_name('memory_mb')} must be a number (MiB), got {memory!r}; set a "
                            "number")
        if not (math.isfinite(memory) and memory > 0):
            raise ValueError(f"adasum.settings: {_name('memory_mb')} must be a finite number > 0 (MiB), got {memory}; "
                             "set one")

    @functools.cached_property
    def shaping(self) -> tuple[str, ...]:
        """The settings that shape a collective's schedule or its checks (rounds, pieces, protocols, the transport
        put first, where checks run), as ``name=value`` for each that differs from its default: every rank of a
        group must have the same (`adasum.checks.plan.prepare` compares them with the call's configuration),
        or the ranks would move different pieces in different orders."""
        defaults = Settings()
        return tuple(
            f"{name}={getattr(self, name)}" for name in SHAPING if getattr(self, name) != getattr(defaults, name)
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """The settings that `env` (default: ``os.environ``) gives; unset (or empty) variables keep the defaults.

        A boolean variable takes 0/1, false/true, no/yes or off/on in any case; another value, or a number out of
        its setting's range, is a ValueError naming the variable. An ``ADASUM_*`` variable that is not a setting
        (a typo) is ignored with a warning naming the closest setting.

        >>> Settings.from_env({"ADASUM_CUDA_GRAPHS": "off"}).cuda_graphs
        False
        >>> Settings.from_env({"ADASUM_CUDA_GRAPHS": "maybe"})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: adasum.settings: ADASUM_CUDA_GRAPHS='maybe' is not a boolean; use 0/1, false/true, no/yes, ...
        """
        env = os.environ if env is None else env
        v = VARIABLES  # each field's variable, named once
        found = cls(
            cuda_graphs=_flag(env, v["cuda_graphs"]),
            transport_first=env.get(v["transport_first"], ""),
            local_world_size=_int(env, v["local_world_size"], None),
            local_rank=_rank(env, v["local_rank"]),
            group_rank=_rank(env, v["group_rank"]),
            symmetric=_flag(env, v["symmetric"]),
            symmetric_push=_flag(env, v["symmetric_push"]),
            symmetric_chunks=_flag(env, v["symmetric_chunks"]),
            symmetric_chunk_bytes=_int(env, v["symmetric_chunk_bytes"], 32 << 20),
            symmetric_max_chunks=_int(env, v["symmetric_max_chunks"], 4),
            triton_vectors=_vectors(env),
            one_shot_bytes=_int(env, v["one_shot_bytes"], 4 << 20),
            memory_mb=_float(env, v["memory_mb"], 512.0),
        )
        _warn_unknown(env)
        return found


SHAPING = (
    "transport_first", "piece_elements", "deferred_checks", "symmetric_push", "symmetric_chunks",
    "symmetric_chunk_bytes", "symmetric_max_chunks", "one_shot_bytes", "memory_mb",
)
"""The `Settings.shaping` fields; the others are local (graphs, kernels' vector loads, where this rank is) or agreed
elsewhere (``symmetric``: `adasum.transport.symmetric.SymmetricPool.supported`)."""

# The settings in force: the process's, read once, unless an `override` block of this thread or task set others.
_in_force: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("adasum_settings", default=None)


def current() -> Settings:
    """The settings in force (module doc)."""
    found = _in_force.get()
    if found is not None:
        return found
    return _from_process_env()


@functools.cache
def _from_process_env() -> Settings:
    return Settings.from_env()


@contextmanager
def override(**changes: object) -> Iterator[Settings]:
    """Run a block with some settings changed (keyword names: the `Settings` fields), for the calling thread.
    A name that is not a field is a TypeError naming the closest field (or the field of an environment variable
    given by its name).

    >>> with override(piece_elements=(1000, 1000)) as s:
    ...     s.piece_elements
    (1000, 1000)
    """
    fields = [f.name for f in dataclasses.fields(Settings)]
    for name in changes:
        if name not in fields:
            of_variable = [f for f, v in VARIABLES.items() if v == name]
            close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
            hint = (
                f"did you mean {of_variable[0]}, the field of that variable?" if of_variable
                else f"did you mean {close[0]}?" if close
                else "the fields of adasum.settings.Settings are the settings"
            )
            raise TypeError(f"adasum.settings: override got {name!r}, which is not a setting ({hint}); pass a field "
                            "of Settings")
    token = _in_force.set(dataclasses.replace(current(), **changes))  # type: ignore[arg-type]
    try:
        yield _in_force.get()  # type: ignore[misc]
    finally:
        _in_force.reset(token)
