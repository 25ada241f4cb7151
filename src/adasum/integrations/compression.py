r"""Compressed deltas: what crosses the network in a lower precision, combined in full precision.

For each bucket of deltas (pseudo-gradients) ``d`` of a rank, n values end to end, with error feedback's
residual ``r`` (zeros without it)::

    v     = d + r                                  (float32)
    s     = max_ranks(amax(v_tensor)) / FP8_MAX     (fp8 only: one scale per tensor, the same on every rank)
    q     = round_to_dtype(v / s)                   (bf16, fp16, or fp8 e4m3)
    r'    = v - s q                                 (the rounding residual, kept for the next round)

then, for the library's reducers (`chunked`: sum, mean, flat Adasum, AdaCons), a reduce-scatter and an all-gather
of compressed chunks. The bucket is cut into P chunks of ``c = ceil(n / P)`` positions (the last one padded), and
rank j owns chunk j:

1. **All-to-all.** Rank i sends chunk j of its ``q`` to rank j: rank j receives chunk j of every worker,
   ``c (P - 1)`` values of the wire dtype, and dequantizes them to float32 (``s q_i``).
2. **The combine on the chunk.** Sum and mean: the P copies summed in float32 (in rank order; the mean divides by
   P). Adasum and AdaCons: rank j adds its chunk's share of each tensor's Gram matrix of the P copies
   (``G_ik = <x_i, x_k>``, float64, P x P per tensor); one float64 SUM all-reduce of the ``[P, P, T]`` partial
   Grams gives every rank the whole tensors' Gram matrices, hence the same weights (`adasum.core.gram`: Adasum's
   tree of P for any P; AdaCons' consensus weights and momentum), and rank j writes its chunk of
   ``sum_i w_i x_i`` (float64, rounded once to float32).
3. **All-gather, compressed again.** The combined chunk ``y`` (plus the owner's residual ``e``) is rounded to the
   wire dtype with one scale per tensor (fp8: ``max_ranks(amax(y_tensor)) / FP8_MAX``, agreed with a MAX
   all-reduce of T values) and all-gathered; every rank dequantizes the same bytes with the same scales, so the
   ranks agree bitwise. With error feedback the owner keeps ``e' = (y + e) - s q_y`` for its chunk: the second
   rounding is fed back at the combine's output (as the first is at its input), so neither rounding's error is
   lost over rounds.

Bytes a rank receives per bucket: ``2 c (P - 1)`` values of the wire dtype, under ``2 n`` whatever P, against
``(P - 1) n`` for gathering every rank's whole bucket; plus the Gram all-reduce's ``P^2 T`` float64 values (Adasum
and AdaCons) and, for fp8, the two MAX all-reduces of T float32 scales. Another reducer (a subclass, hierarchical
Adasum) is combined in one process over the gathered copies (`adasum.reducers.Reducer.reduce`, the same inputs and
the same computation on every rank): each rank receives P - 1 whole compressed copies, and the result is not
rounded a second time.

`quantize`, `dequantize`, `compress` and `round_trip` are the math, used by the simulator too; `CompressedCombine`
is the distributed form.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from adasum.core.layout import Layout
from adasum.core.tree import Tree
from adasum.kernels import gram, tree_weights, weighted_sum
from adasum.reducers import Reducer
from adasum.reducers.adacons import AdaCons, Consensus, layout_key
from adasum.reducers.adasum import Adasum
from adasum.reducers.simple import Mean, Sum
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
    ValueError: adasum.SlowMo: communication_dtype must be None, a torch dtype or one of [...], got 'int8'; pass ...
    """
    if value is None:
        return None
    name = getattr(value, "__name__", None)
    if isinstance(name, str) and name in _HOROVOD:
        return _HOROVOD[name]
    choices = sorted(NAMES)
    if isinstance(value, str):
        if value.lower() not in NAMES:
            raise ValueError(
                f"{operation}: {option} must be None, a torch dtype or one of {choices}, got {value!r}; pass one of "
                "them (None: full precision)"
            )
        return NAMES[value.lower()]
    if isinstance(value, torch.dtype):
        allowed = {d for d in NAMES.values() if d is not None}
        if value in (torch.float32, torch.float64):
            return None
        if value not in allowed:
            raise ValueError(
                f"{operation}: {option} {value} is not one of the communication dtypes "
                f"{sorted(str(d) for d in allowed)}; pass one of them (None: full precision)"
            )
        return value
    kind = type(value).__name__
    raise TypeError(
        f"{operation}: {option} must be None, a torch dtype or one of {choices}, got {kind}; pass one of them "
        "(None: full precision)"
    )


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


