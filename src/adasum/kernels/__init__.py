"""The per-tensor math on flat buffers, behind one dispatch: Triton kernels on GPUs when Triton
imports (`adasum.kernels.triton`), batched torch ops on other devices (`adasum.kernels.torch_ops`),
cache-blocked float64 BLAS on the CPU (`adasum.kernels.cpu`). All three compute the same sums and
combinations in float64; callers never pick one.

Names: a layout's `sizes` are its tensors' element counts (the public APIs take these); the kernels
take `lengths`, the element counts of the consecutive segments of one flat slice, which are the
parts of those tensors that the slice holds (whole tensors only when the slice is the whole buffer).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from adasum.core.gram import pair_ops, weights
from adasum.core.layout import Scattered
from adasum.core.operator import pair_coefficients
from adasum.core.tree import Tree
from adasum.kernels import cpu, torch_ops
from adasum.kernels.addresses import AddressTables, tile_addresses


def _triton(device: torch.device):
    """The Triton kernels module for `device`, or None. Imported on first use on a GPU only: a
    process that loaded Triton's native library and exits while gloo's threads still run (no
    ``destroy_process_group``) aborts at exit now and then ("terminate called without an active
    exception"), so CPU processes must never load it."""
    if device.type != "cuda":
        return None
    from adasum.kernels import triton as triton_kernels

    return triton_kernels if triton_kernels.available(device) else None


def dot_and_norms(
    a: torch.Tensor, b: torch.Tensor, lengths: Sequence[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-segment ``<a,b>``, ``|a|^2``, ``|b|^2`` of two flat tensors, in float64, as a [3, T] tensor.

    `lengths` splits the flat tensors into T consecutive segments (zero lengths allowed); their sum
    is ``a.numel()``. Everything is computed in float64. On the CPU, chunks of both inputs are cast
    into a cached 2 x chunk float64 block whose Gram matrix (one BLAS call) gives all three sums;
    on GPUs Triton kernels (or, without Triton, a few batched torch kernels) serve all segments
    together, with no host synchronisation. With `out` ([3, T] float64), the sums are added into it.
    """
    triton_kernels = _triton(a.device)
    if triton_kernels is not None:
        return triton_kernels.dot_and_norms(a, b, lengths, out)
    sums = torch_ops.dot_and_norms(a, b, lengths) if a.device.type != "cpu" else cpu.dot_and_norms(a, b, lengths)
    if out is None:
        return sums
    return out.add_(sums)


def gram(rows: Sequence[torch.Tensor], lengths: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """Per segment the Gram matrix ``<row_i, row_j>`` of P flat tensors of one dtype (`lengths` as in
    `dot_and_norms`), in float64, as a [P, P, T] tensor; with `out` the sums are added into it. Triton kernels on
    GPUs (up to `adasum.kernels.triton.MAX_ROWS` rows), cached float64 blocks and BLAS on the CPU."""
    triton_kernels = _triton(rows[0].device)
    if triton_kernels is not None and len(rows) <= triton_kernels.MAX_ROWS:
        return triton_kernels.gram(rows, lengths, out)
    sums = cpu.gram(rows, lengths) if rows[0].device.type == "cpu" else torch_ops.gram(rows, lengths)
    return sums if out is None else out.add_(sums)


def tree_weights(gram_sums: torch.Tensor, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
    """`adasum.core.gram.weights` of `tree` from the [P, P, T] float64 Gram sums: (the root's weights [P, T], every
    pair's sums [P - 1, 3, T]). One Triton kernel on GPUs, torch ops elsewhere."""
    triton_kernels = _triton(gram_sums.device)
    if triton_kernels is not None and tree.workers <= triton_kernels.MAX_ROWS:
        return triton_kernels.tree_weights(gram_sums, pair_ops(tree))
    return weights(gram_sums, tree)


def weighted_sum(
    rows: Sequence[torch.Tensor], row_weights: torch.Tensor, lengths: Sequence[int], out, *more_outs: torch.Tensor
) -> None:
    """``out = sum_j row_weights[j] rows[j]`` per segment (`row_weights` [P, T] float64), computed in float64 and
    written in out's dtype; `out` may be one of the rows. `more_outs` (at most three) receive the same values (in
    the same pass with Triton, where `out` may also be `adasum.kernels.addresses.TileAddresses`)."""
    like = rows[0]
    triton_kernels = _triton(like.device)
    if triton_kernels is not None and len(rows) <= triton_kernels.MAX_ROWS:
        triton_kernels.weighted_sum(rows, row_weights, lengths, out, *more_outs)
        return
    if like.device.type == "cpu":
        cpu.weighted_sum(rows, row_weights, lengths, out)
    else:
        torch_ops.weighted_sum(rows, row_weights, lengths, out)
    for extra in more_outs:
        extra.copy_(out)


def scale_add(
    a: torch.Tensor,
    b: torch.Tensor,
    coeff_a: torch.Tensor,
    coeff_b: torch.Tensor,
    lengths: Sequence[int],
    out: torch.Tensor,
) -> None:
    """``out = coeff_a * a + coeff_b * b`` segment by segment, computed in float64 and written in
    out's dtype. `out` may alias `a` or `b`."""
    if a.device.type != "cpu":
        torch_ops.scale_add(a, b, coeff_a, coeff_b, lengths, out)
        return
    cpu.scale_add(a, b, coeff_a, coeff_b, lengths, out)


def combine_from_sums(
    a: torch.Tensor,
    b: torch.Tensor,
    sums: torch.Tensor,
    workers_a: int | torch.Tensor,
    workers_b: int | torch.Tensor,
    lengths: Sequence[int],
    out: torch.Tensor,
    *more_outs: torch.Tensor,
) -> None:
    """``out = c_a a + c_b b`` per segment, `a` standing for `workers_a` workers and `b` for
    `workers_b` (ints, or int64 tensors with one count per segment), with (c_a, c_b) =
    ``adasum.core.operator.coefficients(sums, w_a, w_b)``: Adasum's pair, the coefficients computed inside the
    kernel (`combine_with` takes another rule's). One fused kernel on GPUs with Triton; `out` may alias `a`
    or `b`. `more_outs` (at most three) receive the same values (in the same pass with Triton).
    With Triton, `a`, `b` and `out` may be `adasum.kernels.addresses.TileAddresses` (slices of a `Scattered` buffer)."""
    like = next(x for x in (a, b, out) if isinstance(x, torch.Tensor))
    triton_kernels = _triton(like.device)
    if triton_kernels is not None:
        triton_kernels.combine(a, b, sums, workers_a, workers_b, lengths, out, *more_outs)
        return
    _combine_unfused(a, b, sums, workers_a, workers_b, lengths, out)
    for extra in more_outs:
        extra.copy_(out)


def _combine_unfused(a, b, sums, workers_a, workers_b, lengths, out) -> None:
    coeff_a, coeff_b = pair_coefficients(sums, workers_a, workers_b)
    scale_add(a, b, coeff_a, coeff_b, lengths, out)


def combine_with(
    a: torch.Tensor, b: torch.Tensor, coefficients: torch.Tensor, lengths: Sequence[int], out: torch.Tensor,
    *more_outs: torch.Tensor,
) -> None:
    """``out = c_a a + c_b b`` per segment with given coefficients (`coefficients`: [2, T] float64, rows c_a and
    c_b: a combine op's, `adasum.collectives.slices.CombineOp.pair_coefficients`), computed in float64 and written
    in out's dtype; `out` may alias `a` or `b`. `more_outs` (at most three) receive the same values. With Triton one
    kernel, the fused combine's with its coefficients read rather than computed (`adasum.kernels.triton.scale_add`),
    where `a`, `b` and `out` may be `adasum.kernels.addresses.TileAddresses`; elsewhere `scale_add`."""
    like = next(x for x in (a, b, out) if isinstance(x, torch.Tensor))
    triton_kernels = _triton(like.device)
    if triton_kernels is not None:
        triton_kernels.scale_add(a, b, coefficients, lengths, out, *more_outs)
        return
    scale_add(a, b, coefficients[0], coefficients[1], lengths, out)
    for extra in more_outs:
        extra.copy_(out)


def _in_place(tensors, like: torch.Tensor, tables: AddressTables | None):
    """(Triton kernels, the tensors' `TileAddresses`, the tensors as a list) when one kernel can read or write the
    list where it lies (a GPU with Triton, every tensor contiguous and of `like`'s dtype), else (None, None, the
    list). `tensors` is a list or a `Scattered` view of one (which a caller may keep between calls); the addresses
    come from `tables` (kept there) or are built afresh."""
    triton_kernels = _triton(like.device)
    if isinstance(tensors, Scattered):
        listed = tensors.tensors
    else:
        listed = list(tensors)
        if triton_kernels is not None and all(t.is_contiguous() and t.dtype == like.dtype for t in listed):
            tensors = Scattered(listed)
    if triton_kernels is None or not isinstance(tensors, Scattered) or tensors.dtype != like.dtype:
        return None, None, listed
    n = tensors.numel()
    return triton_kernels, tables.get(tensors, 0, n) if tables is not None else tile_addresses(tensors, 0, n), listed


def subtract_into(out: torch.Tensor, tensors, base: torch.Tensor, tables: AddressTables | None = None) -> None:
    """``out = tensors - base`` with `out` and `base` flat (the tensors end to end, each in its own shape and
    strides; a list or a `Scattered` view), rounded as ``torch.sub`` rounds: one kernel on GPUs with Triton when
    the tensors are contiguous, one op per tensor otherwise (a channels-last weight is read in its logical order).
    `tables` keeps the list's tile addresses between calls (a group's, `adasum.transport.communicator.Communicator`)."""
    triton_kernels, where, tensors = _in_place(tensors, out, tables)
    sizes = [t.numel() for t in tensors]
    if triton_kernels is not None:
        triton_kernels.add(where, base, out, sizes, subtract=True)
        return
    for t, o, b in zip(tensors, out.split(sizes), base.split(sizes)):
        torch.sub(t, b.view(t.shape), out=o.view(t.shape))


def add_into(
    tensors, base: torch.Tensor, delta: torch.Tensor, base_too: bool = False, tables: AddressTables | None = None
) -> None:
    """``tensors = base + delta`` (`base` and `delta` flat, the tensors end to end; a list or a `Scattered`
    view), rounded as ``torch.add`` rounds, and with `base_too` ``base = base + delta`` as well (the same values,
    from the same pass): one kernel on GPUs with Triton when the tensors are contiguous, one op per tensor
    otherwise. `tables` as in `subtract_into`."""
    triton_kernels, where, tensors = _in_place(tensors, base, tables)
    sizes = [t.numel() for t in tensors]
    if triton_kernels is not None:
        triton_kernels.add(base, delta, where, sizes, x_too=base_too)
        return
    for t, b, d in zip(tensors, base.split(sizes), delta.split(sizes)):
        torch.add(b.view(t.shape), d.view(t.shape), out=t)
        if base_too:
            b.view(t.shape).copy_(t)


def clear_device_caches() -> None:
    """Empty the process's caches of small device tensors the kernels read: the tile tables
    (`adasum.core.tiles.tiles`), the Triton tree kernels' pair tables and the single-process tree's segment counts
    (`adasum.kernels.reduce`), where their modules are loaded (a CPU process never loads Triton's). A CUDA graph
    that reads one keeps it (`adasum.core.keep`); `adasum.release` calls this after dropping the graphs."""
    from adasum.core import tiles

    tiles.clear_cache()
    for name in ("adasum.kernels.triton", "adasum.kernels.reduce"):
        module = sys.modules.get(name)
        if module is not None:
            module.clear_cache()
