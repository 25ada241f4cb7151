r"""Adasum across one named mesh axis, inside ``jax.shard_map`` or ``jax.pmap``.

For two vectors ``a`` and ``b`` standing for ``n_a`` and ``n_b`` devices, ``w_a = n_a/(n_a+n_b)``::

    adasum(a, b) = (1 - w_a <a,b>/|a|^2) a + (1 - w_b <a,b>/|b|^2) b

applied to each leaf on its own (or to the whole tree with ``per_leaf=False``), over the tree of
`adasum.core.tree.Tree`: with ``P = 2**k + r`` devices, positions ``(2i, 2i+1)`` for ``i < r`` are
folded pairwise first, then Horovod's binary tree runs over the ``2**k`` groups, each subtree
weighted by its device count. So parallel inputs give their mean and orthogonal inputs their sum
for every P, as on the PyTorch side.

Communication (vector halving, distance doubling): all leaves of one dtype travel in one flat
buffer of ``Q = 2**k`` rows (or in `pieces` buffers over contiguous ranges of it, never one per
leaf). At level ``d = 1, 2, 4, ...`` group ``g`` keeps the rows whose bit ``log2 d`` equals its own
and ``ppermute``-s the other half to group ``g ^ d``; each device then holds the two subtrees'
vectors on its rows only, so the per-leaf ``<a,b>``, ``|a|^2``, ``|b|^2`` are
partial sums. One sub-group sum would finish them, but collectives over sub-groups of one axis do
not exist (jax-ml/jax#19709): each device writes its partials into its block's row of a small
``[blocks, leaves, 3]`` array that one ``psum`` adds over the whole axis. After the last level group
``g`` owns row ``g``; one ``all_gather`` copies every row to every device. Each device sends
``2 N (P-1)/P`` elements for a power-of-two P, as a ring all-reduce does; with a fold, followers send
their whole buffer to their leader first. Every element is computed on one device and copied, so
all devices end with bitwise-identical results.

Numerics: the three reductions accumulate in float64 where ``jax_enable_x64`` is on, else in
float32 (``accumulate=`` overrides); coefficients are in that dtype; the combination is computed in
the wider of the leaf's dtype and float32 and stored in the leaf's dtype (bf16 leaves travel as
bf16). Zero guard, no epsilon: a side whose squared norm is below ``sqrt(tiny)`` of the
accumulation dtype (1.5e-154 in float64 as in `adasum.core.operator`, 1.1e-19 in float32, where the float64
threshold would be a subnormal) gets coefficient 1, so ``adasum(0, b) = b`` and never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adasum.core.tree import Tree  # the same tree as the PyTorch side (one definition)
from adasum.options import check_count

MAX_CHUNK = 1024
"""Each leaf is padded to whole chunks of at most this many elements, so per-leaf sums are a
regular row reduction plus a short segment sum over chunks (no element-wise scatter)."""


def accumulation_dtype(accumulate: Any = None) -> jnp.dtype:
    """The dtype of the dot products: float64 if x64 is enabled, else float32, or `accumulate`."""
    if accumulate is None:
        return jnp.dtype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)  # type: ignore[attr-defined]
    dtype = jnp.dtype(accumulate)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        raise ValueError(f"accumulate must be float32 or float64, got {dtype}; pass jnp.float32, jnp.float64 or None")
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]
        raise ValueError(
            "accumulate=float64 needs x64 arrays: call jax.config.update('jax_enable_x64', True) first, or pass "
            "accumulate=jnp.float32"
        )
    return dtype


def zero_norm(dtype: Any) -> float:
    """Squared norms below this count as zero (coefficient 1): ``sqrt(finfo(dtype).tiny)``."""
    return float(np.sqrt(np.finfo(np.dtype(dtype)).tiny))


def axis_size(axis_name: Any, caller: str) -> int:
    """The size of a bound mesh axis, or a ValueError that says where to call `caller`."""
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"{caller}: axis name {axis_name!r} is not bound here; call it inside jax.shard_map (or "
            f"jax.pmap) over a mesh with that axis, e.g. jax.shard_map(step, mesh=Mesh(devices, "
            f"({axis_name!r},)), ...)"
        ) from e


def check_leaves(leaves: list[Any], caller: str) -> None:
    """Every leaf must be a real floating-point array."""
    for i, leaf in enumerate(leaves):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{caller}: leaf {i} has dtype {dtype}; Adasum combines floating-point arrays only: "
                f"leave integer leaves out (use optax.masked or eqx.partition)"
            )


def _varying_axes(x: Any) -> frozenset | None:
    """The mesh axes over which JAX types `x` as differing between devices (None: not tracked)."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None:
        return None
    aval = typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):  # JAX >= 0.9
        return frozenset(mat.varying)
    vma = getattr(aval, "vma", None)  # JAX 0.6 to 0.8
    return None if vma is None else frozenset(vma)


