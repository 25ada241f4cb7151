"""Issue 12, items 1, 7, 10, 11: every reducer checks before data moves that the ranks agree on
the layout (count, shapes or sizes, dtypes, device type) and that no rank's input has a local
problem (non-floating, sparse, wrong device, a leaf that requires grad, overlapping views); every
rank raises the same error at once, never a silent result, a signal death or a wait for the
timeout. A dead peer gives CollectiveError on every reducer; local errors stay themselves."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

import adasum
from adasum.checks import agreement
from adasum.reducers import AdaCons, Adasum, Mean, Sum
from adasum.transport.errors import CollectiveError, failures_named, is_transport_error

import distributed
from reference import U32, U64, combine_with_bound, error_of, gamma, mean_with_bound, sum_with_bound
from reference_adacons import AdaConsReference

FAST_S = 3.0  # every error must come well before the test group's timeout


def _reducers():
    return {
        "sum": Sum(),
        "mean": Mean(),
        "adasum": Adasum(),
        "adasum-whole": Adasum(per_tensor=False),
        "adacons": AdaCons(),
        "adasum-hierarchical": Adasum(hierarchical=True, local_size=2),
    }


def _bad_inputs(rank: int) -> dict:
    """Per case: a callable (reducer -> None) that passes this rank's bad input."""
    last = rank == 1
    x = torch.zeros(10)
    leaf = torch.zeros(3, requires_grad=True)
    sparse = torch.zeros(4).to_sparse()
    return {
        # item 1: the cases (shapes [3],[1] against [1],[3]; counts; sizes; dtypes)
        "shapes": lambda r: r.all_reduce([torch.ones(1), torch.ones(3)] if last else [torch.ones(3), torch.ones(1)]),
        "count": lambda r: r.all_reduce([torch.ones(3) for _ in range(2 if last else 1)]),
        "dtype": lambda r: r.all_reduce([torch.ones(3, dtype=torch.float64 if last else torch.float32)]),
        "flat-sizes": lambda r: r.all_reduce_flat(torch.ones(4), [1, 3] if last else [3, 1]),
        "flat-numel": lambda r: r.all_reduce_flat(torch.ones(5 if last else 4), [5] if last else [4]),
        "flat-sum": lambda r: r.all_reduce_flat(torch.ones(5 if last else 4), [1, 3]),
        # item 7: a device the gloo backend does not serve, on one rank
        "meta": lambda r: r.all_reduce([torch.ones(3, device="meta" if last else "cpu")]),
        # item 11: local problems, on one rank, raised on every rank before data moves
        "requires-grad": lambda r: r.all_reduce([leaf if last else torch.zeros(3)]),
        "sparse": lambda r: r.all_reduce([sparse if last else torch.zeros(4)]),
        "overlap": lambda r: r.all_reduce([x[:6], x[4:]] if last else [torch.zeros(6), torch.zeros(6)]),
        "integer": lambda r: r.all_reduce([torch.ones(3, dtype=torch.int64 if last else torch.float32)]),
        "integer-everywhere": lambda r: r.all_reduce([torch.ones(3, dtype=torch.int64)]),
        # a keyword option the reducer does not take (Adasum's all_reduce dropped them: NaN came out, no error)
        "keyword": lambda r: _unchanged(
            lambda t: r.all_reduce(t, nonfinite="raise"), [torch.tensor([float("nan") if last else 1.0, 2.0])]
        ),
        # a negative segment size (Adasum took [6, -2] over 4 elements as one segment)
        "negative-size": lambda r: _unchanged(lambda b: r.all_reduce_flat(b[0], [6, -2]), [torch.arange(4.0) + rank]),
        # float segment sizes: on one rank (cut to ints first, the error named a sum of 3) and on every rank (taken)
        "float-size": lambda r: _unchanged(
            lambda b: r.all_reduce_flat(b[0], [2.5, 1.5] if last else [2, 2]), [torch.arange(4.0) + rank]
        ),
        "float-sizes-everywhere": lambda r: _unchanged(
            lambda b: r.all_reduce_flat(b[0], [2.0, 2.0]), [torch.arange(4.0) + rank]
        ),
    }


