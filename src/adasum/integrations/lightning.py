"""Adasum in PyTorch Lightning: a callback, and two strategies registered by name.

Three routes, all launched like any Lightning DDP run (``torchrun --nproc-per-node N train.py``, or
Lightning's own launcher with ``devices=N``):

* `AdasumCallback`: add it to a Trainer whose strategy wraps the model in DistributedDataParallel
  (``strategy="ddp"``); it registers `adasum.ddp.adasum_hook` when fitting starts, on CPU and GPU.
* ``strategy="ddp_adasum"`` (`AdasumDDPStrategy`): Lightning's DDP strategy with the hook
  registered on every device. (``DDPStrategy(ddp_comm_hook=...)`` registers a hook on CUDA only and
  ignores it on CPU without a word.)
* ``strategy="ddp_adasum_delta"`` (`AdasumDeltaStrategy`): for optimizers such as Adam, whose
  steps rather than gradients should be combined. The model is not wrapped in DDP (rank 0's
  weights are broadcast once) and every optimizer of ``configure_optimizers`` is wrapped in
  `adasum.DistributedOptimizer` in delta mode: each rank steps locally, the steps are combined.

`AdasumStatistics` logs the per-step statistics of any of the three (``statistics()`` of the hook's
state or of the wrapped optimizers) through the LightningModule's loggers.

The names are registered with Lightning's strategy registry when this module is imported:

>>> import adasum.lightning
>>> trainer = L.Trainer(strategy="ddp_adasum_delta", devices=2)  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from adasum.extras import require

require("lightning", extra="lightning", user="adasum.lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.overrides.distributed import _sync_module_states  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry  # noqa: E402

from adasum.checks.nonfinite import check_policy  # noqa: E402
from adasum.integrations.ddp import AdasumState  # noqa: E402
from adasum.integrations.glue import FRAMEWORKS, check_state, register_hook, warn_one_process  # noqa: E402
from adasum.integrations.loggers import PREFIX, HasStatistics, scalars  # noqa: E402
from adasum.integrations.optim import DistributedOptimizer  # noqa: E402
from adasum.options import Nonfinite, check_count, user_stacklevel  # noqa: E402
from adasum.reducers import Reducer, get_reducer  # noqa: E402

LAUNCH = "torchrun --nproc-per-node N, or Trainer(devices=N)"
HOOK_OPTIONS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")
"""DDPStrategy's options for a DDP communication hook of its own: the strategies here do not apply them."""

__all__ = ["AdasumCallback", "AdasumDDPStrategy", "AdasumDeltaStrategy", "AdasumStatistics"]


class AdasumCallback(pl.Callback):
    """Register `adasum.ddp.adasum_hook` on the strategy's DistributedDataParallel model when
    fitting starts (after the strategy wrapped the model, before the first backward pass).

    Args:
        state: the hook's state (default: ``AdasumState(named_parameters=...)`` of the
            LightningModule, made anew each time fitting starts, so that the callback serves several
            fits); read ``callback.state.iteration`` afterwards. A state given here belongs to one DDP
            model, so to one fit. Anything else than an `AdasumState` or None raises TypeError.

    Warns, and does nothing, when there is one process, when the strategy does not wrap the model in
    DistributedDataParallel, or when it is ``"ddp_adasum"`` (which registers the hook itself).

    >>> trainer = L.Trainer(strategy="ddp", callbacks=[AdasumCallback()])  # doctest: +SKIP
    """

    def __init__(self, state: AdasumState | None = None) -> None:
        check_state(state, "adasum.lightning.AdasumCallback")
        self.state = state
        self._given = state  # None: a new state for each fit (each fit wraps its model in a new DDP model)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register the hook on the DDP-wrapped model (or warn that there is none)."""
        if isinstance(trainer.strategy, AdasumDDPStrategy):
            warnings.warn(
                "adasum.lightning.AdasumCallback: the strategy 'ddp_adasum' registers the Adasum hook already; "
                "the callback does nothing (drop it, or pass its state as AdasumDDPStrategy(adasum_state=...))",
                UserWarning,
                stacklevel=user_stacklevel(*FRAMEWORKS),
            )
            return
        self.state = register_hook(
            trainer.strategy.model,
            self._given,
            pl_module.named_parameters(),
            user="adasum.lightning.AdasumCallback",
            launch=LAUNCH,
            not_ddp=f"the strategy is {type(trainer.strategy).__name__}; use strategy='ddp' or 'ddp_adasum'",
        ) or self._given


class AdasumDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy with `adasum.ddp.adasum_hook` registered on the DDP model, on every
    device (registered as ``"ddp_adasum"``).

    Args:
        adasum_state: the hook's state (default: ``AdasumState(named_parameters=...)`` of the
            LightningModule); ``strategy.adasum_state.iteration`` counts the combined iterations.
            Anything else than an `AdasumState` or None raises TypeError.
        **kwargs: DDPStrategy's arguments (``find_unused_parameters``, ``static_graph``,
            ``process_group_backend``, ...), except its hook options (``ddp_comm_hook``,
            ``ddp_comm_state``, ``ddp_comm_wrapper``, ``model_averaging_period``): this strategy
            registers `adasum.ddp.adasum_hook` itself, so they raise ValueError.

    >>> trainer = L.Trainer(strategy=AdasumDDPStrategy(AdasumState(reducer="adacons")))  # doctest: +SKIP
    """

    def __init__(self, adasum_state: AdasumState | None = None, **kwargs: Any) -> None:
        if "ddp_comm_hook" in kwargs or "ddp_comm_state" in kwargs:
            raise ValueError(
                "AdasumDDPStrategy registers the Adasum hook itself; pass adasum_state=, not ddp_comm_hook="
            )
        hints = {
            "ddp_comm_wrapper": "to combine half-precision gradients, register fp16_compress_wrapper(adasum_hook) on "
            "the DDP model yourself (adasum.ddp)",
            "model_averaging_period": "it goes with torch's post-localSGD hook; for local SGD with Adasum use "
            "strategy='ddp_adasum_delta' with local_steps=",
        }
        for option, hint in hints.items():
            if kwargs.get(option) is not None:
                raise ValueError(
                    f"adasum.lightning.AdasumDDPStrategy: {option}= is not applied (the strategy registers "
                    f"adasum.ddp.adasum_hook itself); {hint}"
                )
        check_state(adasum_state, "adasum.lightning.AdasumDDPStrategy", "adasum_state")
        super().__init__(**kwargs)
        self.adasum_state = adasum_state

    def _register_ddp_hooks(self) -> None:
        assert self.lightning_module is not None  # Lightning sets it before the DDP hooks
        self.adasum_state = register_hook(
            self.model,
            self.adasum_state,
            self.lightning_module.named_parameters(),
            user="adasum.lightning.AdasumDDPStrategy",
            launch=LAUNCH,
            not_ddp="the strategy did not wrap the model",
        ) or self.adasum_state

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register this strategy as ``"ddp_adasum"``."""
        strategy_registry.register(
            "ddp_adasum", cls, description="DDP with Adasum's communication hook on every device", override=True
        )