def _names(axis_name: Any) -> tuple:
    """The mesh axes that `axis_name` stands for: itself, or each name of a tuple of names."""
    return tuple(axis_name) if isinstance(axis_name, tuple) else (axis_name,)


def _typed(axis_name: Any) -> bool:
    """Whether JAX types values as differing or not over every axis of `axis_name` (False under ``pmap``
    or ``shard_map(check_vma=False)``)."""
    tracked = _varying_axes(jax.lax.axis_index(axis_name)) or frozenset()
    return all(name in tracked for name in _names(axis_name))


def check_per_device(leaves: list[Any], axis_name: Any, caller: str) -> None:
    """Refuse leaves that JAX knows to be the same on every device of `axis_name` (of any of its axes,
    for a tuple of names).

    Inside ``shard_map`` (with its default ``check_vma=True``), ``jax.grad`` with respect to replicated
    parameters already sums the gradient over the axis; combining such sums is a silent no-op.
    """
    if not _typed(axis_name):  # pmap, or shard_map(check_vma=False): not typed
        return
    for i, leaf in enumerate(leaves):
        varying = _varying_axes(leaf) or frozenset()
        same = [name for name in _names(axis_name) if name not in varying]
        if same:
            raise ValueError(
                f"{caller}: leaf {i} is the same on every device of axis {same[0]!r} (replicated), so "
                f"there is nothing to combine. If it is a gradient with respect to replicated parameters, "
                f"jax.grad inside shard_map has already summed it over the axis: use jax.grad with "
                f"respect to adasum.jax.vary(params, {axis_name!r}) to get each device's own gradient"
            )


def vary(tree: Any, axis_name: Any) -> Any:
    """`tree` typed as differing between the devices of `axis_name`, so that ``jax.grad`` with respect
    to it gives each device its own gradient instead of the sum over the axis.

    Args:
      tree: a pytree of arrays, typically the replicated parameters inside ``shard_map``.
      axis_name: the mesh axis, or a tuple of axes (typed as differing over each of them).

    Returns:
      The same values (``jax.lax.pcast(..., to="varying")``, ``pvary`` on older JAX; unchanged under
      ``pmap`` or ``shard_map(check_vma=False)``, where gradients are per device anyway).

    >>> grads = jax.grad(loss)(adasum.jax.vary(params, "data"), batch)  # doctest: +SKIP

    On one CPU device (an axis of size one), inside ``shard_map`` with replicated parameters: the mesh axes
    over which JAX types each gradient as differing between devices, recorded while tracing (``jax.eval_shape``
    traces without compiling):

    >>> from jax.sharding import Mesh, PartitionSpec
    >>> mesh, seen = Mesh(jax.devices()[:1], ("data",)), []
    >>> def step(w, x):
    ...     loss = lambda w: (x @ w).sum()
    ...     summed, own = jax.grad(loss)(w), jax.grad(loss)(vary(w, "data"))
    ...     seen.append((_varying_axes(summed), _varying_axes(own)))
    ...     return own
    >>> step = jax.shard_map(step, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec("data")),
    ...                      out_specs=PartitionSpec("data"))
    >>> _ = jax.eval_shape(step, jnp.ones(2), jnp.ones((4, 2)))
    >>> seen                              # the plain gradient is replicated (summed), vary's is per device
    [(frozenset(), frozenset({'data'}))]
    """
    if not _typed(axis_name):
        return tree

    def one(x: Any) -> Any:
        varying = _varying_axes(x) or frozenset()
        missing = tuple(name for name in _names(axis_name) if name not in varying)
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)  # type: ignore[attr-defined]  # older jax

    return jax.tree.map(one, tree)


# --- the fused layout: each dtype's leaves in one padded flat space, cut into `pieces` buffers


@dataclass(frozen=True)
class Piece:
    """One buffer of shape ``[rows, per_row, chunk]`` holding a contiguous range of a dtype's leaves.

    Every leaf is zero-padded to whole chunks; the padded leaves of one dtype, in order, form one flat
    space that is cut into pieces at chunk boundaries. `segments` lists, in buffer order, the leaf
    elements ``[start, stop)`` of leaf ``leaf`` followed by ``padded - (stop - start)`` zeros;
    ``ids[row, c]`` is each chunk's tree-wide leaf index (``leaves`` for the tail padding).
    """

    dtype: np.dtype
    segments: tuple[tuple[int, int, int, int], ...]
    chunk: int
    rows: int
    per_row: int
    ids: np.ndarray