def _unchanged(call, tensors: list[torch.Tensor]) -> None:
    """``call(tensors)``, and whether it returns or raises, `tensors` hold what they held (NaN included)."""
    before = [t.numpy().tobytes() for t in tensors]
    try:
        call(tensors)
    finally:
        assert [t.numpy().tobytes() for t in tensors] == before, "a refused call changed its input"


def bad_input_body(rank, world, names):
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=20))
    out = {}
    for name, reducer in _reducers().items():
        if name not in names:
            continue
        for case, call in _bad_inputs(rank).items():
            start = time.monotonic()
            try:
                call(_bound(reducer, group))
                out[(name, case)] = None
            except (ValueError, TypeError) as error:
                out[(name, case)] = (type(error).__name__, str(error))
            assert time.monotonic() - start < FAST_S, (name, case, time.monotonic() - start)
        # the group is still usable after every refusal: a good call agrees bitwise across ranks (the test) and
        # equals the independent reference of this call alone (the refusals moved no data and left no state)
        t = _after_inputs(rank)
        reducer.all_reduce(t, group)
        _check_after(name, reducer, [_after_inputs(r) for r in range(world)], t)
        out[(name, "after")] = torch.cat(t).numpy().tobytes()
    return out


def _after_inputs(rank: int) -> list[torch.Tensor]:
    """A rank's tensors for the good call after the refusals: small integers, so that the sum and the mean of
    two ranks, their float32 all-reduces and the float64 dot products of AdaCons and Adasum are exact."""
    return [torch.full((3,), float(rank + 1)), torch.full((2,), float(2 * rank - 1))]


def _check_after(name: str, reducer, per_worker: list[list[torch.Tensor]], got: list[torch.Tensor]) -> None:
    """`got` (this rank's result of the good call) against the independent reference, within its error bound
    (g_n = n u/(1 - n u); P ranks; 2-norms, an element-wise bound's 2-norm bounding the error's):

    * sum and mean, and hierarchical Adasum with one node of `local_size` = P ranks (the node mean; Adasum over
      a single node leaves it as it is): `reference.sum_with_bound`, `reference.mean_with_bound`;
    * Adasum: `reference.combine_with_bound` per tensor, whole-model over the tensors (one dtype) concatenated;
    * AdaCons: `reference_adacons` (a fresh one: the reducer's first call that went through). Its mean and its
      float64 dot products are exact here, the float64 weights ``w_i = c_i |m| / |g_i|`` are off by a few
      float64 roundings (allowed: g_32(U64) relative); each rank rounds ``w_i`` to float32 and multiplies
      (2 roundings), the weighted-sum all-reduce adds P terms (P - 1): ``(g_{P+1}(U32) + g_32(U64))
      sum_i |w_i g_i| <= (...) |m| sum_i |g_i| / |g_i|_2``, element by element."""
    p = len(per_worker)
    x = [np.stack([w[i].double().reshape(-1).numpy() for w in per_worker]) for i in range(len(got))]
    if name in ("sum", "mean", "adasum-hierarchical"):
        if name == "adasum-hierarchical":
            assert reducer.hierarchical is True and reducer.local_size == p  # one node: its mean
        with_bound = sum_with_bound if name == "sum" else mean_with_bound
        for i, t in enumerate(got):
            ref, bound = with_bound([w[i] for w in per_worker])
            assert error_of(t, ref) <= bound, (name, i, t, ref, error_of(t, ref), bound)
    elif name == "adasum":
        for i, t in enumerate(got):
            ref, bound = combine_with_bound([w[i] for w in per_worker])
            assert error_of(t, ref) <= bound, (name, i, t, ref, error_of(t, ref), bound)
    elif name == "adasum-whole":
        ref, bound = combine_with_bound([torch.cat([t.reshape(-1) for t in w]) for w in per_worker])
        assert error_of(torch.cat(got), ref) <= bound, (name, got, ref, error_of(torch.cat(got), ref), bound)
    elif name == "adacons":
        reference = AdaConsReference(reducer.momentum, reducer.per_tensor, reducer.scale)
        ref = np.concatenate([r.reshape(-1) for r in reference([[w.numpy() for w in ws] for ws in per_worker])])
        g = [np.concatenate([x[i][r] for i in range(len(got))]) for r in range(p)]
        mean_norm = np.linalg.norm(sum(g) / p)
        bound = (gamma(p + 1, U32) + gamma(32, U64)) * mean_norm * np.linalg.norm(
            sum(np.abs(v) / np.linalg.norm(v) for v in g))
        err = float(np.linalg.norm(torch.cat(got).double().numpy() - ref))
        assert err <= bound, (name, got, ref, err, bound)
    else:
        raise AssertionError(f"no reference for {name}")


