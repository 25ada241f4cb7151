"""Adasum across processes on torch.distributed: vector-halving, distance-doubling (VHDD).

Bandwidth-optimal like a ring all-reduce (each rank sends 2 N (P-1)/P elements for a power of
two). For P = 2**k + r ranks, the tree of `adasum.tree` applies: ranks 2i+1 (i < r) first hand
their buffer to rank 2i, which combines the pair; the Q = 2**k group leaders then run:

1. Reduce-scatter, levels d = 1, 2, 4, ... < Q: the partner is ``group XOR d``; the current
   segment is halved, the lower group keeps the first half. Each sends the half it gives up and
   receives the partner's copy of the half it keeps. It then holds, for its slice, the vectors of
   both subtrees and computes per tensor the partial ``<a,b>``, ``|a|^2``, ``|b|^2`` over the
   slice. One all-reduce over the whole group of a float64 ``[Q/2d, 3, T]`` array (each rank
   writes only its block's row) sums the partials of the 2d ranks of each block, so every rank of
   a block gets the full dot products, computes the same coefficients and applies them to its
   slice. Slices ignore tensor boundaries.
2. Gather, levels in reverse: partners swap their slices until every leader has the whole buffer;
   then leaders send it to their folded partner.

Every element of the result is computed by exactly one rank and copied to the others, so all
ranks end with bitwise-identical tensors.

Point-to-point exchanges go through ``batch_isend_irecv`` so NCCL pairs a send with its receive.
On NCCL nothing here synchronises the host (all work is stream-ordered on the current stream);
on gloo the exchanges block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from adasum import ops
from adasum.layout import Layout, check_same_layout, flatten, group_by_dtype, unflatten_into
from adasum.tree import Tree


class _Workspace:
    """Reusable host buffers. Large fresh CPU allocations are returned to the OS on free and
    page-fault anew on every call (about as slow as the data exchange itself), so the CPU path keeps
    its fusion and receive buffers; CUDA's caching allocator already does this on GPUs."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        if like.device.type != "cpu":
            return torch.empty(numel, dtype=like.dtype, device=like.device)
        key = (name, like.dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=like.dtype)
            self._buffers[key] = buf
        return buf[:numel]

    def clear(self) -> None:
        self._buffers.clear()


_workspace = _Workspace()


def clear_workspace() -> None:
    """Free the host buffers kept between calls (fusion and receive buffers of the CPU path)."""
    _workspace.clear()


_PIPELINE_CHUNK = 1 << 20  # elements per message in gloo's pipelined exchanges


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _post(
    sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], peer: int, group: dist.ProcessGroup | None
) -> tuple[list, list]:
    """Start sending `sends` to and receiving `recvs` from `peer` (a group rank) as one batch, so
    NCCL pairs them; empty tensors are skipped. Returns the send and the receive works (None for
    a skipped receive)."""
    peer = _global(group, peer)
    p2p = [dist.P2POp(dist.isend, t, peer, group) for t in sends if t.numel() > 0]
    p2p += [dist.P2POp(dist.irecv, t, peer, group) for t in recvs if t.numel() > 0]
    works = list(dist.batch_isend_irecv(p2p)) if p2p else []
    if len(works) != len(p2p):
        # NCCL coalesces a batch into one work: every receive then waits for the whole batch
        return works, [works[0] if t.numel() > 0 else None for t in recvs]
    n_send = sum(1 for t in sends if t.numel() > 0)
    send_works, recv_iter = works[:n_send], iter(works[n_send:])
    recv_works = [next(recv_iter) if t.numel() > 0 else None for t in recvs]
    return send_works, recv_works


def _wait(works) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _exchange(
    send: torch.Tensor | None, recv: torch.Tensor | None, peer: int, group: dist.ProcessGroup | None
) -> None:
    """Send `send` to and receive `recv` from `peer` (a group rank), and wait for both."""
    send_works, recv_works = _post([] if send is None else [send], [] if recv is None else [recv], peer, group)
    _wait(send_works + recv_works)


def _chunks(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, hi)) for start in range(lo, hi, size)] or [(lo, hi)]


def _halves(lo: int, hi: int, lower: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """(kept, given up) halves of [lo, hi); the lower partner keeps the first half."""
    mid = lo + (hi - lo) // 2
    return ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))


def _combine_local(buffer: torch.Tensor, other: torch.Tensor, layout: Layout) -> None:
    """buffer := adasum(buffer, other) per tensor, both standing for one worker (the fold)."""
    lengths = list(layout.sizes)
    coeff_a, coeff_b = ops.coefficients(ops.dot_and_norms(buffer, other, lengths), 0.5, 0.5)
    ops.scale_add(buffer, other, coeff_a, coeff_b, lengths, out=buffer)


