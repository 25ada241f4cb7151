"""The per-step statistics (``statistics()`` of `adasum.ddp.AdasumState`, `adasum.DistributedOptimizer` and
`adasum.SlowMo`) written to TensorBoard, MLflow or Weights & Biases.

>>> logger = TensorBoardLogger("runs/adasum")              # or a SummaryWriter of one's own  # doctest: +SKIP
>>> logger.log(state)               # after each step: state, optimizer, or a statistics dict  # doctest: +SKIP

Into a temporary folder, a statistics dict as AdaCons' would have it (the scalars written come back):

>>> import tempfile
>>> folder = tempfile.TemporaryDirectory()
>>> logger = TensorBoardLogger(folder.name)
>>> logger.log({"step": 3, "skipped_steps": 0, "consensus_weights": [0.4, 0.6]})
{'adasum/step': 3.0, 'adasum/skipped_steps': 0.0, 'adasum/consensus_weights/0': 0.4, 'adasum/consensus_weights/1': 0.6}
>>> logger.close(); folder.cleanup()

Each value becomes one scalar named ``adasum/<key>`` (a list, such as AdaCons' per-worker weights,
one scalar per entry: ``adasum/consensus_weights/0``, ...), at the given step or else at the
statistics' own ``step``. Every rank holds the same values: log on one rank (rank 0), as usual.

The adapters need their package: TensorBoard's (``pip install 'adasum[tensorboard]'``), MLflow's
(``pip install 'adasum[mlflow]'``) or W&B's (``pip install 'adasum[wandb]'``); without it, making the adapter
raises ImportError naming the extra. Importing this module needs none of them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from adasum.extras import require

PREFIX = "adasum/"
"""What every scalar's name starts with."""

Statistics = Mapping[str, Any]


class HasStatistics(Protocol):
    """What the adapters read: an object with ``statistics()`` (the hook's state, the optimizer, SlowMo)."""

    def statistics(self) -> Statistics:
        """The last step's statistics as a dict."""
        ...


def scalars(stats: Statistics, prefix: str = PREFIX) -> dict[str, float]:
    """The statistics as flat ``{name: float}`` scalars (module doc).

    >>> scalars({"step": 3, "orthogonality": 0.75, "consensus_weights": [0.4, 0.6]}, prefix="")
    {'step': 3.0, 'orthogonality': 0.75, 'consensus_weights/0': 0.4, 'consensus_weights/1': 0.6}
    """
    out: dict[str, float] = {}
    for key, value in stats.items():
        if isinstance(value, (list, tuple)):
            out.update((f"{prefix}{key}/{i}", float(v)) for i, v in enumerate(value))
        else:
            out[f"{prefix}{key}"] = float(value)
    return out


def _read(source: HasStatistics | Statistics) -> Statistics:
    if isinstance(source, Mapping):
        return source
    if not callable(getattr(source, "statistics", None)):
        raise TypeError(
            f"pass a statistics dict or an object with statistics() (adasum.ddp.AdasumState, "
            f"adasum.DistributedOptimizer, adasum.SlowMo), got {type(source).__name__}"
        )
    return source.statistics()


def _step(stats: Statistics, step: int | None) -> int:
    if step is not None:
        return int(step)
    if "step" not in stats:
        raise ValueError("the statistics have no 'step': pass step=")
    return int(stats["step"])


class TensorBoardLogger:
    """Write the statistics as TensorBoard scalars.

    `writer` is a ``torch.utils.tensorboard.SummaryWriter`` or a log directory (a writer is then made
    there, and `close` closes it).

    >>> logger = TensorBoardLogger(SummaryWriter("runs/adasum"))  # doctest: +SKIP
    >>> logger.log(opt)                                          # after opt.step()  # doctest: +SKIP

    Into a temporary folder, at step 10, read back with TensorBoard's own reader:

    >>> import tempfile
    >>> from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    >>> from torch.utils.tensorboard import SummaryWriter
    >>> folder = tempfile.TemporaryDirectory()
    >>> logger = TensorBoardLogger(SummaryWriter(folder.name))
    >>> _ = logger.log({"step": 3, "orthogonality": 0.75}, step=10)
    >>> logger.close(); logger.writer.close()                  # a writer of one's own: closed by its owner
    >>> events = EventAccumulator(folder.name); _ = events.Reload()
    >>> [(e.step, e.value) for e in events.Scalars("adasum/orthogonality")]
    [(10, 0.75)]
    >>> folder.cleanup()
    """

    def __init__(self, writer: Any, prefix: str = PREFIX) -> None:
        require("tensorboard", extra="tensorboard", user="adasum.loggers.TensorBoardLogger")
        if isinstance(writer, str) or hasattr(writer, "__fspath__"):
            from torch.utils.tensorboard import SummaryWriter

            writer, self._owned = SummaryWriter(str(writer)), True
        else:
            self._owned = False
        self.writer = writer
        self.prefix = prefix

    def log(self, source: HasStatistics | Statistics, step: int | None = None) -> dict[str, float]:
        """Write `source`'s statistics (an object's ``statistics()`` or a dict) at `step` (default: theirs);
        returns the scalars written."""
        stats = _read(source)
        at = _step(stats, step)
        values = scalars(stats, self.prefix)
        for name, value in values.items():
            self.writer.add_scalar(name, value, at)
        return values

    def close(self) -> None:
        """Flush the writer (and close it where this logger made it)."""
        self.writer.flush()
        if self._owned:
            self.writer.close()