class _bound:
    """A reducer with the group filled in."""

    def __init__(self, reducer, group):
        self.reducer, self.group = reducer, group

    def all_reduce(self, tensors, **options):
        self.reducer.all_reduce(tensors, self.group, **options)

    def all_reduce_flat(self, buffer, sizes, **options):
        self.reducer.all_reduce_flat(buffer, sizes, self.group, **options)


EXPECTED = {
    "shapes": ("ValueError", "tensors differ across ranks at index 0: "
        "rank 0 has float32 [3] on cpu, rank 1 has float32 [1]"),
    "count": ("ValueError", "tensors differ across ranks: rank 0 passed 1, rank 1 passed 2"),
    "dtype": ("ValueError", "rank 0 has float32 [3] on cpu, rank 1 has float64 [3] on cpu"),
    "flat-sizes": ("ValueError", "bucket segments differ across ranks at index 0: rank 0 has float32 [3] on cpu"),
    "flat-numel": ("ValueError", "rank 0 has float32 [4] on cpu, rank 1 has float32 [5] on cpu"),
    "flat-sum": ("ValueError", "on rank 1, sizes add up to 4 elements, the buffer has 5"),
    "meta": ("ValueError", "rank 0 has float32 [3] on cpu, rank 1 has float32 [3] on meta"),
    "requires-grad": ("ValueError", "tensor 0 is a leaf that requires grad"),
    "sparse": ("TypeError", "tensor 0 is sparse_coo; only dense (strided) tensors can be combined"),
    "overlap": ("ValueError", "tensors 0 and 1 share memory (overlapping views of one storage)"),
    "integer": ("ValueError", "rank 0 has float32 [3] on cpu, rank 1 has int64 [3] on cpu"),
    "integer-everywhere": ("TypeError", "tensor 0 has dtype torch.int64; only floating-point tensors can be combined"),
    "keyword": ("TypeError", "unexpected keyword argument 'nonfinite'"),
    "negative-size": ("ValueError", "on rank 0, sizes must be >= 0, got -2 at index 1"),
    "float-size": ("ValueError", "segments differ across ranks at index 0: rank 0 has float32 [2] on cpu, "
        "rank 1 has float32 [2.5] on cpu"),
    "float-sizes-everywhere": ("TypeError", "on rank 0, sizes must be integers, got 2.0 at index 0"),
}


def _exact(name: str, case: str) -> str | None:
    """The whole message of the cases whose every word is fixed."""
    cls = type(_reducers()[name]).__name__
    if case == "keyword":
        takes = "check_layout and key" if cls == "AdaCons" else "check_layout only"
        return f"adasum.{cls}.all_reduce: unexpected keyword argument 'nonfinite'; {cls} takes {takes}: remove it"
    if case == "negative-size":
        return f"adasum.{cls}.all_reduce_flat: on rank 0, sizes must be >= 0, got -2 at index 1"
    if case == "float-sizes-everywhere":
        return f"adasum.{cls}.all_reduce_flat: on rank 0, sizes must be integers, got 2.0 at index 0"
    return None