class AdasumDeltaStrategy(DDPStrategy):
    """Combine the optimizers' steps instead of the gradients (registered as ``"ddp_adasum_delta"``):
    the model is not wrapped in DDP; rank 0's parameters and buffers are broadcast when fitting
    starts, and each optimizer is wrapped in ``adasum.DistributedOptimizer(mode="delta")``, which
    runs it locally inside ``step()`` and combines the weight changes (module doc).

    Args:
        reducer: how the steps are combined: "adasum" (default), "mean", "adacons", or a `Reducer`.
        local_steps: local optimizer steps between combinations (local SGD with `reducer`).
        nonfinite: DistributedOptimizer's policy for NaN/Inf gradients ("propagate", "raise", "skip").
        **kwargs: DDPStrategy's process arguments (``process_group_backend``, ``timeout``,
            ``start_method``, ``cluster_environment``, ...); DDP's own options and DDPStrategy's hook
            options (``ddp_comm_hook``, ``ddp_comm_wrapper``, ...) raise ValueError, as no DDP model
            is built.

    `reducer`, `local_steps` and `nonfinite` are checked at construction (as
    `adasum.DistributedOptimizer` checks them), before any process starts.

    Buffers (BatchNorm statistics) stay local after the first broadcast, as in Horovod. Gradient
    accumulation (``accumulate_grad_batches``), clipping (``gradient_clip_val``) and LR schedulers
    work as usual (a scheduler acts on the wrapped optimizer, whose ``param_groups`` the wrapper
    shares); ``trainer.optimizers`` holds the wrappers, and a checkpoint holds their state.

    >>> trainer = L.Trainer(strategy=AdasumDeltaStrategy(reducer="adasum", local_steps=4))  # doctest: +SKIP
    """

    def __init__(
        self, reducer: str | Reducer = "adasum", local_steps: int = 1, nonfinite: Nonfinite = "propagate", **kwargs: Any
    ) -> None:
        operation = "adasum.lightning.AdasumDeltaStrategy"
        for option in HOOK_OPTIONS:
            if kwargs.get(option) is not None:
                raise ValueError(
                    f"{operation}: {option}= does not apply: this strategy builds no DDP model, so no DDP "
                    "communication hook runs (adasum.DistributedOptimizer combines the optimizers' steps)"
                )
        get_reducer(reducer)  # an unknown name raises here, not when fitting starts
        check_count(operation, "local_steps", local_steps)
        check_policy(nonfinite)
        super().__init__(**kwargs)
        if self._ddp_kwargs:
            raise ValueError(
                f"AdasumDeltaStrategy builds no DDP model; DDP options {sorted(self._ddp_kwargs)} do not apply"
            )
        self.optimizer_options: dict[str, Any] = {
            "reducer": reducer, "local_steps": local_steps, "nonfinite": nonfinite
        }

    def configure_ddp(self) -> None:
        """No DDP wrapper: the gradients stay local and `DistributedOptimizer` combines the steps."""
        warn_one_process("adasum.lightning.AdasumDeltaStrategy", LAUNCH)
        assert self.model is not None  # Lightning sets it before configure_ddp
        _sync_module_states(self.model)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The optimizers, each wrapped in `DistributedOptimizer` (delta mode)."""
        super().setup_optimizers(trainer)
        self.optimizers = [self._wrap(optimizer) for optimizer in self.optimizers]

    def _wrap(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if isinstance(optimizer, DistributedOptimizer):
            return optimizer
        return DistributedOptimizer(optimizer, mode="delta", **self.optimizer_options)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register this strategy as ``"ddp_adasum_delta"``."""
        strategy_registry.register(
            "ddp_adasum_delta",
            cls,
            description="Adasum of the optimizers' steps (adasum.DistributedOptimizer, delta mode), no DDP wrapper",
            override=True,
        )


class AdasumStatistics(pl.Callback):
    """Log the per-step statistics (`adasum.ddp.AdasumState.statistics`,
    `adasum.DistributedOptimizer.statistics`) with ``LightningModule.log_dict`` after every
    `every_n_steps`-th training batch, as ``adasum/<key>`` (`adasum.loggers.scalars`), so that
    whatever loggers the Trainer has (TensorBoard, CSV, MLflow, W&B) receive them.

    The statistics come from the hook's state of ``"ddp_adasum"`` or of an `AdasumCallback`, and from the
    `adasum.DistributedOptimizer` optimizers of ``"ddp_adasum_delta"`` (the second and later ones as
    ``adasum/optimizer_<i>/<key>``). Every rank holds the same values; reading them waits for the device
    once per logged step, and adds no collective.

    ``every_n_steps`` is an integer >= 1 (TypeError for another type, ValueError below 1).

    >>> trainer = L.Trainer(strategy="ddp_adasum", callbacks=[AdasumStatistics()])  # doctest: +SKIP
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        check_count("adasum.lightning.AdasumStatistics", "every_n_steps", every_n_steps)
        self.every_n_steps = every_n_steps

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the statistics of every source (class doc)."""
        if batch_idx % self.every_n_steps:
            return
        for prefix, source in sources(trainer):
            pl_module.log_dict(scalars(source.statistics(), prefix), on_step=True, on_epoch=False)


def sources(trainer: pl.Trainer) -> Iterator[tuple[str, HasStatistics]]:
    """(name prefix, owner of statistics) of a Trainer: the hook's state of "ddp_adasum" or of an
    `AdasumCallback`, and its `DistributedOptimizer` optimizers."""
    states = [getattr(trainer.strategy, "adasum_state", None)]
    states += [c.state for c in getattr(trainer, "callbacks", ()) if isinstance(c, AdasumCallback)]
    for state in states:
        if state is not None:
            yield PREFIX, state
    wrapped = [opt for opt in trainer.optimizers if isinstance(opt, DistributedOptimizer)]
    for i, opt in enumerate(wrapped):
        yield (PREFIX if i == 0 else f"{PREFIX}optimizer_{i}/"), opt


AdasumDDPStrategy.register_strategies(StrategyRegistry)
AdasumDeltaStrategy.register_strategies(StrategyRegistry)
