r"""Adasum across one named mesh axis, inside ``jax.shard_map`` or ``jax.pmap``.

For two vectors ``a`` and ``b`` standing for ``n_a`` and ``n_b`` devices, ``w_a = n_a/(n_a+n_b)``::

    adasum(a, b) = (1 - w_a <a,b>/|a|^2) a + (1 - w_b <a,b>/|b|^2) b

applied to each leaf on its own (or to the whole tree with ``per_leaf=False``), over the tree of
`adasum.core.tree.Tree`: with ``P = 2**k + r`` devices, positions ``(2i, 2i+1)`` for ``i < r`` are
folded pairwise first, then Horovod's binary tree runs over the ``2**k`` groups, each subtree
weighted by its device count. So parallel inputs give their mean and orthogonal inputs their sum
for every P, as on the PyTorch side.

Communication (vector halving, distance doubling): all leaves of one dtype travel in one flat
buffer of ``Q = 2**k`` rows. At level ``d = 1, 2, 4, ...`` group ``g`` keeps the rows whose bit
``log2 d`` equals its own and ``ppermute``-s the other half to group ``g ^ d``; each device then holds
the two subtrees' vectors on its rows only, so the per-leaf ``<a,b>``, ``|a|^2``, ``|b|^2`` are
partial sums. One sub-group sum would finish them, but collectives over sub-groups of one axis do
not exist (jax-ml/jax#19709): each device writes its partials into its block's row of a small
``[blocks, 3, leaves]`` array that one ``psum`` adds over the whole axis. After the last level group
``g`` owns row ``g``; one ``all_gather`` copies every row to every device. Each device sends
``2 N (P-1)/P`` elements for a power-of-two P, as a ring all-reduce does; with a fold, followers send
their whole buffer to their leader first. Every element is computed on one device and copied, so
all devices end with bitwise-identical results.

Numerics: the three reductions accumulate in float64 where ``jax_enable_x64`` is on, else in
float32 (``accumulate=`` overrides); coefficients are in that dtype; the combination is computed in
the wider of the leaf's dtype and float32 and stored in the leaf's dtype (bf16 leaves travel as
bf16). Zero guard, no epsilon: a side whose squared norm is below ``sqrt(tiny)`` of the
accumulation dtype (1.5e-154 in float64 as in SPEC 1.1, 1.1e-19 in float32, where the float64
threshold would be a subnormal) gets coefficient 1, so ``adasum(0, b) = b`` and never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The tree is shared with the PyTorch side (one definition). TODO(lead): drop the fallback once
# adasum.core.tree has landed on every branch.
try:
    from adasum.core.tree import Tree
except ImportError:  # pragma: no cover - before the move into adasum.core
    from adasum.tree import Tree

MAX_CHUNK = 1024
"""Each leaf is padded to whole chunks of at most this many elements, so per-leaf sums are a
regular row reduction plus a short segment sum over chunks (no element-wise scatter)."""


def accumulation_dtype(accumulate: Any = None) -> jnp.dtype:
    """The dtype of the dot products: float64 if x64 is enabled, else float32, or `accumulate`."""
    if accumulate is None:
        return jnp.dtype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    dtype = jnp.dtype(accumulate)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        raise ValueError(f"accumulate must be float32 or float64, got {dtype}")
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("accumulate=float64 needs jax.config.update('jax_enable_x64', True)")
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
                f"{caller}: leaf {i} has dtype {dtype}; Adasum combines floating-point arrays only "
                f"(filter integer leaves out, e.g. with optax.masked or eqx.partition)"
            )


# --- the fused layout: one [rows, chunks, chunk] buffer per dtype


@dataclass(frozen=True)
class Bucket:
    """Leaves of one dtype fused in one buffer of shape ``[rows, per_row, chunk]``.

    Leaf ``j`` of the bucket occupies ``chunks[j]`` whole chunks (zero-padded); ``ids[row, c]`` is
    the tree-wide leaf index of each chunk, ``leaves`` (one past the last) for padding chunks.
    """

    dtype: np.dtype
    members: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    chunk: int
    chunks: tuple[int, ...]
    rows: int
    per_row: int
    ids: np.ndarray


def _chunk_size(sizes: list[int]) -> int:
    """A power of two <= MAX_CHUNK with at most ~1.5% padding (chunk <= numel / (64 leaves))."""
    target = max(1, sum(sizes) // (64 * len(sizes)))
    return min(MAX_CHUNK, 1 << (target.bit_length() - 1))


@lru_cache(maxsize=64)
def layout(signature: tuple[tuple[tuple[int, ...], str], ...], rows: int) -> tuple[Bucket, ...]:
    """Buckets (one per dtype, in order of first appearance) for leaves of the given shapes/dtypes."""
    count = len(signature)
    by_dtype: dict[str, list[int]] = {}
    for i, (_, dtype) in enumerate(signature):
        by_dtype.setdefault(dtype, []).append(i)
    buckets = []
    for dtype, members in by_dtype.items():
        shapes = tuple(signature[i][0] for i in members)
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        chunk = _chunk_size(sizes)
        chunks = tuple(max(1, -(-n // chunk)) for n in sizes)
        per_row = -(-sum(chunks) // rows)
        ids = np.full(rows * per_row, count, dtype=np.int32)
        ids[: sum(chunks)] = np.repeat(np.asarray(members, dtype=np.int32), chunks)
        buckets.append(Bucket(np.dtype(dtype), tuple(members), shapes, chunk, chunks, rows, per_row,
                              ids.reshape(rows, per_row)))
    return tuple(buckets)


def pack(leaves: list[jax.Array], bucket: Bucket) -> jax.Array:
    """The bucket's leaves as one zero-padded ``[rows, per_row, chunk]`` buffer."""
    pieces = []
    for i, chunks in zip(bucket.members, bucket.chunks):
        flat = leaves[i].reshape(-1)
        pad = chunks * bucket.chunk - flat.size
        pieces.append(jnp.pad(flat, (0, pad)) if pad else flat)
    tail = (bucket.rows * bucket.per_row - sum(bucket.chunks)) * bucket.chunk
    if tail:
        pieces.append(jnp.zeros((tail,), bucket.dtype))
    flat = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
    return flat.reshape(bucket.rows, bucket.per_row, bucket.chunk)