def round_trip(values: torch.Tensor, sizes: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` (float32, tensors of `sizes` end to end, the same on every rank: a combined result) through the
    wire and back: ``(dequantized, residual)``, fp8 with one scale per tensor from the tensor's own largest
    magnitude. The second rounding of the chunked combine (module doc, step 3), for one process.

    >>> round_trip(torch.tensor([1.0 + 2**-10, 3.0]), [1, 1], torch.bfloat16)
    (tensor([1., 3.]), tensor([0.0010, 0.0000]))
    """
    q, scale = compress(values, sizes, dtype, tensor_amax(values, sizes) if dtype == FP8 else None)
    sent = dequantize(q, scale)
    return sent, values - sent


def chunked(reducer: Reducer) -> bool:
    """Whether `reducer` combines on chunks (module doc): the library's sum, mean, flat Adasum and AdaCons (not their
    subclasses, whose `reduce` may compute something else)."""
    if type(reducer) is Adasum:
        return not reducer.hierarchical
    return type(reducer) in (Sum, Mean, AdaCons)


class CompressedCombine:
    """Combine one bucket's flat deltas across ranks with `reducer`, sending them in `dtype` (module doc).

    Args:
        reducer: the combine: on chunks for the library's reducers (`chunked`), else its one-process form
            (`Reducer.reduce`) over the gathered copies.
        dtype: the communication dtype (`communication_dtype`): bfloat16, float16 or float8 e4m3.
        group: the process group.
        error_feedback: keep each bucket's rounding residuals (this rank's input's, and the combined chunk's it
            owns) and add them to the next round's.
        operation: names failures.

    Call it as the delta combiner's combine function (``combine(flat, sizes, number)``); ``residuals`` holds the
    error feedback's input residuals per bucket and ``chunk_residuals`` the output residuals of this rank's chunk
    (per-rank state, for checkpoints).
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
        self.chunk_residuals: dict[int, torch.Tensor] = {}

    def __call__(self, flat: torch.Tensor, sizes: list[int], number: int = 0) -> None:
        """Combine bucket `number`'s flat deltas (tensors of `sizes`) in place, the same result on every rank."""
        if flat.numel() == 0:  # the same layout on every rank: nothing to send anywhere
            return
        values = flat.to(torch.float32)
        residual = self.residuals.get(number)
        if self.error_feedback and residual is not None and residual.shape == values.shape:
            values = values + residual.to(values.device)
        world = dist.get_world_size(self.group)
        with failures_named(self.operation, "the compressed deltas' exchange", self.group):
            amax = None
            if self.dtype == FP8:  # one scale per tensor, the same on every rank
                amax = tensor_amax(values, sizes)
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
            q, scale = compress(values, sizes, self.dtype, amax)
            if self.error_feedback:
                self.residuals[number] = values - dequantize(q, scale)
            if world > 1 and chunked(self.reducer):
                combined = self._chunked(q, scale, sizes, number, world)
            else:
                combined = self._gathered(q, scale, sizes, world)
        flat.copy_(combined)

    def _gathered(self, q: torch.Tensor, scale: torch.Tensor | None, sizes: list[int], world: int) -> torch.Tensor:
        """Every rank's whole compressed bucket gathered, combined by `Reducer.reduce` in one process."""
        wire = q.view(torch.uint8)  # the bits travel as bytes (gloo has no bf16 or fp8 collectives)
        gathered = [torch.empty_like(wire) for _ in range(world)]
        dist.all_gather(gathered, wire, group=self.group)
        per_worker = [list(dequantize(g.view(self.dtype), scale).split(sizes)) for g in gathered]
        combined = self.reducer.reduce(per_worker)
        return torch.cat([c.reshape(-1) for c in combined]) if combined else q.new_zeros(0, dtype=torch.float32)

    def _chunked(
        self, q: torch.Tensor, scale: torch.Tensor | None, sizes: list[int], number: int, world: int
    ) -> torch.Tensor:
        """Module doc, steps 1-3: all-to-all of the compressed chunks, the combine on this rank's chunk, the combined
        chunks compressed again and all-gathered."""
        n, rank, group = q.numel(), dist.get_rank(self.group), self.group
        width = -(-n // world)  # ceil: every chunk as long, the last padded
        lo, hi = min(rank * width, n), min((rank + 1) * width, n)
        size = q.element_size()
        wire = torch.zeros(world * width * size, dtype=torch.uint8, device=q.device).view(self.dtype)
        wire[:n] = q
        received = torch.empty_like(wire.view(torch.uint8))
        dist.all_to_all_single(received, wire.view(torch.uint8), group=group)
        copies = received.view(self.dtype).view(world, width)[:, : hi - lo]
        rows = dequantize(copies, scale[lo:hi] if scale is not None else None).contiguous()  # [P, chunk] float32
        layout = Layout(tuple(sizes))
        first, lengths = layout.overlap(lo, hi)
        mine = self._combine_chunk(rows, sizes, first, lengths, world)
        if self.error_feedback:
            owed = self.chunk_residuals.get(number)
            if owed is not None and owed.shape == mine.shape:
                mine = mine + owed.to(mine.device)
        out_scale = None
        if self.dtype == FP8:  # one scale per tensor of the combined result, agreed: a MAX all-reduce of T values
            amax = torch.zeros(len(sizes), dtype=torch.float32, device=q.device)
            if lengths:
                pieces = mine.split(lengths)
                amax[first : first + len(lengths)] = torch.stack(
                    [p.abs().max() if p.numel() else p.new_zeros(()) for p in pieces]
                )
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
            out_scale = per_element(scales(amax), sizes)
        q_out = quantize(mine, self.dtype, out_scale[lo:hi] if out_scale is not None else None)
        if self.error_feedback:
            self.chunk_residuals[number] = mine - dequantize(q_out, out_scale[lo:hi] if out_scale is not None else None)
        send = torch.zeros(width * size, dtype=torch.uint8, device=q.device).view(self.dtype)
        send[: hi - lo] = q_out
        gathered = [torch.empty(width * size, dtype=torch.uint8, device=q.device) for _ in range(world)]
        dist.all_gather(gathered, send.view(torch.uint8), group=group)
        whole = torch.cat(gathered).view(self.dtype)[:n]
        return dequantize(whole, out_scale)

    def _combine_chunk(
        self, rows: torch.Tensor, sizes: list[int], first: int, lengths: list[int], world: int
    ) -> torch.Tensor:
        """This rank's chunk of the combination of the P dequantized copies `rows` ([P, chunk] float32): tensors
        ``first, first + 1, ...`` with `lengths` elements each in the chunk (module doc, step 2)."""
        reducer = self.reducer
        if isinstance(reducer, (Sum, Mean)):
            total = rows.sum(0)
            return total / world if isinstance(reducer, Mean) else total
        count = len(sizes)
        sums = torch.zeros((world, world, count), dtype=torch.float64, device=rows.device)
        parts = list(rows.unbind(0))
        if lengths:
            gram(parts, lengths, out=sums[:, :, first : first + len(lengths)])
        dist.all_reduce(sums, group=self.group)
        if isinstance(reducer, AdaCons):
            key = layout_key([(torch.float32, k) for k in sizes], reducer.per_tensor)
            coefficients = Consensus(reducer, key, count, world, rows.device).weights(sums, 0)
        elif reducer.per_tensor:
            coefficients = tree_weights(sums, Tree(world))[0]
        else:  # whole model: one pair of coefficients per node over all tensors (one dtype here)
            coefficients = tree_weights(sums.sum(-1, keepdim=True), Tree(world))[0].expand(world, count)
        out = torch.empty(rows.shape[1], dtype=torch.float32, device=rows.device)
        if lengths:
            weighted_sum(parts, coefficients[:, first : first + len(lengths)].contiguous(), lengths, out)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The error feedback's residuals (this rank's own: its input's per bucket, and its chunk's output's)."""
        return {
            "residuals": {k: v.clone() for k, v in self.residuals.items()},
            "chunk_residuals": {k: v.clone() for k, v in self.chunk_residuals.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (a state without ``chunk_residuals`` starts them at zero)."""
        self.residuals = {int(k): v.clone() for k, v in state.get("residuals", {}).items()}
        self.chunk_residuals = {int(k): v.clone() for k, v in state.get("chunk_residuals", {}).items()}
