"""One training run, top to bottom: data, model, workers (simulated or real), epochs, metrics,
checkpoints. `train` is what ``adasum train`` runs and what ``adasum compare`` runs per cell.

Data split: every epoch a seeded permutation of the training set is cut into global batches of
P x B examples; worker i takes rows [i B, (i+1) B) of each. Simulated and real workers see the
same examples in the same order, and one worker (sequential) walks the same permutation B at a time.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from adasum.collectives.nonfinite import POLICIES, NonFiniteError, find_nonfinite
from adasum.diagnostics import Orthogonality, all_reduce_orthogonality
from adasum.experiments.checkpoint import kill_point, load_checkpoint, save_checkpoint
from adasum.experiments.data import Dataset, load_task
from adasum.experiments.methods import get_method, method_reducer
from adasum.experiments.models import build_model
from adasum.integrations.optim import DistributedOptimizer
from adasum.integrations.slowmo import SlowMo
from adasum.reducers import Reducer
from adasum.sim import SimulatedWorkers, StepResult, cross_entropy

log = logging.getLogger("adasum")

OPTIMIZERS = ("sgd", "adam", "lamb")


@dataclass
class RunConfig:
    """Everything that defines one run (plain values: it is stored in checkpoints and results)."""

    task: str = "digits"
    model: str | None = None
    method: str = "adasum"
    workers: int = 1
    lr: float = 0.01
    epochs: int = 2
    batch_size: int = 32
    optimizer: str = "sgd"
    momentum: float = 0.5
    weight_decay: float = 0.0
    local_steps: int = 4
    slow_momentum: float = 0.5
    slow_lr: float = 1.0
    seed: int = 0
    train_limit: int | None = None
    data_dir: str | None = None
    device: str = "cpu"
    chunk_size: int | None = None
    nonfinite: str = "propagate"
    checkpoint_every: int | None = None
    deterministic: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        get_method(self.method)
        checks = [
            (self.workers >= 1, f"workers must be >= 1, got {self.workers}"),
            (self.lr > 0 and math.isfinite(self.lr), f"learning rate must be > 0, got {self.lr}"),
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= 1, f"batch size must be >= 1, got {self.batch_size}"),
            (
                self.optimizer in OPTIMIZERS,
                f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}",
            ),
            (0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}"),
            (self.local_steps >= 1, f"local steps must be >= 1, got {self.local_steps}"),
            (0 <= self.slow_momentum < 1, f"slow momentum must be in [0, 1), got {self.slow_momentum}"),
            (self.slow_lr > 0, f"slow learning rate must be > 0, got {self.slow_lr}"),
            (self.train_limit is None or self.train_limit >= 1, f"train limit must be >= 1, got {self.train_limit}"),
            (self.chunk_size is None or self.chunk_size >= 1, f"chunk size must be >= 1, got {self.chunk_size}"),
            (self.nonfinite in POLICIES, f"nonfinite must be one of {', '.join(POLICIES)}, got {self.nonfinite!r}"),
            (
                self.checkpoint_every is None or self.checkpoint_every >= 1,
                f"checkpoint every must be >= 1, got {self.checkpoint_every}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


# keys that may change when a run is resumed
RESUMABLE = {"epochs", "device", "chunk_size", "data_dir", "nonfinite", "checkpoint_every", "deterministic"}


def make_optimizer(config: RunConfig, lr: float) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """A factory for the configured optimizer at learning rate `lr` (LAMB from pytorch_optimizer)."""
    if config.optimizer == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if config.optimizer == "adam":
        return lambda ps: torch.optim.Adam(ps, lr=lr, weight_decay=config.weight_decay)
    if config.optimizer == "lamb":
        try:
            from pytorch_optimizer import Lamb
        except ImportError:
            raise ValueError("the LAMB optimizer needs pytorch-optimizer (pip install 'adasum[experiments]')") from None
        return lambda ps: Lamb(ps, lr=lr, weight_decay=config.weight_decay)
    raise ValueError(f"unknown optimizer {config.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")


def worker_batches(examples: int, workers: int, batch_size: int, epoch: int, seed: int) -> torch.Tensor:
    """Example indices of one epoch as [steps, workers, batch_size] (a seeded permutation, the
    last incomplete global batch dropped).

    >>> worker_batches(100, 2, 10, epoch=0, seed=0).shape
    torch.Size([5, 2, 10])
    """
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    steps = examples // (workers * batch_size)
    order = torch.randperm(examples, generator=generator)[: steps * workers * batch_size]
    return order.view(steps, workers, batch_size)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 500) -> tuple[float, float]:
    """Mean cross-entropy and accuracy (percent, per predicted position) of `model` on (x, y)."""
    model.eval()
    loss, correct, count = 0.0, 0, 0
    for start in range(0, len(x), batch):
        out = model(x[start : start + batch])
        target = y[start : start + batch]
        loss += cross_entropy(out, target).item() * target.numel()
        correct += (out.argmax(-1) == target).sum().item()
        count += target.numel()
    return loss / count, 100.0 * correct / count


class DistributedWorker:
    """One real data-parallel worker of a torchrun job, with the simulator's interface (`step`,
    `module`, `state_dict`) for one worker's rows and the same method options as
    `SimulatedWorkers`, run by the library's distributed classes:

    * ``combine="gradients"``: ``adasum.DistributedOptimizer(mode="gradient")``;
    * ``combine="deltas"``: ``adasum.DistributedOptimizer(mode="delta", local_steps=tau)``
      (each rank keeps its own optimizer state);
    * with `slow_momentum`: ``adasum.SlowMo(sync_every=tau, slow_lr, slow_momentum, reducer)``.

    `module` is the model the ranks agree on (in the middle of a round of local steps, the last
    combined one, as the simulator's `module`), for evaluation.

    >>> worker = DistributedWorker(net, make_optimizer(config, lr), get_reducer("adasum"))
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        reducer: Reducer,
        *,
        combine: str = "gradients",
        local_steps: int = 1,
        slow_momentum: float | None = None,
        slow_lr: float = 1.0,
        diagnostics_every: int = 10,
        nonfinite: str = "propagate",
    ) -> None:
        if combine == "gradients" and (local_steps != 1 or slow_momentum is not None):
            raise ValueError("local_steps and slow_momentum need combine='deltas'")
        self.model = model
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.reducer = reducer
        self.params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():  # every rank starts from rank 0's model (before the wrappers copy it)
            for p in model.state_dict().values():
                dist.broadcast(p, 0)
        base = optimizer(self.params)
        self.optimizer: DistributedOptimizer | SlowMo
        if slow_momentum is not None:
            self.optimizer = SlowMo(
                base,
                sync_every=local_steps,
                slow_lr=slow_lr,
                slow_momentum=slow_momentum,
                reducer=reducer,
                nonfinite="propagate",  # the policy is applied per step in `step`, as the simulator does
            )
        else:
            mode = "delta" if combine == "deltas" else "gradient"
            self.optimizer = DistributedOptimizer(
                base, reduce=reducer, mode=mode, local_steps=local_steps, nonfinite="propagate"
            )
        self.diagnostics_every = diagnostics_every
        self.steps = 0
        self._agreed: nn.Module | None = None  # a copy for evaluation in the middle of a round

    @property
    def module(self) -> nn.Module:
        """The model every rank agrees on: the training model, or in the middle of a round of local
        steps a copy holding the last combined parameters."""
        combined = self.optimizer.last_combined()
        if combined is None:
            return self.model
        if self._agreed is None:
            self._agreed = copy.deepcopy(self.model)
        self._agreed.load_state_dict(self.model.state_dict())
        agreed = [p for p in self._agreed.parameters() if p.requires_grad]
        with torch.no_grad():
            for p, value in zip(agreed, combined):
                p.copy_(value)
        return self._agreed

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepResult:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        loss = cross_entropy(self.model(inputs[0]), targets[0])
        loss.backward()
        grads = [p.grad for p in self.params]
        diag: Orthogonality | None = None
        if self.diagnostics_every and self.steps % self.diagnostics_every == 0 and dist.get_world_size() > 1:
            diag = all_reduce_orthogonality(grads)
        # the policy is applied here, on the local gradients of every step, as the simulator does;
        # the wrappers then never see a non-finite value
        found = find_nonfinite(grads, names=self.names) if self.nonfinite != "propagate" else None
        if found is not None and self.nonfinite == "raise":
            raise NonFiniteError(
                f"step {self.steps + 1}: the gradient of {found.name!r} has {found.kind} on rank {found.rank} "
                "(nonfinite='raise')",
                found,
            )
        if found is not None:  # skip on every rank: nothing combined, no optimizer step
            self.skipped_steps += 1
        else:
            self.optimizer.step()
        self.steps += 1
        mean_loss = loss.detach().reshape(1)
        dist.all_reduce(mean_loss)
        return StepResult(mean_loss / dist.get_world_size(), diag)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "reducer": self.reducer.state_dict(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.reducer.load_state_dict(state.get("reducer", {}))
        self.steps = int(state["steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def write_json_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


class ProgressBar:
    """A rich progress bar over the steps of runs, or nothing when disabled or rich is missing."""

    def __init__(self, enabled: bool) -> None:
        self._progress = None
        if enabled:
            try:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            except ImportError:
                return
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                transient=True,
            )

    def __enter__(self) -> ProgressBar:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def task(self, description: str, total: int, completed: int = 0) -> Callable[[int], None]:
        """A function that advances a new bar by its argument."""
        if self._progress is None:
            return lambda n: None
        progress = self._progress
        task_id = progress.add_task(description, total=total, completed=completed)
        return lambda n: progress.advance(task_id, n)


def _tensorboard_writer(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("--tensorboard needs the tensorboard package (pip install tensorboard)") from None
    return SummaryWriter(str(path))


@contextmanager
def _metrics_file(path: Path, keep_epochs: int | None) -> Iterator[Any]:
    """metrics.jsonl for appending; on resume, lines of epochs after the checkpoint are dropped."""
    if keep_epochs is not None and path.exists():
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["epoch"] <= keep_epochs]
        path.write_text("".join(line + "\n" for line in kept))
    elif keep_epochs is None and path.exists():
        path.unlink()
    with open(path, "a") as f:
        yield f


def train(
    config: RunConfig,
    out_dir: str | os.PathLike | None = None,
    *,
    resume: bool = False,
    dataset: Dataset | None = None,
    progress: ProgressBar | None = None,
    tensorboard: bool = False,
    distributed: bool = False,
) -> dict[str, Any]:
    """Train one run and return its result (also written to ``OUT/result.json``).

    Simulated unless `distributed` (then one process per worker under torchrun, every method).
    `out_dir` receives ``metrics.jsonl`` (one line per step and per epoch),
    ``checkpoint.pt`` after every epoch (and every ``config.checkpoint_every`` steps), and
    ``result.json``; `resume` continues from the checkpoint, mid-epoch included, exactly where the
    uninterrupted run would be (`adasum.experiments.checkpoint`).

    >>> result = train(RunConfig(method="adasum", workers=16, lr=0.01, epochs=2), "runs/one")
    >>> result["test_accuracy"]
    """
    config.validate()
    if config.deterministic:  # bitwise-repeatable kernels (CPU runs with fixed threads already are)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    method = get_method(config.method)
    device = torch.device(config.device)
    rank = dist.get_rank() if distributed else 0
    workers = dist.get_world_size() if distributed else method.workers(config.workers)
    if distributed and method.single_worker and workers > 1:
        raise ValueError(f"method {method.name!r} is one worker: launch it with torchrun --nproc-per-node 1")
    reducer = method_reducer(method)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None and rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    data = (dataset if dataset is not None else load_task(config.task, config.data_dir)).to(device)
    train_x, train_y = data.train_x, data.train_y
    if config.train_limit is not None:
        train_x, train_y = train_x[: config.train_limit], train_y[: config.train_limit]
    steps_per_epoch = len(train_x) // (workers * config.batch_size)
    if steps_per_epoch == 0:
        raise ValueError(
            f"{len(train_x)} training examples are fewer than one global batch of "
            f"{workers} workers x {config.batch_size}"
        )
    model_name = config.model or data.default_model
    lr = method.learning_rate(config.lr, workers)

    torch.manual_seed(config.seed)  # the same initial model for every method and worker count
    model = build_model(model_name, data.input_shape, data.classes).to(device)
    optimizer = make_optimizer(config, lr)
    options = dict(  # the method, the same for simulated and real workers
        combine=method.combine,
        local_steps=config.local_steps if method.local else 1,
        slow_momentum=config.slow_momentum if method.slow_momentum else None,
        slow_lr=config.slow_lr,
    )
    if distributed:
        torch.manual_seed(config.seed * 1000 + rank + 1)  # each rank its own dropout
        engine: SimulatedWorkers | DistributedWorker = DistributedWorker(
            model, optimizer, reducer, nonfinite=config.nonfinite, **options
        )
    else:
        engine = SimulatedWorkers(
            model,
            workers,
            optimizer,
            reducer=reducer,
            chunk_size=config.chunk_size,
            nonfinite=config.nonfinite,
            **options,
        )
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    history: list[dict[str, Any]] = []
    trace: list[list[float]] = []
    start_epoch = start_step = 0
    partial: dict[str, Any] = {"losses": [], "ortho": [], "per_tensor": []}  # the epoch so far
    checkpoint = out / "checkpoint.pt" if out is not None else None
    if resume and checkpoint is not None and checkpoint.exists():
        state, local = load_checkpoint(checkpoint, device, distributed=distributed)
        _check_same_run(state["config"], asdict(config), checkpoint)
        engine.load_state_dict(local["engine"])
        history, trace, start_epoch = state["history"], state["trace"], int(state["epoch"])
        start_step = int(state.get("step_in_epoch", 0))
        partial = state.get("partial") or partial
        torch.set_rng_state(local["rng"])
        if device.type == "cuda" and local.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(local["cuda_rng"], device)
        log.info("resumed %s from epoch %d, step %d", out, start_epoch, start_step)

    def save(epoch: int, step_in_epoch: int) -> None:
        """Checkpoint after `epoch` whole epochs and `step_in_epoch` more steps (every rank calls)."""
        if checkpoint is None:
            return
        common = {
            "config": asdict(config),
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "partial": partial if step_in_epoch else None,
            "history": history,
            "trace": trace,
        }
        local = {
            "engine": engine.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        }
        save_checkpoint(checkpoint, common, local, distributed=distributed)

    total_steps = steps_per_epoch * config.epochs
    trace_every = max(1, total_steps // 400)
    label = f"{method.name} P={workers} lr={config.lr:g}"
    advance = (progress or ProgressBar(False)).task(label, total_steps, start_epoch * steps_per_epoch + start_step)
    writer = _tensorboard_writer(out / "tensorboard") if tensorboard and out is not None and rank == 0 else None
    diverged = bool(history and history[-1].get("diverged"))
    metrics_path = out / "metrics.jsonl" if out is not None and rank == 0 else None
    metrics_cm = _metrics_file(metrics_path, start_epoch if resume else None) if metrics_path else _null()
    with metrics_cm as metrics:
        for epoch in range(start_epoch, config.epochs):
            if diverged:
                break
            started = time.perf_counter()
            order = worker_batches(len(train_x), workers, config.batch_size, epoch, config.seed).to(device)
            first = start_step if epoch == start_epoch else 0
            if first == 0:
                partial = {"losses": [], "ortho": [], "per_tensor": []}
            losses, ortho, per_tensor = partial["losses"], partial["ortho"], partial["per_tensor"]
            for s in range(first, steps_per_epoch):
                idx = order[s, rank : rank + 1] if distributed else order[s]
                result = engine.step(train_x[idx], train_y[idx])
                losses.append(result.losses.mean().detach())
                if result.orthogonality is not None:
                    ortho.append((s, result.orthogonality.model))
                    per_tensor.append(result.orthogonality.per_tensor)
                advance(1)
                global_step = epoch * steps_per_epoch + s + 1
                if config.checkpoint_every and global_step % config.checkpoint_every == 0 and s + 1 < steps_per_epoch:
                    save(epoch, s + 1)
                kill_point(rank, global_step)
            step_losses = torch.stack(losses).tolist()
            if config.nonfinite == "skip":  # a skipped step's loss may be NaN: not a divergence
                finite_mean = _finite_mean(step_losses)
                train_loss = finite_mean if finite_mean is not None else float("nan")
            else:
                train_loss = sum(step_losses) / len(step_losses)
            test_loss, test_acc = evaluate(engine.module, data.test_x, data.test_y)
            diverged = not (math.isfinite(train_loss) and math.isfinite(test_loss))
            mean_o = _finite_mean([o for _, o in ortho])
            tensor_o = torch.stack(per_tensor).mean(0).tolist() if per_tensor else []
            record = {
                "epoch": epoch + 1,
                "train_loss": train_loss,
                "test_loss": test_loss,
                "test_accuracy": test_acc,
                "orthogonality": mean_o,
                "orthogonality_per_tensor": dict(zip(names, tensor_o)),
                "steps": (epoch + 1) * steps_per_epoch,
                "wall_s": time.perf_counter() - started,
                "diverged": diverged,
                "skipped_steps": engine.skipped_steps,
            }
            history.append(record)
            for s, o in ortho:
                step = epoch * steps_per_epoch + s
                if step % trace_every == 0:
                    trace.append([epoch + s / steps_per_epoch, o])
            if rank == 0:
                log.info(
                    "%s epoch %d/%d: train loss %.4f, test loss %.4f, test accuracy %.2f%%%s%s",
                    label,
                    epoch + 1,
                    config.epochs,
                    train_loss,
                    test_loss,
                    test_acc,
                    f", orthogonality {mean_o:.3f}" if mean_o is not None else "",
                    " (diverged)" if diverged else "",
                )
                if metrics is not None:
                    o_by_step = dict(ortho)
                    for s, value in enumerate(step_losses):
                        line = {"epoch": epoch + 1, "step": epoch * steps_per_epoch + s + 1, "loss": value}
                        if s in o_by_step:
                            line["orthogonality"] = o_by_step[s]
                        metrics.write(json.dumps(line) + "\n")
                    metrics.write(json.dumps({"epoch": epoch + 1, "kind": "epoch", **record}) + "\n")
                    metrics.flush()
                if writer is not None:
                    for key in ("train_loss", "test_loss", "test_accuracy", "orthogonality"):
                        if record[key] is not None:
                            writer.add_scalar(key, record[key], epoch + 1)
            save(epoch + 1, 0)
    if writer is not None:
        writer.close()

    last = history[-1]
    result = {
        "method": method.name,
        "workers": workers,
        "lr": config.lr,
        "effective_lr": lr,
        "epochs": config.epochs,
        "epochs_run": len(history),
        "batch_size": config.batch_size,
        "optimizer": config.optimizer,
        "momentum": config.momentum,
        "task": data.name,
        "model": model_name,
        "seed": config.seed,
        "local_steps": config.local_steps if method.local else None,
        "slow_momentum": config.slow_momentum if method.slow_momentum else None,
        "test_accuracy": last["test_accuracy"],
        "test_loss": last["test_loss"],
        "train_loss": last["train_loss"],
        "best_test_accuracy": max(h["test_accuracy"] for h in history),
        "diverged": last["diverged"],
        "skipped_steps": engine.skipped_steps,
        "steps": len(history) * steps_per_epoch,
        "wall_s": sum(h["wall_s"] for h in history),
        "distributed": distributed,
        "history": history,
        "orthogonality_trace": trace,
    }
    if out is not None and rank == 0:
        write_json_atomic(result, out / "result.json")
    return result


@contextmanager
def _null() -> Iterator[None]:
    yield None


def _finite_mean(values: list[float]) -> float | None:
    good = [v for v in values if math.isfinite(v)]
    return sum(good) / len(good) if good else None


def _check_same_run(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    for f in fields(RunConfig):
        key = f.name
        if key not in RESUMABLE and saved.get(key) != current.get(key):
            raise ValueError(
                f"{path} belongs to another run ({key} {saved.get(key)!r}, now {current.get(key)!r}); "
                "drop --resume or use another --out"
            )
