"""P data-parallel workers simulated in one process on one device.

Each step every worker computes the gradient of the same model on its own batch; all P gradients
come from one batched computation (``torch.func``: ``functional_call`` + ``grad`` + ``vmap``).
They are combined by the same reducer objects the distributed path uses
(``adasum.reducers.get_reducer(name).reduce``), and SlowMo's outer step is
``adasum.slowmo.slow_momentum_update``: no method has a second implementation here.

What is combined (the names of `adasum.DistributedOptimizer`'s ``mode``):

* ``combine="gradient"``: the workers' gradients are reduced and one optimizer steps the one
  model (every real worker would hold the same model and optimizer state).
* ``combine="delta"``: every worker steps its own copy of the model with its own optimizer
  state for ``local_steps`` steps; then the model deltas ``x_i - x_0`` are reduced and every
  worker restarts from ``x_0 + reduce(deltas)`` (Horovod's ``DistributedOptimizer(op=Adasum)``
  with ``local_steps=1``, local SGD with the mean). With ``slow_momentum`` set, the restart point
  is SlowMo's outer step instead; with ``outer_optimizer`` (DiLoCo) that optimizer's step on the
  pseudo-gradients (`adasum.integrations.slowmo.pseudo_gradient`), and with ``communication_dtype``
  the deltas are rounded as the wire rounds them (`adasum.integrations.compression.compress`, with
  error feedback's residual per worker) before they are combined, and the combined result once more
  after (`adasum.integrations.compression.round_trip`, where the ranks combine on chunks).

Per-worker copies are stacked as ``[P, ...]`` tensors under one ordinary optimizer: for
elementwise optimizers (SGD, Adam, ...) that is exactly P independent optimizers. Optimizers
whose update couples the elements of a tensor (LAMB's per-tensor trust ratio) would mix the
workers, so they are refused for ``combine="delta"``.

Random streams per worker. `KeyedDropout` draws its mask from a hash of a key and each element's
index, and the key of worker ``i`` at step ``s`` is `dropout_key` ``(seed, i, s, layer)``: the
simulator's worker ``i`` and a real rank ``i`` (``adasum train`` under torchrun) drop the same
units and end with the same parameters. ``nn.Dropout`` and other random layers draw instead from
the global generator (``vmap(randomness="different")``), which one process cannot match to
P processes' generators: those give statistically equivalent, not equal, runs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from adasum.checks.nonfinite import NonFinite, check_policy, decide_nonfinite
from adasum.diagnostics import Orthogonality, orthogonality_stacked
from adasum.integrations.compression import chunked, compress, dequantize, round_trip
from adasum.integrations.compression import communication_dtype as wire_dtype
from adasum.integrations.slowmo import check_slow_options, outer_description, pseudo_gradient, slow_momentum_update
from adasum.integrations.streaming import fragment_bounds, sync_offsets
from adasum.options import Mode, Nonfinite, check_count, check_option, check_saved_settings
from adasum.reducers import Reducer, get_reducer

# Optimizers whose update of each element depends only on that element's history: over a
# [P, ...] stack they are P independent optimizers.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
)



def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: [B, C] logits with [B] targets, or [B, T, C] with [B, T]."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2**32), elementwise (products stay below 2**63)."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


class KeyedDropout(nn.Module):
    """Dropout whose mask is a function of the `key` buffer and each element's index (a counter-based
    hash), so that a simulated worker and a real process with the same key drop the same units.
    With `channels` whole channels are dropped (``nn.Dropout1d``/``nn.Dropout2d``: one draw per
    sample and channel of a [B, C, ...] input).

    The key is set before each step by `SimulatedWorkers` (one per worker, batched) and by
    `set_dropout_keys` in a real worker (``dropout_key(seed, rank, step, layer)``). Identity in eval mode.

    >>> layer = KeyedDropout(0.5).train()
    >>> torch.equal(layer(torch.ones(8)), layer(torch.ones(8)))  # the same key, the same mask
    True
    """

    key: torch.Tensor  # a buffer: the layer's key (int64)

    def __init__(self, p: float = 0.5, channels: bool = False) -> None:
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}; pass p= a number in [0, 1), e.g. 0.5")
        self.p, self.channels = p, channels
        self.register_buffer("key", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` times the layer's keyed mask, scaled by 1 / (1 - p) (training), else `x`."""
        if not self.training or self.p == 0:
            return x
        shape = (*x.shape[:2], *([1] * (x.dim() - 2))) if self.channels else x.shape
        index = torch.arange(math.prod(shape), device=x.device, dtype=torch.int64).reshape(shape)
        bits = _hash32((_hash32(self.key & _MASK32) + index) & _MASK32)
        keep = (bits.to(torch.float64) / 2**32 >= self.p).to(x.dtype)
        return x * keep / (1 - self.p)