def _chunk_size(sizes: list[int]) -> int:
    """A power of two <= MAX_CHUNK with at most ~1.5% padding (chunk <= numel / (64 leaves))."""
    target = max(1, sum(sizes) // (64 * len(sizes)))
    return min(MAX_CHUNK, 1 << (target.bit_length() - 1))


@lru_cache(maxsize=64)
def layout(signature: tuple[tuple[tuple[int, ...], str], ...], rows: int, pieces: int = 1) -> tuple[Piece, ...]:
    """The pieces (per dtype in order of first appearance, then in flat order) for leaves of the given
    shapes and dtype names, with `rows` rows each."""
    count = len(signature)
    by_dtype: dict[str, list[int]] = {}
    for i, (_, dtype) in enumerate(signature):
        by_dtype.setdefault(dtype, []).append(i)
    out = []
    for dtype, members in by_dtype.items():
        sizes = [int(np.prod(signature[i][0], dtype=np.int64)) for i in members]
        chunk = _chunk_size(sizes)
        chunks = [max(1, -(-n // chunk)) for n in sizes]
        offsets = np.concatenate([[0], np.cumsum(chunks)])
        total = int(offsets[-1])
        cuts = [total * j // pieces for j in range(pieces + 1)]
        for a, b in zip(cuts[:-1], cuts[1:]):
            if a == b:
                continue
            segments, ids = [], []
            for i, n, lo, hi in zip(members, sizes, offsets[:-1], offsets[1:]):
                first, last = max(a, lo) - lo, min(b, hi) - lo
                if first < last:
                    segments.append((i, int(first * chunk), int(min(last * chunk, n)), int((last - first) * chunk)))
                    ids += [i] * int(last - first)
            per_row = -(-(b - a) // rows)
            table = np.full(rows * per_row, count, dtype=np.int32)
            table[: len(ids)] = ids
            out.append(Piece(np.dtype(dtype), tuple(segments), chunk, rows, per_row, table.reshape(rows, per_row)))
    return tuple(out)


def pack(leaves: list[jax.Array], piece: Piece) -> jax.Array:
    """The piece's range of the leaves as one zero-padded ``[rows, per_row, chunk]`` buffer."""
    parts = []
    for i, start, stop, padded in piece.segments:
        flat = leaves[i].reshape(-1)
        if (start, stop) != (0, flat.size):
            flat = flat[start:stop]
        parts.append(jnp.pad(flat, (0, padded - (stop - start))) if padded > stop - start else flat)
    tail = piece.rows * piece.per_row * piece.chunk - sum(seg[3] for seg in piece.segments)
    if tail:
        parts.append(jnp.zeros((tail,), piece.dtype))
    flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return flat.reshape(piece.rows, piece.per_row, piece.chunk)


def unpack(buffers: list[jax.Array], pieces: tuple[Piece, ...], shapes: list[tuple[int, ...]]) -> list[jax.Array]:
    """The leaves (of `shapes`) from the pieces' ``[rows, per_row, chunk]`` buffers."""
    parts: list[list[jax.Array]] = [[] for _ in shapes]
    for buffer, piece in zip(buffers, pieces):
        flat = buffer.reshape(-1)
        offset = 0
        for i, start, stop, padded in piece.segments:
            parts[i].append(flat[offset : offset + stop - start])
            offset += padded
    return [(p[0] if len(p) == 1 else jnp.concatenate(p)).reshape(s) for p, s in zip(parts, shapes)]


# --- the math on local slices


def partial_sums(mine: list[jax.Array], other: list[jax.Array], ids: list[jax.Array], leaves: int,
                 acc: jnp.dtype) -> jax.Array:
    """Per leaf ``[<mine,other>, |mine|^2, |other|^2]`` over the rows held here: shape [leaves + 1, 3]."""
    total = jnp.zeros((leaves + 1, 3), acc)
    for x, y, seg in zip(mine, other, ids):
        x, y = x.astype(acc), y.astype(acc)
        per_chunk = jnp.stack([(x * y).sum(-1), (x * x).sum(-1), (y * y).sum(-1)], axis=-1)
        total = total + jax.ops.segment_sum(per_chunk.reshape(-1, 3), seg.reshape(-1), num_segments=leaves + 1)
    return total


def coefficients(dot: jax.Array, aa: jax.Array, bb: jax.Array, wa: Any, wb: Any) -> tuple[jax.Array, jax.Array]:
    """``(1 - w_a <a,b>/|a|^2, 1 - w_b <a,b>/|b|^2)``, 1 where a squared norm is below `zero_norm`."""
    tiny = zero_norm(dot.dtype)
    ca = jnp.where(aa < tiny, 1.0, 1.0 - wa * dot / jnp.where(aa < tiny, 1.0, aa))
    cb = jnp.where(bb < tiny, 1.0, 1.0 - wb * dot / jnp.where(bb < tiny, 1.0, bb))
    return ca.astype(dot.dtype), cb.astype(dot.dtype)


def combine(mine: jax.Array, other: jax.Array, c_mine: jax.Array, c_other: jax.Array, ids: Any) -> jax.Array:
    """``c_mine[leaf] * mine + c_other[leaf] * other`` chunk by chunk, stored in mine's dtype."""
    compute = jnp.promote_types(mine.dtype, jnp.float32)
    cm = c_mine[ids][..., None].astype(compute)
    co = c_other[ids][..., None].astype(compute)
    return (cm * mine.astype(compute) + co * other.astype(compute)).astype(mine.dtype)


def _whole(sums: jax.Array, per_leaf: bool) -> jax.Array:
    """Per-leaf sums, or (per_leaf=False) the whole tree's sums repeated for every leaf."""
    if per_leaf:
        return sums
    return jnp.broadcast_to(sums.sum(0, keepdims=True), sums.shape)


def _split(x: jax.Array, bit: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows ordered by ``row >> level``: keep those whose next bit is `bit`, give away the others."""
    pairs = x.reshape(x.shape[0] // 2, 2, *x.shape[1:])
    keep = jax.lax.dynamic_index_in_dim(pairs, bit, axis=1, keepdims=False)
    give = jax.lax.dynamic_index_in_dim(pairs, 1 - bit, axis=1, keepdims=False)
    return keep, give


def _gather(buffer: jax.Array, axis_name: Any) -> jax.Array:
    """all_gather typed as the same on every device (it is: each row has one owner), so that the
    result can leave ``shard_map`` with a replicated out_spec; plain all_gather on older JAX."""
    try:
        return jax.lax.all_gather(buffer, axis_name, tiled=True, to="invarying")
    except TypeError:  # no `to=` before JAX 0.8
        return jax.lax.all_gather(buffer, axis_name, tiled=True)


@lru_cache(maxsize=64)
def _device_tables(workers: int) -> dict[str, np.ndarray]:
    """Per device position: its group, whether it leads it, and per level its block and the
    worker counts of the lower and upper subtree of that block."""
    tree = Tree(workers)
    levels = tree.levels()
    group = np.array([tree.group_of(p) for p in range(workers)], np.int32)
    leader = np.array([tree.is_leader(p) for p in range(workers)], np.float32)
    lo = np.zeros((workers, max(1, len(levels))), np.float32)
    hi = np.zeros_like(lo)
    for p in range(workers):
        for i, d in enumerate(levels):
            base = (group[p] // (2 * d)) * 2 * d
            lo[p, i], hi[p, i] = tree.count(base, d), tree.count(base + d, d)
    return {"group": group, "leader": leader, "lo": lo, "hi": hi}


def all_reduce(tree: Any, axis_name: Any, *, per_leaf: bool = True, accumulate: Any = None, pieces: int = 1) -> Any:
    """Adasum of `tree` across the devices of mesh axis `axis_name` (module docstring for the math).

    Call inside ``jax.shard_map`` or ``jax.pmap`` over `axis_name`; every device passes its own copy
    of the tree (same structure, shapes and dtypes) and gets the same combined tree back. Inside
    ``shard_map``, take gradients with respect to `vary` (params): ``jax.grad`` with respect to
    replicated parameters returns the sum over the axis, which is refused here.

    Args:
      tree: a pytree of floating-point arrays (float32, bfloat16, float16, float64).
      axis_name: the mesh axis to combine over, or a tuple of axes combined as one axis of their
        product's size (the devices in JAX's ``axis_index`` order over them).
      per_leaf: one pair of coefficients per leaf (the paper's "per layer", the default) or one for the whole tree.
      accumulate: dtype of the dot products: None (float64 with x64 enabled, else float32),
        ``jnp.float32`` or ``jnp.float64``.
      pieces: cut each dtype's fused buffer into this many contiguous pieces (an int >= 1), each with
        its own collectives, so that XLA can overlap one piece's arithmetic with another's transfers.

    Returns:
      A pytree like `tree`, identical (bitwise) on every device of the axis.

    >>> grads = adasum.jax.all_reduce(grads, "data")   # inside jax.shard_map over "data"  # doctest: +SKIP

    On one CPU device (an axis of size one; on a larger axis every device makes the same call):

    >>> from jax.sharding import Mesh, PartitionSpec
    >>> mesh = Mesh(jax.devices()[:1], ("data",))
    >>> combine = jax.shard_map(lambda g: all_reduce(g, "data"), mesh=mesh, in_specs=PartitionSpec("data"),
    ...                         out_specs=PartitionSpec("data"))
    >>> combine(jnp.array([3.0, 4.0]))
    Array([3., 4.], dtype=float32)
    """
    leaves, treedef = jax.tree.flatten(tree)
    check_leaves(leaves, "adasum.jax.all_reduce")
    acc = accumulation_dtype(accumulate)
    check_count("adasum.jax.all_reduce", "pieces", pieces)
    workers = axis_size(axis_name, "adasum.jax.all_reduce")
    if workers == 1 or not leaves:
        return tree
    check_per_device(leaves, axis_name, "adasum.jax.all_reduce")
    leaves = [jnp.asarray(x) for x in leaves]
    schedule = Tree(workers)
    count = len(leaves)
    cut = layout(tuple((tuple(x.shape), jnp.dtype(x.dtype).name) for x in leaves), schedule.groups, int(pieces))
    buffers = [pack(leaves, piece) for piece in cut]
    ids = [jnp.asarray(piece.ids) for piece in cut]
    tables = _device_tables(workers)
    me = jax.lax.axis_index(axis_name)

    if schedule.folded:
        # followers hand their buffer to their leader; the others receive zeros, and adasum(x, 0) = x
        pairs = [(schedule.follower(g), schedule.leader(g)) for g in range(schedule.folded)]
        received = jax.lax.ppermute(buffers, axis_name, pairs)
        sums = _whole(partial_sums(buffers, received, ids, count, acc), per_leaf)
        c_mine, c_other = coefficients(sums[:, 0], sums[:, 1], sums[:, 2], 0.5, 0.5)
        buffers = [combine(x, y, c_mine, c_other, i) for x, y, i in zip(buffers, received, ids)]

    group = jnp.asarray(tables["group"])[me]
    leader = jnp.asarray(tables["leader"])[me].astype(acc)
    for level, d in enumerate(schedule.levels()):
        bit = (group >> level) & 1
        split = [_split(x, bit) for x in buffers]
        ids = [_split(i, bit)[0] for i in ids]
        buffers = [keep for keep, _ in split]
        pairs = [(schedule.leader(g), schedule.leader(g ^ d)) for g in range(schedule.groups)]
        received = jax.lax.ppermute([give for _, give in split], axis_name, pairs)
        mine = partial_sums(buffers, received, ids, count, acc)
        # orient as (dot, |lower subtree|^2, |upper subtree|^2) so that the block's partials add up
        upper = bit.astype(bool)
        row = jnp.stack([mine[:, 0], jnp.where(upper, mine[:, 2], mine[:, 1]),
                         jnp.where(upper, mine[:, 1], mine[:, 2])], axis=-1) * leader
        blocks = schedule.groups // (2 * d)
        block = group // (2 * d)
        table = jax.lax.dynamic_update_index_in_dim(jnp.zeros((blocks, count + 1, 3), acc), row, block, axis=0)
        sums = _whole(jax.lax.psum(table, axis_name)[block], per_leaf)
        n_lo = jnp.asarray(tables["lo"][:, level])[me].astype(acc)
        n_hi = jnp.asarray(tables["hi"][:, level])[me].astype(acc)
        c_lo, c_hi = coefficients(sums[:, 0], sums[:, 1], sums[:, 2], n_lo / (n_lo + n_hi), n_hi / (n_lo + n_hi))
        c_mine, c_other = jnp.where(upper, c_hi, c_lo), jnp.where(upper, c_lo, c_hi)
        buffers = [combine(x, y, c_mine, c_other, i) for x, y, i in zip(buffers, received, ids)]

    leaders = np.array([schedule.leader(g) for g in range(schedule.groups)])
    gathered = []
    for buffer in buffers:
        rows = _gather(buffer, axis_name)  # [workers, per_row, chunk]
        gathered.append(rows[leaders] if schedule.folded else rows)  # row g lives on group g's leader
    return jax.tree.unflatten(treedef, unpack(gathered, cut, [x.shape for x in leaves]))
