"""The GPU Triton kernels, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1 in a child
process, since the flag must be set before Triton is imported), against the CPU kernels.

The interpreter computes scalars in float64 where compiled kernels would use float32, so argument
typing is checked on GPUs by the NCCL suite (its zero-input case), not here."""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import torch
from adasum import kernels as ops
from adasum.core.operator import coefficients
from adasum.kernels import triton as tk
from adasum.kernels.addresses import tile_addresses
import adasum.core.tiles as tile_tables
# The interpreter pays per loop iteration of every program, masked or not: tiles of 2048 (2 iterations) instead
# of 16384 (16) keep every case's structure (segments over several tiles, tile-sized ones, tiny ones) at an
# eighth of the cost. Set before the first table is built (tables are cached).
tile_tables.TILE = 2048
tk.ITERS = tile_tables.TILE // tk.BLOCK
tk.COPY_ITERS = -(-tile_tables.TILE // tk.COPY_BLOCK)
g = torch.Generator().manual_seed(3)
g_given = torch.Generator().manual_seed(5)  # a combine op's coefficients (apart, so that `g`'s draws stay as they were)
EPS = torch.finfo(torch.float64).eps


def sum_bound(a, b, lengths):
    # The largest difference two float64 summations of the same products may show, per sum:
    # each sum of n products has |computed - exact| <= gamma(n+1) * sum |a_i b_i| (n-1 additions in
    # any order, plus one rounding per product for float64 inputs; products of narrower dtypes are
    # exact in float64), gamma(k) = k eps / (1 - k eps); two implementations differ by at most twice.
    n = torch.tensor([float(x) for x in lengths], dtype=torch.float64)
    gamma = (n + 1) * EPS / (1 - (n + 1) * EPS)
    magnitudes = ops.dot_and_norms(a.abs(), b.abs(), lengths)  # sum|a b|, sum a^2, sum b^2
    return 2 * gamma * magnitudes


def combine_bound(a, b, ca, cb, lengths, want, dtype):
    # ca a + cb b from the same sums by two implementations. Each coefficient 1 - w dot/norm takes
    # about 3 roundings of |w dot/norm| <= |c| + 1, and the float64 combination 2 more of its terms,
    # so each result is within 4 eps64 ((|ca| + 1)|a| + (|cb| + 1)|b|) of the exact value (which may
    # cancel to far below its terms); then the cast to dtype: float64 -> float32 -> dtype may round
    # twice for half types, one unit in the last place each.
    reps = torch.tensor(lengths, dtype=torch.int64)
    ca64 = torch.repeat_interleave(ca.abs() + 1, reps)
    cb64 = torch.repeat_interleave(cb.abs() + 1, reps)
    terms = ca64 * a.double().abs() + cb64 * b.double().abs()
    ulp = torch.finfo(dtype).eps * want.double().abs().clamp_min(torch.finfo(dtype).tiny)
    return 2 * 4 * EPS * terms + 2 * ulp


# segments spanning several tiles, multiples of the tile, empty ones, many tiny ones
cases = [[5, 0, 33000, 1, 0, 300], [16384, 16385, 1], [0], [7] * 12, [], [3, 0, 4]]
for number, lengths in enumerate(cases):
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)[: 4 if number == 0 else 2]:
        n = sum(lengths)
        a = torch.randn(n, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        if lengths == [3, 0, 4]:  # zero inputs: the zero guard inside the fused kernel
            a.zero_()
        ref = ops.dot_and_norms(a, b, lengths)
        got = tk.dot_and_norms(a, b, lengths)
        assert got.shape == (3, len(lengths)), got.shape
        bound = sum_bound(a, b, lengths)
        assert ((got - ref).abs() <= bound).all(), (lengths, dtype, (got - ref).abs().max())
        acc = torch.ones(3, len(lengths) + 2, dtype=torch.float64)[:, 1:-1]  # a strided [3, T] view
        tk.dot_and_norms(a, b, lengths, out=acc)
        # adding into 1 rounds once more: half an ulp of the result
        assert ((acc - (ref + 1)).abs() <= bound + EPS * (ref + 1).abs()).all(), (lengths, dtype)
        ca, cb = coefficients(ref, 2 / 5, 3 / 5)
        want, out = torch.empty_like(a), torch.full_like(a, float("nan"))
        ops.scale_add(a, b, ca, cb, lengths, want)
        tk.combine(a, b, ref, 2, 3, lengths, out)
        assert torch.isfinite(out).all() or n == 0
        bound = combine_bound(a, b, ca, cb, lengths, want, dtype)
        assert ((out.double() - want.double()).abs() <= bound).all(), (lengths, dtype)
        # per-segment worker counts (the batched single-process tree)
        counts_a = torch.arange(1, len(lengths) + 1, dtype=torch.int64)
        counts_b = torch.full((len(lengths),), 3, dtype=torch.int64)
        total = (counts_a + counts_b).double()
        ca, cb = coefficients(ref, counts_a / total, counts_b / total)
        ops.scale_add(a, b, ca, cb, lengths, want)
        tk.combine(a, b, ref, counts_a, counts_b, lengths, out)
        bound = combine_bound(a, b, ca, cb, lengths, want, dtype)
        assert ((out.double() - want.double()).abs() <= bound).all(), (lengths, dtype, "per segment")
        # a combine op's coefficients ([2, T], not Adasum's), read by the same kernel (`scale_add`)
        given = torch.randn(2, len(lengths), generator=g_given, dtype=torch.float64)
        ops.scale_add(a, b, given[0], given[1], lengths, want)
        out.fill_(float("nan"))
        tk.scale_add(a, b, given, lengths, out)
        bound = combine_bound(a, b, given[0], given[1], lengths, want, dtype)
        assert ((out.double() - want.double()).abs() <= bound).all(), (lengths, dtype, "given coefficients")
        # the symmetric-memory kernels: the partner's copy read in the same pass as the sums, in its own
        # dtype; the combination stored into several outputs at once (a local and a peer's buffer)
        for lower in (True, False) if number in (1, 3) else ():
            theirs = torch.full_like(b, float("nan"))
            acc = torch.zeros(3, len(lengths), dtype=torch.float64)
            mine, other = (a, b) if lower else (b, a)
            tk.pull_dot_and_norms(mine, other, theirs, lengths, acc, lower)
            assert torch.equal(theirs, other), (lengths, dtype, "pulled copy")
            assert ((acc - ref).abs() <= sum_bound(a, b, lengths)).all(), (lengths, dtype, lower)
        if number in (1, 3):
            outs = [torch.full_like(a, float("nan")) for _ in range(4)]
            tk.combine(a, b, ref, 2, 3, lengths, *outs)
            ca, cb = coefficients(ref, 2 / 5, 3 / 5)
            ops.scale_add(a, b, ca, cb, lengths, want)
            bound = combine_bound(a, b, ca, cb, lengths, want, dtype)
            assert ((outs[0].double() - want.double()).abs() <= bound).all(), (lengths, dtype, "several outputs")
            assert all(torch.equal(outs[0], o) for o in outs[1:]), (lengths, dtype)
            given_outs = [torch.full_like(a, float("nan")) for _ in range(4)]
            tk.scale_add(a, b, given, lengths, *given_outs)
            assert all(torch.equal(out, o) for o in given_outs), (lengths, dtype, "given, several outputs")
        # a list of tensors read and written where it lies (Scattered: per-tile addresses), over slices that
        # cut tensors: the same bits as the flat kernels on the same values
        if number in (0, 1, 3) and n and dtype in (torch.float32, torch.bfloat16):
            from adasum.core.layout import Scattered
            for lo, hi in ((0, n), (n // 3, n - n // 5)):
                parts = [a[o : o + k].clone() for o, k in zip([0, *torch.tensor(lengths).cumsum(0).tolist()], lengths)]
                scattered = Scattered([p for p in parts if p.numel()])
                first, cut = scattered.layout.overlap(lo, hi)
                theirs, theirs_flat = (torch.full((hi - lo,), float("nan"), dtype=dtype) for _ in range(2))
                got, want = (torch.zeros(3, len(cut), dtype=torch.float64) for _ in range(2))
                tk.pull_dot_and_norms(tile_addresses(scattered, lo, hi), b[lo:hi], theirs, cut, got, True)
                tk.pull_dot_and_norms(a[lo:hi].clone(), b[lo:hi], theirs_flat, cut, want, True)
                assert torch.equal(got, want) and torch.equal(theirs, theirs_flat), (lengths, dtype, lo, hi, "pull")
                peer_out = torch.full((hi - lo,), float("nan"), dtype=dtype)
                flat_out = a[lo:hi].clone()
                tk.combine(flat_out, b[lo:hi], want, 2, 3, cut, flat_out)
                view = tile_addresses(scattered, lo, hi)
                tk.combine(view, b[lo:hi], want, 2, 3, cut, view, peer_out)
                whole = torch.cat(scattered.tensors)
                assert torch.equal(whole[lo:hi], flat_out) and torch.equal(peer_out, flat_out), (lengths, dtype)
                cut_given = torch.randn(2, len(cut), generator=g_given, dtype=torch.float64)
                flat_given, peer_given = whole[lo:hi].clone(), torch.full((hi - lo,), float("nan"), dtype=dtype)
                tk.scale_add(flat_given, b[lo:hi], cut_given, cut, flat_given)
                tk.scale_add(view, b[lo:hi], cut_given, cut, view, peer_given)
                whole = torch.cat(scattered.tensors)
                assert torch.equal(whole[lo:hi], flat_given) and torch.equal(peer_given, flat_given), "given, in place"
                flat_out = flat_given
                assert torch.equal(whole[:lo], a[:lo]) and torch.equal(whole[hi:], a[hi:]), "outside: untouched"
                staged = torch.zeros(n, dtype=dtype)
                scattered.read_into(staged, lo, hi)
                assert torch.equal(staged[lo:hi], flat_out) and not staged[:lo].any(), "read_into"
                scattered.write_from(torch.zeros(n, dtype=dtype), lo, hi)
                assert not torch.cat(scattered.tensors)[lo:hi].any(), "write_from"
# the optimizer's elementwise passes: x - y and x + y, bitwise as torch rounds them, the list read and written in place
from adasum.core.layout import Scattered


def same(got, want, dtype):
    # the interpreter truncates float32 -> bfloat16 where compiled kernels round to nearest as torch does: one ulp
    if dtype == torch.bfloat16:
        return bool(((got.float() - want.float()).abs() <= torch.finfo(dtype).eps * want.float().abs()).all())
    return torch.equal(got, want)


ALL = (torch.float32, torch.bfloat16, torch.float64)
for lengths, dtypes in (([1024, 0, 32, 64], ALL), ([5, 1029, 3], (torch.float32,))):
    for dtype in dtypes:
        n = sum(lengths)
        x = torch.randn(n, generator=g).to(dtype)
        y = torch.randn(n, generator=g).to(dtype)
        out = torch.full_like(x, float("nan"))
        tk.add(x, y, out, lengths, subtract=True)
        assert same(out, torch.sub(x, y), dtype), (lengths, dtype, "flat difference")
        parts = [t.clone() for t in x.split(lengths)]
        tk.add(tile_addresses(Scattered(parts), 0, n), y, out, lengths, subtract=True)
        assert same(out, torch.sub(x, y), dtype), (lengths, dtype, "difference of a list in place")
        targets = [torch.full((k,), float("nan"), dtype=dtype) for k in lengths]
        tk.add(x, y, tile_addresses(Scattered(targets), 0, n), lengths)
        assert same(torch.cat(targets), torch.add(x, y), dtype), (lengths, dtype, "sum into a list in place")
        base = x.clone()  # the sum into the list and into x as well, from one pass (delta mode's anchor)
        tk.add(base, y, tile_addresses(Scattered(targets), 0, n), lengths, x_too=True)
        assert torch.equal(base, torch.cat(targets)) and same(base, torch.add(x, y), dtype), (lengths, dtype, "x too")
        copied = torch.full_like(x, float("nan"))
        tk.add(tile_addresses(Scattered(parts), 0, n), None, copied, lengths)  # a copy: the bits as they are
        assert torch.equal(copied, x), (lengths, dtype, "copy of a list")
        # the sums without keeping the partner's copy (the push protocol reads it where it was pushed)
        kept, read = (torch.zeros(3, len(lengths), dtype=torch.float64) for _ in range(2))
        tk.pull_dot_and_norms(x, y, torch.empty_like(y), lengths, kept, True)
        tk.pull_dot_and_norms(tile_addresses(Scattered(parts), 0, n), y, None, lengths, read, True)
        assert torch.equal(kept, read), (lengths, dtype, "sums without the kept copy")
# several moves in one copy kernel (`CopyTable`): slices of a list into flat rows (a scatter into peers' rows) and
# flat rows into slices of a list (a gather), tiles dealt in turn; the bits as they are, nothing else written
from adasum.kernels.addresses import copy_table
for dtype in (torch.float32, torch.bfloat16):
    lengths = [5000, 3, 0, 4096, 2048, 7000]
    n = sum(lengths)
    x = torch.randn(n, generator=g).to(dtype)
    parts = [t.clone() for t in x.split(lengths)]
    source = Scattered([p for p in parts if p.numel()])
    cuts = [(0, 4000), (4000, 9000), (9000, n)]
    rows = torch.full((3, 9200), float("nan"), dtype=dtype)
    moves = [((source, lo, hi), (rows[k], 0, hi - lo)) for k, (lo, hi) in enumerate(cuts)]
    table = copy_table(moves, torch.device("cpu"))
    # tiles of at most 2048 inside one tensor each: 2 in the first cut, 1 + 1 + 2 + 1 in the second, 1 + 4 in the last
    assert table.n == 12 and table.sizes.sum() == n, table.n
    tk.copy_tiles(table, x)
    for k, (lo, hi) in enumerate(cuts):
        assert torch.equal(rows[k, : hi - lo], x[lo:hi]), (dtype, k, "scattered into rows")
        assert rows[k, hi - lo :].isnan().all(), (dtype, k, "past the run: untouched")
    targets = [torch.zeros(k, dtype=dtype) for k in lengths if k]
    back = Scattered(targets)
    tk.copy_tiles(copy_table([((rows[k], 0, hi - lo), (back, lo, hi)) for k, (lo, hi) in enumerate(cuts)],
                             torch.device("cpu")), x)
    assert torch.equal(torch.cat(targets), x), (dtype, "rows into the list")
    flat = torch.zeros(n, dtype=dtype)
    tk.copy_tiles(copy_table([((x, 0, 9000), (flat, 1, 9001))], torch.device("cpu")), x)
    assert torch.equal(flat[1:9001], x[:9000]) and flat[0] == 0 and not flat[9001:].any(), (dtype, "flat to flat")
# the Gram form of the tree (`adasum.core.gram`): P rows anywhere in memory, the Gram sums, the tree's weights and
# the weighted sum, against the CPU kernels and the torch form of the weights
from adasum.core.gram import pair_ops, weights as torch_weights
from adasum.core.tree import Tree
from adasum.kernels import cpu as cpu_kernels
# one level, two and three (5 workers: a tree that is not a power of two), both dtypes: the kernels take P and the
# tree's pair list as data, so 4 and 8 workers add no path, only interpreter time (it grows with P^2)
CASES = ((2, torch.float32), (3, torch.bfloat16), (5, torch.float32))
for world, dtype in CASES:
    lengths = [5, 0, 4100, 1, 2048, 64]
    n = sum(lengths)
    pool = torch.randn(world * (n + 8), generator=g).to(dtype)
    rows = [pool[k * (n + 8) + 4 * (k % 2) : k * (n + 8) + 4 * (k % 2) + n] for k in range(world)]
    rows[-1] = torch.randn(n, generator=g).to(dtype)  # one row in another allocation, as a flat B's own row
    want = cpu_kernels.gram(rows, lengths)
    got = tk.gram(rows, lengths)
    # float64 sums of exact products (narrow dtypes): two summation orders differ by at most twice gamma(n+1)
    magnitude = cpu_kernels.gram([r.abs() for r in rows], lengths)
    gamma = torch.tensor([(k + 1) * EPS for k in lengths], dtype=torch.float64)
    assert ((got - want).abs() <= 2 * gamma * magnitude).all(), (world, dtype, "gram")
    added = tk.gram(rows, lengths, out=want.clone())  # added into `out`
    assert ((added - 2 * want).abs() <= 4 * gamma * magnitude + 1e-300).all(), (world, dtype, "gram added")
    w_got, s_got = tk.tree_weights(want, pair_ops(Tree(world)))
    w_want, s_want = torch_weights(want, Tree(world))
    assert torch.allclose(w_got, w_want, rtol=1e-12, atol=1e-14), (world, dtype, "weights")
    assert torch.allclose(s_got, s_want, rtol=1e-12, atol=1e-12), (world, dtype, "pair sums")
    out = torch.full((n,), float("nan"), dtype=dtype)
    extra = torch.full((n,), float("nan"), dtype=dtype)
    tk.weighted_sum(rows, w_want, lengths, out, extra)
    ref = torch.empty(n, dtype=dtype)
    cpu_kernels.weighted_sum(rows, w_want, lengths, ref)
    # float64 sums of P terms in two orders, then a rounding each to the dtype: at most one ulp apart
    assert torch.equal(out, extra), (world, dtype, "second output")
    ulp = torch.finfo(dtype).eps * ref.float().abs()
    assert ((out.float() - ref.float()).abs() <= ulp).all(), (world, dtype, "weighted sum")
    parts = [t.clone() for t in torch.full((n,), float("nan"), dtype=dtype).split(lengths)]
    tk.weighted_sum(rows, w_want, lengths, tile_addresses(Scattered(parts), 0, n))
    assert torch.equal(torch.cat(parts), out), (world, dtype, "weighted sum into a list in place")
    inplace = [r.clone() for r in rows]
    tk.weighted_sum(inplace, w_want, lengths, inplace[0])  # into one of the rows it reads
    assert torch.equal(inplace[0], out), (world, dtype, "weighted sum in place")
# a worker's NaN reaches every node's sums through zero weights: NaN weights, never the zero guard's 1
nan_gram = torch.full((4, 4, 2), 6.0, dtype=torch.float64)
nan_gram[3, :, 0] = float("nan")
nan_gram[:, 3, 0] = float("nan")
w_nan, _ = tk.tree_weights(nan_gram, pair_ops(Tree(4)))
assert torch.isnan(w_nan[:, 0]).all() and torch.isfinite(w_nan[:, 1]).all(), w_nan
assert torch.equal(w_nan[:, 1:], torch_weights(nan_gram, Tree(4))[0][:, 1:]), "finite column"
print("ok")
"""


def test_triton_kernels_match_cpu_kernels_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is in the test extra on Linux x86_64")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_vector_width_only_where_every_tile_allows_it():
    """The kernels are told to load 16-byte vectors only when every tile's start and size and every address
    table entry is a multiple of 16 bytes (the last case of the interpreter script runs that path)."""
    pytest.importorskip("triton", reason="Triton is in the test extra on Linux x86_64")
    import torch

    from adasum.core.layout import Scattered
    from adasum.core.tiles import tiles
    from adasum.kernels import triton as tk
    from adasum.kernels.addresses import tile_addresses
    from adasum.settings import override

    cpu = torch.device("cpu")
    f32, bf16 = torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)
    assert tk.vector_width(tiles((16384, 0, 32, 4096), cpu), bf16) == 8
    assert tk.vector_width(tiles((16384, 0, 32, 4096), cpu), f32) == 4
    assert tk.vector_width(tiles((16384, 0, 30, 4096), cpu), f32) == 1  # 30 fp32: not a multiple of 16 bytes
    with override(triton_vectors="2-byte"):
        assert tk.vector_width(tiles((16384, 0, 32, 4096), cpu), f32) == 1
        assert tk.vector_width(tiles((16384, 0, 32, 4096), cpu), bf16) == 8
    with override(triton_vectors="0"):
        assert tk.vector_width(tiles((16384, 0, 32, 4096), cpu), bf16) == 1
    assert tk.vector_width(tiles((16384, 16384 + 8, 8), cpu), bf16) == 8
    assert tk.vector_width(tiles((16384, 16385, 1), cpu), bf16) == 1  # a tile of odd size
    assert tk.vector_width(tiles((36, 4), cpu), bf16) == 1  # 36 elements: not a multiple of 8 bf16
    aligned = Scattered([torch.zeros(64, dtype=torch.bfloat16), torch.zeros(32, dtype=torch.bfloat16)])
    assert tk.vector_width(tiles((64, 32), cpu), bf16, tile_addresses(aligned, 0, 96)) == 8
    # 16 bytes in: still aligned
    assert tk.vector_width(tiles((56, 32), cpu), bf16, tile_addresses(aligned, 8, 96)) == 8
    assert not tile_addresses(aligned, 4, 96).aligned  # 8 bytes in
    odd = Scattered([torch.zeros(65, dtype=torch.bfloat16)[1:], torch.zeros(32, dtype=torch.bfloat16)])
    assert not tile_addresses(odd, 0, 96).aligned  # the first tensor starts 2 bytes into its storage
    assert tk.vector_width(tiles((64, 32), cpu), bf16, tile_addresses(odd, 0, 96)) == 1


def test_kernels_compile_for_hopper_with_vector_accesses_where_told():
    """The kernels compile for sm_90 (no GPU needed: Triton's compiler and its bundled ptxas), and the alignment
    hint turns bf16 loads and stores into 16-byte vector instructions (without it: 2-byte ones, which made bf16
    slower than fp32 per byte on 2 x H100)."""
    pytest.importorskip("triton", reason="Triton is in the test extra on Linux x86_64")
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from adasum.kernels import triton as tk

    def ptx(fn, types, constants):
        names = fn.arg_names
        signature = {n: types.get(n, "constexpr") for n in names}
        constexprs = {(names.index(k),): v for k, v in constants.items()}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if types.get(n, "").startswith("*")}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

    def vectors(text):
        return len(re.findall(r"(ld|st)\.global(\.\w+)*\.v4", text))

    for dtype in ("bf16",):  # fp32 keeps 4-byte accesses by policy (`vector_width`), so it is never told
        ints = {"starts_ptr": "*i64", "sizes_ptr": "*i64", "segs_ptr": "*i64", "counts_ptr": "*i64"}
        pull = {"mine_ptr": "*" + dtype, "peer_ptr": "*" + dtype, "theirs_ptr": "*" + dtype, "out_ptr": "*fp64",
                "mine_tiles": "*i64", **ints}
        combine = {"a_ptr": "*" + dtype, "b_ptr": "*" + dtype, "out_ptr": "*" + dtype, "out2_ptr": "*" + dtype,
                   "out3_ptr": "*" + dtype, "out4_ptr": "*" + dtype, "sums_ptr": "*fp64", "row_stride": "i64",
                   "workers_a": "i64", "workers_b": "i64", "segments": "i64", "a_tiles": "*i64", "b_tiles": "*i64",
                   "out_tiles": "*i64",
                   **ints}
        add = {"x_ptr": "*" + dtype, "y_ptr": "*" + dtype, "out_ptr": "*" + dtype, "x_tiles": "*i64",
               "out_tiles": "*i64", **ints}
        copy = {"like_ptr": "*" + dtype, "sources_ptr": "*i64", "targets_ptr": "*i64", "sizes_ptr": "*i64",
                "n": "i64", "programs": "i64"}
        for align in (1, 8 if dtype == "bf16" else 4):
            rows, fold, _ = tk.sum_steps(align, tk.PAIR_STEPS, tk.PAIR_PLAIN)
            found = [
                vectors(ptx(tk.pull_tile_sums_kernel, pull, {"R": rows, "F": fold, "ITERS": 8, "LOWER": True,
                                                              "MINE_TILES": True, "ALIGN": align, "KEEP": True})),
                vectors(ptx(tk.combine_kernel, combine, {"BLOCK": tk.BLOCK, "ITERS": tk.ITERS, "PER_SEGMENT": False,
                                                          "OUTS": 2, "A_TILES": True, "B_TILES": False,
                                                          "OUT_TILES": True, "ALIGN": align})),
                vectors(ptx(tk.add_kernel, add, {"BLOCK": tk.BLOCK, "ITERS": tk.ITERS, "MODE": 2, "X_TOO": False,
                                                  "X_TILES": True, "OUT_TILES": False, "ALIGN": align})),
                vectors(ptx(tk.copy_tiles_kernel, copy, {"BLOCK": tk.COPY_BLOCK, "ITERS": tk.COPY_ITERS, "ROUNDS": 4,
                                                          "ALIGN": align})),
            ]
            if align == 1:
                assert found == [0, 0, 0, 0], (dtype, found)
            else:
                assert all(n > 0 for n in found), (dtype, found)
