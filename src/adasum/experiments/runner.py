"""One training run, top to bottom: data, model, workers (simulated or real), epochs, metrics,
checkpoints. `train` is what ``adasum train`` runs and what ``adasum compare`` runs per cell.

Data split: every epoch a seeded permutation of the training set is cut into global batches of
P x B examples; worker i takes rows [i B, (i+1) B) of each. Simulated and real workers see the
same examples in the same order, and one worker (sequential) walks the same permutation B at a time.
The permutation depends on the seed and the epoch only, not on P: a torchrun job resumed on P' ranks
from a checkpoint written by P (`resized_position`) goes on in the same permutation, cut for P'.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from adasum.checks.nonfinite import POLICIES, apply_nonfinite_policy
from adasum.diagnostics import Orthogonality, all_reduce_orthogonality
from adasum.experiments.checkpoint import applied, load_checkpoint, save_checkpoint, saved_world_size
from adasum.experiments.data import DEFAULT_MODELS, Dataset, load_task
from adasum.experiments.io import read_jsonl, write_json_atomic, write_text_atomic
from adasum.experiments.methods import Method, get_method, method_reducer
from adasum.experiments.models import build_model
from adasum.experiments.progress import ProgressBar
from adasum.integrations.optim import DistributedOptimizer
from adasum.integrations.slowmo import SlowMo, diloco_outer
from adasum.options import Mode, Nonfinite
from adasum.reducers import Reducer
from adasum.sim import SimulatedWorkers, StepResult, cross_entropy, set_dropout_keys
from adasum.transport.alone import quiet_one_rank
from adasum.transport.errors import failures_named

log = logging.getLogger("adasum")

OPTIMIZERS = ("sgd", "adam", "lamb")
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


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
    warmup_epochs: float = 0.0  # the learning rate rises linearly from 0 over these epochs (Goyal et al. 2017)
    local_steps: int = 4
    slow_momentum: float = 0.5
    slow_lr: float = 1.0
    outer_lr: float | None = None  # DiLoCo methods: the outer Nesterov SGD's lr (None: 0.7)
    outer_momentum: float | None = None  # and its momentum (None: 0.9)
    communication_dtype: str | None = None  # DiLoCo methods: the pseudo-gradients' wire dtype (bf16, fp16, fp8)
    error_feedback: bool | None = None  # DiLoCo methods with a communication dtype (None: no)
    fragments: int | None = None  # streaming-diloco: fragments (None: 2)
    delay: int | None = None  # streaming-diloco: inner steps before a fragment's outer step (None: 1)
    mixing: float | None = None  # streaming-diloco: the synced weights' share when mixed in (None: 0.5)
    seed: int = 0
    train_limit: int | None = None
    data_dir: str | None = None
    device: str = "cpu"
    chunk_size: int | None = None
    nonfinite: Nonfinite = "propagate"
    checkpoint_every: int | None = None
    deterministic: bool = False
    val_fraction: float = 0.1
    evals_per_epoch: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        method = get_method(self.method)
        used_lr = method.learning_rate(self.lr, method.workers(self.workers)) if self.lr > 0 else self.lr
        checks = [
            (self.workers >= 1, f"workers must be >= 1, got {self.workers}"),
            (self.lr > 0 and math.isfinite(self.lr), f"learning rate must be > 0, got {self.lr}"),
            (
                used_lr <= FLOAT32_MAX,
                f"learning rate {self.lr:g} gives the optimizer {used_lr:g}, more than float32 holds "
                f"({FLOAT32_MAX:.3g})",
            ),
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= 1, f"batch size must be >= 1, got {self.batch_size}"),
            (
                self.optimizer in OPTIMIZERS,
                f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}",
            ),
            (0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}"),
            (
                0 <= self.warmup_epochs <= self.epochs and math.isfinite(self.warmup_epochs),
                f"warm-up epochs must be in [0, epochs = {self.epochs}], got {self.warmup_epochs}",
            ),
            (self.local_steps >= 1, f"local steps must be >= 1, got {self.local_steps}"),
            (0 <= self.slow_momentum < 1, f"slow momentum must be in [0, 1), got {self.slow_momentum}"),
            (self.slow_lr > 0, f"slow learning rate must be > 0, got {self.slow_lr}"),
            (self.outer_lr is None or self.outer_lr > 0, f"outer learning rate must be > 0, got {self.outer_lr}"),
            (
                self.outer_momentum is None or 0 <= self.outer_momentum < 1,
                f"outer momentum must be in [0, 1), got {self.outer_momentum}",
            ),
            (
                not self.error_feedback or self.communication_dtype is not None,
                "error feedback needs a communication dtype",
            ),
            (self.train_limit is None or self.train_limit >= 1, f"train limit must be >= 1, got {self.train_limit}"),
            (self.chunk_size is None or self.chunk_size >= 1, f"chunk size must be >= 1, got {self.chunk_size}"),
            (self.nonfinite in POLICIES, f"nonfinite must be one of {', '.join(POLICIES)}, got {self.nonfinite!r}"),
            (
                self.checkpoint_every is None or self.checkpoint_every >= 1,
                f"checkpoint every must be >= 1, got {self.checkpoint_every}",
            ),
            (0 < self.val_fraction <= 0.5, f"validation fraction must be in (0, 0.5], got {self.val_fraction}"),
            (
                self.evals_per_epoch is None or self.evals_per_epoch >= 1,
                f"evaluations per epoch must be >= 1, got {self.evals_per_epoch}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


# keys that may change when a run is resumed
RESUMABLE = frozenset({"epochs", "device", "chunk_size", "data_dir", "nonfinite", "checkpoint_every", "deterministic"})


def make_optimizer(
    config: RunConfig, lr: float, warmup_steps: int = 0
) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """A factory for the configured optimizer at learning rate `lr` (LAMB from pytorch_optimizer).

    With `warmup_steps`, the optimizer's k-th step (k = 1, 2, ...) runs at ``lr * min(1, k / warmup_steps)``:
    the linear warm-up of large-batch training. The count lives in the optimizer's parameter groups
    (``warmup_step``), so it is saved and restored with the optimizer's state.
    """
    factory = _optimizer(config, lr)
    if warmup_steps <= 0:
        return factory

    def warmed(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        optimizer = factory(params)
        for group in optimizer.param_groups:
            group["warmup_step"], group["base_lr"] = 0, group["lr"]

        def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for group in opt.param_groups:
                group["warmup_step"] += 1
                group["lr"] = group["base_lr"] * min(1.0, group["warmup_step"] / warmup_steps)

        optimizer.register_step_pre_hook(before_step)
        return optimizer

    return warmed


def _optimizer(config: RunConfig, lr: float) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    if config.optimizer == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if config.optimizer == "adam":
        return lambda ps: torch.optim.Adam(ps, lr=lr, weight_decay=config.weight_decay)
    if config.optimizer == "lamb":
        try:
            from pytorch_optimizer import Lamb
        except ImportError:
            raise ValueError(
                "the LAMB optimizer needs pytorch-optimizer: pip install 'adasum[experiments]' "
                "(from a checkout: pip install '.[experiments]')"
            ) from None
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


def resized_position(step: int, saved_workers: int, workers: int, batch_size: int, steps: int) -> tuple[int, int]:
    """Where a run resumed on `workers` ranks goes on in an epoch that `saved_workers` ranks left after `step`
    steps of `batch_size` examples each: (the step at the new size, the examples skipped). The saved ranks took
    the first ``step * saved_workers * batch_size`` examples of the epoch's permutation (`worker_batches`, the
    same for every worker count); the resumed run takes the first whole global batch of the new size that starts
    at or after them (none of the epoch's examples is taken twice; fewer than ``workers * batch_size`` are
    skipped), at most the epoch's `steps` at the new size (the epoch is then over).

    >>> resized_position(3, 3, 2, 4, steps=12)   # 36 examples taken: step 5 of 2 x 4 starts at 40
    (5, 4)
    >>> resized_position(4, 2, 4, 8, steps=8)    # 64 examples: step 2 of 4 x 8, nothing skipped
    (2, 0)
    """
    taken = step * saved_workers * batch_size
    width = workers * batch_size
    resumed = min(-(-taken // width), steps)
    return resumed, max(0, resumed * width - taken)


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

    * ``combine="gradient"``: ``adasum.DistributedOptimizer(mode="gradient")``;
    * ``combine="delta"``: ``adasum.DistributedOptimizer(mode="delta", local_steps=tau)``
      (each rank keeps its own optimizer state);
    * with `slow_momentum`: ``adasum.SlowMo(local_steps=tau, slow_lr, slow_momentum, reducer)``.

    `module` is the model the ranks agree on (in the middle of a round of local steps, the last
    combined one, as the simulator's `module`), for evaluation.

    >>> worker = DistributedWorker(net, make_optimizer(config, lr), get_reducer("adasum"))  # doctest: +SKIP

    On one process (a group of one rank; under torchrun every rank makes the same calls on its own rows),
    in delta mode with two local steps per round:

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> net = torch.nn.Linear(2, 2)
    >>> _ = [torch.nn.init.zeros_(p) for p in net.parameters()]   # zero logits: the loss is log 2
    >>> worker = DistributedWorker(net, make_optimizer(RunConfig(), lr=0.1), adasum.get_reducer("adasum"),
    ...                            combine="delta", local_steps=2)
    >>> inputs, targets = torch.ones(1, 4, 2), torch.zeros(1, 4, dtype=torch.int64)   # [1 worker, 4 rows]
    >>> round(worker.step(inputs, targets).losses.item(), 4)
    0.6931
    >>> worker.module is net                  # mid-round: a copy holding the last combined weights
    False
    >>> _ = worker.step(inputs, targets)
    >>> worker.module is net, worker.steps    # the round is combined: the training model itself
    (True, 2)
    >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        reducer: Reducer,
        *,
        combine: Mode = "gradient",
        local_steps: int = 1,
        slow_momentum: float | None = None,
        slow_lr: float = 1.0,
        outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        communication_dtype: str | None = None,
        error_feedback: bool = False,
        fragments: int = 1,
        delay: int = 0,
        mixing: float = 1.0,
        diagnostics_every: int = 10,
        nonfinite: Nonfinite = "propagate",
        seed: int = 0,
    ) -> None:
        if combine == "gradient" and (local_steps != 1 or slow_momentum is not None):
            raise ValueError(
                "local_steps and slow_momentum need combine='delta'; pass combine='delta' (or leave local_steps and "
                "slow_momentum out)"
            )
        self.model = model
        self.seed = seed
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.reducer = reducer
        self.params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():  # every rank starts from rank 0's model (before the wrappers copy it)
            for p in model.state_dict().values():
                dist.broadcast(p, 0)
        quiet_one_rank(None)  # one process is a sequential run here (`adasum train` says so), not a mistake
        base = optimizer(self.params)
        self.optimizer: DistributedOptimizer | SlowMo
        if slow_momentum is not None or outer_optimizer is not None:
            self.optimizer = SlowMo(
                base,
                local_steps=local_steps,
                slow_lr=slow_lr,
                slow_momentum=slow_momentum or 0.0,
                reducer=reducer,
                nonfinite="propagate",  # the policy is applied per step in `step`, as the simulator does
                outer_optimizer=outer_optimizer,
                communication_dtype=communication_dtype,
                error_feedback=error_feedback,
                fragments=fragments,
                delay=delay,
                mixing=mixing,
            )
        else:
            self.optimizer = DistributedOptimizer(
                base, reducer=reducer, mode=combine, local_steps=local_steps, nonfinite="propagate"
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
        """One training step on this rank's batch; the loss is the mean over ranks."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        set_dropout_keys(self.model, self.seed, dist.get_rank(), self.steps)  # the simulator's worker `rank`
        loss = cross_entropy(self.model(inputs[0]), targets[0])
        loss.backward()
        grads = [cast(torch.Tensor, p.grad) for p in self.params]  # every trained parameter has one now
        diag: Orthogonality | None = None
        if self.diagnostics_every and self.steps % self.diagnostics_every == 0 and dist.get_world_size() > 1:
            diag = all_reduce_orthogonality(grads)
        # the policy is applied here, on the local gradients of every step, as the simulator does;
        # the wrappers then never see a non-finite value
        operation, what = f"adasum train, step {self.steps + 1}", "the gradient of parameter"
        if apply_nonfinite_policy(self.nonfinite, grads, None, self.names, operation=operation, what=what):
            self.skipped_steps += 1  # skipped on every rank: nothing combined, no optimizer step
        else:
            self.optimizer.step()
        self.steps += 1
        mean_loss = loss.detach().reshape(1)
        with failures_named("adasum train", f"the all-reduce of step {self.steps}'s loss", None):
            dist.all_reduce(mean_loss)
        return StepResult(mean_loss / dist.get_world_size(), diag)

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, reducer state and counters, for a checkpoint."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "reducer": self.reducer.state_dict(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved: the model first, then the optimizer (whose `load_state_dict` applies
        the library's rules to a state saved on another world size, docs/faults.md: a round in flight goes back
        to its start weights); the reducer's state only from the same world size (AdaCons' per-worker momentum,
        one entry per rank, starts afresh on another, as the optimizer's rules say)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        saved_world = dict(state["optimizer"]).get("world_size")
        if saved_world is None or int(saved_world) == dist.get_world_size():
            self.reducer.load_state_dict(state.get("reducer", {}))
        self.steps = int(state["steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def _tensorboard_writer(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(
            "--tensorboard needs the tensorboard extra: pip install 'adasum[tensorboard]' "
            "(from a checkout: pip install '.[tensorboard]')"
        ) from None
    return SummaryWriter(str(path))


def _trim_metrics(path: Path, keep_epochs: int | None) -> None:
    """Before appending to metrics.jsonl: on resume drop the lines of epochs after the checkpoint
    (a torn last line too, with a warning naming the file); on a fresh start remove the file."""
    if keep_epochs is not None and path.exists():
        kept = [row for row in read_jsonl(path) if row.get("epoch", 0) <= keep_epochs]
        write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in kept))
    elif keep_epochs is None and path.exists():
        path.unlink()


