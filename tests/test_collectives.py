"""adasum.all_reduce on real spawned process groups (gloo here; NCCL with ADASUM_TEST_BACKEND=nccl),
against the independent NumPy tree of `reference.py` within its error bound (`combine_with_bound`: computed
in float64, stored in the tensors' dtype), with bitwise agreement across ranks."""

import pytest
import torch

import adasum
from adasum.settings import override

import distributed
from reference import combine_with_bound

pytestmark = pytest.mark.nccl

SIZES = [1, 0, 7, 33, 5, 1000, 3, 0, 64, 129, 2, 17, 8, 511, 1, 1, 90, 4, 12, 6, 250, 31, 2, 9, 77, 3, 14, 1, 40, 5]


def worker_data(seed: int, world: int, shapes, dtype=torch.float32):
    """Every rank's tensors, generated identically on each rank so any rank can build the reference."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes] for _ in range(world)]


def error_and_bound(x, per_rank, index) -> tuple[float, float]:
    """The 2-norm distance of `x` from the reference tree of every rank's tensor `index`, and the bound on it
    for a result computed in float64 and stored in the tensors' dtype (`reference.combine_with_bound`)."""
    ref, bound = combine_with_bound([per_rank[r][index] for r in range(len(per_rank))])
    return float((x.detach().double().cpu().reshape(-1) - ref.reshape(-1)).norm()), bound


def within_bound(x, per_rank, index) -> bool:
    err, bound = error_and_bound(x, per_rank, index)
    return err <= bound