class MLflowLogger:
    """Log the statistics as MLflow metrics of a run: `run_id`, or the active run (``mlflow.start_run()``)
    at each call; through `client` (default: an ``MlflowClient`` of the current tracking URI).

    >>> mlflow.set_tracking_uri("file:./mlruns"); run = mlflow.start_run()  # doctest: +SKIP
    >>> MLflowLogger().log(state)                 # after a step  # doctest: +SKIP
    """

    def __init__(self, run_id: str | None = None, client: Any = None, prefix: str = PREFIX) -> None:
        require("mlflow", extra="mlflow", user="adasum.loggers.MLflowLogger")
        from mlflow.tracking import MlflowClient

        self.run_id = run_id
        self.client = client if client is not None else MlflowClient()
        self.prefix = prefix

    def log(self, source: HasStatistics | Statistics, step: int | None = None) -> dict[str, float]:
        """Log `source`'s statistics (an object's ``statistics()`` or a dict) at `step` (default: theirs), in one
        batch; returns the metrics logged."""
        import mlflow
        from mlflow.entities import Metric

        run_id = self.run_id
        if run_id is None:
            active = mlflow.active_run()
            if active is None:
                raise RuntimeError("MLflowLogger without run_id logs to the active run: call mlflow.start_run() first")
            run_id = active.info.run_id
        stats = _read(source)
        at = _step(stats, step)
        values = scalars(stats, self.prefix)
        now = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(name, value, now, at) for name, value in values.items()])
        return values


class WandbLogger:
    """Log the statistics to a Weights & Biases run: `run` (``wandb.init()``'s) or, where None, the active run
    (``wandb.run``) at each call. Offline runs (``WANDB_MODE=offline``) work the same.

    >>> run = wandb.init(project="adasum")  # doctest: +SKIP
    >>> WandbLogger(run).log(opt)           # after opt.step()  # doctest: +SKIP

    W&B wants the steps of a run to increase: log at the statistics' own ``step`` (the default) or at the
    training loop's, not at both.
    """

    def __init__(self, run: Any = None, prefix: str = PREFIX) -> None:
        require("wandb", extra="wandb", user="adasum.loggers.WandbLogger")
        self.run = run
        self.prefix = prefix

    def log(self, source: HasStatistics | Statistics, step: int | None = None) -> dict[str, float]:
        """Log `source`'s statistics (an object's ``statistics()`` or a dict) at `step` (default: theirs), in one
        ``run.log`` call; returns the values logged."""
        import wandb

        run = self.run if self.run is not None else wandb.run
        if run is None:
            raise RuntimeError("WandbLogger without a run logs to the active run: call wandb.init() first")
        stats = _read(source)
        at = _step(stats, step)
        values = scalars(stats, self.prefix)
        run.log(values, step=at)
        return values


def log_statistics(target: Any, source: HasStatistics | Statistics, step: int | None = None) -> dict[str, float]:
    """Write `source`'s statistics to `target` once: a TensorBoard ``SummaryWriter`` (anything with
    ``add_scalar``), an MLflow run (``mlflow.start_run()``'s, or any with ``info.run_id``) or a W&B run
    (``wandb.init()``'s).

    >>> log_statistics(writer, state, step)  # doctest: +SKIP

    To a writer of one's own that prints what it is given:

    >>> class PrintingWriter:
    ...     def add_scalar(self, name, value, step):
    ...         print(name, value, step)
    >>> _ = log_statistics(PrintingWriter(), {"step": 3, "orthogonality": 0.75})
    adasum/step 3.0 3
    adasum/orthogonality 0.75 3
    """
    if hasattr(target, "add_scalar"):
        return TensorBoardLogger(target).log(source, step)
    run_id = getattr(getattr(target, "info", None), "run_id", None)
    if isinstance(run_id, str):
        return MLflowLogger(run_id).log(source, step)
    if type(target).__module__.startswith("wandb.") and callable(getattr(target, "log", None)):
        return WandbLogger(target).log(source, step)
    raise TypeError(
        f"log_statistics writes to a SummaryWriter, an MLflow run or a W&B run, got {type(target).__name__}"
    )