def unpack(buffer: jax.Array, bucket: Bucket, out: list[Any]) -> None:
    """Write the bucket's leaves from a ``[rows, per_row, chunk]`` buffer into `out`."""
    flat = buffer.reshape(-1)
    start = 0
    for i, shape, chunks in zip(bucket.members, bucket.shapes, bucket.chunks):
        size = int(np.prod(shape, dtype=np.int64))
        out[i] = flat[start : start + size].reshape(shape)
        start += chunks * bucket.chunk


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


def all_reduce(tree: Any, axis_name: Any, *, per_leaf: bool = True, accumulate: Any = None) -> Any:
    """Adasum of `tree` across the devices of mesh axis `axis_name` (module docstring for the math).

    Call inside ``jax.shard_map`` or ``jax.pmap`` over `axis_name`; every device passes its own copy
    of the tree (same structure, shapes and dtypes) and gets the same combined tree back.

    Args:
      tree: a pytree of floating-point arrays (float32, bfloat16, float16, float64).
      axis_name: the mesh axis to combine over (one axis).
      per_leaf: one pair of coefficients per leaf (SPEC 1.2, the default) or one for the whole tree.
      accumulate: dtype of the dot products: None (float64 with x64 enabled, else float32),
        ``jnp.float32`` or ``jnp.float64``.

    Returns:
      A pytree like `tree`, identical (bitwise) on every device of the axis.

    >>> grads = adasum.jax.all_reduce(grads, "data")   # inside jax.shard_map over "data"
    """
    leaves, treedef = jax.tree.flatten(tree)
    check_leaves(leaves, "adasum.jax.all_reduce")
    acc = accumulation_dtype(accumulate)
    workers = axis_size(axis_name, "adasum.jax.all_reduce")
    if workers == 1 or not leaves:
        return tree
    leaves = [jnp.asarray(x) for x in leaves]
    schedule = Tree(workers)
    count = len(leaves)
    buckets = layout(tuple((tuple(x.shape), jnp.dtype(x.dtype).name) for x in leaves), schedule.groups)
    buffers = [pack(leaves, b) for b in buckets]
    ids = [jnp.asarray(b.ids) for b in buckets]
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

    out: list[Any] = [None] * count
    leaders = np.array([schedule.leader(g) for g in range(schedule.groups)])
    for buffer, bucket in zip(buffers, buckets):
        rows = jax.lax.all_gather(buffer, axis_name, tiled=True)  # [workers, per_row, chunk]
        if schedule.folded:
            rows = rows[leaders]  # row g lives on group g's leader
        unpack(rows, bucket, out)
    return jax.tree.unflatten(treedef, out)
