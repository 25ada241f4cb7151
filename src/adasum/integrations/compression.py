r"""Compressed deltas: what crosses the network in a lower precision, combined in full precision.

For each bucket of deltas (pseudo-gradients) ``d`` of a rank, with error feedback's residual ``r`` (zeros
without it)::

    v     = d + r                                  (float32)
    s     = max_ranks(amax(v_tensor)) / FP8_MAX     (fp8 only: one scale per tensor, the same on every rank)
    q     = round_to_dtype(v / s)                   (bf16, fp16, or fp8 e4m3)
    r'    = v - s q                                 (the rounding residual, kept for the next round)
    gather q (and s) from every rank; combine the dequantized s q_i with the reducer in float32 (its dot
    products in float64), the same computation on every rank, so the ranks agree bitwise.

The combine runs in one process over the gathered copies (`adasum.reducers.Reducer.reduce`): each rank
receives P - 1 compressed copies (P n bytes of q per bucket, against about 2 n of the uncompressed
all-reduce's parameter dtype), which pays off for the few replicas over slow links that local-step methods
(SlowMo, DiLoCo) serve. `quantize` and `dequantize` are the math, used by the simulator too;
`CompressedCombine` is the distributed form.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from adasum.reducers import Reducer
from adasum.transport.errors import failures_named

FP8 = getattr(torch, "float8_e4m3fn", None)
"""torch's float8 e4m3 dtype where this torch has it (None otherwise)."""

FP8_MAX = 448.0
"""The largest finite float8 e4m3fn value: the per-tensor scale maps each tensor's largest magnitude to it."""

NAMES: Mapping[str, torch.dtype | None] = MappingProxyType({
    "none": None,
    "fp32": None,
    "float32": None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    **({"fp8": FP8, "float8": FP8, "float8_e4m3fn": FP8, "e4m3": FP8} if FP8 is not None else {}),
})
"""The names a communication dtype may be given by (Horovod's ``Compression.none`` / ``.fp16`` among them)."""

_HOROVOD: Mapping[str, torch.dtype | None] = MappingProxyType(
    {"NoneCompressor": None, "FP16Compressor": torch.float16}  # hvd.Compression's classes, by name
)


def communication_dtype(value: Any, operation: str, option: str = "communication_dtype") -> torch.dtype | None:
    """The dtype `value` names: None (no compression: the deltas travel in their own dtype), a torch dtype
    (bfloat16, float16, float8_e4m3fn where torch has it), one of `NAMES`, or Horovod's ``hvd.Compression.none``
    / ``hvd.Compression.fp16`` (recognised by their class names, without importing Horovod). TypeError or
    ValueError otherwise, naming the choices.

    >>> communication_dtype("bf16", "adasum.SlowMo"), communication_dtype(torch.float16, "adasum.SlowMo")
    (torch.bfloat16, torch.float16)
    >>> communication_dtype("int8", "adasum.SlowMo")
    Traceback (most recent call last):
    ValueError: adasum.SlowMo: communication_dtype must be None, a torch dtype or one of [...], got 'int8'
    """
    if value is None:
        return None
    name = getattr(value, "__name__", None)
    if isinstance(name, str) and name in _HOROVOD:
        return _HOROVOD[name]
    choices = sorted(NAMES)
    if isinstance(value, str):
        if value.lower() not in NAMES:
            raise ValueError(f"{operation}: {option} must be None, a torch dtype or one of {choices}, got {value!r}")
        return NAMES[value.lower()]
    if isinstance(value, torch.dtype):
        allowed = {d for d in NAMES.values() if d is not None}
        if value in (torch.float32, torch.float64):
            return None
        if value not in allowed:
            raise ValueError(
                f"{operation}: {option} {value} is not one of the communication dtypes "
                f"{sorted(str(d) for d in allowed)}"
            )
        return value
    kind = type(value).__name__
    raise TypeError(f"{operation}: {option} must be None, a torch dtype or one of {choices}, got {kind}")


