"""Checkpoints of a training run that survive kills and restarts.

* Written atomically (`adasum.experiments.io.write_atomic`): `torch.save` to a temporary file in
  the same folder, then `os.replace`, so a kill in the middle of a save leaves the previous
  checkpoint intact and usable; the temporary file of such a kill is removed at the next save.
* Of one kind: a checkpoint records whether a simulated run or a torchrun job wrote it, and the
  other kind refuses it in one line (their engines' states differ).
* Under torchrun every rank's own state (its RNG state; in delta mode its optimizer state) is
  gathered to rank 0, which writes one file; on resume every rank takes its own part back, and on
  another world size (an elastic restart) every rank takes rank 0's part (`load_checkpoint`).
* Checksummed: every checkpoint holds the SHA-256 of its contents (every tensor's bytes, dtype and
  shape, every plain value); loading recomputes it, so a flipped byte that still unpickles
  (a weight, a momentum, an epoch number) is refused in one line instead of resuming silently.
* Read with ``weights_only=True``; a damaged, truncated or foreign file gives a one-line
  ValueError naming the file, never an unpickling traceback; so does one whose checksum holds but
  whose contents this run cannot take (another model's shapes, a missing key, a short RNG state:
  `applied`; an epoch that is not a count of finished epochs).
* A write that fails (a full disk) raises `adasum.experiments.io.WriteFailed` in one line, on every
  rank under torchrun; the previous checkpoint is intact.
* `kill_at(rank, step, marker)`: a test's fault injection, an ``on_step`` callback for `train`:
  rank RANK SIGKILLs itself after global step STEP unless the file MARKER exists (it creates
  MARKER first, so only the first attempt dies and a restarted run goes on).

>>> save_checkpoint(path, common, local, distributed=True)     # on every rank  # doctest: +SKIP
>>> common, local = load_checkpoint(path, device, distributed=True)  # doctest: +SKIP

On one process (a group of one rank), in a temporary folder:

>>> import tempfile
>>> import torch.distributed as dist
>>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
>>> folder = tempfile.TemporaryDirectory()
>>> path = Path(folder.name) / "checkpoint.pt"
>>> save_checkpoint(path, {"config": {}, "epoch": 3}, {"engine": {"w": torch.ones(2)}}, distributed=True)
>>> common, local = load_checkpoint(path, "cpu", distributed=True)
>>> common["epoch"], common["world_size"], local["engine"]["w"]
(3, 1, tensor([1., 1.]))
>>> load_checkpoint(path, "cpu", distributed=False)  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: .../checkpoint.pt was written by a torchrun job, this is a simulated run; resume it the way ...
>>> dist.destroy_process_group(); folder.cleanup()
"""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from adasum.experiments.io import WriteFailed, write_atomic
from adasum.transport.errors import failures_named

REQUIRED = ("config", "epoch", "engine")
CHECKSUM = "checksum"


def content_checksum(obj: Any) -> str:
    """SHA-256 over `obj`'s contents: nested dicts, lists and tuples of tensors and plain values
    (each tensor's dtype, shape and bytes on the CPU; each value's type and repr)."""
    digest = hashlib.sha256()
    _feed(digest, obj)
    return digest.hexdigest()


