r"""SlowMo: slow momentum over periodically combined models (Wang et al., ICLR 2020).

Every worker takes tau steps of a base optimizer (learning rate gamma_t) from the anchor
x_{t,0}; then, per parameter::

    x_bar     = combine of the workers' x_{t,tau}       (exact average, or a reducer of the deltas)
    u_{t+1}   = beta u_t + (x_{t,0} - x_bar) / gamma_t   (slow momentum buffer)
    x_{t+1,0} = x_{t,0} - alpha gamma_t u_{t+1}          (every worker restarts here)

alpha = 1, beta = 0 is local SGD (periodic averaging); one worker with beta = 0 is Lookahead.

DiLoCo (Douillard et al. 2023) takes any outer optimizer over the pseudo-gradients::

    Delta_t   = x_{t,0} - x_bar = -(combine of the deltas x_i - x_{t,0})
    x_{t+1,0} = outer_optimizer.step(x_{t,0}, gradient Delta_t)    (DiLoCo: Nesterov SGD, lr 0.7, momentum 0.9)

SlowMo's update is the outer optimizer ``SGD(lr=alpha, momentum=beta)`` on Delta_t for a constant
gamma (u = v / gamma). `slow_momentum_update` is the built-in outer step for one tensor and
`pseudo_gradient` the outer gradient (the simulator uses both); `SlowMo` wraps a torch optimizer
and runs it across a process group with any reducer.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from adasum.checks.agreement import agree, local_problem
from adasum.checks.nonfinite import apply_nonfinite_policy, check_policy
from adasum.core.statistics import StepStatistics
from adasum.integrations.compression import CompressedCombine, communication_dtype
from adasum.integrations.delta import DeltaCombiner, buckets
from adasum.integrations.optim import check_same_parameters, check_wrappable, optimizer_param_names
from adasum.integrations.streaming import Streaming, make_group
from adasum.options import Buffers, Nonfinite, check_count, check_flag, check_number, check_option, check_saved_settings
from adasum.reducers import Mean, Reducer, get_reducer
from adasum.transport.alone import warn_one_rank
from adasum.transport.errors import failures_named
from adasum.transport.groups import group_device

BUCKET_CAP_MB = 25.0
"""The largest delta slot of a sync with a per-tensor reducer, in MiB (`adasum.integrations.delta`)."""


def slow_momentum_update(
    anchor: torch.Tensor,
    combined: torch.Tensor,
    momentum: torch.Tensor,
    lr: float,
    slow_lr: float,
    slow_momentum: float,
) -> None:
    """The outer step for one parameter, in place on `anchor` (x_{t,0} -> x_{t+1,0}) and `momentum`.

    `combined` is x_bar. With ``lr == 0`` (warm-up from zero) there is no division: the momentum
    only decays (u = beta u) and the anchor moves to x_bar, so nothing becomes NaN.

    >>> anchor, momentum = torch.tensor([1.0]), torch.zeros(1)
    >>> slow_momentum_update(anchor, torch.tensor([0.8]), momentum, lr=0.1, slow_lr=1.0, slow_momentum=0.5)
    >>> anchor, momentum      # u = (1 - 0.8) / lr = 2; x = 1 - slow_lr * lr * u: x_bar
    (tensor([0.8000]), tensor([2.0000]))
    >>> slow_momentum_update(anchor, torch.tensor([0.7]), momentum, lr=0.1, slow_lr=1.0, slow_momentum=0.5)
    >>> anchor, momentum      # u = 0.5 * 2 + (0.8 - 0.7) / lr = 2: one step past x_bar
    (tensor([0.6000]), tensor([2.0000]))
    """
    if lr == 0:
        momentum.mul_(slow_momentum)
        anchor.copy_(combined)
        return
    momentum.mul_(slow_momentum).add_(anchor - combined, alpha=1.0 / lr)
    anchor.add_(momentum, alpha=-slow_lr * lr)



def pseudo_gradient(anchor: torch.Tensor, combined_delta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The outer optimizer's gradient for one parameter: ``x_{t,0} - x_bar = -combined_delta``, in `dtype`
    (the outer parameters' float32 or float64). `anchor` names the parameter it belongs to (its shape).

    >>> pseudo_gradient(torch.zeros(2), torch.tensor([0.5, -1.0]), torch.float32)
    tensor([-0.5000,  1.0000])
    """
    return combined_delta.reshape(anchor.shape).to(dtype).neg()