def quantize(values: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """`values` (float32) rounded to `dtype`; for fp8 divided by `scale` (one per tensor, broadcast) first.

    >>> quantize(torch.tensor([1.0, 1.0 + 2**-10]), torch.bfloat16)
    tensor([1., 1.], dtype=torch.bfloat16)
    """
    if scale is not None:
        values = values / scale
    return values.to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """`q` as float32, times `scale` where given (fp8)."""
    values = q.to(torch.float32)
    return values * scale if scale is not None else values


def scales(amax: torch.Tensor) -> torch.Tensor:
    """The fp8 per-tensor scales from the tensors' largest magnitudes (agreed across ranks): amax / FP8_MAX, 1 for
    an all-zero tensor (no division by zero)."""
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def tensor_amax(flat: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The largest magnitude of each tensor of `flat` (float32; 0 for an empty tensor)."""
    return torch.stack([p.abs().max() if p.numel() else p.new_zeros(()) for p in flat.split(sizes)]).float()


def per_element(values: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """One value per tensor spread over its elements (the scales, for a flat buffer)."""
    return torch.repeat_interleave(values, torch.tensor(sizes, device=values.device))


def compress(
    values: torch.Tensor, sizes: list[int], dtype: torch.dtype, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One worker's flat float32 `values` (tensors of `sizes` end to end) in `dtype`: ``(q, scale)``, the scale
    per element for fp8 (from `amax`, each tensor's largest magnitude over every worker), None otherwise. The
    residual of error feedback is ``values - dequantize(q, scale)``.

    >>> q, scale = compress(torch.tensor([896.0, 1.0]), [1, 1], FP8, torch.tensor([896.0, 1.0]))
    >>> dequantize(q, scale)
    tensor([896.,   1.])
    """
    scale = per_element(scales(amax), sizes) if dtype == FP8 and amax is not None else None
    return quantize(values, dtype, scale), scale


class CompressedCombine:
    """Combine one bucket's flat deltas across ranks with `reducer`, sending them in `dtype` (module doc).

    Args:
        reducer: the combine (its one-process form, `Reducer.reduce`, over the gathered copies).
        dtype: the communication dtype (`communication_dtype`): bfloat16, float16 or float8 e4m3.
        group: the process group.
        error_feedback: keep each bucket's rounding residual and add it to the next round's deltas.
        operation: names failures.

    Call it as the delta combiner's combine function (``combine(flat, sizes, number)``); ``residuals`` holds the
    error feedback's residuals per bucket (per-rank state, for checkpoints).
    """

    def __init__(
        self,
        reducer: Reducer,
        dtype: torch.dtype,
        group: dist.ProcessGroup | None,
        error_feedback: bool = False,
        operation: str = "adasum",
    ) -> None:
        self.reducer = reducer
        self.dtype = dtype
        self.group = group
        self.error_feedback = error_feedback
        self.operation = operation
        self.residuals: dict[int, torch.Tensor] = {}

    def __call__(self, flat: torch.Tensor, sizes: list[int], number: int = 0) -> None:
        """Combine bucket `number`'s flat deltas (tensors of `sizes`) in place, the same result on every rank."""
        values = flat.to(torch.float32)
        residual = self.residuals.get(number)
        if self.error_feedback and residual is not None and residual.shape == values.shape:
            values = values + residual.to(values.device)
        world = dist.get_world_size(self.group)
        with failures_named(self.operation, "the compressed deltas' all-gather", self.group):
            amax = None
            if self.dtype == FP8:  # one scale per tensor, the same on every rank
                amax = tensor_amax(values, sizes)
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
            q, scale = compress(values, sizes, self.dtype, amax)
            if self.error_feedback:
                self.residuals[number] = values - dequantize(q, scale)
            wire = q.view(torch.uint8)  # the bits travel as bytes (gloo has no bf16 or fp8 all-gather)
            gathered = [torch.empty_like(wire) for _ in range(world)]
            dist.all_gather(gathered, wire, group=self.group)
        copies = [dequantize(g.view(self.dtype), scale) for g in gathered]
        per_worker = [list(c.split(sizes)) for c in copies]
        combined = self.reducer.reduce(per_worker)
        flat.copy_(torch.cat([c.reshape(-1) for c in combined]) if combined else flat)

    def state_dict(self) -> dict[str, Any]:
        """The error feedback's residuals (this rank's own)."""
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.residuals = {int(k): v.clone() for k, v in state.get("residuals", {}).items()}