def _feed(digest: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        digest.update(f"tensor {t.dtype} {tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        digest.update(f"dict {len(obj)};".encode())
        for key, value in obj.items():
            _feed(digest, key)
            _feed(digest, value)
    elif isinstance(obj, (list, tuple)):
        digest.update(f"{type(obj).__name__} {len(obj)};".encode())
        for value in obj:
            _feed(digest, value)
    else:
        digest.update(f"{type(obj).__name__} {obj!r};".encode())


def save_atomic(obj: dict[str, Any], path: Path) -> None:
    """torch.save `obj` with its `content_checksum` to a temporary file in the same folder, then
    os.replace: never a torn file."""
    stamped = {**obj, CHECKSUM: content_checksum(obj)}
    write_atomic(path, lambda f: torch.save(stamped, f))


def save_checkpoint(path: Path, common: dict[str, Any], local: dict[str, Any], *, distributed: bool) -> None:
    """Write ``{**common, **local_of_rank_0, "ranks": [local of every rank]}`` to `path` atomically.

    `local` holds what differs between ranks ("engine", "rng", ...). Under torchrun every rank must
    call this (the local parts are gathered to rank 0, which writes); otherwise the one process writes.
    """
    if not distributed:
        save_atomic({**common, **local, "kind": "simulated"}, path)
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    with failures_named("adasum train", "the gather of every rank's checkpoint part", None):
        dist.gather_object(local, gathered, dst=0)

    def write() -> None:
        assert gathered is not None  # rank 0's
        save_atomic({**common, **gathered[0], "ranks": gathered, "world_size": world, "kind": "torchrun"}, path)

    # every rank stops with rank 0's error, instead of going on to wait for a peer that left
    on_rank_zero(write, WriteFailed, "the checkpoint's verdict across ranks")


def on_rank_zero(action: Callable[[], object], error: type[Exception], what: str) -> None:
    """Run `action` on rank 0 (its result is not kept) and tell every rank how it went: an `error` it raises is
    raised again, with the same one-line message, on every rank (not on rank 0 alone, with the others waiting for a
    peer that left). `what` names the broadcast if it fails."""
    verdict: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            action()
        except error as failed:
            verdict[0] = str(failed)
    with failures_named("adasum train", what, None):
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise error(verdict[0])


def read_checkpoint(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Load `path` with ``weights_only=True``; ValueError (one line) if it is damaged or not ours."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as error:  # zip, unpickling and EOF errors all mean "not a usable checkpoint"
        lines = str(error).strip().splitlines()
        reason = lines[0] if lines else type(error).__name__
        raise ValueError(
            f"{path} is not a readable checkpoint ({type(error).__name__}: {reason}); "
            "delete it or use another --out"
        ) from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED):
        raise ValueError(f"{path} is not an adasum training checkpoint; delete it or use another --out")
    saved = state.pop(CHECKSUM, None)
    if saved is None or saved != content_checksum(state):
        reason = "has no checksum" if saved is None else "does not match its checksum"
        raise ValueError(f"{path} {reason} (damaged or altered); delete it or use another --out")
    for key in ("epoch", "step_in_epoch"):
        value = state.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{path} holds {key} {value!r}, not a count (an integer >= 0); it is not a checkpoint "
                             "of a run: delete it or use another --out")
    return state


def applied(path: Path, apply: Callable[[], object]) -> None:
    """Run `apply` (a checkpoint's parts loaded into this run: a model's and an optimizer's state, the RNG's); a
    part that does not fit (another model's shapes, a missing key, a short RNG state: a checkpoint of another run,
    or altered and checksummed again) is a one-line ValueError naming `path`, not torch's traceback."""
    try:
        apply()
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = "; ".join(lines[:2])[:200] or type(error).__name__
        raise ValueError(f"{path} holds a state this run cannot take ({type(error).__name__}: {reason}); delete it "
                         "or use another --out") from None


def load_checkpoint(
    path: Path, device: torch.device | str = "cpu", *, distributed: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, this rank's local part) from `path`; the local part is the top level when not
    distributed, else ``state["ranks"][rank]``, or on another world size than the checkpoint's
    (``saved_world_size(state)``: an elastic restart, docs/faults.md) rank 0's part on every rank,
    so that every rank starts from the same per-rank state."""
    state = read_checkpoint(path, device)
    kind = state.get("kind", "torchrun" if "ranks" in state else "simulated")
    wanted = "torchrun" if distributed else "simulated"
    if kind != wanted:
        names = {"torchrun": "a torchrun job", "simulated": "a simulated run"}
        raise ValueError(
            f"{path} was written by {names.get(kind, kind)}, this is {names[wanted]}; "
            "resume it the way it was started or use another --out"
        )
    if not distributed:
        return state, state
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = state.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise ValueError(f"{path} holds no rank's part; it is not a checkpoint of a torchrun job: delete it or use "
                         "another --out")
    return state, ranks[rank] if len(ranks) == world else ranks[0]


def saved_world_size(state: dict[str, Any]) -> int:
    """The number of ranks that wrote a torchrun job's checkpoint `state` (`load_checkpoint`'s)."""
    return len(state["ranks"])


def kill_at(rank: int, step: int, marker: str | os.PathLike) -> Callable[[int, int], None]:
    """An ``on_step`` callback (`adasum.experiments.runner.train`): SIGKILL this process after global step `step`
    on rank `rank`, unless the file `marker` exists (it is created first, so a restarted run goes on)."""

    def on_step(this_rank: int, global_step: int) -> None:
        if this_rank != rank or global_step != step or os.path.exists(marker):
            return
        Path(marker).write_text(f"killed rank {rank} after step {global_step}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    return on_step
