"""One atomic writer for every file the experiments write whole (checkpoints, result.json,
results.jsonl, report.md, the MNIST-1D cache), and the reader of append-only JSON-lines files.

`write_atomic` writes to ``.NAME.tmp<PID>`` in the same folder, then `os.replace`: a reader sees
the old file or the new one, never a torn one. A kill in the middle leaves the temporary file;
the next write to the same path removes the ones whose process is gone.

>>> import tempfile
>>> folder = Path(tempfile.mkdtemp())
>>> write_atomic(folder / "state.pt", lambda f: torch.save({"step": 3}, f))
>>> torch.load(folder / "state.pt")
{'step': 3}
>>> write_text_atomic(folder / "result.json", json.dumps({"test_accuracy": 94.6}))
>>> json.loads((folder / "result.json").read_text())
{'test_accuracy': 94.6}
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("adasum")


def _temporary(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}.tmp{pid}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove ``.NAME.tmp<PID>`` files next to `path` left by writers that no longer run; their paths."""
    removed: list[Path] = []
    prefix = f".{path.name}.tmp"
    if not path.parent.is_dir():
        return removed
    for candidate in path.parent.iterdir():
        if not candidate.name.startswith(prefix):
            continue
        pid = candidate.name[len(prefix) :]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        try:
            candidate.unlink()
            removed.append(candidate)
        except FileNotFoundError:
            pass
    return removed


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> None:
    """Call ``write(file)`` on a temporary file in `path`'s folder, then replace `path` with it.

    On any error (a kill included, at the next write) the temporary file is removed and `path` is
    left as it was.
    """
    path = Path(path)
    for stale in remove_stale_temporaries(path):
        log.info("removed %s (left by an interrupted write)", stale)
    tmp = _temporary(path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically (`write_atomic`)."""
    write_atomic(path, lambda f: f.write(text.encode()))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as indented JSON to `path` atomically."""
    write_text_atomic(path, json.dumps(obj, indent=1) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file that is only ever appended to (gzip-compressed if it ends in ``.gz``).

    A torn last line (a kill or a full disk during the append) is dropped with a warning naming the
    file; a bad line anywhere else is damage, and a one-line ValueError names the file and line.
    """
    path = Path(path)
    data = path.read_bytes()
    if path.suffix == ".gz":  # results kept in the repository are compressed (`adasum report runs.jsonl.gz`)
        data = gzip.decompress(data)
    lines = data.decode().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            if all(not rest.strip() for rest in lines[number:]):
                log.warning("%s: dropped its torn last line %d (an interrupted append: %s)", path, number, error.msg)
                break
            raise ValueError(
                f"{path}: line {number} is not JSON ({error.msg}); the file is damaged: "
                "delete it or use another --out"
            ) from None
    return rows
