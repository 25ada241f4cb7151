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
import functools
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass


def _flag(env: Mapping[str, str], name: str, default: bool = True) -> bool:
    value = env.get(name)
    return default if value in (None, "") else value != "0"


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    return default if value in (None, "") else int(value)


@dataclass(frozen=True)
class Settings:
    """The library's settings (docs/settings.md names the environment variable of each)."""

    cuda_graphs: bool = True
    """Capture repeated GPU collectives into CUDA graphs (``ADASUM_CUDA_GRAPHS``)."""
    transport_first: str = ""
    """A transport put first in the NCCL default order where the group can run it (``ADASUM_TEST_TRANSPORT``)."""
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
    only, where the host must not wait; `adasum.collectives.plan`)."""
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
    """Device memory adasum may keep per process, in MiB (``ADASUM_MEMORY_MB``): every transport's buffers (the
    symmetric transports' staging, the slice-parallel movers' rows and ring, on symmetric memory or c10d) fit in it,
    a layout larger than they hold running in rounds (`adasum.transport.slices.memory_budget_bytes`)."""

    @functools.cached_property
    def shaping(self) -> tuple[str, ...]:
        """The settings that shape a collective's schedule or its checks (rounds, pieces, protocols, the transport
        put first, where checks run), as ``name=value`` for each that differs from its default: every rank of a
        group must have the same (`adasum.collectives.plan.prepare` compares them with the call's configuration),
        or the ranks would move different pieces in different orders."""
        defaults = Settings()
        return tuple(
            f"{name}={getattr(self, name)}" for name in _SHAPING if getattr(self, name) != getattr(defaults, name)
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """The settings that `env` (default: ``os.environ``) gives; unset variables keep the defaults."""
        env = os.environ if env is None else env
        local = _int(env, "LOCAL_WORLD_SIZE", 0)
        local_rank, group_rank = _int(env, "LOCAL_RANK", -1), _int(env, "GROUP_RANK", -1)
        return cls(
            cuda_graphs=_flag(env, "ADASUM_CUDA_GRAPHS"),
            transport_first=env.get("ADASUM_TEST_TRANSPORT", ""),
            local_world_size=local if local > 0 else None,
            local_rank=local_rank if local_rank >= 0 else None,
            group_rank=group_rank if group_rank >= 0 else None,
            symmetric=_flag(env, "ADASUM_SYMMETRIC"),
            symmetric_push=_flag(env, "ADASUM_SYMMETRIC_PUSH"),
            symmetric_chunks=_flag(env, "ADASUM_SYMMETRIC_CHUNKS"),
            symmetric_chunk_bytes=_int(env, "ADASUM_SYMMETRIC_CHUNK_BYTES", 32 << 20),
            symmetric_max_chunks=_int(env, "ADASUM_SYMMETRIC_MAX_CHUNKS", 4),
            triton_vectors=env.get("ADASUM_TRITON_VECTORS", "1"),
            one_shot_bytes=_int(env, "ADASUM_ONE_SHOT_BYTES", 4 << 20),
            memory_mb=float(env.get("ADASUM_MEMORY_MB", 512.0)),
        )


_SHAPING = (
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

    >>> with override(piece_elements=(1000, 1000)) as s:
    ...     s.piece_elements
    (1000, 1000)
    """
    token = _in_force.set(dataclasses.replace(current(), **changes))  # type: ignore[arg-type]
    try:
        yield _in_force.get()  # type: ignore[misc]
    finally:
        _in_force.reset(token)