@pytest.mark.parametrize("names", [("sum", "mean", "adasum"), ("adasum-whole", "adacons", "adasum-hierarchical")])
def test_every_reducer_refuses_bad_input_on_every_rank_at_once(names):
    results = distributed.run(2, bad_input_body, names, timeout_s=60)
    distributed.assert_ranks_agree(results)
    for (name, case), got in results[0].items():
        if case == "after":
            continue
        kind, text = EXPECTED[case]
        assert got is not None, (name, case, "no error")
        assert got[0] == kind and text in got[1], (name, case, got)
        assert got[1].startswith(f"adasum.{type(_reducers()[name]).__name__}.all_reduce"), (name, case, got)
        assert _exact(name, case) in (None, got[1]), (name, case, got)


def overlap_body(rank, world):
    """Interleaved views of one storage are not overlapping; they are combined like separate tensors."""
    x = torch.arange(10, dtype=torch.float32) * (rank + 1)
    y = x.clone()
    Adasum().all_reduce([x[::2], x[1::2]])
    separate = [y[::2].clone(), y[1::2].clone()]
    Adasum().all_reduce(separate)
    return bool(torch.equal(x[::2], separate[0]) and torch.equal(x[1::2], separate[1]))


def test_interleaved_views_are_allowed():
    assert distributed.run(2, overlap_body) == [True, True]
    x = torch.zeros(10)
    assert agreement.overlapping([x[::2], x[1::2]]) is None
    assert agreement.overlapping([x[:6], x[4:]]) == (0, 1)
    assert agreement.overlapping([x, torch.zeros(3), x]) == (0, 2)
    w = torch.zeros(4, 6)
    assert agreement.overlapping([w[:, :3], w[:, 3:]]) is None


def world3_body(rank, world):
    """World 3: rank 1 alone has a problem; ranks 0 and 2 name it too (the lowest such rank)."""
    out = {}
    leaf = torch.zeros(3, requires_grad=True)
    for name, reducer in (("mean", Mean()), ("adasum", Adasum())):
        try:
            reducer.all_reduce([leaf if rank in (1, 2) else torch.zeros(3)])
            out[name] = None
        except ValueError as error:
            out[name] = str(error)
    # adasum.all_reduce takes the same collective check
    try:
        adasum.all_reduce([torch.zeros(3, requires_grad=rank == 2)])
        out["api"] = None
    except ValueError as error:
        out["api"] = str(error)
    # a transport name that does not exist: the message of a world of one (test_transport_typo_on_one_process)
    try:
        adasum.all_reduce([torch.zeros(3)], transport="bogus")
        out["transport"] = None
    except ValueError as error:
        out["transport"] = str(error)
    return out


def test_world_three_names_the_lowest_rank_with_a_problem():
    results = distributed.run(3, world3_body)
    distributed.assert_ranks_agree(results)
    assert "tensor 0 is a leaf that requires grad" in results[0]["mean"] and "on rank 1" in results[0]["mean"]
    assert "tensor 0 is a leaf that requires grad" in results[0]["adasum"] and "on rank 1" in results[0]["adasum"]
    assert results[0]["api"] is not None and "requires grad" in results[0]["api"] and "on rank 2" in results[0]["api"]
    assert results[0]["transport"] == BOGUS_TRANSPORT.format(operation="adasum.all_reduce")


BOGUS_TRANSPORT = ("{operation}: transport must be one of ['p2p', 'collectives', 'symmetric', 'slices', 'one-shot'] "
                   "or None, got 'bogus'; pass one of them, or None to let adasum choose")