def diloco_outer(lr: float = 0.7, momentum: float = 0.9) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """DiLoCo's outer optimizer as a factory for ``SlowMo(outer_optimizer=...)``: Nesterov SGD (lr 0.7,
    momentum 0.9 in the paper).

    >>> diloco_outer()([torch.zeros(2)])
    SGD (
    Parameter Group 0
        dampening: 0
        differentiable: False
        foreach: None
        fused: None
        lr: 0.7
        maximize: False
        momentum: 0.9
        nesterov: True
        weight_decay: 0
    )
    """
    return functools.partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=True)


def outer_description(optimizer: torch.optim.Optimizer) -> str:
    """An outer optimizer as a state's settings record it: its class and its first group's numbers."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    numbers = {k: v for k, v in sorted(group.items()) if k != "params" and isinstance(v, (int, float, bool, tuple))}
    return f"{type(optimizer).__name__}({numbers})"


def check_slow_options(operation: str, local_steps: object, slow_lr: object, slow_momentum: object) -> None:
    """The rules of SlowMo's numbers, for `SlowMo` and the simulator alike: `local_steps` an integer >= 1,
    `slow_lr` a finite number > 0 (at 0 the anchor never moves), `slow_momentum` a number in [0, 1) (None: no
    slow step, the simulator's default). TypeError for a value of another type, ValueError out of range.

    >>> check_slow_options("adasum.SlowMo", 4, 0.0, 0.5)
    Traceback (most recent call last):
    ValueError: adasum.SlowMo: slow_lr must be a finite number > 0, got 0.0; pass slow_lr= a finite number > 0
    """
    check_count(operation, "local_steps", local_steps)
    check_number(operation, "slow_lr", slow_lr, "a finite number > 0", lambda v: 0 < v < math.inf)
    if slow_momentum is not None:
        check_number(operation, "slow_momentum", slow_momentum, "a number in [0, 1)", lambda v: 0 <= v < 1)


def _check_streaming(
    operation: str, outer: object, local_steps: int, fragments: int, delay: int, buffers: str, module: object,
    nonfinite: str,
) -> None:
    """The rules of Streaming DiLoCo's options (`adasum.integrations.streaming`)."""
    if outer is None:
        raise ValueError(f"{operation}: fragments, delay and mixing are Streaming DiLoCo's: give outer_optimizer too")
    if fragments > local_steps:
        raise ValueError(
            f"{operation}: fragments={fragments} needs local_steps >= fragments, got {local_steps}; "
            "pass fewer fragments or more local_steps"
        )
    if delay >= local_steps:
        raise ValueError(
            f"{operation}: delay={delay} must be below local_steps={local_steps}; pass a delay from 0 to "
            f"{local_steps - 1}"
        )
    if buffers == "average" or module is not None or nonfinite == "skip":
        raise ValueError(
            f"{operation}: streaming fragments combine in the background; buffers='average', module= and "
            "nonfinite='skip' would need the group in the foreground at the same time: leave them out"
        )


def _outer_dtype(dtype: torch.dtype) -> torch.dtype:
    """The outer state's dtype for parameters of `dtype`: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _communication_dtype(value: Any, operation: str) -> torch.dtype | None:
    return communication_dtype(value, operation)


def _world_size(group: dist.ProcessGroup | None) -> int:
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


class SlowMo:
    """Wrap any torch optimizer (the base algorithm) with SlowMo: `local_steps` base steps, then the
    workers' models are combined and the slow momentum step is taken (module docstring).

    * ``reducer="mean"`` (default) averages the models exactly; any other reducer (one whose
      ``exact_average`` trait is False: "adasum", "adacons", "sum" or a `Reducer` object) combines
      the model deltas ``x_i - x_{t,0}`` and ``x_bar = x_{t,0} + combined delta``.
    * gamma_t is each param group's current ``lr`` at the sync; ``lr == 0`` does not divide
      (see `slow_momentum_update`).
    * ``buffers``: the base optimizer's state (momentum, Adam moments) is kept per worker
      ("local", the default, as public implementations do), cleared at each sync ("reset"), or
      averaged across workers at each sync ("average": every floating-point state tensor except
      ``step``, matched by parameter and state key, not by position). "average" needs every rank
      to hold the same state: state for the same parameters, with the same keys, shapes and
      dtypes; otherwise (say rank 0 trained branch ``a`` in the round and rank 1 branch ``b``)
      every rank raises ValueError naming the first parameter whose state differs, before
      anything is averaged (use "local" or "reset" for such models). One small all-reduce per
      sync checks this.
    * ``module``: its floating-point buffers (BatchNorm running statistics) are averaged at each
      sync; integer buffers (``num_batches_tracked``) are left alone. Their layout is checked
      across ranks at construction.
    * The base algorithm may be plain local steps or DDP-synchronised steps (a DDP-wrapped model).
    * One worker (no process group, or world size 1): nothing is communicated (every reducer is the
      identity on one worker); this is Lookahead.

    Memory: two extra copies of the parameters, the anchor ``x_{t,0}`` (flat buckets) and the slow
    momentum buffer ``u``, each in the parameter's dtype; a sync also needs the delta combiner's
    slots (`adasum.integrations.delta`: `adasum.integrations.delta.IN_FLIGHT` flat buffers of at most
    `BUCKET_CAP_MB` MiB, kept between syncs; a whole-model reducer such as AdaCons one bucket per
    dtype, the whole model). A model converted after
    construction (``model.double()``, ``model.to(device)``) is followed: each sync first moves the
    anchor and ``u`` to the parameters' dtypes and devices.

    The workers' models must be identical when SlowMo is constructed (DDP ensures this; otherwise
    broadcast them first); the anchor is taken then. With ``check=True`` (default) construction
    checks it (shapes, dtypes and exact values, two small all-reduces) and raises ValueError on
    every rank naming the first differing parameter.

    ``nonfinite``: at each sync, before anything is combined, every rank's local model is checked
    for NaN/Inf (one 8-byte all-reduce per sync, decided identically on every rank). "raise"
    (default): `adasum.NonFiniteError` on every rank naming the parameter (its name when the base
    optimizer was given ``model.named_parameters()``) and the rank. "skip": the round is discarded
    on every rank (every worker restarts from the anchor; slow momentum, anchor and the other
    ranks' state untouched; base-optimizer state holding a NaN/Inf is dropped on the rank that has
    it) and counted in ``skipped_steps`` (the steps whose sync was skipped). "propagate": nothing
    is checked. The default differs from
    `DistributedOptimizer`'s "propagate" on purpose: there the check costs a host
    synchronisation on every step; here one per sync, amortised over `local_steps` steps, and a
    non-finite model averaged into every rank would poison the anchor and the slow momentum.

    ``outer_optimizer``: a factory of any torch optimizer (``params -> Optimizer``) that takes the
    outer step instead of the slow momentum: it steps float32 copies of the anchor (float64 for
    float64 parameters) with the pseudo-gradient ``x_{t,0} - x_bar`` as their gradient
    (`pseudo_gradient`), and every worker restarts from the result; `diloco_outer` is DiLoCo's
    Nesterov SGD. ``slow_lr``/``slow_momentum`` then stay at their defaults (ValueError otherwise).
    ``communication_dtype`` (None, "bf16", "fp16", "fp8" or a torch dtype) sends the deltas in that
    dtype, as compressed chunks combined in float32 on their owners and all-gathered compressed again
    (`adasum.integrations.compression`), and ``error_feedback=True`` adds each round's rounding residuals
    to the next round's (the deltas' before the combine, the combined chunk's after it).
    ``fragments``, ``delay`` and ``mixing`` (with an outer optimizer) are Streaming DiLoCo's: the
    parameters split into fragments synced at staggered steps, each combined on a background thread
    and applied ``delay`` inner steps later, mixed into the local weights
    (`adasum.integrations.streaming`).

    Learning-rate schedulers take the base optimizer (``param_groups`` is shared).
    ``state_dict()`` carries the base optimizer's state, the anchor, the slow momentum, the step
    counter, the reducer's state and the settings; together with the model's own state dict, a run
    resumed from any step continues exactly as if never stopped. It loads only into a SlowMo with
    the same ``local_steps``, ``slow_lr``, ``slow_momentum``, ``buffers``, reducer, outer optimizer
    (its class and numbers), ``communication_dtype`` and ``error_feedback``: otherwise
    ValueError naming the settings that differ, and nothing changes.

    ``local_steps`` is an integer >= 1, ``slow_lr`` a finite number > 0 (at 0 the anchor would never
    move), ``slow_momentum`` a number in [0, 1) (`check_slow_options`, which the simulator applies
    too). The optimizer is a torch optimizer, not an adasum wrapper: an `adasum.DistributedOptimizer`
    (TypeError) would combine every step a second time.

    >>> model = torch.nn.Linear(4, 1)
    >>> opt = adasum.SlowMo(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    ...                     local_steps=12, slow_lr=1.0, slow_momentum=0.5)
    >>> loss = model(torch.randn(8, 4)).pow(2).mean()
    >>> loss.backward(); opt.step(); opt.zero_grad()     # (one process, as here: no process group needed)
    """

    combines_across_ranks = True  # another wrapper refuses to wrap it (`adasum.integrations.optim.check_wrappable`)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        local_steps: int,
        slow_lr: float = 1.0,
        slow_momentum: float = 0.0,
        reducer: str | Reducer = "mean",
        buffers: Buffers = "local",
        group: dist.ProcessGroup | None = None,
        module: torch.nn.Module | None = None,
        nonfinite: Nonfinite = "raise",
        check: bool = True,
        outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        communication_dtype: Any = None,
        error_feedback: bool = False,
        fragments: int = 1,
        delay: int = 0,
        mixing: float = 1.0,
    ) -> None:
        operation = "adasum.SlowMo"
        check_policy(nonfinite)
        check_wrappable(optimizer, operation)
        check_slow_options(operation, local_steps, slow_lr, slow_momentum)
        check_option("buffers", buffers, Buffers)
        check_flag(operation, "check", check)
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"module must be a torch.nn.Module, got {type(module).__name__}; pass the model or leave module= out"
            )
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise TypeError(
                f"{operation}: outer_optimizer must be a factory of a torch optimizer (params -> Optimizer), got "
                f"{type(outer_optimizer).__name__}; pass one such as adasum.diloco_outer() or "
                "functools.partial(torch.optim.SGD, lr=0.7)"
            )
        if outer_optimizer is not None and (slow_lr != 1.0 or slow_momentum != 0.0):
            raise ValueError(
                f"{operation}: slow_lr and slow_momentum are the built-in outer step's; with outer_optimizer= give "
                "the outer learning rate and momentum to that optimizer (SGD(lr=alpha, momentum=beta) is SlowMo's step)"
            )
        check_count(operation, "fragments", fragments)
        check_number(operation, "delay", delay, "an integer in [0, local_steps)", lambda v: v == int(v) and v >= 0)
        check_number(operation, "mixing", mixing, "a number in (0, 1]", lambda v: 0 < v <= 1)
        streaming = fragments > 1 or delay > 0 or mixing != 1.0
        if streaming:
            _check_streaming(operation, outer_optimizer, local_steps, fragments, delay, buffers, module, nonfinite)
        compress = _communication_dtype(communication_dtype, operation)
        check_flag(operation, "error_feedback", error_feedback)
        if error_feedback and compress is None:
            raise ValueError(
                f"{operation}: error_feedback=True needs a communication_dtype (bf16, fp16 or fp8); pass "
                "communication_dtype= too, or drop error_feedback"
            )
        self.communication_dtype = compress
        self.error_feedback = error_feedback
        self.optimizer = optimizer
        self.local_steps = local_steps
        self.slow_lr = float(slow_lr)
        self.slow_momentum = float(slow_momentum)
        self.reducer = get_reducer(reducer)
        self.buffers = buffers
        self.group = group
        self.module = module
        self.nonfinite = nonfinite
        self.skipped_steps = 0  # steps whose sync was skipped (the round discarded) under nonfinite="skip"
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        if len({id(p) for p in self._params}) != len(self._params):
            raise ValueError(
                "a parameter appears more than once in the optimizer's param_groups; build the optimizer with each "
                "parameter in one group, once"
            )
        if check and _world_size(group) > 1:
            with torch.no_grad():
                check_same_parameters(self._params, group, optimizer_param_names(optimizer), operation="adasum.SlowMo")
                if module is not None:  # the buffers averaged at each sync: a fixed layout, checked once
                    self._agree("module buffers", self._buffer_layout(), None)
        self._step = 0
        self._statistics = StepStatistics()  # the last sync's records (`statistics`)
        cap = int(BUCKET_CAP_MB * 2**20) if self.reducer.per_tensor else None
        # the anchor x_{t,0} (flat buckets), the delta slots and the pipeline (`adasum.integrations.delta`)
        self._deltas = DeltaCombiner(self.reducer, group, cap, self._statistics)
        self._compressed = (
            CompressedCombine(self.reducer, compress, group, error_feedback, "adasum.SlowMo.sync")
            if compress is not None
            else None
        )
        with torch.no_grad():
            self._deltas.save(self._params)
            self._momentum = [torch.zeros_like(p) for p in self._params]
            # the outer optimizer's parameters: the anchor in float32 (float64 for float64 parameters)
            self._outer_params = [a.to(_outer_dtype(a.dtype), copy=True) for a in self._anchor]
        self.outer_optimizer: torch.optim.Optimizer | None = None
        if outer_optimizer is not None:
            self.outer_optimizer = outer_optimizer(self._outer_params)
            if not isinstance(self.outer_optimizer, torch.optim.Optimizer):
                raise TypeError(
                    f"{operation}: outer_optimizer returned {type(self.outer_optimizer).__name__}, not a torch "
                    "optimizer; pass a factory that returns a torch.optim.Optimizer, such as adasum.diloco_outer()"
                )
        self.fragments, self.delay, self.mixing = int(fragments), int(delay), float(mixing)
        self._streaming: Streaming | None = None
        if streaming:
            assert self.outer_optimizer is not None
            stream_group = make_group(group)  # the background combinations' own group
            stream_compressed = (
                CompressedCombine(self.reducer, compress, stream_group, error_feedback, "adasum.SlowMo.step")
                if compress is not None
                else None
            )
            self._compressed = stream_compressed
            self._streaming = Streaming(
                self._params, self._anchor, self._outer_params, self.outer_optimizer.step, self.reducer,
                stream_group, cap, stream_compressed, nonfinite,
                fragments=fragments, local_steps=local_steps, delay=delay, mixing=mixing,
            )
        warn_one_rank(group, operation)

    # -- pass-through

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The base optimizer's parameter groups (LR schedulers act on them)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The base optimizer's state."""
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The base optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- the algorithm

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One base-optimizer step; every `local_steps`-th step also combines the workers and takes
        the slow momentum step. Returns what the base step returns."""
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self._step += 1
        if self._streaming is not None:
            self._stream()
            return loss
        if self._step % self.local_steps == 0:
            self.sync()
        return loss

    def _stream(self) -> None:
        """Streaming: apply the fragments due now, then start those whose turn it is (module streaming doc)."""
        assert self._streaming is not None
        world = _world_size(self.group)
        self._streaming.finish_due(self._step)
        for k in self._streaming.due_to_start(self._step):
            self._streaming.start(k, self._step, world)
            if self.delay == 0:
                self._streaming.finish(k)
        self._statistics.finish_step()

    @torch.no_grad()
    def sync(self) -> None:
        """Combine the workers' models and take the slow momentum step now (`step` calls this
        every `local_steps` steps). Streaming: every fragment is synced now (those in flight finished)."""
        if self._streaming is not None:
            world = _world_size(self.group)
            for k in range(len(self._streaming.bounds)):
                if k not in self._streaming.in_flight:
                    self._streaming.start(k, self._step, world)
            self._streaming.finish_all()
            return
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if len(params) != len(self._params) or any(p is not q for p, q in zip(params, self._params)):
            raise ValueError(
                "the optimizer's parameters changed since SlowMo was constructed; build a new SlowMo around the "
                "optimizer after changing its param_groups"
            )
        world = _world_size(self.group)
        if world > 1:  # before anything moves: the same dtypes and shapes on every rank (a 24-byte all-reduce)
            self._deltas.check(self._params, "adasum.SlowMo.sync", optimizer_param_names(self.optimizer))
        self._follow_parameters()
        if self._nonfinite_round():
            return
        state_tensors: list[torch.Tensor] = []
        if self.buffers == "average" and world > 1:  # before anything moves: the same state everywhere
            description, state_tensors = self._state_layout()
            problem = local_problem(state_tensors, group_device(self.group), in_place=False, group=self.group)
            self._agree("optimizer state entries", description, problem)
        if self.outer_optimizer is not None:
            self._outer_step(world)
        else:
            if world > 1 and self._params:
                # the layouts were checked at construction (parameters) and just now (state); the average of the
                # models, or the anchor plus the combined deltas, into the parameters (the anchor stays x_{t,0})
                self._deltas.combine(
                    self._params,
                    deltas=self._compressed is not None or not self.reducer.exact_average,
                    advance=False,
                    combine=self._compressed,
                )
            index = 0
            for group in self.optimizer.param_groups:
                lr = float(group["lr"])
                for p in group["params"]:
                    anchor, momentum = self._anchor[index], self._momentum[index]
                    slow_momentum_update(anchor, p.detach(), momentum, lr, self.slow_lr, self.slow_momentum)
                    p.detach().copy_(anchor)
                    index += 1
        if self.buffers == "reset":
            self.optimizer.state.clear()
        elif self.buffers == "average" and world > 1:
            Mean().all_reduce(state_tensors, self.group, check_layout=False)
        if self.module is not None and world > 1:
            Mean().all_reduce(self._floating_buffers(), self.group, check_layout=False)

    def _outer_step(self, world: int) -> None:
        """The outer optimizer's step on the pseudo-gradients (module doc), then every worker restarts there."""
        assert self.outer_optimizer is not None
        outer = self._outer_params
        if world > 1 and self._params:
            cuts = buckets(self._params, self._deltas.bucket_cap_bytes)

            def take(number: int, flat: torch.Tensor) -> None:
                sizes = [self._params[i].numel() for i in cuts[number]]
                for i, delta in zip(cuts[number], flat.split(sizes)):
                    outer[i].grad = pseudo_gradient(outer[i], delta, outer[i].dtype)

            self._deltas.combine(self._params, advance=False, combine=self._compressed, apply=take)
        else:  # one worker: the combination of one delta is itself
            for o, p, anchor in zip(outer, self._params, self._anchor):
                o.grad = pseudo_gradient(o, p.detach() - anchor, o.dtype)
        with torch.enable_grad():  # torch's optimizers step under their own no_grad
            self.outer_optimizer.step()
        for o, p, anchor in zip(outer, self._params, self._anchor):
            o.grad = None
            anchor.copy_(o)
            p.detach().copy_(anchor)

    def statistics(self) -> dict[str, float | int | list[float]]:
        """The last sync's statistics, identical on every rank, kept from what the reducer computes anyway (no
        collective; reading waits for the device): ``step`` (syncs that combined so far), ``skipped_steps``
        (syncs skipped under ``nonfinite="skip"``) and, for Adasum of the model deltas or AdaCons, the keys
        that `adasum.DistributedOptimizer.statistics` describes (`adasum.core.statistics`).

        >>> opt = adasum.SlowMo(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), local_steps=2)
        >>> opt.statistics()                     # nothing combined yet (and one process combines nothing)
        {'step': 0, 'skipped_steps': 0}
        """
        return {"step": self._statistics.steps, "skipped_steps": self.skipped_steps, **self._statistics.summary()}

    def last_combined(self) -> list[torch.Tensor] | None:
        """The anchor x_{t,0} (the last slow step's result, the model every worker agrees on) while
        a round of base steps is under way; None right after a sync (the parameters are the anchor).

        >>> model = torch.nn.Linear(2, 1)
        >>> opt = adasum.SlowMo(torch.optim.SGD(model.parameters(), lr=0.1), local_steps=2)
        >>> model(torch.ones(2)).sum().backward(); opt.step()    # step 1 of 2: the anchor is kept
        >>> [p.shape for p in opt.last_combined()]
        [torch.Size([1, 2]), torch.Size([1])]
        >>> model(torch.ones(2)).sum().backward(); opt.step()    # step 2: the sync
        >>> agreed = opt.last_combined() or [p for g in opt.param_groups for p in g["params"]]   # the parameters
        """
        if self._streaming is not None:  # the fragments' last synced weights
            return list(self._anchor)
        return list(self._anchor) if self._step % self.local_steps else None

    @property
    def _anchor(self) -> list[torch.Tensor]:
        """The anchor x_{t,0}, per parameter (views of the delta combiner's flat buckets)."""
        assert self._deltas.anchor is not None
        return self._deltas.anchor

    def _follow_parameters(self) -> None:
        """The anchor and the slow momentum in each parameter's dtype and device: a model converted after
        construction (``model.double()``, ``model.to(device)``) keeps its parameters and changes their dtype or
        device. ValueError for a parameter whose shape changed (its anchor no longer fits)."""
        if self._deltas.fits(self._params):
            return
        for i, (p, anchor) in enumerate(zip(self._params, self._anchor)):
            if anchor.shape != p.shape:
                raise ValueError(
                    f"adasum.SlowMo.sync: parameter {i} has shape {list(p.shape)}, its anchor {list(anchor.shape)}: "
                    "a parameter changed shape since SlowMo was constructed; build a new SlowMo after reshaping the "
                    "model"
                )
        self._deltas.move(self._params, "adasum.SlowMo.sync")
        self._momentum = [m.to(device=p.device, dtype=p.dtype) for m, p in zip(self._momentum, self._params)]

    def _nonfinite_round(self) -> bool:
        """Whether this round is discarded: a NaN/Inf in any rank's local model (checked across ranks)."""
        if not apply_nonfinite_policy(
            self.nonfinite,
            [p.detach() for p in self._params],
            self.group,
            optimizer_param_names(self.optimizer),
            operation="adasum.SlowMo.sync",
            what="parameter",
        ):
            return False
        self.skipped_steps += 1
        for p, anchor in zip(self._params, self._anchor):
            p.detach().copy_(anchor)
        for p in self._params:
            state = self.optimizer.state.get(p)
            if state and any(
                isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())
                for v in state.values()
            ):
                del self.optimizer.state[p]
        return True

    def _agree(self, what: str, description: list[tuple], problem: Any) -> None:
        """Raise the same error on every rank unless every rank has the same `description`."""
        with failures_named("adasum.SlowMo", f"the {what} check", self.group):
            agree(description, problem, self.group, what, "adasum.SlowMo")

    def _floating_buffers(self) -> list[torch.Tensor]:
        assert self.module is not None
        return [b for b in self.module.buffers() if b.is_floating_point()]

    def _buffer_layout(self) -> list[tuple]:
        return [(name, str(b.dtype).removeprefix("torch."), tuple(b.shape), b.device.type)
                for name, b in self.module.named_buffers() if b.is_floating_point()]  # type: ignore[union-attr]

    def _state_layout(self) -> tuple[list[tuple], list[torch.Tensor]]:
        """The base optimizer's floating-point state tensors except step counters, matched by
        parameter (its index and name) and state key: ``(description, tensors)``."""
        names = optimizer_param_names(self.optimizer)
        description: list[tuple] = []
        tensors: list[torch.Tensor] = []
        for i, p in enumerate(self._params):
            state = self.optimizer.state.get(p, {})
            label = f"parameter {i}" + (f" ({names[i]!r})" if names is not None else "")
            for key in sorted(state):
                value = state[key]
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    description.append((label, key, str(value.dtype).removeprefix("torch."), tuple(value.shape)))
                    tensors.append(value)
        return description, tensors

    # -- checkpoints

    def _settings(self) -> dict[str, Any]:
        """What a state depends on (`state_dict`'s "settings", compared by `load_state_dict`)."""
        return {
            "local_steps": self.local_steps,
            "slow_lr": self.slow_lr,
            "slow_momentum": self.slow_momentum,
            "buffers": self.buffers,
            "reducer": repr(self.reducer),
            "outer_optimizer": outer_description(self.outer_optimizer) if self.outer_optimizer is not None else None,
            "communication_dtype": str(self.communication_dtype) if self.communication_dtype is not None else None,
            "error_feedback": self.error_feedback,
            "fragments": self.fragments,
            "delay": self.delay,
            "mixing": self.mixing,
        }

    def state_dict(self) -> dict[str, Any]:
        """Base optimizer state, anchor, slow momentum, step counter, reducer state (references,
        as torch optimizers return them; `torch.save` copies) and the settings they were made with."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "step": self._step,
            "anchor": list(self._anchor),
            "momentum": list(self._momentum),
            "reducer": self.reducer.state_dict(),
            "skipped_steps": self.skipped_steps,
            "settings": self._settings(),
            "outer": self.outer_optimizer.state_dict() if self.outer_optimizer is not None else None,
            "outer_params": list(self._outer_params) if self.outer_optimizer is not None else None,
            "compression": self._compressed.state_dict() if self._compressed is not None else None,
            "streaming": self._streaming.state_dict() if self._streaming is not None else None,
            "world_size": _world_size(self.group),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, into a SlowMo built with the same settings (``local_steps``,
        ``slow_lr``, ``slow_momentum``, ``buffers``, the reducer): otherwise ValueError naming the settings that
        differ, and nothing is changed (the step counter places the round boundary at multiples of
        ``local_steps``; the slow momentum and the reducer's state belong to their settings)."""
        check_saved_settings("adasum.SlowMo.load_state_dict", "SlowMo", state.get("settings"), self._settings())
        for name in ("anchor", "momentum"):
            saved = state[name]
            if len(saved) != len(self._params):
                raise ValueError(
                    f"state has {len(saved)} {name} tensors, the optimizer has {len(self._params)} parameters; "
                    "load a state saved by a SlowMo over the same model"
                )
            for i, (mine, theirs) in enumerate(zip(getattr(self, f"_{name}"), saved)):
                if mine.shape != theirs.shape:
                    raise ValueError(
                        f"{name} {i}: state has shape {list(theirs.shape)}, parameter has {list(mine.shape)}; "
                        "load a state saved by a SlowMo over the same model"
                    )
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for mine, theirs in zip(self._anchor, state["anchor"]):
                mine.copy_(theirs)
            for mine, theirs in zip(self._momentum, state["momentum"]):
                mine.copy_(theirs)
        self._step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        saved_world, world = state.get("world_size"), _world_size(self.group)
        if saved_world is not None and int(saved_world) != world:  # an elastic restart (docs/faults.md)
            self._resized(state, int(saved_world), world)
            return
        self.reducer.load_state_dict(state.get("reducer", {}))
        if self.outer_optimizer is not None and state.get("outer") is not None:
            self.outer_optimizer.load_state_dict(state["outer"])
            with torch.no_grad():
                for mine, theirs in zip(self._outer_params, state["outer_params"]):
                    mine.copy_(theirs)
        if self._compressed is not None and state.get("compression") is not None:
            self._compressed.load_state_dict(state["compression"])
        if self._streaming is not None and state.get("streaming") is not None:
            self._streaming.load_state_dict(state["streaming"])

    def _resized(self, state: dict[str, Any], saved_world: int, world: int) -> None:
        """The rules of a state saved on `saved_world` ranks loaded on `world` (SPEC 3.2, docs/faults.md): the
        replicated state (anchor, slow momentum, outer optimizer and its parameters, counters) loads as saved; the
        per-rank state follows a rule, named on every rank in one warning. A round (or a streaming fragment) in
        flight is discarded: the parameters go back to its start weights (the anchor) and the step counter to the
        round's start; the reducer's cross-call state (AdaCons' per-worker momentum: one entry per rank) and error
        feedback's residuals start afresh; the base optimizer's state is the saved rank's on every rank."""
        if self.outer_optimizer is not None and state.get("outer") is not None:
            self.outer_optimizer.load_state_dict(state["outer"])
            with torch.no_grad():
                for mine, theirs in zip(self._outer_params, state["outer_params"]):
                    mine.copy_(theirs)
        notes = ["the base optimizer's state is the saved rank's on every rank"]
        in_round = self._step % self.local_steps
        streaming = dict(state.get("streaming") or {}).get("in_flight")
        if in_round or streaming:
            with torch.no_grad():
                for p, anchor in zip(self._params, self._anchor):
                    p.detach().copy_(anchor)
            self._step -= in_round
            notes.append(f"the round in flight ({in_round} of {self.local_steps} steps) restarts from its start")
        if state.get("reducer"):
            notes.append(f"{type(self.reducer).__name__}'s state (one entry per rank) starts afresh")
        if dict(state.get("compression") or {}).get("residuals"):
            notes.append("error feedback's residuals start at zero")
        warnings.warn(
            f"adasum.SlowMo.load_state_dict: the state was saved on {saved_world} ranks and loads on {world}: "
            + "; ".join(notes),
            stacklevel=3,
        )

    def __repr__(self) -> str:
        return (
            f"SlowMo({type(self.optimizer).__name__}, local_steps={self.local_steps}, slow_lr={self.slow_lr}, "
            f"slow_momentum={self.slow_momentum}, reducer={self.reducer!r}, buffers={self.buffers!r})"
        )