# what a run writes into its folder; a fresh start replaces them
RUN_FILES = ("checkpoint.pt", "metrics.jsonl", "result.json")


def _start_over(out: Path, resuming: bool, overwrite: bool) -> None:
    """Before a run starts from step 0 in `out`: ValueError if that would replace a run's files,
    unless `overwrite` (then they are removed). `resuming`: --resume found no checkpoint."""
    found = [name for name in RUN_FILES if (out / name).exists() and (out / name).stat().st_size > 0]
    if found and not overwrite:
        if resuming:
            raise ValueError(
                f"{out} holds {', '.join(found)} but no checkpoint.pt to resume from; "
                "--overwrite starts the run again and replaces them"
            )
        raise ValueError(
            f"{out} already holds a run ({', '.join(found)}); --resume continues it, --overwrite replaces it"
        )
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)


def _agree(error: str | None, distributed: bool) -> None:
    """Raise rank 0's ValueError `error` on every rank (rank 0 alone writes the output files)."""
    if distributed:
        box = [error]
        with failures_named("adasum train", "the check of the output files across ranks", None):
            dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ValueError(error)


EXPLODED = 1000.0
"""A loss above this many times the chance-level loss (at least 1 nat) counts as diverged."""


@dataclass
class Chance:
    """What a model that learned nothing scores: the accuracy of always predicting the most
    frequent validation label, and the loss of predicting the training label frequencies."""

    accuracy: float  # percent
    noise: float  # 3 binomial standard deviations of that accuracy over the validation set, percent
    loss: float  # entropy of the training labels (nats)

    @classmethod
    def of(cls, train_y: torch.Tensor, val_y: torch.Tensor, classes: int) -> Chance:
        """Chance level of a task from its label frequencies."""
        val = torch.bincount(val_y.reshape(-1).cpu(), minlength=classes).double()
        majority = float(val.max() / val.sum())
        p = torch.bincount(train_y.reshape(-1).cpu(), minlength=classes).double()
        p = p[p > 0] / p.sum()
        entropy = float(-(p * p.log()).sum())
        noise = 3 * math.sqrt(majority * (1 - majority) / float(val.sum()))
        return cls(100 * majority, 100 * noise, entropy)

    def diverged(self, *losses: float) -> bool:
        """A loss that is NaN or Inf, or finite but above `EXPLODED` times the chance-level loss (a run at
        1e19 is as lost as one at NaN; no learning run gets near 1,000 times the loss of guessing)."""
        return not all(math.isfinite(v) and v <= EXPLODED * max(self.loss, 1.0) for v in losses)

    def collapsed(self, history: list[dict[str, Any]]) -> bool:
        """At chance: the last validation accuracy within noise of the majority rate, or a training
        loss that never left the chance level (every epoch's mean at least 99% of it)."""
        if not history:
            return False
        at_chance_accuracy = history[-1]["val_accuracy"] <= self.accuracy + self.noise
        loss_stayed = all(h["train_loss"] >= 0.99 * self.loss for h in history)
        return at_chance_accuracy or loss_stayed