def checks(rank, world):
    """Many checks in one spawn; returns the results' bytes for the cross-rank bitwise comparison."""
    dev = distributed.device_for(rank)
    out = {}

    # dozens of fused tensors of odd sizes (zero-size included), fp32 and fp64, against the reference
    for dtype in (torch.float32, torch.float64):
        data = worker_data(10 + world, world, [(n,) for n in SIZES], dtype)
        mine = [t.clone().to(dev) for t in data[rank]]
        adasum.all_reduce(mine)
        for i, t in enumerate(mine):
            if t.numel():
                assert within_bound(t, data, i), (dtype, i, error_and_bound(t, data, i))
        out[f"fused-{dtype}"] = torch.cat([t.cpu().reshape(-1) for t in mine]).numpy().tobytes()

    # multi-dimensional tensors, one call, mixed dtypes
    shapes = [(3, 5), (2, 2, 3), (7,)]
    data32 = worker_data(20, world, shapes, torch.float32)
    data64 = worker_data(21, world, shapes, torch.float64)
    mixed = [data32[rank][0].clone(), data64[rank][1].clone(), data32[rank][2].clone()]
    mixed = [t.to(dev) for t in mixed]
    adasum.all_reduce(mixed)
    assert mixed[1].dtype == torch.float64 and mixed[0].shape == (3, 5)
    assert within_bound(mixed[0], data32, 0), error_and_bound(mixed[0], data32, 0)
    assert within_bound(mixed[1], data64, 1), error_and_bound(mixed[1], data64, 1)
    assert within_bound(mixed[2], data32, 2), error_and_bound(mixed[2], data32, 2)
    out["mixed"] = b"".join(t.cpu().numpy().tobytes() for t in mixed)

    # a single tensor passed alone, larger than the world and odd
    single = worker_data(30, world, [(1001,)])
    t = single[rank][0].clone().to(dev)
    adasum.all_reduce(t)
    assert within_bound(t, single, 0), error_and_bound(t, single, 0)
    out["single"] = t.cpu().numpy().tobytes()

    # orthogonal inputs give the sum; parallel inputs with random signed scales give the mean
    for n in (world * 20 - 17, world * 2 + 1, world + 2):
        q, _ = torch.linalg.qr(torch.randn(n, world, generator=torch.Generator().manual_seed(n), dtype=torch.float64))
        t = q[:, rank].clone().to(dev)
        adasum.all_reduce(t)
        assert torch.allclose(t.cpu(), q.sum(dim=1), atol=1e-12), n
    g = torch.Generator().manual_seed(40)
    v = torch.randn(45, generator=g, dtype=torch.float64)
    scales = torch.randn(world, generator=g, dtype=torch.float64) * 5
    t = (scales[rank] * v).to(dev)
    adasum.all_reduce(t)
    assert torch.allclose(t.cpu(), scales.mean() * v, rtol=1e-10, atol=1e-12)

    # Horovod's stability cases: parallel vectors at the ends of float32's range
    base = torch.tensor([0.5, -0.25, 0.75, 1.0, 0.125], dtype=torch.float64)
    for e in (-126, -60, 0, 60, 126):
        exps = [e if r % 2 else -e for r in range(world)]
        t = (base * 2.0 ** exps[rank]).float().to(dev)
        adasum.all_reduce(t)
        expected = sum(base * 2.0**x for x in exps) / world
        assert torch.isfinite(t).all()
        assert torch.allclose(t.cpu().double(), expected.float().double(), rtol=1e-6, atol=0), e

    # bf16 and fp16 within their precision: the tree of the half-precision inputs, computed in float64, every
    # node stored in the half dtype (the bound's store roundoff is the dtype's)
    for dtype in (torch.bfloat16, torch.float16):
        data = worker_data(50, world, [(300,), (41,)], dtype)
        mine = [x.clone().to(dev) for x in data[rank]]
        adasum.all_reduce(mine)
        for i in range(2):
            assert mine[i].dtype == dtype
            assert within_bound(mine[i], data, i), (dtype, i, error_and_bound(mine[i], data, i))
        out[f"half-{dtype}"] = b"".join(x.cpu().view(torch.int16).numpy().tobytes() for x in mine)

    # zero inputs never give NaN; an empty list and zero-size tensors are fine
    z = torch.zeros(10, device=dev)
    adasum.all_reduce(z)
    assert torch.equal(z.cpu(), torch.zeros(10))
    adasum.all_reduce([])
    empties = [torch.zeros(0, device=dev), torch.zeros(0, 3, device=dev)]
    adasum.all_reduce(empties)

    # non-finite values propagate identically on every rank
    nan = torch.ones(6, device=dev)
    if rank == world - 1:
        nan[2] = float("nan")
    adasum.all_reduce([nan, torch.ones(4, device=dev)])
    if world > 1:
        assert torch.isnan(nan).all()
    out["nan"] = nan.cpu().numpy().tobytes()

    # bad input: a clear error on every rank, never a hang
    errors = {}
    bad_cases = {
        "count": [torch.ones(3, device=dev)] * (2 if rank == world - 1 else 1),
        "shape": [torch.ones(3 if rank == world - 1 else 4, device=dev)],
        "dtype": [torch.ones(3, device=dev, dtype=torch.float64 if rank == world - 1 else torch.float32)],
    }
    for name, tensors in bad_cases.items():
        try:
            adasum.all_reduce(tensors)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    for kind in (torch.int64, torch.bool, torch.complex64):
        with pytest.raises(TypeError):
            adasum.all_reduce([torch.ones(3, device=dev, dtype=kind)])
    out["errors"] = errors
    return out


@pytest.mark.parametrize("world", distributed.world_sizes(1, 2, 3, 4, 5, 6, 7, 8))
def test_all_reduce_matches_reference_and_is_bitwise_identical(world):
    results = distributed.run(world, checks)
    distributed.assert_ranks_agree(results, skip=("errors",))
    for r in range(world):
        errors = results[r]["errors"]
        if world == 1:
            assert all(v is None for v in errors.values())
            continue
        assert "rank 0 passed 1, rank" in errors["count"] and "passed 2" in errors["count"]
        assert "index 0" in errors["shape"] and "[4]" in errors["shape"] and "[3]" in errors["shape"]
        assert "float64" in errors["dtype"] and "float32" in errors["dtype"]


def test_world_size_one_leaves_inputs_unchanged():
    def_ = distributed.run(1, _identity_body)
    assert def_ == [True]


