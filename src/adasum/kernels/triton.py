"""Triton kernels for the per-tensor math on GPUs (optional: used when Triton imports).

A slice of a flat buffer is cut into tiles that each lie inside one tensor (segment) and hold at
most `TILE` elements. `dot_and_norms` reduces each tile in float64 (one program per tile), then
adds the tiles of each segment together in order; `combine` writes ``ca * a + cb * b`` per tile,
computed in float64, with the tile's segment coefficients (Adasum's, computed in the kernel from the segment's
sums; `scale_add`: a combine op's, read from a tensor). Tile tables are cached per layout, so
a call launches two or three kernels and never synchronises the host. Results are deterministic.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import cast

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is missing
    triton = None

from adasum.core.keep import kept
from adasum.core.tiles import TILE, tiles
from adasum.settings import current

BLOCK = 1024
ITERS = TILE // BLOCK
MORE_OUTS = 3
"""Outputs `combine` writes besides its first, at most (the kernel's out2 to out4)."""


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device`."""
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _tile_base(tiles_ptr, tile, ptr, start, TILES: tl.constexpr, ALIGN: tl.constexpr):
        # a tile's first element: from the address table (a `Scattered` slice), else at `start` in the flat tensor
        if TILES:
            at = tl.load(tiles_ptr + tile).to(tl.pointer_type(ptr.dtype.element_ty))
            if ALIGN > 1:  # every address a multiple of 16 bytes (checked on the host): vector loads and stores
                at = tl.multiple_of(at, 16)
        else:
            at = ptr + start
        return at

    @triton.jit
    def _tile_extent(starts_ptr, sizes_ptr, tile, ALIGN: tl.constexpr):
        # a tile's first element and size; with ALIGN both are multiples of ALIGN elements (16 bytes, checked on
        # the host), which lets Triton emit vector loads and stores
        start = tl.load(starts_ptr + tile)
        size = tl.load(sizes_ptr + tile)
        if ALIGN > 1:
            start = tl.multiple_of(start, ALIGN)
            size = tl.multiple_of(size, ALIGN)
        return start, size

    @triton.jit
    def _coefficients(dot, norm_a, norm_b, weight_a, weight_b):
        # `adasum.core.operator.coefficients`: the zero guard's threshold built from its float64 bits (a Python float
        # would arrive as float32, where 2**-511 flushes to 0)
        zero_norm = tl.full([], 0x2000000000000000, tl.int64).to(tl.float64, bitcast=True)  # 2**-511
        ca = tl.where(norm_a >= zero_norm, 1.0 - weight_a * dot / tl.where(norm_a >= zero_norm, norm_a, 1.0), 1.0)
        cb = tl.where(norm_b >= zero_norm, 1.0 - weight_b * dot / tl.where(norm_b >= zero_norm, norm_b, 1.0), 1.0)
        return ca, cb

    @triton.jit
    def _folded(it, R: tl.constexpr, F: tl.constexpr):
        # step `it`'s elements of a tile as [R, F]: F consecutive elements a row (16 bytes, one vector load a
        # thread, `sum_steps`), whose products the thread sums before they reach [R] float64 accumulators: a quarter
        # to an eighth of the registers of [R * F] accumulators, so more loads in flight (docs/benchmarks.md,
        # settings)
        return it * (R * F) + tl.arange(0, R)[:, None] * F + tl.arange(0, F)[None, :]

    @triton.jit
    def _accumulator(R: tl.constexpr, F: tl.constexpr):
        # [R] float64 zeros in the layout of a [R, F] tile summed over F
        return tl.sum(tl.zeros([R, F], dtype=tl.float64), axis=1)

    @triton.jit
    def _tile_sums_kernel(
        a_ptr, b_ptr, starts_ptr, sizes_ptr, out_ptr, R: tl.constexpr, F: tl.constexpr, ITERS: tl.constexpr,
        ALIGN: tl.constexpr,
    ):
        tile = tl.program_id(0)
        start, size = _tile_extent(starts_ptr, sizes_ptr, tile, ALIGN)
        ab = _accumulator(R, F)
        aa = _accumulator(R, F)
        bb = _accumulator(R, F)
        for i in range(ITERS):
            offs = _folded(i, R, F)
            mask = offs < size
            a = tl.load(a_ptr + start + offs, mask=mask, other=0.0).to(tl.float64)
            b = tl.load(b_ptr + start + offs, mask=mask, other=0.0).to(tl.float64)
            ab += tl.sum(a * b, axis=1)
            aa += tl.sum(a * a, axis=1)
            bb += tl.sum(b * b, axis=1)
        tl.store(out_ptr + tile * 3 + 0, tl.sum(ab, axis=0))
        tl.store(out_ptr + tile * 3 + 1, tl.sum(aa, axis=0))
        tl.store(out_ptr + tile * 3 + 2, tl.sum(bb, axis=0))

    @triton.jit
    def _segment_sums_kernel(
        tiles_ptr, first_ptr, count_ptr, out_ptr, row_stride, BLOCK: tl.constexpr, ROUNDS: tl.constexpr,
        ACCUMULATE: tl.constexpr,
    ):
        seg = tl.program_id(0)
        first = tl.load(first_ptr + seg)
        count = tl.load(count_ptr + seg)
        ab = tl.zeros([BLOCK], dtype=tl.float64)
        aa = tl.zeros([BLOCK], dtype=tl.float64)
        bb = tl.zeros([BLOCK], dtype=tl.float64)
        for r in range(ROUNDS):  # enough rounds for the longest segment (a power of two: few compilations)
            offs = r * BLOCK + tl.arange(0, BLOCK)
            mask = offs < count
            row = (first + offs) * 3
            ab += tl.load(tiles_ptr + row + 0, mask=mask, other=0.0)
            aa += tl.load(tiles_ptr + row + 1, mask=mask, other=0.0)
            bb += tl.load(tiles_ptr + row + 2, mask=mask, other=0.0)
        ab_sum, aa_sum, bb_sum = tl.sum(ab, axis=0), tl.sum(aa, axis=0), tl.sum(bb, axis=0)
        if ACCUMULATE:
            ab_sum += tl.load(out_ptr + seg)
            aa_sum += tl.load(out_ptr + row_stride + seg)
            bb_sum += tl.load(out_ptr + 2 * row_stride + seg)
        tl.store(out_ptr + seg, ab_sum)
        tl.store(out_ptr + row_stride + seg, aa_sum)
        tl.store(out_ptr + 2 * row_stride + seg, bb_sum)

    @triton.jit(do_not_specialize=["workers_a", "workers_b", "segments"])  # a 1 would become a Python int
    def combine_kernel(
        a_ptr, b_ptr, sums_ptr, row_stride, workers_a, workers_b, counts_ptr, segments, out_ptr, starts_ptr,
        sizes_ptr, segs_ptr, out2_ptr, out3_ptr, out4_ptr, a_tiles, b_tiles, out_tiles, BLOCK: tl.constexpr,
        ITERS: tl.constexpr, PER_SEGMENT: tl.constexpr, OUTS: tl.constexpr, A_TILES: tl.constexpr,
        B_TILES: tl.constexpr, OUT_TILES: tl.constexpr, ALIGN: tl.constexpr, GIVEN: tl.constexpr,
    ):
        """The coefficients of `adasum.core.operator.coefficients`, computed per tile from the segment's three sums.
        Python floats would arrive as float32 (1/3 inexact, the zero guard 2**-511 flushed to 0),
        so the weights come as worker counts and the guard is built from its float64 bits.
        With PER_SEGMENT the counts come per segment from counts_ptr ([2, segments] int64).
        With GIVEN the coefficients are read, not computed: sums_ptr holds a combine op's [2, segments] float64
        (c_a, then c_b, rows row_stride apart; `scale_add`)."""
        tile = tl.program_id(0)
        start, size = _tile_extent(starts_ptr, sizes_ptr, tile, ALIGN)
        seg = tl.load(segs_ptr + tile)
        if GIVEN:
            ca = tl.load(sums_ptr + seg)
            cb = tl.load(sums_ptr + row_stride + seg)
        else:
            if PER_SEGMENT:
                count_a = tl.load(counts_ptr + seg).to(tl.float64)
                count_b = tl.load(counts_ptr + segments + seg).to(tl.float64)
            else:
                count_a = workers_a.to(tl.float64)
                count_b = workers_b.to(tl.float64)
            weight_a = count_a / (count_a + count_b)
            weight_b = count_b / (count_a + count_b)
            dot = tl.load(sums_ptr + seg)
            norm_a = tl.load(sums_ptr + row_stride + seg)
            norm_b = tl.load(sums_ptr + 2 * row_stride + seg)
            ca, cb = _coefficients(dot, norm_a, norm_b, weight_a, weight_b)
        # with X_TILES, X is a `Scattered` buffer's slice: the tile's first element is at x_tiles[tile]
        a_at = _tile_base(a_tiles, tile, a_ptr, start, A_TILES, ALIGN)
        b_at = _tile_base(b_tiles, tile, b_ptr, start, B_TILES, ALIGN)
        out_at = _tile_base(out_tiles, tile, out_ptr, start, OUT_TILES, ALIGN)
        for i in range(ITERS):
            offs = i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < size
            a = tl.load(a_at + offs, mask=mask, other=0.0).to(tl.float64)
            b = tl.load(b_at + offs, mask=mask, other=0.0).to(tl.float64)
            mixed = ca * a + cb * b
            out = mixed if out_ptr.dtype.element_ty == tl.float64 else mixed.to(tl.float32)
            out = out.to(out_ptr.dtype.element_ty)
            tl.store(out_at + offs, out, mask=mask)
            if OUTS > 1:  # the same values into more buffers (symmetric memory: a local and a peer's)
                tl.store(out2_ptr + start + offs, out, mask=mask)
            if OUTS > 2:
                tl.store(out3_ptr + start + offs, out, mask=mask)
            if OUTS > 3:
                tl.store(out4_ptr + start + offs, out, mask=mask)

    @triton.jit
    def pull_tile_sums_kernel(
        mine_ptr, peer_ptr, theirs_ptr, starts_ptr, sizes_ptr, out_ptr, mine_tiles, R: tl.constexpr, F: tl.constexpr,
        ITERS: tl.constexpr, LOWER: tl.constexpr, MINE_TILES: tl.constexpr, ALIGN: tl.constexpr, KEEP: tl.constexpr,
    ):
        """One pass: load this rank's slice and the partner's copy (a peer's memory: NVLink loads), keep the
        partner's copy in `theirs` (with KEEP), and reduce the three sums of the tile in float64 ("a" = the lower
        side). Without KEEP the partner's copy is already local (pushed there) and only read."""
        tile = tl.program_id(0)
        start, size = _tile_extent(starts_ptr, sizes_ptr, tile, ALIGN)
        ab = _accumulator(R, F)
        mm = _accumulator(R, F)
        tt = _accumulator(R, F)
        mine_at = _tile_base(mine_tiles, tile, mine_ptr, start, MINE_TILES, ALIGN)
        for i in range(ITERS):
            offs = _folded(i, R, F)
            mask = offs < size
            other = tl.load(peer_ptr + start + offs, mask=mask, other=0.0)
            if KEEP:
                tl.store(theirs_ptr + start + offs, other, mask=mask)
            m = tl.load(mine_at + offs, mask=mask, other=0.0).to(tl.float64)
            t = other.to(tl.float64)
            ab += tl.sum(m * t, axis=1)
            mm += tl.sum(m * m, axis=1)
            tt += tl.sum(t * t, axis=1)
        if LOWER:
            aa, bb = tl.sum(mm, axis=0), tl.sum(tt, axis=0)
        else:
            aa, bb = tl.sum(tt, axis=0), tl.sum(mm, axis=0)
        tl.store(out_ptr + tile * 3 + 0, tl.sum(ab, axis=0))
        tl.store(out_ptr + tile * 3 + 1, aa)
        tl.store(out_ptr + tile * 3 + 2, bb)

    @triton.jit
    def add_kernel(
        x_ptr, y_ptr, out_ptr, starts_ptr, sizes_ptr, x_tiles, out_tiles, BLOCK: tl.constexpr, ITERS: tl.constexpr,
        MODE: tl.constexpr, X_TILES: tl.constexpr, OUT_TILES: tl.constexpr, ALIGN: tl.constexpr, X_TOO: tl.constexpr,
    ):
        """MODE 0: out = x (a copy, bits as they are); 1: out = x + y; 2: out = x - y, rounded once as torch rounds
        it: float64 in float64, every other dtype in float32. X_TOO: the result is stored into x as well."""
        tile = tl.program_id(0)
        start, size = _tile_extent(starts_ptr, sizes_ptr, tile, ALIGN)
        x_at = _tile_base(x_tiles, tile, x_ptr, start, X_TILES, ALIGN)
        out_at = _tile_base(out_tiles, tile, out_ptr, start, OUT_TILES, ALIGN)
        for i in range(ITERS):
            offs = i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < size
            x = tl.load(x_at + offs, mask=mask, other=0.0)
            if MODE == 0:
                tl.store(out_at + offs, x, mask=mask)
            else:
                y = tl.load(y_ptr + start + offs, mask=mask, other=0.0)
                if out_ptr.dtype.element_ty != tl.float64:
                    x = x.to(tl.float32)
                    y = y.to(tl.float32)
                if MODE == 2:
                    result = x - y
                else:
                    result = x + y
                tl.store(out_at + offs, result.to(out_ptr.dtype.element_ty), mask=mask)
                if X_TOO:
                    tl.store(x_at + offs, result.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def copy_tiles_kernel(like_ptr, sources_ptr, targets_ptr, sizes_ptr, n, programs, BLOCK: tl.constexpr,
                           ITERS: tl.constexpr, ROUNDS: tl.constexpr, ALIGN: tl.constexpr):
        """The tiles of a `CopyTable`, program k copying tiles k, k + programs, ... (bits as they are); a round past
        the table copies nothing (its size reads as 0)."""
        for r in range(ROUNDS):
            tile = r * programs + tl.program_id(0)
            valid = tile < n
            source = tl.load(sources_ptr + tile, mask=valid, other=0).to(tl.pointer_type(like_ptr.dtype.element_ty))
            target = tl.load(targets_ptr + tile, mask=valid, other=0).to(tl.pointer_type(like_ptr.dtype.element_ty))
            size = tl.load(sizes_ptr + tile, mask=valid, other=0)
            if ALIGN > 1:
                source = tl.multiple_of(source, 16)
                target = tl.multiple_of(target, 16)
                size = tl.multiple_of(size, ALIGN)
            for i in range(ITERS):
                offs = i * BLOCK + tl.arange(0, BLOCK)
                mask = offs < size
                tl.store(target + offs, tl.load(source + offs, mask=mask), mask=mask)

    @triton.jit
    def _pick(j: tl.constexpr, o0, o1, o2, o3, o4, o5, o6, o7):
        # row j's offset (j known when the kernel compiles)
        if j == 0:
            return o0
        elif j == 1:
            return o1
        elif j == 2:
            return o2
        elif j == 3:
            return o3
        elif j == 4:
            return o4
        elif j == 5:
            return o5
        elif j == 6:
            return o6
        else:
            return o7

    @triton.jit
    def _row_at(base_ptr, j: tl.constexpr, o0, o1, o2, o3, o4, o5, o6, o7, start, ALIGN: tl.constexpr):
        # row j's element `start` (row j at base + offset_j); with ALIGN every row is 16-byte aligned (checked on the
        # host), which lets Triton emit vector loads
        at = base_ptr + _pick(j, o0, o1, o2, o3, o4, o5, o6, o7) + start
        if ALIGN > 1:
            at = tl.multiple_of(at, 16)
        return at

    @triton.jit
    def _zeros(N: tl.constexpr, R: tl.constexpr, F: tl.constexpr):
        # N float64 accumulators of [R] (`_accumulator`)
        accs = ()
        for _ in tl.static_range(N):
            accs = accs + (_accumulator(R, F),)  # type: ignore[assignment]
        return accs

    @triton.jit
    def _add_at(accs, k: tl.constexpr, value):
        # accs[k] += value (a tuple is rebuilt: kernels cannot assign into one)
        return accs[:k] + (accs[k] + value,) + accs[k + 1 :]

    @triton.jit(do_not_specialize=["o0", "o1", "o2", "o3", "o4", "o5", "o6", "o7"])
    def _gram_tile_kernel(
        base_ptr, o0, o1, o2, o3, o4, o5, o6, o7, starts_ptr, sizes_ptr, out_ptr, P: tl.constexpr,
        PP: tl.constexpr, R: tl.constexpr, F: tl.constexpr, ITERS: tl.constexpr, ALIGN: tl.constexpr,
    ):
        # One tile of P rows (at base + offset_j): the [PP, PP] products summed in float64 over the tile (rows past
        # P: 0). The rows one after another as [R, F] loads (`_folded`) and one accumulator per product i <= j: a
        # [PP, BLOCK] load with [PP, PP, BLOCK] products took well above the rows' memory time (docs/benchmarks.md,
        # settings)
        tile = tl.program_id(0)
        start, size = _tile_extent(starts_ptr, sizes_ptr, tile, ALIGN)
        accs = _zeros(P * P, R, F)  # product (i, j) at i * P + j; those with i > j stay unused
        for it in range(ITERS):
            offs = _folded(it, R, F)
            mask = offs < size
            xs = ()
            for j in tl.static_range(P):
                at = _row_at(base_ptr, j, o0, o1, o2, o3, o4, o5, o6, o7, start, ALIGN)
                xs = xs + (tl.load(at + offs, mask=mask, other=0.0).to(tl.float64),)  # type: ignore[assignment]
            for i in tl.static_range(P):
                for j in tl.static_range(i, P):
                    accs = _add_at(accs, i * P + j, tl.sum(xs[i] * xs[j], axis=1))
        at = out_ptr + tile * PP * PP
        for i in tl.static_range(PP):
            for j in tl.static_range(PP):
                if i >= P or j >= P:
                    tl.store(at + i * PP + j, 0.0)
                elif i <= j:
                    tl.store(at + i * PP + j, tl.sum(accs[i * P + j], axis=0))
                else:
                    tl.store(at + i * PP + j, tl.sum(accs[j * P + i], axis=0))

    @triton.jit
    def _gram_segments_kernel(
        tiles_ptr, first_ptr, count_ptr, out_ptr, row_stride, P: tl.constexpr, PP: tl.constexpr,
        BLOCK: tl.constexpr, ROUNDS: tl.constexpr,
    ):
        # a segment's tile sums ([n_tiles, PP, PP]) added in order into out[i, j, seg] (rows i * P + j apart by
        # row_stride)
        seg = tl.program_id(0)
        first = tl.load(first_ptr + seg)
        count = tl.load(count_ptr + seg)
        cols = tl.arange(0, PP * PP)
        acc = tl.zeros([BLOCK, PP * PP], dtype=tl.float64)
        for r in range(ROUNDS):
            offs = r * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(tiles_ptr + (first + offs)[:, None] * PP * PP + cols[None, :],
                           mask=(offs < count)[:, None], other=0.0)
        i, j = cols // PP, cols % PP
        keep = (i < P) & (j < P)
        at = out_ptr + (i * P + j) * row_stride + seg
        tl.store(at, tl.sum(acc, axis=0) + tl.load(at, mask=keep, other=0.0), mask=keep)

    @triton.jit(do_not_specialize=["segments", "row_stride"])
    def _tree_weights_kernel(
        gram_ptr, gram_stride, ops_ptr, weights_ptr, row_stride, sums_ptr, segments, P: tl.constexpr,
        PP: tl.constexpr, OPS: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        # `adasum.core.gram.weights` for BLOCK_T tensors: nodes[t, k, j] is node k's weight of worker j
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        live = t < segments
        ranks = tl.arange(0, PP)
        k3 = ranks[None, :, None]
        j3 = ranks[None, None, :]
        gram = tl.load(gram_ptr + (k3 * P + j3) * gram_stride + t[:, None, None],
                       mask=live[:, None, None] & (k3 < P) & (j3 < P), other=0.0)
        nodes = tl.where(k3 == j3, 1.0, 0.0).to(tl.float64) + tl.zeros([BLOCK_T, PP, PP], dtype=tl.float64)
        for k in tl.static_range(OPS):
            a = tl.load(ops_ptr + 4 * k)
            b = tl.load(ops_ptr + 4 * k + 1)
            count_a = tl.load(ops_ptr + 4 * k + 2).to(tl.float64)
            count_b = tl.load(ops_ptr + 4 * k + 3).to(tl.float64)
            side_a = tl.sum(tl.where(k3 == a, nodes, 0.0), axis=1)  # [BLOCK_T, PP]
            side_b = tl.sum(tl.where(k3 == b, nodes, 0.0), axis=1)
            g_a = tl.sum(side_a[:, :, None] * gram, axis=1)  # (G W_a)[t, j]: G is symmetric
            g_b = tl.sum(side_b[:, :, None] * gram, axis=1)
            dot = tl.sum(g_a * side_b, axis=1)
            norm_a = tl.sum(g_a * side_a, axis=1)
            norm_b = tl.sum(g_b * side_b, axis=1)
            tl.store(sums_ptr + (3 * k) * segments + t, dot, mask=live)
            tl.store(sums_ptr + (3 * k + 1) * segments + t, norm_a, mask=live)
            tl.store(sums_ptr + (3 * k + 2) * segments + t, norm_b, mask=live)
            weight_a = count_a / (count_a + count_b)
            weight_b = count_b / (count_a + count_b)
            ca, cb = _coefficients(dot, norm_a, norm_b, weight_a, weight_b)
            # non-finite sums give NaN coefficients, never the zero guard's 1 (`adasum.core.gram`'s module doc)
            broken = (tl.abs(dot) == float("inf")) | (dot != dot) | (tl.abs(norm_a) == float("inf"))
            broken = broken | (norm_a != norm_a) | (tl.abs(norm_b) == float("inf")) | (norm_b != norm_b)
            ca = tl.where(broken, float("nan"), ca)
            cb = tl.where(broken, float("nan"), cb)
            mixed = ca[:, None] * side_a + cb[:, None] * side_b
            nodes = tl.where(k3 == a, mixed[:, None, :], nodes)
        root = tl.sum(tl.where(k3 == 0, nodes, 0.0), axis=1)
        tl.store(weights_ptr + ranks[None, :] * row_stride + t[:, None], root,
                 mask=live[:, None] & (ranks[None, :] < P))

    @triton.jit(do_not_specialize=["o0", "o1", "o2", "o3", "o4", "o5", "o6", "o7", "row_stride"])
    def _weighted_kernel(
        base_ptr, o0, o1, o2, o3, o4, o5, o6, o7, weights_ptr, row_stride, starts_ptr, sizes_ptr, segs_ptr,
        out_ptr, out2_ptr, out3_ptr, out4_ptr, out_tiles, P: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
        OUTS: tl.constexpr, OUT_TILES: tl.constexpr, ALIGN: tl.constexpr,
    ):
        # out = sum_j w[j, seg] row_j over one tile, in float64, stored in out's dtype (into OUTS buffers); the rows
        # one after another as 1-D loads, faster than a [P, BLOCK] load reduced over P (docs/benchmarks.md, settings)
        tile = tl.program_id(0)
        start, size = _tile_extent(starts_ptr, sizes_ptr, tile, ALIGN)
        seg = tl.load(segs_ptr + tile)
        out_at = _tile_base(out_tiles, tile, out_ptr, start, OUT_TILES, ALIGN)
        for i in range(ITERS):
            offs = i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < size
            mixed = tl.zeros([BLOCK], dtype=tl.float64)
            for j in tl.static_range(P):
                at = _row_at(base_ptr, j, o0, o1, o2, o3, o4, o5, o6, o7, start, ALIGN)
                x = tl.load(at + offs, mask=mask, other=0.0).to(tl.float64)
                mixed += tl.load(weights_ptr + j * row_stride + seg) * x
            out = mixed if out_ptr.dtype.element_ty == tl.float64 else mixed.to(tl.float32)
            out = out.to(out_ptr.dtype.element_ty)
            tl.store(out_at + offs, out, mask=mask)
            if OUTS > 1:
                tl.store(out2_ptr + start + offs, out, mask=mask)
            if OUTS > 2:
                tl.store(out3_ptr + start + offs, out, mask=mask)
            if OUTS > 3:
                tl.store(out4_ptr + start + offs, out, mask=mask)

def vector_width(table, *operands) -> int:
    """The vector width the kernels may assume, in elements: 16 bytes' worth when every tile starts and ends on
    such a boundary and every `TileAddresses` operand is 16-byte aligned, else 1. Without the hint Triton cannot
    prove alignment from the tile table and moves bf16 2 bytes per instruction, fp32 4 (docs/benchmarks.md lists
    the measurements). Flat tensors need no check: Triton marks a pointer 16-byte aligned only when it is.
    ``ADASUM_TRITON_VECTORS=0`` turns vectors off, ``=2-byte`` keeps them to 2-byte dtypes (for comparisons)."""
    tensors = [x for x in operands if isinstance(x, torch.Tensor)]
    size = tensors[0].element_size()
    if not _vectors(size):
        return 1
    width = 16 // size
    if table.align % width or not all(x.aligned for x in operands if not isinstance(x, torch.Tensor)):
        return 1
    return width


def _vectors(element_size: int) -> bool:
    """Whether the settings let kernels move elements of `element_size` bytes in 16-byte vectors where aligned
    (`vector_width`'s rule: every dtype; ``ADASUM_TRITON_VECTORS=0`` none, ``=2-byte`` 2-byte dtypes only)."""
    setting = current().triton_vectors
    return setting != "0" and (element_size < 4 or setting != "2-byte")


def _rounds(longest: int, block: int) -> int:
    return 1 << max(0, (-(-longest // block) - 1).bit_length())


def dot_and_norms(
    a: torch.Tensor, b: torch.Tensor, lengths: Sequence[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-segment ``<a,b>``, ``|a|^2``, ``|b|^2`` in float64 as a [3, T] tensor (see module doc);
    with `out` (a float64 [3, T] view whose rows are contiguous) the sums are added into it."""
    table = tiles(tuple(lengths), a.device)
    segments = len(lengths)
    accumulate = out is not None
    if out is None:
        out = torch.empty(3, segments, dtype=torch.float64, device=a.device)
    if segments == 0:
        return out
    assert out.stride(1) == 1 and out.dtype == torch.float64
    tile_sums = torch.empty(max(table.n_tiles, 1), 3, dtype=torch.float64, device=a.device)
    if table.n_tiles:
        align = vector_width(table, a, b)
        step_rows, fold, warps = sum_steps(align, PAIR_STEPS, PAIR_PLAIN)
        _tile_sums_kernel[(table.n_tiles,)](
            a, b, table.starts, table.sizes, tile_sums, R=step_rows, F=fold, ITERS=_iters(step_rows * fold),
            ALIGN=align, num_warps=warps,
        )
    _add_segment_sums(table, tile_sums, out, segments, accumulate)
    return out


def _add_segment_sums(table, tile_sums: torch.Tensor, out: torch.Tensor, segments: int, accumulate: bool) -> None:
    """Each of the `segments` segments' tile sums, added in order, into (or, without `accumulate`, stored in)
    its column of `out` ([3, T] float64, rows contiguous)."""
    _segment_sums_kernel[(segments,)](
        tile_sums, table.first, table.count, out, out.stride(0),
        BLOCK=256, ROUNDS=_rounds(table.longest, 256), ACCUMULATE=accumulate,
    )


def _operand(x, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(pointer, tile addresses, whether the addresses are used) for a kernel operand: a flat tensor, or a
    `Scattered` slice's `TileAddresses` (then `like`, a tensor of its dtype, stands for the pointer's type)."""
    if isinstance(x, torch.Tensor):
        return x, like, False
    assert x.dtype == like.dtype
    return like, x.table, True


def combine(
    a, b, sums: torch.Tensor, workers_a: int | torch.Tensor,
    workers_b: int | torch.Tensor, lengths: Sequence[int], out, *more_outs: torch.Tensor,
) -> None:
    """``out = c_a * a + c_b * b`` per segment with the coefficients of the segment's `sums`
    (``adasum.core.operator.coefficients``), in float64, stored in out's dtype: one kernel. The worker counts are
    ints, or int64 tensors with one count per segment. `more_outs` (at most `MORE_OUTS`, of out's dtype and
    size) receive the same values in the same pass. `a`, `b` and `out` are flat tensors or `TileAddresses`
    (a slice of `adasum.core.layout.Scattered`, read and written in place); one of a and b is a tensor."""
    _launch_combine(a, b, sums, workers_a, workers_b, lengths, out, more_outs, given=False)


def scale_add(a, b, coefficients: torch.Tensor, lengths: Sequence[int], out, *more_outs: torch.Tensor) -> None:
    """``out = c_a * a + c_b * b`` per segment with a combine op's coefficients (`coefficients`: [2, T] float64,
    rows c_a and c_b, its last dimension contiguous; `adasum.collectives.slices.CombineOp.pair_coefficients`), in
    float64, stored in out's dtype: the combine kernel of `combine`, reading the coefficients rather than computing
    Adasum's. `a`, `b`, `out` and `more_outs` as in `combine`."""
    _launch_combine(a, b, coefficients, 0, 0, lengths, out, more_outs, given=True)


def _launch_combine(a, b, values: torch.Tensor, workers_a, workers_b, lengths: Sequence[int], out, more_outs,
                    given: bool) -> None:
    """`combine_kernel` over the tiles of `lengths`: from the pair's sums `values` ([3, T]) and worker counts, or,
    with `given`, from the coefficients `values` ([2, T])."""
    like = next(x for x in (a, b, out, *more_outs) if isinstance(x, torch.Tensor))
    table = tiles(tuple(lengths), like.device)
    if table.n_tiles:
        assert values.stride(1) == 1 and values.dtype == torch.float64 and len(more_outs) <= MORE_OUTS
        assert not given or values.shape == (2, len(lengths)), values.shape
        per_segment = isinstance(workers_a, torch.Tensor)
        per_segment_counts = cast(list[torch.Tensor], [workers_a, workers_b])
        counts = torch.stack(per_segment_counts) if per_segment else values  # any pointer when unused
        (a_ptr, a_tiles, a_at), (b_ptr, b_tiles, b_at) = _operand(a, like), _operand(b, like)
        out_ptr, out_tiles, out_at = _operand(out, like)
        extra = list(more_outs) + [out_ptr] * (MORE_OUTS - len(more_outs))  # unused pointers when fewer
        combine_kernel[(table.n_tiles,)](
            a_ptr, b_ptr, values, values.stride(0), 0 if per_segment else workers_a, 0 if per_segment else workers_b,
            counts, len(lengths), out_ptr, table.starts, table.sizes, table.segments, *extra,
            a_tiles, b_tiles, out_tiles, BLOCK=BLOCK, ITERS=ITERS, PER_SEGMENT=per_segment, OUTS=1 + len(more_outs),
            A_TILES=a_at, B_TILES=b_at, OUT_TILES=out_at, ALIGN=vector_width(table, a, b, out, *more_outs),
            GIVEN=given,
        )


def pull_dot_and_norms(
    mine, peer: torch.Tensor, theirs: torch.Tensor | None, lengths: Sequence[int], out: torch.Tensor,
    lower: bool,
) -> None:
    """One pass over a slice: ``theirs := peer`` (the partner's copy, typically in its symmetric
    memory; skipped when `theirs` is None) and the per-segment sums of the pair added into `out` ([3, T]
    float64, rows contiguous), with "a" this rank's copy `mine` (a flat tensor or `TileAddresses`) if
    `lower`, else the partner's."""
    table = tiles(tuple(lengths), peer.device)
    segments = len(lengths)
    if segments == 0:
        return
    assert out.stride(1) == 1 and out.dtype == torch.float64
    tile_sums = torch.empty(max(table.n_tiles, 1), 3, dtype=torch.float64, device=peer.device)
    if table.n_tiles:
        mine_ptr, mine_tiles, mine_at = _operand(mine, peer)
        align = vector_width(table, mine, peer, *([theirs] if theirs is not None else []))
        step_rows, fold, warps = sum_steps(align, PAIR_STEPS, PAIR_PLAIN)
        pull_tile_sums_kernel[(table.n_tiles,)](
            mine_ptr, peer, theirs if theirs is not None else peer, table.starts, table.sizes, tile_sums, mine_tiles,
            R=step_rows, F=fold, ITERS=_iters(step_rows * fold), LOWER=lower, MINE_TILES=mine_at,
            KEEP=theirs is not None, ALIGN=align, num_warps=warps,
        )
    _add_segment_sums(table, tile_sums, out, segments, accumulate=True)


def add(
    x, y: torch.Tensor | None, out, lengths: Sequence[int], subtract: bool = False, x_too: bool = False,
) -> None:
    """``out = x - y`` (`subtract`), ``x + y``, or with `y` None ``out = x`` (a copy), over segments of
    `lengths`, rounded as torch rounds it: one kernel. `y` is a flat tensor; `x` and `out` flat tensors or
    `TileAddresses` (a list of tensors in place). With `x_too` the result is written into `x` as well (in
    the same pass; not with a copy)."""
    if x_too and y is None:
        raise ValueError("x_too needs y: a copy into x is no operation (internal error; please report)")
    like = next(t for t in (y, x, out) if isinstance(t, torch.Tensor))
    table = tiles(tuple(lengths), like.device)
    if table.n_tiles:
        x_ptr, x_tiles, x_at = _operand(x, like)
        out_ptr, out_tiles, out_at = _operand(out, like)
        operands = (x, out) if y is None else (x, y, out)
        add_kernel[(table.n_tiles,)](
            x_ptr, y if y is not None else like, out_ptr, table.starts, table.sizes, x_tiles, out_tiles, BLOCK=BLOCK,
            ITERS=ITERS, MODE=0 if y is None else (2 if subtract else 1), X_TILES=x_at, OUT_TILES=out_at,
            ALIGN=vector_width(table, *operands), X_TOO=x_too,
        )


COPY_BLOCK = 4096
"""Elements the copy kernel's programs move per step (8 warps: 16 a thread, 32-64 bytes in flight)."""
COPY_ITERS = -(-TILE // COPY_BLOCK)

COPY_PROGRAMS_PER_SM = 2
"""The copy kernel's programs per multiprocessor. A grid this size stores into NVLink as fast as a program per tile,
and leaves room on every multiprocessor for the kernels that run beside the stores (the Gram sums and the tree's
passes of the round before or after), where a program per tile fills them (docs/benchmarks.md, settings)."""

CPU_COPY_PROGRAMS = 5
"""The copy kernel's programs where it runs in Triton's interpreter (a few, so that programs take several tiles)."""


def copy_tiles(table, like: torch.Tensor) -> None:
    """Every tile of a `adasum.kernels.addresses.CopyTable` copied (bits as they are), in one kernel of at most
    `COPY_PROGRAMS_PER_SM` programs per multiprocessor, each taking every grid-th tile; `like` a tensor of the
    table's dtype on its device. It moves 16 bytes per access where the table is aligned (`vector_width`'s rule)."""
    if not table.n:
        return
    device = like.device
    most = (COPY_PROGRAMS_PER_SM * _multiprocessors(device.index if device.index is not None else
                                                    torch.cuda.current_device())
            if device.type == "cuda" else CPU_COPY_PROGRAMS)
    launch_copy(table, like, min(table.n, most), 8, COPY_BLOCK, COPY_ITERS)


def launch_copy(table, like: torch.Tensor, programs: int, warps: int, block: int, iters: int) -> None:
    """The copy kernel of `copy_tiles` over a non-empty `table` in another shape: `programs` programs (at most the
    table's tiles) of `warps` warps, `block` elements a step, `iters` steps a tile (benchmarks compare shapes)."""
    size = like.element_size()
    copy_tiles_kernel[(programs,)](
        like, table.sources, table.targets, table.sizes, table.n, programs, BLOCK=block, ITERS=iters,
        ROUNDS=_rounds(table.n, programs), ALIGN=16 // size if table.aligned and _vectors(size) else 1,
        num_warps=warps,
    )


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


GRAM_STEPS = ((256, 4), (64, 2))
"""(R, warps) of the Gram kernel's [R, F] steps up to 4 rows and above (up to 36 accumulators), where the rows are
16-byte aligned (`sum_steps`); the fastest of the shapes measured on one H200 (docs/benchmarks.md, settings)."""

GRAM_PLAIN = ((512, 4), (128, 4))
"""(R, warps) of the Gram kernel's steps where the rows are not 16-byte aligned (F = 1), up to 4 rows and above."""

PAIR_STEPS = (256, 8)
"""(R, warps) of the pair kernels' [R, F] steps (`dot_and_norms`, `pull_dot_and_norms`) where aligned."""

PAIR_PLAIN = (1024, 4)
"""(R, warps) of the pair kernels' steps where not aligned (F = 1)."""


def sum_steps(align: int, folded: tuple[int, int], plain: tuple[int, int]) -> tuple[int, int, int]:
    """(R, F, warps) of a sum kernel's steps for tiles of vector width `align` (`vector_width`): with vectors,
    F = `align` (16 bytes a thread, one load) and `folded`'s R and warps; without, F = 1 and `plain`'s, the 1-D
    steps where neighbouring threads load neighbouring elements (F elements a thread would each be a load of its
    own, F times the memory sectors a warp's load touches)."""
    if align > 1:
        return folded[0], align, folded[1]
    return plain[0], 1, plain[1]


def _iters(step: int) -> int:
    """Steps of `step` elements that cover a tile (`TILE`, as `ITERS` steps of `BLOCK`)."""
    return -(-(ITERS * BLOCK) // step)


MAX_ROWS = 8
"""The most rows `gram` and `weighted_sum` read in one kernel (a host's GPUs); more go to the torch path."""


def _rows(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int], bool]:
    """(the base row, every row's first element in elements from the base's, padded to `MAX_ROWS`, whether every
    row is 16-byte aligned): the rows of one dtype and device, anywhere in memory."""
    base = rows[0]
    size = base.element_size()
    offsets = []
    for row in rows:
        assert row.dtype == base.dtype and row.device == base.device and row.is_contiguous()
        gap = row.data_ptr() - base.data_ptr()
        assert gap % size == 0
        offsets.append(gap // size)
    aligned = all(row.data_ptr() % 16 == 0 for row in rows)
    return base, offsets + [0] * (MAX_ROWS - len(offsets)), aligned


def _pad(workers: int) -> int:
    return 1 << max(0, (workers - 1).bit_length())


def gram(rows: Sequence[torch.Tensor], lengths: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """Per segment the Gram matrix of the rows (at most `MAX_ROWS` flat tensors of one dtype, anywhere), in
    float64: ``[P, P, T]``; with `out` (a float64 [P, P, T] view with its last dimension contiguous and rows
    ``i * P + j`` evenly spaced) the sums are added into it. One program per tile reduces the P x P products in
    float64, one per segment adds its tiles in order."""
    workers = len(rows)
    assert workers <= MAX_ROWS
    base, offsets, aligned = _rows(rows)
    table = tiles(tuple(lengths), base.device)
    segments = len(lengths)
    if out is None:
        out = torch.zeros(workers, workers, segments, dtype=torch.float64, device=base.device)
    assert out.dtype == torch.float64 and out.stride(2) == 1 and out.stride(0) == workers * out.stride(1)
    if not table.n_tiles:
        return out
    padded = _pad(workers)
    tile_sums = torch.empty(table.n_tiles, padded, padded, dtype=torch.float64, device=base.device)
    align = vector_width(table, base) if aligned else 1
    above = int(workers > 4)
    step_rows, fold, warps = sum_steps(align, GRAM_STEPS[above], GRAM_PLAIN[above])
    _gram_tile_kernel[(table.n_tiles,)](
        base, *offsets, table.starts, table.sizes, tile_sums, P=workers, PP=padded, R=step_rows, F=fold,
        ITERS=_iters(step_rows * fold), ALIGN=align, num_warps=warps,
    )
    rounds_block, warps = _segment_block(table.longest, padded)
    _gram_segments_kernel[(segments,)](
        tile_sums, table.first, table.count, out, out.stride(1), P=workers, PP=padded, BLOCK=rounds_block,
        ROUNDS=_rounds(table.longest, rounds_block), num_warps=warps,
    )
    return out


def _segment_block(longest: int, padded: int) -> tuple[int, int]:
    """(tiles a program of `_gram_segments_kernel` adds per round, its warps) for segments of at most `longest`
    tiles and a padded P of `padded`: up to 4 ranks, a round as long as the longest segment, 64-1024 tiles, with
    a warp per 64 (4 at least), so that a long segment (a flat slice) takes one or a few rounds; above, 64 tiles
    on 4 warps (the [tiles, P x P] float64 sums held in registers). Measured on one H200 (docs/benchmarks.md,
    settings)."""
    if padded > 4:
        return max(16, 4096 // (padded * padded)), 4
    block = min(1024, max(64, 1 << max(0, (longest - 1).bit_length())))
    return block, max(4, block // 64)


def tree_weights(gram: torch.Tensor, ops: Sequence[tuple[int, int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`adasum.core.gram.weights` in one kernel: (weights [P, T], sums [len(ops), 3, T]) from `gram` ([P, P, T]
    float64, its last dimension contiguous and rows evenly spaced) and the tree's `ops`
    (`adasum.core.gram.pair_ops`)."""
    workers, _, segments = gram.shape
    assert gram.stride(2) == 1 and gram.stride(0) == workers * gram.stride(1)
    weights = torch.empty(workers, segments, dtype=torch.float64, device=gram.device)
    sums = torch.empty(len(ops), 3, segments, dtype=torch.float64, device=gram.device)
    if segments:
        table = _ops_table(tuple(ops), gram.device)
        block = 16
        _tree_weights_kernel[(-(-segments // block),)](
            gram, gram.stride(1), table, weights, segments, sums, segments, P=workers, PP=_pad(workers),
            OPS=len(ops), BLOCK_T=block,
        )
    return weights, sums


def _ops_table(ops: tuple[tuple[int, int, int, int], ...], device: torch.device) -> torch.Tensor:
    """A tree's pairs on the device (cached: made once, never copied again, so a captured call reads it; the graph
    keeps it, `adasum.core.keep`)."""
    return kept(_ops_tensor(ops, device))


@functools.lru_cache(maxsize=64)
def _ops_tensor(ops: tuple[tuple[int, int, int, int], ...], device: torch.device) -> torch.Tensor:
    return torch.tensor([x for op in ops for x in op], dtype=torch.int64, device=device)


def clear_cache() -> None:
    """Forget the trees' pair tables kept on devices (`adasum.kernels.clear_device_caches`)."""
    _ops_tensor.cache_clear()


def weighted_sum(rows: Sequence[torch.Tensor], weights: torch.Tensor, lengths: Sequence[int], out,
                 *more_outs: torch.Tensor) -> None:
    """``out = sum_j weights[j, seg] rows[j]`` per segment, in float64, stored in out's dtype: one kernel. `rows`
    as in `gram`; `weights` [P, T] float64 with its last dimension contiguous; `out` a flat tensor (it may be one
    of the rows) or `TileAddresses`; `more_outs` (at most `MORE_OUTS`) receive the same values in the same pass."""
    base, offsets, aligned = _rows(rows)
    table = tiles(tuple(lengths), base.device)
    if not table.n_tiles:
        return
    assert weights.dtype == torch.float64 and weights.stride(1) == 1 and len(more_outs) <= MORE_OUTS
    out_ptr, out_tiles, out_at = _operand(out, base)
    extra = list(more_outs) + [out_ptr] * (MORE_OUTS - len(more_outs))
    block = 2 * BLOCK  # with 8 warps: the fastest of the sizes and warps measured (docs/benchmarks.md, settings)
    align = vector_width(table, base, out, *more_outs) if aligned else 1
    _weighted_kernel[(table.n_tiles,)](
        base, *offsets, weights, weights.stride(0), table.starts, table.sizes, table.segments, out_ptr, *extra,
        out_tiles, P=len(rows), BLOCK=block, ITERS=_iters(block), OUTS=1 + len(more_outs),
        OUT_TILES=out_at, ALIGN=align, num_warps=8,
    )
