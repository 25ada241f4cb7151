"""One atomic writer for every file the experiments write whole (checkpoints, result.json,
results.jsonl, report.md, the MNIST-1D cache), and the readers of append-only JSON-lines files.

`write_atomic` writes to ``.NAME.tmp<PID>`` in the same folder, then `os.replace`: a reader sees
the old file or the new one, never a torn one. A kill in the middle leaves the temporary file;
the next write to the same path removes the ones whose process is gone. A write that fails (a full
disk, a lost mount) raises `WriteFailed`, one line naming the file and the reason; the file is
left as it was.

`read_jsonl` and `read_results` raise `ResultsFileError` (a ValueError), one line naming the file,
the line and what is wrong, for any damage: never a KeyError, TypeError or EOFError from a row.

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

import fcntl
import gzip
import json
import logging
import math
import os
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any, cast

log = logging.getLogger("adasum")


class WriteFailed(OSError):  # noqa: N818 (the CLI's one-line errors print this name)
    """A file could not be written (a full disk, a lost mount); the previous file is intact."""


class ResultsFileError(ValueError):
    """A JSON-lines file (results.jsonl, metrics.jsonl) is damaged or not of the expected shape."""


@contextmanager
def folder_lock(path: str | os.PathLike, holder: str) -> Iterator[None]:
    """Hold `path` (a folder, made if missing) for the block, as `holder` (a command, for the message); ValueError
    in one line at once if another process holds it. The lock is the kernel's (``flock`` on the folder itself):
    it leaves no file behind and ends with its process, killed or not."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{path}: another {holder} is writing into this folder; wait for it to end, or use "
                             "another --out") from None
        yield
    finally:
        os.close(fd)  # releases the lock


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
            recorder = _Recorder(f)
            try:
                write(cast(IO[bytes], recorder))  # a file object as far as writers go
            except Exception:  # torch.save turns the file's OSError into an opaque RuntimeError
                if recorder.error is None:
                    raise
                raise _write_failed(path, recorder.error) from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except WriteFailed:
        raise
    except OSError as error:
        raise _write_failed(path, error) from None
    finally:
        if tmp.exists():
            tmp.unlink()


class _Recorder:
    """A file object that remembers the first OSError of its writes (what a wrapping writer hides)."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def _write_failed(path: Path, error: OSError) -> WriteFailed:
    kept = f"the previous {path.name} is unchanged" if path.exists() else f"{path.name} was not written"
    failed = WriteFailed(f"cannot write {path}: {error.strerror or error}; {kept}")
    failed.errno = error.errno
    return failed


@contextmanager
def writing(path: str | os.PathLike, what: str | None = None) -> Iterator[None]:
    """Turn an OSError of the block's writes into a one-line `WriteFailed` naming `path` (or `what`: the figures
    of a folder, say): a full disk raises OSError without a file name where a file is written, not opened."""
    try:
        yield
    except WriteFailed:
        raise
    except OSError as error:
        name = what if what is not None else str(path)
        raise WriteFailed(f"cannot write {name}: {error.strerror or error}") from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically (`write_atomic`)."""
    write_atomic(path, lambda f: f.write(text.encode()))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as indented JSON to `path` atomically."""
    write_text_atomic(path, json.dumps(obj, indent=1) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file that is only ever appended to (gzip-compressed if it ends in ``.gz``).

    A torn last line (a kill or a full disk during the append) is dropped with a warning naming the
    file; a bad line anywhere else, or a line that is not a JSON object, is damage: a one-line
    `ResultsFileError` names the file and line.
    """
    return [row for _, row in _numbered_rows(Path(path))]


def _decoded_lines(path: Path) -> list[str]:
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":  # results kept in the repository are compressed (`adasum report runs.jsonl.gz`)
            data = gzip.decompress(data)
        return data.decode().splitlines()
    except (EOFError, zlib.error, gzip.BadGzipFile) as error:
        raise ResultsFileError(
            f"{path}: not a complete gzip file ({error or type(error).__name__}); "
            "the file is damaged: delete it or use another --out"
        ) from None
    except UnicodeDecodeError as error:
        raise ResultsFileError(
            f"{path}: not text (byte {error.start} is not UTF-8); "
            "the file is damaged: delete it or use another --out"
        ) from None