def _named_backends_body(rank, world):
    """A group whose backend is given per device type ("cpu:gloo,cuda:nccl", what ``init_process_group()`` makes
    with no backend on a GPU host; "cpu:gloo" on gloo): its tensors are combined as on a plain group."""
    import torch.distributed as dist

    group = dist.new_group(backend="cpu:gloo,cuda:nccl" if distributed.BACKEND == "nccl" else "cpu:gloo")
    dev = distributed.device_for(rank)
    data = worker_data(5, world, [SIZES[i] for i in range(12)])
    mine = [x.clone().to(dev) for x in data[rank]]
    adasum.all_reduce(mine, group=group)
    assert all(within_bound(mine[i], data, i) for i in range(len(mine)))
    return b"".join(x.cpu().numpy().tobytes() for x in mine)


@pytest.mark.parametrize("world", distributed.world_sizes(2, 3))
def test_a_group_of_backends_named_per_device_type_combines_as_a_plain_one(world):
    distributed.assert_ranks_agree(distributed.run(world, _named_backends_body))


def _identity_body(rank, world):
    t = torch.randn(17).to(distributed.device_for(rank))
    before = t.clone()
    adasum.all_reduce(t)
    return bool(torch.equal(t, before))


def async_errors_body(rank, world):
    """all_reduce_async's wrong arguments, each raised by the call (the same on every rank), naming it."""
    errors = []
    device = distributed.device_for(rank)
    for kwargs in (dict(group="world"), dict(nonfinite="skip"), dict(check_layout="no"), dict(check_layout=None)):
        try:
            adasum.all_reduce_async([torch.ones(2, device=device)], **kwargs)
            errors.append(None)
        except (TypeError, ValueError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    try:
        adasum.all_reduce_async([torch.ones(2, dtype=torch.int64, device=device)])
    except TypeError as error:
        errors.append(str(error))
    try:
        adasum.all_reduce([torch.ones(2, device=device)], check_layout="no")
    except TypeError as error:
        errors.append(str(error))
    # the two entry points are one collective: ranks may mix them
    t = torch.full((3,), float(rank + 1), device=device)
    adasum.all_reduce_async(t).wait() if rank == 0 else adasum.all_reduce(t)
    return errors, t.tolist()


@pytest.mark.parametrize("world", distributed.world_sizes(2))  # NCCL: one GPU per rank
def test_all_reduce_async_refuses_bad_arguments_naming_itself(world):
    results = distributed.run(world, async_errors_body)
    assert results[0][0] == results[1][0]
    assert results[0][0] == [
        "TypeError: adasum.all_reduce_async: group must be a torch.distributed ProcessGroup or None, got 'world'; "
        "pass dist.new_group(...) or None",
        "ValueError: adasum.all_reduce_async: nonfinite must be one of ['propagate', 'raise'], got 'skip'; pass one "
        "of them",
        "TypeError: adasum.all_reduce_async: check_layout must be True or False, got 'no'; pass a bool",
        "TypeError: adasum.all_reduce_async: check_layout must be True or False, got None; pass a bool",
        "adasum.all_reduce_async: on rank 0, tensor 0 has dtype torch.int64; only floating-point tensors can be "
        "combined",
        "adasum.all_reduce: check_layout must be True or False, got 'no'; pass a bool",
    ]
    assert results[0][1] == results[1][1] == [1.5] * 3  # parallel inputs: their mean


def large_buffers(rank, world):
    """Tensors larger than one pipelined gloo message, crossing message boundaries (the message size
    is shrunk from 2**20 to 1000 elements so the buffers stay small)."""
    sizes = [3001, 17, 1500, 5, 0, 2222]
    data = worker_data(60, world, [(n,) for n in sizes])
    mine = [t.clone().to(distributed.device_for(rank)) for t in data[rank]]
    with override(piece_elements=(1000, 1000)):
        adasum.all_reduce(mine)
    errs = [error_and_bound(mine[i], data, i) for i in range(len(sizes))]
    return errs, b"".join(t.cpu().numpy().tobytes() for t in mine)


@pytest.mark.parametrize("world", distributed.world_sizes(2, 3, 4))
def test_large_buffers_agree_with_reference(world):
    results = distributed.run(world, large_buffers)
    assert all(err <= bound for err, bound in results[0][0]), results[0][0]
    assert all(r[1] == results[0][1] for r in results)


def repeated_single_tensors(rank, world):
    """Single contiguous tensors (no fusion: on NCCL the symmetric transport stages them), called four
    times on the same tensors with new values: eager, CUDA-graph capture, replays."""
    dev = distributed.device_for(rank)
    sizes = [50_000, 4097, 1]
    tensors = [torch.empty(n, device=dev) for n in sizes]
    errs, results = [], []
    for call in range(4):
        data = worker_data(70 + call, world, [(n,) for n in sizes])
        for i, t in enumerate(tensors):
            t.copy_(data[rank][i])
            adasum.all_reduce(t)
            errs.append(error_and_bound(t, data, i))
        results.append(b"".join(t.cpu().numpy().tobytes() for t in tensors))
    return errs, results


@pytest.mark.parametrize("world", distributed.world_sizes(2, 4))
def test_repeated_single_tensors_agree_with_reference(world):
    results = distributed.run(world, repeated_single_tensors)
    assert all(err <= bound for err, bound in results[0][0]), results[0][0]
    assert all(r[1] == results[0][1] for r in results)


def alternating_lists(rank, world):
    """Two lists called in turn (one per parameter group, say), new values each call: on NCCL both are captured,
    then each replays from the group's recent lists though the other was called in between."""
    from adasum.transport import communicator as communicators

    dev = distributed.device_for(rank)
    shapes = {"a": [(64, 3, 7), (64,), (300, 20)], "b": [(1000, 10), (4096,), (3, 5)]}
    lists = {k: [torch.empty(s, device=dev) for s in v] for k, v in shapes.items()}
    errs, results = [], []
    for call in range(4):  # eager, captured, replayed twice
        for j, k in enumerate("ab"):
            data = worker_data(90 + 2 * call + j, world, shapes[k])
            for t, d in zip(lists[k], data[rank]):
                t.copy_(d)
            adasum.all_reduce(lists[k])
            errs.extend(error_and_bound(t, data, i) for i, t in enumerate(lists[k]))
            results.append(b"".join(t.cpu().numpy().tobytes() for t in lists[k]))
    comm = communicators.communicator(None)
    return errs, results, comm.graphs.count(), len(comm.recent)


@pytest.mark.parametrize("world", distributed.world_sizes(2, 3, 4))
def test_alternating_lists_agree_with_reference_and_replay(world):
    results = distributed.run(world, alternating_lists)
    assert all(err <= bound for err, bound in results[0][0]), results[0][0]
    assert all(r[1] == results[0][1] for r in results)
    captured = 2 if distributed.BACKEND == "nccl" else 0  # no graphs on the CPU
    assert all(r[2:] == (captured, captured) for r in results), [r[2:] for r in results]


def mixed_contiguity(rank, world):
    """Rank 1 passes a transposed (non-contiguous) view where the others pass contiguous tensors: on NCCL
    the symmetric transport then fuses rank 1's list into its staging buffer while the others' lists are
    read in place (`Scattered`), and with pieces of 4 KiB every half is pipelined; the ranks must still
    run the same barriers (a different count hangs) and agree bitwise with the reference."""
    dev = distributed.device_for(rank)
    shapes = [(64, 48), (3000,), (5, 7)]
    data = worker_data(80, world, shapes)
    mine = []
    for i, t in enumerate(data[rank]):
        if rank == 1 and i == 0:
            view = torch.empty(t.shape[::-1], device=dev).t()  # same shape, column-major
            view.copy_(t)
            assert not view.is_contiguous()
            mine.append(view)
        else:
            mine.append(t.clone().to(dev))
    errs, results = [], []
    for _ in range(3):  # eager, captured, replayed
        for t, d in zip(mine, data[rank]):
            t.copy_(d)
        adasum.all_reduce(mine)
        errs.extend(error_and_bound(t, data, i) for i, t in enumerate(mine))
        results.append(b"".join(t.cpu().contiguous().numpy().tobytes() for t in mine))
    return errs, results


@pytest.mark.parametrize("world", distributed.world_sizes(2))  # the pipelined case: groups of two
def test_ranks_that_differ_in_contiguity_agree(world):
    results = distributed.run(world, mixed_contiguity, env={"ADASUM_SYMMETRIC_CHUNK_BYTES": "4096"})
    assert all(err <= bound for err, bound in results[0][0]), results[0][0]
    assert all(r[1] == results[0][1] for r in results)