def dropout_key(seed: int, worker: int, step: int, layer: int) -> int:
    """The key of `layer` (its index among the model's `KeyedDropout` layers) for `worker` at `step`."""
    digest = hashlib.blake2b(f"{seed}/{worker}/{step}/{layer}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def keyed_dropouts(model: nn.Module) -> list[tuple[str, KeyedDropout]]:
    """The `KeyedDropout` layers of `model` with their names, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, KeyedDropout)]


def set_dropout_keys(model: nn.Module, seed: int, worker: int, step: int) -> None:
    """Set every `KeyedDropout` of `model` to `worker`'s key at `step` (a real worker, before its forward)."""
    with torch.no_grad():
        for layer, (_, m) in enumerate(keyed_dropouts(model)):
            m.key.fill_(dropout_key(seed, worker, step, layer))


def _worker_keys(
    layers: Sequence[tuple[str, KeyedDropout]], seed: int, workers: Iterable[int], step: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """{buffer name: [P] keys} of every keyed layer at `step`, for the batched forward."""
    workers = list(workers)
    return {
        f"{name}.key" if name else "key": torch.tensor(
            [dropout_key(seed, w, step, layer) for w in workers], dtype=torch.int64, device=device
        )
        for layer, (name, _) in enumerate(layers)
    }


@dataclass(frozen=True)
class StepResult:
    """What one simulated step reports: each worker's loss ([P]) and the gradients' orthogonality."""

    losses: torch.Tensor
    orthogonality: Orthogonality | None


class SimulatedWorkers:
    """`workers` data-parallel copies of `model`, trained in one process.

    `optimizer` builds the optimizer from a list of tensors: the model's parameters for
    ``combine="gradient"``, the stacked per-worker parameters for ``combine="delta"``.
    `module` always holds the model the workers agree on (for evaluation and checkpoints).
    `reducer` is "mean" by default (plain data parallelism, the baseline a simulation compares against), where
    `adasum.DistributedOptimizer`, `adasum.ddp.AdasumState` and `adasum.fsdp.enable` default to "adasum": pass
    ``reducer="adasum"`` to simulate those.
    `chunk_size` bounds how many workers' backward passes run at once (memory).
    `nonfinite` ("propagate" by default, "raise", "skip"): what a NaN/Inf in any worker's gradients
    does, decided before any worker steps (`adasum.checks.nonfinite.decide_nonfinite`, with
    workers in place of ranks); skipped steps are counted in ``skipped_steps``.
    `seed` keys the workers' `KeyedDropout` masks (``dropout_key(seed, worker, step, layer)``).
    `local_steps`, `slow_lr` and `slow_momentum` follow `adasum.SlowMo`'s rules
    (`adasum.integrations.slowmo.check_slow_options`); `slow_momentum=None` (default) takes no slow
    step, and a `slow_lr` other than 1.0 without it raises ValueError (it would have no effect).

    >>> _ = torch.manual_seed(0)
    >>> sim = SimulatedWorkers(torch.nn.Linear(4, 3), 8, lambda ps: torch.optim.SGD(ps, lr=0.5), reducer="adasum")
    >>> x, y = torch.randn(8, 16, 4), torch.randint(0, 3, (8, 16))   # inputs [8, B, ...], targets [8, B]
    >>> [round(sim.step(x, y).losses.mean().item(), 3) for _ in range(3)]   # the workers' mean loss
    [1.222, 1.088, 1.05]
    """

    def __init__(
        self,
        model: nn.Module,
        workers: int,
        optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        *,
        reducer: str | Reducer = "mean",
        combine: Mode = "gradient",
        local_steps: int = 1,
        slow_momentum: float | None = None,
        slow_lr: float = 1.0,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy,
        chunk_size: int | None = None,
        diagnostics: bool = True,
        nonfinite: Nonfinite = "propagate",
        seed: int = 0,
        outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        communication_dtype: Any = None,
        error_feedback: bool = False,
        fragments: int = 1,
        delay: int = 0,
        mixing: float = 1.0,
    ) -> None:
        operation = "adasum.SimulatedWorkers"
        check_policy(nonfinite)
        check_count(operation, "workers", workers)
        check_option("combine", combine, Mode)
        check_slow_options(operation, local_steps, slow_lr, slow_momentum)  # SlowMo's rules
        if combine == "gradient" and (local_steps != 1 or slow_momentum is not None):
            raise ValueError(
                f"{operation}: local_steps and slow_momentum need combine='delta'; pass combine='delta' (or "
                "leave local_steps and slow_momentum out)"
            )
        if slow_momentum is None and slow_lr != 1.0:
            raise ValueError(
                f"{operation}: slow_lr={slow_lr!r} needs slow_momentum (SlowMo's outer step, combine='delta'); "
                "without it every worker restarts from the combined model, as slow_lr=1.0 with slow_momentum=0.0 does; "
                "pass slow_momentum= too (0.0 for none) or leave slow_lr out"
            )
        self.communication_dtype = wire_dtype(communication_dtype, operation)
        if (outer_optimizer is not None or self.communication_dtype is not None) and combine != "delta":
            raise ValueError(
                f"{operation}: outer_optimizer and communication_dtype need combine='delta'; pass combine='delta' (or "
                "leave outer_optimizer and communication_dtype out)"
            )
        if outer_optimizer is not None and slow_momentum is not None:
            raise ValueError(f"{operation}: give either slow_momentum (SlowMo's outer step) or outer_optimizer")
        if error_feedback and self.communication_dtype is None:
            raise ValueError(
                f"{operation}: error_feedback=True needs a communication_dtype (bf16, fp16 or fp8); pass "
                "communication_dtype= too, or drop error_feedback"
            )
        self.error_feedback = bool(error_feedback)
        self.streaming = fragments > 1 or delay > 0 or mixing != 1.0
        if self.streaming and outer_optimizer is None:
            raise ValueError(f"{operation}: fragments, delay and mixing are Streaming DiLoCo's: give outer_optimizer")
        if self.streaming and not (fragments <= local_steps and 0 <= delay < local_steps and 0 < mixing <= 1):
            raise ValueError(
                f"{operation}: streaming needs fragments <= local_steps, 0 <= delay < local_steps and mixing in "
                f"(0, 1], got fragments={fragments}, delay={delay}, mixing={mixing} with local_steps={local_steps}; "
                "change the one out of range"
            )
        self.fragments, self.delay, self.mixing = fragments, delay, float(mixing)
        if chunk_size is not None:
            check_count(operation, "chunk_size", chunk_size)
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                raise ValueError(
                    "BatchNorm with running statistics cannot be simulated (its buffers would be "
                    "updated by all workers at once); use GroupNorm or LayerNorm"
                )
        self.module = model
        self.workers = workers
        self.reducer = get_reducer(reducer)
        self.combine = combine
        self.local_steps = local_steps
        self.slow_momentum = slow_momentum
        self.slow_lr = slow_lr
        self.loss_fn = loss_fn
        self.chunk_size = chunk_size
        self.diagnostics = diagnostics
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.steps = 0
        self.draws = 0  # steps begun, skipped ones included: the dropout keys' step
        self.seed = seed
        self._keyed = keyed_dropouts(model)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = dict(model.named_parameters())
        self._anchor: list[torch.Tensor] = [params[n] for n in self.names]
        if combine == "gradient":
            self.stacked: list[torch.Tensor] | None = None
            self.optimizer = optimizer(self._anchor)
        else:
            self.stacked = [
                p.detach().unsqueeze(0).repeat(workers, *([1] * p.dim())).requires_grad_(True)
                for p in self._anchor
            ]
            self.optimizer = optimizer(self.stacked)
            if not isinstance(self.optimizer, ELEMENTWISE_OPTIMIZERS):
                raise ValueError(
                    f"{type(self.optimizer).__name__} is not elementwise (e.g. LAMB's per-tensor trust "
                    "ratio): over stacked per-worker parameters it would mix the workers; use it with "
                    "combine='gradient' or run real workers"
                )
        self.momentum_buffers = (
            [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self._anchor]
            if slow_momentum is not None
            else []
        )
        # DiLoCo: the outer optimizer steps the model the workers agree on, with the pseudo-gradients as gradients
        self.outer_optimizer = outer_optimizer(self._anchor) if outer_optimizer is not None else None
        self.residuals: dict[int, torch.Tensor] = {}  # error feedback: per tensor index, [P, ...] float32
        self.output_residuals: dict[int, torch.Tensor] = {}  # and of the combined result's rounding, per tensor
        # Streaming DiLoCo: the fragments (as `adasum.SlowMo` cuts them) and those in flight: {k: (due, grads)}
        self.bounds = fragment_bounds([p.numel() for p in self._anchor], fragments) if self.streaming else []
        self.offsets = sync_offsets(local_steps, fragments)
        self.in_flight: dict[int, tuple[int, dict[int, torch.Tensor]]] = {}

    def _per_worker_grads(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        buffers = dict(self.module.named_buffers())
        keys = _worker_keys(self._keyed, self.seed, range(self.workers), self.draws, inputs.device)
        buffers.update(keys)
        buffer_dims = {name: 0 if name in keys else None for name in buffers}

        def loss(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
            value = self.loss_fn(functional_call(self.module, (params, buffers), (x,)), y)
            return value, value.detach()

        if self.stacked is None:
            params = {n: p.detach() for n, p in zip(self.names, self._anchor)}
            param_dims: Any = None
        else:
            params = {n: p.detach() for n, p in zip(self.names, self.stacked)}
            param_dims = 0
        batched = vmap(
            grad(loss, has_aux=True),
            in_dims=(param_dims, buffer_dims, 0, 0),
            randomness="different",
            chunk_size=self.chunk_size,
        )
        grads, losses = batched(params, buffers, inputs, targets)
        return [grads[n] for n in self.names], losses

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepResult:
        """One training step of every worker; worker i trains on ``inputs[i]``, ``targets[i]``."""
        if inputs.shape[0] != self.workers or targets.shape[0] != self.workers:
            raise ValueError(
                f"inputs and targets need the worker index first ({self.workers}), "
                f"got {tuple(inputs.shape)} and {tuple(targets.shape)}; pass one batch per worker, stacked "
                "([workers, batch, ...])"
            )
        self.module.train()
        grads, losses = self._per_worker_grads(inputs, targets)
        self.draws += 1
        diag = orthogonality_stacked(grads) if self.diagnostics and self.workers > 1 else None
        if self.nonfinite != "propagate" and decide_nonfinite(
            self.nonfinite,
            _first_nonfinite_stacked(grads, self.names),
            operation=f"simulated step {self.steps + 1}",
            what="the gradient of parameter",
            where="worker",
        ):  # skip: no worker steps, nothing is combined
            self.skipped_steps += 1
            return StepResult(losses, diag)
        if self.stacked is None:
            combined = self.reducer.reduce(_unstack(grads, self.workers))
            for p, g in zip(self._anchor, combined):
                p.grad = g
            self.optimizer.step()
        else:
            for p, g in zip(self.stacked, grads):
                p.grad = g
            self.optimizer.step()
        self.steps += 1
        if self.streaming:
            self._stream()
        elif self.stacked is not None and self.steps % self.local_steps == 0:
            self.synchronize()
        return StepResult(losses, diag)

    @torch.no_grad()
    def _stream(self) -> None:
        """Streaming DiLoCo's schedule (`adasum.integrations.streaming`): the fragments due are applied, then those
        whose turn it is start (and with no delay are applied at once)."""
        for k in sorted(k for k, (due, _) in self.in_flight.items() if due <= self.steps):
            self._apply_fragment(k)
        for k, offset in enumerate(self.offsets):
            if self.steps % self.local_steps == offset:
                indices = list(range(*self.bounds[k]))
                self.in_flight[k] = (self.steps + self.delay, self._pseudo_gradients(indices))
                if self.delay == 0:
                    self._apply_fragment(k)

    def _apply_fragment(self, k: int) -> None:
        """The outer step of fragment k, mixed into every worker's copy."""
        assert self.stacked is not None and self.outer_optimizer is not None
        _, grads = self.in_flight.pop(k)
        for i, g in grads.items():
            self._anchor[i].grad = g
        with torch.enable_grad():
            self.outer_optimizer.step()
        for i in grads:
            p = self._anchor[i]
            p.grad = None
            synced = p.detach().unsqueeze(0).expand_as(self.stacked[i])
            if self.mixing == 1.0:
                self.stacked[i].copy_(synced)
            else:
                self.stacked[i].mul_(1.0 - self.mixing).add_(synced, alpha=self.mixing)

    def _pseudo_gradients(self, indices: list[int]) -> dict[int, torch.Tensor]:
        """x_0 - R(x_i - x_0) of the tensors `indices` (through the wire's dtype where set)."""
        assert self.stacked is not None
        deltas = [self.stacked[i] - self._anchor[i] for i in indices]
        combined = self._combine_deltas(deltas, indices)
        return {i: pseudo_gradient(self._anchor[i], d, self._anchor[i].dtype) for i, d in zip(indices, combined)}

    @torch.no_grad()
    def synchronize(self) -> None:
        """Combine the workers' model deltas and restart every worker from the result."""
        assert self.stacked is not None
        if self.outer_optimizer is not None:
            self.in_flight = {-1: (self.steps, self._pseudo_gradients(list(range(len(self._anchor)))))}
            self._apply_fragment(-1)
            return
        deltas = [w - a for w, a in zip(self.stacked, self._anchor)]
        combined = self._combine_deltas(deltas, list(range(len(deltas))))
        lr = self.optimizer.param_groups[0]["lr"]
        for i, (anchor, delta) in enumerate(zip(self._anchor, combined)):
            target = anchor + delta
            if self.slow_momentum is None:
                anchor.copy_(target)
            else:
                slow_momentum_update(
                    anchor.data, target, self.momentum_buffers[i], lr, self.slow_lr, self.slow_momentum
                )
            self.stacked[i].copy_(anchor.unsqueeze(0).expand_as(self.stacked[i]))

    def _combine_deltas(self, deltas: list[torch.Tensor], indices: list[int]) -> list[torch.Tensor]:
        """The reducer's combination of the workers' deltas ([P, ...] per tensor `indices`); with
        `communication_dtype`, through the wire as `adasum.SlowMo` sends them: each worker's deltas rounded before,
        and (the chunked combine of the library's reducers, `adasum.integrations.compression.chunked`) the
        combined result rounded again after, each rounding's residual kept with error feedback."""
        if self.communication_dtype is None:
            return self.reducer.reduce(_unstack(deltas, self.workers))
        combined = self.reducer.reduce(_unstack(self._through_the_wire(deltas, indices), self.workers))
        if self.workers == 1 or not chunked(self.reducer):
            return combined
        sizes = [c.numel() for c in combined]
        values = torch.cat([c.reshape(-1).to(torch.float32) for c in combined])
        if self.error_feedback and all(i in self.output_residuals for i in indices):
            values = values + torch.cat([self.output_residuals[i].reshape(-1) for i in indices])
        sent, residual = round_trip(values, sizes, self.communication_dtype)
        if self.error_feedback:
            for i, r, c in zip(indices, residual.split(sizes), combined):
                self.output_residuals[i] = r.reshape(c.shape)
        return [v.reshape(c.shape).to(c.dtype) for v, c in zip(sent.split(sizes), combined)]

    def _through_the_wire(self, deltas: list[torch.Tensor], indices: list[int]) -> list[torch.Tensor]:
        """The workers' deltas ([P, ...] per tensor) as `adasum.SlowMo` sends them in `communication_dtype`: each
        worker's tensors end to end, plus its residual, compressed (fp8: one scale per tensor from the largest
        magnitude over every worker, as the ranks agree on it) and dequantized to float32."""
        assert self.communication_dtype is not None
        sizes = [d[0].numel() for d in deltas]
        values = torch.cat([d.reshape(self.workers, -1).to(torch.float32) for d in deltas], dim=1)  # [P, n]
        if self.error_feedback and all(i in self.residuals for i in indices):
            values = values + torch.cat([self.residuals[i].reshape(self.workers, -1) for i in indices], dim=1)
        amax = torch.stack([v.abs().max() if v.numel() else v.new_zeros(()) for v in values.split(sizes, dim=1)])
        sent = []
        for v in values:
            q, scale = compress(v, sizes, self.communication_dtype, amax)
            sent.append(dequantize(q, scale))
        received = torch.stack(sent)
        if self.error_feedback:
            for i, r, d in zip(indices, (values - received).split(sizes, dim=1), deltas):
                self.residuals[i] = r.reshape(d.shape)
        return [r.reshape(d.shape).to(d.dtype) for r, d in zip(received.split(sizes, dim=1), deltas)]

    def _settings(self) -> dict[str, Any]:
        """What a state depends on (`state_dict`'s "settings", compared by `load_state_dict`)."""
        return {
            "outer_optimizer": outer_description(self.outer_optimizer) if self.outer_optimizer is not None else None,
            "communication_dtype": str(self.communication_dtype) if self.communication_dtype is not None else None,
            "error_feedback": self.error_feedback,
            "fragments": self.fragments,
            "delay": self.delay,
            "mixing": self.mixing,
            "workers": self.workers,
            "combine": self.combine,
            "local_steps": self.local_steps,
            "slow_lr": self.slow_lr,
            "slow_momentum": self.slow_momentum,
            "reducer": repr(self.reducer),
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue: the model, the optimizer, per-worker copies, SlowMo's
        buffers, the step counter and the settings they were made with (tensors and plain values
        only: loadable with weights_only)."""
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "stacked": [p.detach().clone() for p in self.stacked] if self.stacked is not None else None,
            "momentum_buffers": [b.clone() for b in self.momentum_buffers],
            "reducer": self.reducer.state_dict(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "draws": self.draws,
            "settings": self._settings(),
            "outer": self.outer_optimizer.state_dict() if self.outer_optimizer is not None else None,
            "residuals": {i: r.clone() for i, r in self.residuals.items()},
            "output_residuals": {i: r.clone() for i, r in self.output_residuals.items()},
            "in_flight": {
                k: (due, {i: g.clone() for i, g in grads.items()}) for k, (due, grads) in self.in_flight.items()
            },
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved, into a simulator built with the same settings (``workers``,
        ``combine``, ``local_steps``, ``slow_lr``, ``slow_momentum``, the reducer): otherwise ValueError
        naming the settings that differ, and nothing is changed."""
        check_saved_settings("adasum.SimulatedWorkers.load_state_dict", "simulator", state.get("settings"),
                             self._settings())
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.stacked is not None:
            for p, saved in zip(self.stacked, state["stacked"]):
                p.copy_(saved)
        for b, saved in zip(self.momentum_buffers, state["momentum_buffers"]):
            b.copy_(saved)
        self.reducer.load_state_dict(state["reducer"])
        self.steps = int(state["steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.draws = int(state.get("draws", self.steps + self.skipped_steps))
        if self.outer_optimizer is not None and state.get("outer") is not None:
            self.outer_optimizer.load_state_dict(state["outer"])
        self.residuals = {int(i): r.clone() for i, r in dict(state.get("residuals") or {}).items()}
        self.output_residuals = {int(i): r.clone() for i, r in dict(state.get("output_residuals") or {}).items()}
        self.in_flight = {
            int(k): (int(due), {int(i): g.clone() for i, g in grads.items()})
            for k, (due, grads) in dict(state.get("in_flight") or {}).items()
        }


def _first_nonfinite_stacked(grads: Sequence[torch.Tensor], names: Sequence[str]) -> NonFinite | None:
    """The first tensor (lowest index) whose [P, ...] stack is non-finite for some worker, and the
    lowest such worker (the simulated counterpart of `adasum.find_nonfinite`)."""
    if not grads:
        return None
    finite = torch.stack([torch.isfinite(g.reshape(g.shape[0], -1)).all(1) for g in grads])  # [T, P]
    if bool(finite.all()):  # one host sync in the common case
        return None
    index, worker = (int(i) for i in (~finite).nonzero()[0])
    kind = "NaN" if bool(torch.isnan(grads[index][worker]).any()) else "Inf"
    return NonFinite(index, worker, kind, names[index])


def _unstack(stacked: Sequence[torch.Tensor], workers: int) -> list[list[torch.Tensor]]:
    """[P, ...] tensors to the reducers' layout: one list of tensors per worker (views)."""
    return [[t[i] for t in stacked] for i in range(workers)]