def _numbered_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    lines = _decoded_lines(path)
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except RecursionError:  # nested past the interpreter's limit: no result of ours nests more than a few levels
            raise ResultsFileError(
                f"{path}: line {number} nests too deeply to be a result; "
                "the file is damaged: delete it or use another --out"
            ) from None
        except json.JSONDecodeError as error:
            if all(not rest.strip() for rest in lines[number:]):
                log.warning("%s: dropped its torn last line %d (an interrupted append: %s)", path, number, error.msg)
                break
            raise ResultsFileError(
                f"{path}: line {number} is not JSON ({error.msg}); "
                "the file is damaged: delete it or use another --out"
            ) from None
        if not isinstance(row, dict):
            raise ResultsFileError(
                f"{path}: line {number} is a JSON {type(row).__name__}, not an object; "
                "the file is damaged: delete it or use another --out"
            )
        rows.append((number, row))
    return rows


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    return _number(value) and math.isfinite(value) and value > 0


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# what every row of a results file must hold, and how each field is checked
RESULT_FIELDS: Mapping[str, tuple[Callable[[Any], bool], str]] = MappingProxyType({
    "method": (lambda v: isinstance(v, str) and bool(v), "a method name"),
    "workers": (lambda v: _count(v) and v >= 1, "an integer >= 1"),
    "lr": (_positive, "a number > 0"),
    "seed": (_count, "an integer >= 0"),
    "epochs": (lambda v: _count(v) and v >= 1, "an integer >= 1"),
    "val_accuracy": (_number, "a number"),
    "test_accuracy": (_number, "a number"),
    "diverged": (lambda v: isinstance(v, bool), "true or false"),
    "collapsed": (lambda v: isinstance(v, bool), "true or false"),
    "history": (
        lambda v: isinstance(v, list) and bool(v) and all(isinstance(h, dict) for h in v),
        "a non-empty list of epoch records",
    ),
    "orthogonality_trace": (lambda v: isinstance(v, list), "a list"),
    "config": (lambda v: isinstance(v, dict), "an object"),
})


def read_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    r"""The rows of a results file (``results.jsonl``, or ``.jsonl.gz``), each checked to hold
    `RESULT_FIELDS` with values of the right kind; else one-line `ResultsFileError` naming the
    file, the line and the field.

    >>> rows = read_results("runs/demo/results.jsonl")  # doctest: +SKIP

    A results file of one row, written to a temporary folder, then the same row without its history:

    >>> import tempfile
    >>> folder = tempfile.TemporaryDirectory()
    >>> path = Path(folder.name) / "results.jsonl"
    >>> row = {"method": "adasum", "workers": 4, "lr": 0.05, "seed": 0, "epochs": 1, "val_accuracy": 91.0,
    ...        "test_accuracy": 90.5, "diverged": False, "collapsed": False, "history": [{"epoch": 1}],
    ...        "orthogonality_trace": [], "config": {}}
    >>> write_text_atomic(path, json.dumps(row) + "\n")
    >>> [(r["method"], r["workers"], r["test_accuracy"]) for r in read_results(path)]
    [('adasum', 4, 90.5)]
    >>> del row["history"]
    >>> write_text_atomic(path, json.dumps(row) + "\n")
    >>> read_results(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    adasum.experiments.io.ResultsFileError: .../results.jsonl: line 1 has no 'history' (not a result of ...); pass ...
    >>> folder.cleanup()
    """
    path = Path(path)
    rows = _numbered_rows(path)
    for number, row in rows:
        for name, (valid, kind) in RESULT_FIELDS.items():
            if name not in row:
                raise ResultsFileError(
                    f"{path}: line {number} has no {name!r} (not a result of adasum compare/train); pass a "
                    "results.jsonl that adasum compare or adasum train wrote"
                )
            if not valid(row[name]):
                raise ResultsFileError(
                    f"{path}: line {number}: {name!r} is {json.dumps(row[name])[:40]}, not {kind}; "
                    "the file is damaged: delete it or use another --out"
                )
    return [row for _, row in rows]