def test_transport_typo_on_one_process():
    """A transport name is checked before the one-rank shortcut: a typo raises at world size 1 as at 3."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = [torch.ones(3)]
        for call in (adasum.all_reduce, adasum.all_reduce_async):
            operation = f"adasum.{call.__name__}"
            with pytest.raises(ValueError) as info:
                call(t, transport="bogus")
            assert str(info.value) == BOGUS_TRANSPORT.format(operation=operation)
            with pytest.raises(TypeError) as info:
                call(t, transport=2)
            assert str(info.value) == (f"{operation}: transport must be one of ['p2p', 'collectives', 'symmetric', "
                                       "'slices', 'one-shot'], a Transport or None, got 2; pass one of them, or "
                                       "None to let adasum choose")
            call(t, transport="p2p")  # a name that exists: nothing to combine on one rank
        assert torch.equal(t[0], torch.ones(3))
    finally:
        dist.destroy_process_group()


def dead_peer_body(rank, world, name):
    dist.barrier()
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=3))
    dist.barrier(group=group)
    reducer = {"sum": Sum(), "mean": Mean(), "adacons": AdaCons()}[name]
    if rank == 1:
        os._exit(17)
    time.sleep(0.5)
    start = time.monotonic()
    try:
        reducer.all_reduce([torch.ones(5)], group, check_layout=False)
    except CollectiveError as error:
        return (str(error), time.monotonic() - start)
    return None


@pytest.mark.parametrize("name", ["sum", "mean", "adacons"])
def test_dead_peer_is_a_collective_error_on_every_reducer(name):
    results = distributed.run(2, dead_peer_body, name, allow_exit=True, timeout_s=30)
    message, elapsed = results[0]
    assert isinstance(results[1], distributed.Exited)
    assert f"adasum.{type(_reducers()[name]).__name__}.all_reduce on rank 0 of 2" in message, message
    assert "a peer died, stalled past the timeout" in message and elapsed < 3 + 2


def test_local_errors_are_not_blamed_on_peers():
    assert is_transport_error(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed"))
    assert is_transport_error(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    local = RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    assert not is_transport_error(local)
    with pytest.raises(RuntimeError) as info:
        with failures_named("adasum.all_reduce", "the exchange", None):
            raise local
    assert info.value is local and not isinstance(info.value, CollectiveError)
    with pytest.raises(ValueError):
        with failures_named("adasum.all_reduce", "the exchange", None):
            raise ValueError("local")


def test_single_process_checks():
    """Without peers the local problems are still found (a world of one)."""
    problem = agreement.local_problem([torch.zeros(3, requires_grad=True)], torch.device("cpu"))
    assert problem is not None and problem.error == "ValueError"
    with torch.no_grad():
        assert agreement.local_problem([torch.zeros(3, requires_grad=True)], torch.device("cpu")) is None
    assert agreement.local_problem([torch.zeros(3).to_sparse()], None).error == "TypeError"
    assert agreement.local_problem([torch.zeros(3, dtype=torch.int32)], None).error == "TypeError"
    assert agreement.local_problem([torch.zeros(3, dtype=torch.int32)], None, floating=False) is None


def _autograd_case(case: str, rank: int) -> torch.Tensor:
    """Rank 1's tensor an in-place write cannot take (`case`), the others' plain."""
    if rank != 1:
        return torch.ones(4)
    if case == "view":
        return torch.ones(8, requires_grad=True)[2:6]
    if case == "non-leaf":
        return torch.ones(4, requires_grad=True) * 2
    with torch.inference_mode():
        return torch.ones(4)


AUTOGRAD_CASES = {
    "view": "on rank 1, tensor 0 is a view of a tensor that requires grad, which an in-place collective cannot "
            "write; pass t.detach() (or call under torch.no_grad())",
    "non-leaf": "on rank 1, tensor 0 is the output of an operation autograd records (it requires grad), which an "
                "in-place collective cannot write; pass t.detach() (or call under torch.no_grad())",
    "inference": "on rank 1, tensor 0 is an inference tensor (made under torch.inference_mode()), which an in-place "
                 "collective cannot write outside inference mode; pass t.clone() (made outside it)",
}


def autograd_body(rank, world):
    out = {}
    for case in AUTOGRAD_CASES:
        for name, call in (("adasum.all_reduce", adasum.all_reduce), ("adasum.Mean.all_reduce", Mean().all_reduce),
                           ("adasum.Sum.all_reduce", adasum.Sum().all_reduce)):
            t = _autograd_case(case, rank)
            before = t.detach().clone()
            try:
                call([t])
                out[case, name] = None
            except (ValueError, RuntimeError) as error:
                out[case, name] = (type(error).__name__, str(error), torch.equal(t.detach(), before))
    return out


def test_tensors_an_in_place_write_cannot_take_are_refused_on_every_rank_before_data_moves():
    results = distributed.run(2, autograd_body)
    distributed.assert_ranks_agree(results)
    for (case, name), got in results[0].items():
        assert got == ("ValueError", f"{name}: {AUTOGRAD_CASES[case]}", True), (case, name, got)


def float8_body(rank, world):
    """Each reducer and the non-finite check on float8 tensors: every rank's result, and the check's verdict on a
    NaN that rank 1 alone holds."""
    dtype = torch.float8_e4m3fn
    g = torch.Generator().manual_seed(rank)
    mine = [torch.randn(6, generator=g).to(dtype), torch.randn(2, 3, generator=g).to(dtype)]
    out = {}
    for name in ("sum", "mean", "adasum", "adacons"):
        tensors = [t.clone() for t in mine]
        adasum.get_reducer(name).all_reduce(tensors)
        out[name] = [t.float().tolist() for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in mine])
    adasum.Mean().all_reduce_flat(flat, [6, 6])
    out["mean flat"] = flat.float().tolist()
    from adasum.reducers.base import ShardGroups

    alone = [dist.new_group([r]) for r in range(world)]  # one shard per replica: the sharded form's grid
    grid = ShardGroups(None, dist.new_group(list(range(world))), alone[rank], tuple(range(world)), world, 1)
    for name in ("mean", "adacons"):
        sharded = torch.cat([t.reshape(-1) for t in mine])
        adasum.get_reducer(name).all_reduce_shards(sharded, [6, 6], grid)
        out[f"{name} shards"] = sharded.float().tolist()
    nan = [t.clone() for t in mine]
    if rank == 1:
        nan[1][0, 1] = float("nan")
    try:
        adasum.all_reduce(nan, nonfinite="raise")
        out["raise"] = None
    except adasum.NonFiniteError as error:
        out["raise"] = str(error)
    adasum.all_reduce([t.clone() for t in mine], nonfinite="raise")  # finite: passes
    return out, [t.float() for t in mine]


def test_float8_works_in_every_reducer_and_the_non_finite_check():
    results = distributed.run(2, float8_body)
    outs = [r[0] for r in results]
    distributed.assert_ranks_agree(outs)  # bitwise identical on every rank
    copies = [[t.to(torch.float8_e4m3fn) for t in r[1]] for r in results]
    for name in ("sum", "mean", "adasum", "adacons"):
        want = [w.float() for w in adasum.get_reducer(name).reduce(copies)]
        # the distributed form rounds once to float8 as the single-process one: equal within one float8 step
        for got, ref in zip(outs[0][name], want):
            assert torch.allclose(torch.tensor(got), ref, rtol=0.13, atol=1e-2), (name, got, ref)
    for name in ("mean", "adacons"):  # the sharded form, one shard per replica: the flat form's result
        assert outs[0][f"{name} shards"] == [x for t in outs[0][name] for x in torch.tensor(t).reshape(-1).tolist()]
    assert outs[0]["raise"].startswith("adasum.all_reduce: tensor 1 has NaN on rank 1 "), outs[0]["raise"]


def agree_async_body(rank, world):
    """Two agreements posted before either is waited for: the first the same everywhere, the second not."""
    same = agreement.agree_async([("tensor", 3)], None, None, ("op",))
    differ = agreement.agree_async([("tensor", 3 + rank)], None, None, ("op",))
    answers = [same.same(), differ.same()]
    same.check("the units", "adasum.test")  # passes
    try:
        differ.check("the units", "adasum.test")
    except ValueError as error:
        return answers, str(error)
    return answers, None


def test_an_agreement_posted_without_waiting_gives_every_rank_the_same_answer_and_error():
    results = distributed.run(2, agree_async_body)
    distributed.assert_ranks_agree(results)
    answers, error = results[0]
    assert answers == [True, False]
    assert error is not None and error.startswith("adasum.test: ") and "rank 1" in error, error