@dataclass
class _Progress:
    """Where a run stands: finished epochs, the epoch in progress, the orthogonality trace."""

    history: list[dict[str, Any]]
    trace: list[list[float]]
    curve: list[dict[str, Any]] = field(default_factory=list)  # the learning curve (`evals_per_epoch`)
    epoch: int = 0
    step: int = 0  # steps done in `epoch`
    partial: dict[str, Any] | None = None  # that epoch's losses and diagnostics so far

    def start_epoch(self, epoch: int) -> dict[str, Any]:
        if epoch != self.epoch or self.step == 0 or self.partial is None:
            self.epoch, self.step = epoch, 0
            self.partial = {"losses": [], "ortho": [], "per_tensor": []}
        return self.partial


class _Run:
    """One training run's parts: data, model, engine, output paths; `train` drives it."""

    def __init__(self, config: RunConfig, out: Path | None, dataset: Dataset | None, distributed: bool) -> None:
        self.config, self.out, self.distributed = config, out, distributed
        self.on_step: Callable[[int, int], None] | None = None  # called after every step with (rank, global step)
        self.method = get_method(config.method)
        self.device = torch.device(config.device)
        self.rank = dist.get_rank() if distributed else 0
        self.workers = dist.get_world_size() if distributed else self.method.workers(config.workers)
        if distributed and self.method.single_worker and self.workers > 1:
            raise ValueError(f"method {self.method.name!r} is one worker: launch it with torchrun --nproc-per-node 1")
        self.reducer = method_reducer(self.method)
        if out is not None and self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        self._load_data(dataset)
        self.lr = self.method.learning_rate(config.lr, self.workers)
        self._build_engine()
        self.checkpoint = out / "checkpoint.pt" if out is not None else None
        self.label = f"{self.method.name} P={self.workers} lr={config.lr:g} seed={config.seed}"

    def _load_data(self, dataset: Dataset | None) -> None:
        config = self.config
        if dataset is not None and dataset.name != config.task:
            raise ValueError(
                f"the dataset given is {dataset.name!r}, the config's task {config.task!r}; set the task to the "
                "dataset's name (the results and checkpoints name the run by its task)"
            )
        base = dataset if dataset is not None else load_task(config.task, config.data_dir)
        self.data = base.with_validation(config.val_fraction).to(self.device)
        assert self.data.val_x is not None and self.data.val_y is not None  # with_validation split them
        self.train_x, self.train_y = self.data.train_x, self.data.train_y
        if config.train_limit is not None:
            if config.train_limit > len(self.train_x):  # a limit that limits nothing would name another setting
                raise ValueError(
                    f"train limit {config.train_limit} is more than the {len(self.train_x)} training examples of "
                    f"{self.data.name} (after the validation split of {len(self.data.val_y)}); "
                    "leave it out to train on all of them"
                )
            self.train_x, self.train_y = self.train_x[: config.train_limit], self.train_y[: config.train_limit]
        self.steps_per_epoch = len(self.train_x) // (self.workers * config.batch_size)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{len(self.train_x)} training examples are fewer than one global batch of "
                f"{self.workers} workers x {config.batch_size}; pass a smaller --batch-size or fewer workers"
            )
        self.chance = Chance.of(self.train_y, self.data.val_y, self.data.classes)
        # evaluations inside an epoch for the learning curve: every `eval_every` steps, and at each epoch's end
        per_epoch = config.evals_per_epoch
        self.eval_every = max(1, self.steps_per_epoch // per_epoch) if per_epoch else None

    def _build_engine(self) -> None:
        config = self.config
        self.model_name = config.model or self.data.default_model
        torch.manual_seed(config.seed)  # the same initial model for every method and worker count
        model = build_model(self.model_name, self.data.input_shape, self.data.classes).to(self.device)
        optimizer = make_optimizer(config, self.lr, round(config.warmup_epochs * self.steps_per_epoch))
        options: dict[str, Any] = dict(  # the method, the same for simulated and real workers
            combine=self.method.combine,
            local_steps=config.local_steps if self.method.local else 1,
            slow_momentum=config.slow_momentum if self.method.slow_momentum else None,
            slow_lr=config.slow_lr if self.method.slow_momentum else 1.0,
            **diloco_options(config, self.method),
        )
        self.engine: SimulatedWorkers | DistributedWorker
        if self.distributed:
            self.engine = DistributedWorker(
                model, optimizer, self.reducer, nonfinite=config.nonfinite, seed=config.seed, **options
            )
        else:
            self.engine = SimulatedWorkers(
                model,
                self.workers,
                optimizer,
                reducer=self.reducer,
                chunk_size=config.chunk_size,
                nonfinite=config.nonfinite,
                seed=config.seed,
                **options,
            )
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]

    def restore(self, resume: bool) -> _Progress:
        """The progress to start from: the checkpoint's with `resume` (if there is one), else none."""
        progress = _Progress(history=[], trace=[])
        if not (resume and self.checkpoint is not None and self.checkpoint.exists()):
            return progress
        state, local = load_checkpoint(self.checkpoint, self.device, distributed=self.distributed)
        saved_workers = saved_world_size(state) if self.distributed else self.workers
        current = asdict(self.config)
        if saved_workers != self.workers:  # an elastic restart: the run is the same at any world size
            current["workers"] = state["config"].get("workers", saved_workers)
        check_same_run(state["config"], current, self.checkpoint)
        if int(state["epoch"]) > self.config.epochs:
            raise ValueError(
                f"{self.checkpoint} is at epoch {int(state['epoch'])}, past --epochs {self.config.epochs}; "
                "drop --resume or use another --out"
            )
        with warnings.catch_warnings(record=True) as caught:  # the library's resize rules: into the one line
            warnings.simplefilter("always")
            applied(self.checkpoint, lambda: self.engine.load_state_dict(local["engine"]))
        library_notes = []
        for caught_warning in caught:
            text = str(caught_warning.message)
            if saved_workers != self.workers and " loads on " in text:
                library_notes.append(text.split(f"loads on {self.workers}: ", 1)[-1])
            else:
                warnings.warn_explicit(caught_warning.message, caught_warning.category, caught_warning.filename,
                                       caught_warning.lineno)
        made: list[_Progress] = []
        applied(self.checkpoint, lambda: made.append(_Progress(
            history=state["history"],
            trace=state["trace"],
            curve=state.get("curve", []),
            epoch=int(state["epoch"]),
            step=int(state.get("step_in_epoch", 0)),
            partial=state.get("partial"),
        )))
        progress = made[0]
        if saved_workers != self.workers:
            self._resized(progress, saved_workers, library_notes)
        applied(self.checkpoint, lambda: torch.set_rng_state(local["rng"]))
        if self.device.type == "cuda" and local.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(local["cuda_rng"], self.device)
        log.info("resumed %s from epoch %d, step %d", self.out, progress.epoch, progress.step)
        return progress

    def _resized(self, progress: _Progress, saved_workers: int, library_notes: list[str]) -> None:
        """A checkpoint of `saved_workers` ranks resumed on `self.workers` (docs/faults.md): the position in the
        epoch's permutation carries over (`resized_position`), the learning rate is the method's at the new
        size, and one warning on every rank says what did not survive (with the library's `library_notes`)."""
        step, skipped = resized_position(
            progress.step, saved_workers, self.workers, self.config.batch_size, self.steps_per_epoch
        )
        notes = ["every rank starts from rank 0's part (model, optimizer and reducer state, RNG state)"]
        if progress.step:
            notes.append(
                f"epoch {progress.epoch + 1} goes on at example {step * self.workers * self.config.batch_size} of its "
                f"permutation, step {step} of {self.steps_per_epoch} at {self.workers} ranks"
                + (f" ({skipped} examples after the {saved_workers} ranks' last step are skipped)" if skipped else "")
            )
        progress.step = step
        groups = self.engine.optimizer.param_groups
        if any(group["lr"] != self.lr for group in groups):
            notes.append(f"the learning rate is the method's at {self.workers} ranks, {self.lr:g}")
            for group in groups:
                group["lr"] = self.lr
        log.warning(
            "adasum train: %s was written by %d ranks and resumes on %d: %s",
            self.checkpoint, saved_workers, self.workers, "; ".join([*notes, *library_notes]),
        )

    def save(self, progress: _Progress, epoch: int, step_in_epoch: int) -> None:
        """Checkpoint after `epoch` whole epochs and `step_in_epoch` more steps (every rank calls)."""
        if self.checkpoint is None:
            return
        common = {
            "config": asdict(self.config),
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "partial": progress.partial if step_in_epoch else None,
            "history": progress.history,
            "trace": progress.trace,
            "curve": progress.curve,
        }
        local = {
            "engine": self.engine.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
        }
        save_checkpoint(self.checkpoint, common, local, distributed=self.distributed)

    def train_epoch(self, progress: _Progress, epoch: int, advance: Callable[[int], None]) -> dict[str, Any]:
        """Run the rest of `epoch`; its losses and diagnostics (also in ``progress.partial``)."""
        config = self.config
        partial = progress.start_epoch(epoch)
        order = worker_batches(len(self.train_x), self.workers, config.batch_size, epoch, config.seed).to(self.device)
        for s in range(progress.step, self.steps_per_epoch):
            idx = order[s, self.rank : self.rank + 1] if self.distributed else order[s]
            result = self.engine.step(self.train_x[idx], self.train_y[idx])
            partial["losses"].append(result.losses.mean().detach())
            if result.orthogonality is not None:
                partial["ortho"].append((s, result.orthogonality.model))
                partial["per_tensor"].append(result.orthogonality.per_tensor)
            advance(1)
            progress.step = s + 1
            global_step = epoch * self.steps_per_epoch + s + 1
            if self.eval_every and (s + 1) % self.eval_every == 0 and s + 1 < self.steps_per_epoch:
                self.curve_point(progress, global_step)
            if config.checkpoint_every and global_step % config.checkpoint_every == 0 and s + 1 < self.steps_per_epoch:
                self.save(progress, epoch, s + 1)
            if self.on_step is not None:
                self.on_step(self.rank, global_step)
        return partial

    def curve_point(self, progress: _Progress, step: int, measured: tuple[float, ...] | None = None) -> None:
        """Append the learning curve's point after `step` global steps: validation loss and accuracy, test
        accuracy (`measured`: those three where the caller has them)."""
        assert self.data.val_x is not None and self.data.val_y is not None
        if measured is None:
            val_loss, val_acc = evaluate(self.engine.module, self.data.val_x, self.data.val_y)
            test_acc = evaluate(self.engine.module, self.data.test_x, self.data.test_y)[1]
            scores = self.scores()
        else:
            val_loss, val_acc, test_acc = measured
            scores = progress.history[-1].get("scores") if progress.history else None
        examples = step * self.workers * self.config.batch_size
        progress.curve.append({
            "step": step, "examples": examples, "epoch": step / self.steps_per_epoch,
            "val_loss": val_loss, "val_accuracy": val_acc, "test_accuracy": test_acc,
            **({"scores": scores} if scores is not None else {}),
        })

    def scores(self) -> dict[str, float] | None:
        """The task's own scores of the agreed model (`Dataset.scorer`), or None for a task without them."""
        return self.data.scorer(self.engine.module) if self.data.scorer is not None else None

    def epoch_record(self, progress: _Progress, epoch: int, partial: dict[str, Any], wall_s: float) -> dict[str, Any]:
        """Evaluate the agreed model after `epoch` and append the epoch's record to the history."""
        step_losses = torch.stack(partial["losses"]).tolist()
        if self.config.nonfinite == "skip":  # a skipped step's loss may be NaN: not a divergence
            finite_mean = _finite_mean(step_losses)
            train_loss = finite_mean if finite_mean is not None else float("nan")
        else:
            train_loss = sum(step_losses) / len(step_losses)
        assert self.data.val_x is not None and self.data.val_y is not None
        val_loss, val_acc = evaluate(self.engine.module, self.data.val_x, self.data.val_y)
        test_loss, test_acc = evaluate(self.engine.module, self.data.test_x, self.data.test_y)
        diverged = self.chance.diverged(train_loss, val_loss, test_loss)
        tensor_o = torch.stack(partial["per_tensor"]).mean(0).tolist() if partial["per_tensor"] else []
        record: dict[str, Any] = {
            "epoch": epoch + 1,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "val_accuracy": val_acc,
            "test_loss": test_loss,
            "test_accuracy": test_acc,
            "orthogonality": _finite_mean([o for _, o in partial["ortho"]]),
            "orthogonality_per_tensor": dict(zip(self.names, tensor_o)),
            "steps": (epoch + 1) * self.steps_per_epoch,
            "wall_s": wall_s,
            "diverged": diverged,
            "skipped_steps": self.engine.skipped_steps,
        }
        scores = self.scores()
        if scores is not None:
            record["scores"] = scores
        record["collapsed"] = not diverged and self.chance.collapsed([*progress.history, record])
        progress.history.append(record)
        if self.eval_every:
            self.curve_point(progress, (epoch + 1) * self.steps_per_epoch, (val_loss, val_acc, test_acc))
        trace_every = max(1, self.steps_per_epoch * self.config.epochs // 400)
        for s, o in partial["ortho"]:
            if (epoch * self.steps_per_epoch + s) % trace_every == 0:
                progress.trace.append([epoch + s / self.steps_per_epoch, o])
        record["_step_losses"] = step_losses  # for metrics.jsonl, removed there
        return record

    def report_epoch(self, record: dict[str, Any], partial: dict[str, Any], metrics: Any, writer: Any) -> None:
        """Log the epoch (rank 0) and append it to metrics.jsonl and TensorBoard."""
        step_losses = record.pop("_step_losses")
        if self.rank != 0:
            return
        mean_o = record["orthogonality"]
        log.info(
            "%s epoch %d/%d: train loss %.4f, val accuracy %.2f%%, test accuracy %.2f%%%s%s%s",
            self.label,
            record["epoch"],
            self.config.epochs,
            record["train_loss"],
            record["val_accuracy"],
            record["test_accuracy"],
            f", orthogonality {mean_o:.3f}" if mean_o is not None else "",
            "".join(f", {name} {value:.2f}" for name, value in record.get("scores", {}).items()),
            " (diverged)" if record["diverged"] else " (at chance)" if record["collapsed"] else "",
        )
        if metrics is not None:
            epoch = record["epoch"] - 1
            o_by_step = dict(partial["ortho"])
            for s, value in enumerate(step_losses):
                line = {"epoch": epoch + 1, "step": epoch * self.steps_per_epoch + s + 1, "loss": value}
                if s in o_by_step:
                    line["orthogonality"] = o_by_step[s]
                metrics.write(json.dumps(line) + "\n")
            metrics.write(json.dumps({"epoch": epoch + 1, "kind": "epoch", **record}) + "\n")
            metrics.flush()
        if writer is not None:
            for key in ("train_loss", "val_accuracy", "test_loss", "test_accuracy", "orthogonality"):
                if record[key] is not None:
                    writer.add_scalar(key, record[key], record["epoch"])

    def result(self, progress: _Progress) -> dict[str, Any]:
        config, method, history = self.config, self.method, progress.history
        last = history[-1]
        return {
            "method": method.name,
            "workers": self.workers,
            "lr": config.lr,
            "effective_lr": self.lr,
            "epochs": config.epochs,
            "seed": config.seed,
            "val_accuracy": last["val_accuracy"],
            "test_accuracy": last["test_accuracy"],
            "diverged": last["diverged"],
            "collapsed": last["collapsed"],
            "epochs_run": len(history),
            "batch_size": config.batch_size,
            "optimizer": config.optimizer,
            "momentum": config.momentum if config.optimizer == "sgd" else None,
            "task": self.data.name,
            "model": self.model_name,
            "local_steps": config.local_steps if method.local else None,
            "slow_momentum": config.slow_momentum if method.slow_momentum else None,
            "val_loss": last["val_loss"],
            "test_loss": last["test_loss"],
            "train_loss": last["train_loss"],
            "best_val_accuracy": max(h["val_accuracy"] for h in history),
            **({"scores": last["scores"]} if "scores" in last else {}),
            "chance_accuracy": self.chance.accuracy,
            "chance_noise": self.chance.noise,
            "skipped_steps": self.engine.skipped_steps,
            "steps": len(history) * self.steps_per_epoch,
            "wall_s": sum(h["wall_s"] for h in history),
            "distributed": self.distributed,
            "config": identity(asdict(config)),
            "history": history,
            "orthogonality_trace": progress.trace,
            **({"curve": progress.curve} if self.eval_every else {}),
        }


def _set_deterministic(config: RunConfig) -> None:
    if config.deterministic:  # bitwise-repeatable kernels (CPU runs with fixed threads already are)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def train(
    config: RunConfig,
    out_dir: str | os.PathLike | None = None,
    *,
    resume: bool = False,
    dataset: Dataset | None = None,
    progress: ProgressBar | None = None,
    tensorboard: bool = False,
    distributed: bool = False,
    overwrite: bool = False,
    on_step: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Train one run and return its result (also written to ``OUT/result.json``).

    Simulated unless `distributed` (then one process per worker under torchrun, every method).
    `dataset`, where given, is used instead of loading ``config.task``, and must be named so.
    The task's training data loses ``config.val_fraction`` to a fixed validation split
    (`Dataset.with_validation`); every epoch evaluates the agreed model on it and on the test set.
    `out_dir` receives ``metrics.jsonl`` (one line per step and per epoch),
    ``checkpoint.pt`` after every epoch (and every ``config.checkpoint_every`` steps), and
    ``result.json``; `resume` continues from the checkpoint, mid-epoch included, exactly where the
    uninterrupted run would be (`adasum.experiments.checkpoint`). A run that starts from step 0
    into a folder holding another run's files raises ValueError unless `overwrite` (they are
    replaced): nothing finished is lost silently. `on_step(rank, global_step)` is called after every
    training step (tests kill a rank there: `adasum.experiments.checkpoint.kill_at`).

    >>> result = train(RunConfig(method="adasum", workers=16, lr=0.01, epochs=2), "runs/one")  # doctest: +SKIP
    >>> result["val_accuracy"], result["test_accuracy"], result["collapsed"]  # doctest: +SKIP

    A short simulated run of 4 workers on a toy task (is the first input positive?), into a temporary folder:

    >>> import tempfile
    >>> x = torch.randn(200, 4, generator=torch.Generator().manual_seed(0))
    >>> toy = Dataset("toy", x[:160], (x[:160, 0] > 0).long(), x[160:], (x[160:, 0] > 0).long(), 2, "mlp")
    >>> folder = tempfile.TemporaryDirectory()
    >>> config = RunConfig(task="toy", method="adasum", workers=4, lr=0.1, epochs=3, batch_size=8)
    >>> result = train(config, folder.name, dataset=toy)
    >>> result["epochs_run"], result["steps"], result["diverged"], result["test_accuracy"] > 90
    (3, 12, False, True)
    >>> sorted(p.name for p in Path(folder.name).iterdir())
    ['checkpoint.pt', 'metrics.jsonl', 'result.json']
    >>> train(config, folder.name, dataset=toy)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: ... already holds a run (checkpoint.pt, metrics.jsonl, result.json); --resume continues it, ...
    >>> folder.cleanup()
    """
    config.validate()
    _set_deterministic(config)
    out = Path(out_dir) if out_dir is not None else None
    run = _Run(config, out, dataset, distributed)
    run.on_step = on_step
    state = run.restore(resume)
    advance = (progress or ProgressBar(False)).task(
        run.label, run.steps_per_epoch * config.epochs, state.epoch * run.steps_per_epoch + state.step
    )
    metrics_path = out / "metrics.jsonl" if out is not None and run.rank == 0 else None
    writer, error = None, None
    resumed = state.epoch > 0 or state.step > 0
    try:  # what only rank 0 does, and every rank must hear about
        if out is not None and run.rank == 0 and not resumed:
            _start_over(out, resume, overwrite)
        if metrics_path is not None:
            _trim_metrics(metrics_path, state.epoch if resumed else None)
        if tensorboard and out is not None and run.rank == 0:
            writer = _tensorboard_writer(out / "tensorboard")
    except ValueError as e:
        error = str(e)
    _agree(error, distributed)
    with open(metrics_path, "a") if metrics_path is not None else nullcontext() as metrics:
        for epoch in range(state.epoch, config.epochs):
            if state.history and state.history[-1]["diverged"]:
                break
            started = time.perf_counter()
            partial = run.train_epoch(state, epoch, advance)
            record = run.epoch_record(state, epoch, partial, time.perf_counter() - started)
            run.report_epoch(record, partial, metrics, writer)
            state.epoch, state.step = epoch + 1, 0
            run.save(state, epoch + 1, 0)
    if writer is not None:
        writer.close()
    result = run.result(state)
    if out is not None and run.rank == 0:
        write_json_atomic(out / "result.json", result)
    return result


def _finite_mean(values: list[float]) -> float | None:
    good = [v for v in values if math.isfinite(v)]
    return sum(good) / len(good) if good else None


def diloco_options(config: RunConfig, method: Method) -> dict[str, Any]:
    """The DiLoCo options of `method` under `config` for `SimulatedWorkers` and `DistributedWorker` ({} for the
    other methods): the outer Nesterov SGD, the communication dtype, error feedback."""
    if not method.outer:
        return {}
    lr = 0.7 if config.outer_lr is None else config.outer_lr
    momentum = 0.9 if config.outer_momentum is None else config.outer_momentum
    options: dict[str, Any] = {
        "outer_optimizer": diloco_outer(lr, momentum),
        "communication_dtype": config.communication_dtype,
        "error_feedback": bool(config.error_feedback),
    }
    if method.streaming:
        options["fragments"] = 2 if config.fragments is None else config.fragments
        options["delay"] = 1 if config.delay is None else config.delay
        options["mixing"] = 0.5 if config.mixing is None else config.mixing
    return options


def identity(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of a run's configuration that make it that run (all but the RESUMABLE ones); no
    model stands for the task's default model (``--model cnn`` on digits is the same run), and a field the
    configuration lacks (written before the field existed) has its default."""
    values: dict[str, Any] = {
        f.name: config.get(f.name, f.default) for f in fields(RunConfig) if f.name not in RESUMABLE
    }
    if values["model"] is None:
        values["model"] = DEFAULT_MODELS.get(values["task"])
    return values


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"key saved -> current"`` for every identity field that differs."""
    a, b = identity(saved), identity(current)
    return [f"{key} {a[key]!r} -> {b[key]!r}" for key in a if a[key] != b[key]]


def check_same_run(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """ValueError naming every difference if `saved` is another run's configuration."""
    diff = differences(saved, current)
    if diff:
        raise ValueError(
            f"{path} belongs to another run ({', '.join(diff)}); drop --resume or use another --out"
        )