def adasum_flat_(buffer: torch.Tensor, sizes: Sequence[int], group: dist.ProcessGroup | None = None) -> None:
    """Adasum of a flat buffer across the group, in place, each of `sizes` a tensor of its own.

    Every rank must pass the same sizes and dtype; nothing is checked here (see `all_reduce`).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    layout = Layout(tuple(int(n) for n in sizes))
    if layout.numel != buffer.numel():
        raise ValueError(f"sizes add up to {layout.numel} elements, the buffer has {buffer.numel()}")
    rank = dist.get_rank(group)
    tree = Tree(world)
    me = tree.group_of(rank)
    tensors = len(layout.sizes)
    partial_shape = (3, tensors)

    if not tree.is_leader(rank):
        leader = tree.leader(me)
        _exchange(buffer, None, leader, group)
        for d in tree.levels():
            blocks = tree.groups // (2 * d)
            dist.all_reduce(buffer.new_zeros((blocks, *partial_shape), dtype=torch.float64), group=group)
        _exchange(None, buffer, leader, group)
        return

    follower = tree.follower(me)
    if follower is not None:
        received = _workspace.get("recv", buffer.numel(), buffer)
        _exchange(None, received, follower, group)
        _combine_local(buffer, received, layout)
        del received

    # On gloo the exchanges run on gloo's own threads: cutting them into chunks lets the math on one
    # chunk overlap the transfer of the next. NCCL serialises a pair's sends and receives on one
    # stream, so there a level stays one batched exchange.
    chunk = _PIPELINE_CHUNK if dist.get_backend(group) == "gloo" else max(buffer.numel(), 1)
    levels = tree.levels()
    segments = [(0, buffer.numel())]
    for d in levels:
        lower = (me & d) == 0
        peer = tree.leader(me ^ d)
        (klo, khi), (glo, ghi) = _halves(*segments[-1], lower)
        theirs = _workspace.get("recv", khi - klo, buffer)
        kept_chunks = _chunks(klo, khi, chunk)
        send_works, recv_works = _post(
            [buffer[lo:hi] for lo, hi in _chunks(glo, ghi, chunk)],
            [theirs[lo - klo : hi - klo] for lo, hi in kept_chunks],
            peer,
            group,
        )

        def pair(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
            mine, other = buffer[lo:hi], theirs[lo - klo : hi - klo]
            return (mine, other) if lower else (other, mine)

        block = me // (2 * d)
        sums = buffer.new_zeros((tree.groups // (2 * d), *partial_shape), dtype=torch.float64)
        for (lo, hi), work in zip(kept_chunks, recv_works):
            _wait([work])
            first, lengths = layout.overlap(lo, hi)
            if lengths:
                sums[block, :, first : first + len(lengths)] += ops.dot_and_norms(*pair(lo, hi), lengths)
        _wait(send_works)
        dist.all_reduce(sums, group=group)

        base = block * 2 * d
        workers_a, workers_b = tree.count(base, d), tree.count(base + d, d)
        coeff_a, coeff_b = ops.coefficients(
            sums[block], workers_a / (workers_a + workers_b), workers_b / (workers_a + workers_b)
        )
        # The last level's result goes straight to its partner: the first step of the gather.
        gather_now = d == levels[-1] and chunk < buffer.numel()
        gather_works = _post([], [buffer[lo:hi] for lo, hi in _chunks(glo, ghi, chunk)], peer, group)[1] if gather_now else []
        for lo, hi in kept_chunks:
            first, lengths = layout.overlap(lo, hi)
            if lengths:
                picked = slice(first, first + len(lengths))
                ops.scale_add(*pair(lo, hi), coeff_a[picked], coeff_b[picked], lengths, out=buffer[lo:hi])
            if gather_now:
                gather_works += _post([buffer[lo:hi]], [], peer, group)[0]
        _wait(gather_works)
        segments.append((klo, khi))
    if levels and chunk < buffer.numel():
        segments.pop()
        levels = levels[:-1]

    for d in reversed(levels):
        lower = (me & d) == 0
        kept, given = _halves(*segments[-2], lower)
        assert kept == segments[-1]
        _exchange(buffer[kept[0] : kept[1]], buffer[given[0] : given[1]], tree.leader(me ^ d), group)
        segments.pop()

    if follower is not None:
        _exchange(buffer, None, follower, group)


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    check_layout: bool = True,
) -> None:
    """Replace each tensor, on every rank, by the Adasum of the ranks' copies; in place.

    Each tensor gets its own coefficients ("per layer"). Any world size; gloo and NCCL; all ranks
    end with bitwise-identical tensors, equal to ``adasum.reduce`` of the ranks' copies up to
    float64 rounding of the coefficients. Tensors are fused into one flat buffer per dtype.

    With `check_layout` (the default) one 16-byte all-reduce first checks that every rank passed
    the same number of tensors with the same shapes and dtypes; a mismatch raises ValueError on
    every rank, naming the first difference. Non-floating dtypes raise TypeError. World size 1
    leaves the tensors unchanged. Non-finite values propagate identically on every rank.

    >>> grads = [p.grad for p in model.parameters()]
    >>> adasum.all_reduce(grads)
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not dist.is_initialized():
        raise RuntimeError("adasum.all_reduce needs torch.distributed to be initialised")
    if dist.get_world_size(group) == 1:
        for t in tensors:
            ops.check_floating(t.dtype)
        return
    device = _group_device(group)
    if check_layout:
        check_same_layout(tensors, group, device)
    for t in tensors:
        ops.check_floating(t.dtype)
        if t.device != tensors[0].device:
            raise ValueError(f"all tensors must be on one device, got {tensors[0].device} and {t.device}")
    if tensors and tensors[0].device.type != device.type:
        raise ValueError(f"the {dist.get_backend(group)} backend needs {device.type} tensors, got {tensors[0].device}")
    for indices in group_by_dtype(tensors).values():
        members = [tensors[i] for i in indices]
        flat = flatten(members, _workspace.get("fusion", sum(t.numel() for t in members), members[0]))
        adasum_flat_(flat, [t.numel() for t in members], group)
        unflatten_into(flat, members)


def all_reduce_async(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    check_layout: bool = True,
) -> torch.futures.Future:
    """`all_reduce`, returning a Future of the list of tensors.

    On NCCL the work is enqueued on the current CUDA stream and the host does not wait for it
    (except for the layout check's one small read, which ``check_layout=False`` removes); consumers
    on the same stream see the result. On gloo the exchanges complete before it returns.
    """
    tensor_list = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    all_reduce(tensor_list, group, check_layout=check_layout)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor_list)
    return future
