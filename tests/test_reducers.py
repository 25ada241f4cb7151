"""Every reducer's distributed form (`all_reduce`, `all_reduce_flat`) against its single-process
form (`reduce`) on 2, 3 and 4 real gloo ranks, bitwise identical across ranks; and against an
independent reference: sum and mean against NumPy's, Adasum per tensor and whole-model against the
NumPy tree of `reference.py` within its error bound, AdaCons over several steps with momentum against
the NumPy reference of `reference_adacons.py`; AdaCons also as a DDP communication hook."""

import numpy as np
import pytest
import torch

import adasum
from adasum.reducers import get_reducer

import distributed
from reference import combine_with_bound, error_of, mean_with_bound, sum_with_bound
from reference_adacons import AdaConsReference

pytestmark = pytest.mark.nccl

REDUCERS = {
    "sum": lambda: get_reducer("sum"),
    "mean": lambda: get_reducer("mean"),
    "adasum": lambda: get_reducer("adasum"),
    "adasum-model": lambda: adasum.Adasum(per_tensor=False),
    "adacons": lambda: get_reducer("adacons"),
    "adacons-momentum": lambda: adasum.AdaCons(momentum=0.9),
    "adacons-per-tensor": lambda: adasum.AdaCons(momentum=0.7, per_tensor=True),
    "adacons-unit": lambda: adasum.AdaCons(momentum=0.5, scale="unit"),
}
SHAPES = [(3, 4), (0,), (17,), (1,), (2, 5)]
DTYPES = [torch.float32, torch.float64, torch.float32, torch.float64, torch.float32]
TOL = {torch.float32: 2e-5, torch.float64: 1e-11}
STEPS = 3


def consensus_data(step: int, world: int) -> list[list[torch.Tensor]]:
    """Worker gradients g_i = v + t_i w_i (w_i orthonormal, orthogonal to v, over the whole model):
    a_i = <g_i, m>/|g_i| decreases with t_i while t_i < sqrt(N - 2), so the sort order is chosen:
    at step 0 it is [1, 2, .., N-1, 0], a permutation that is not its own inverse for N >= 3."""
    n = sum(int(np.prod(s)) for s in SHAPES)
    q, _ = torch.linalg.qr(
        torch.randn(n, world + 1, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
    )
    t = [0.05] + [0.9 - 0.2 * (j - 1) for j in range(1, world)]
    t = t[-step % world :] + t[: -step % world] if step else t
    flats = [3 * q[:, 0] + t[i] * q[:, i + 1] for i in range(world)]
    out = []
    for flat in flats:
        pieces = flat.split([int(np.prod(s)) for s in SHAPES])
        out.append([p.reshape(s).to(d) for p, s, d in zip(pieces, SHAPES, DTYPES)])
    return out


def rel_err(x: torch.Tensor, ref) -> float:
    ref = torch.as_tensor(np.asarray(ref), dtype=torch.float64).reshape(-1)
    x = x.double().reshape(-1)
    return float((x - ref).norm() / ref.norm()) if ref.norm() > 0 else float(x.norm())


def _dtype_groups(tensors) -> dict:
    """Indices of `tensors` per dtype, in order: what whole-model Adasum fuses (src/adasum/reducers/adasum.py:
    one pair of coefficients per dtype group, the collective running on one flat buffer per dtype)."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def check_reference(name, per_worker, got, label) -> None:
    """`got` (this rank's result of reducer `name` over `per_worker`, one list of tensors per rank) against the
    independent reference within its error bound (`reference.py`); names other than sum, mean, adasum,
    adasum-model: nothing. Sum and mean against the float64 sum and mean, Adasum per tensor
    (`combine_with_bound`), whole-model Adasum over each dtype group's tensors concatenated into one vector per
    rank (`combine_with_bound` of the concatenations)."""
    if name in ("sum", "mean", "adasum"):
        with_bound = {"sum": sum_with_bound, "mean": mean_with_bound, "adasum": combine_with_bound}[name]
        for i, t in enumerate(got):
            if t.numel():
                ref, bound = with_bound([w[i] for w in per_worker])
                assert error_of(t, ref) <= bound, (name, label, i, error_of(t, ref), bound)
    elif name == "adasum-model":
        for dtype, indices in _dtype_groups(got).items():
            joined = [torch.cat([w[i].reshape(-1) for i in indices]) for w in per_worker]
            if not joined[0].numel():
                continue
            ref, bound = combine_with_bound(joined)
            mine = torch.cat([got[i].reshape(-1) for i in indices])
            assert error_of(mine, ref) <= bound, (name, label, str(dtype), error_of(mine, ref), bound)


def checks(rank, world):
    out = {}
    device = distributed.device_for(rank)  # the CPU on gloo, this rank's GPU on NCCL
    for name, make in REDUCERS.items():
        ours, single = make(), make()
        reference = (
            AdaConsReference(single.momentum, single.per_tensor, single.scale) if name.startswith("adacons") else None
        )
        for step in range(STEPS):
            data = consensus_data(step, world)
            mine = [t.to(device, copy=True) for t in data[rank]]
            ours.all_reduce(mine)
            mine = [t.cpu() for t in mine]
            expected = single.reduce(data)
            ref = reference([[t.numpy() for t in w] for w in data]) if reference else None
            # whole-model AdaCons shares coefficients across dtypes: float32 precision throughout
            shared = name.startswith("adacons") and not single.per_tensor
            for i, (t, e) in enumerate(zip(mine, expected)):
                tol = TOL[torch.float32] if shared else TOL[t.dtype]
                assert t.shape == e.shape and t.dtype == e.dtype == DTYPES[i], (name, t.dtype, e.dtype)
                if t.numel():
                    assert rel_err(t, e) < tol, (name, step, i, rel_err(t, e))
                    if ref is not None:
                        assert rel_err(t, ref[i]) < tol, (name, step, i, rel_err(t, ref[i]))
            check_reference(name, data, mine, step)
            out[f"{name}-{step}"] = b"".join(t.numpy().tobytes() for t in mine)
        if reference is not None:
            mine_state, single_state = ours.state_dict()["states"], single.state_dict()["states"]
            assert mine_state.keys() == single_state.keys()
            for k in mine_state:
                assert torch.allclose(mine_state[k], single_state[k], rtol=1e-6)  # float32 means inside

        # one flat float32 buffer with a zero-size tensor inside, as a DDP bucket
        flat_reducer, flat_single = make(), make()
        sizes = [5, 0, 17, 3]
        g = torch.Generator().manual_seed(77)
        per_worker = [torch.randn(sum(sizes), generator=g) for _ in range(world)]
        buffer = per_worker[rank].to(device, copy=True)
        flat_reducer.all_reduce_flat(buffer, sizes)
        buffer = buffer.cpu()
        expected = torch.cat([t.reshape(-1) for t in flat_single.reduce([list(w.split(sizes)) for w in per_worker])])
        assert rel_err(buffer, expected) < TOL[torch.float32], (name, rel_err(buffer, expected))
        # the flat form against the reference too: per segment, or the whole buffer for whole-model Adasum
        check_reference(name, [list(w.split(sizes)) for w in per_worker], list(buffer.split(sizes)), "flat")
        if name.startswith("adacons"):
            flat_ref = AdaConsReference(flat_single.momentum, flat_single.per_tensor, flat_single.scale)(
                [[t.numpy() for t in w.split(sizes)] for w in per_worker]
            )
            assert rel_err(buffer, np.concatenate(flat_ref)) < TOL[torch.float32], (name, "flat")
        out[f"{name}-flat"] = buffer.numpy().tobytes()
        # a buffer of another shape, or one that is not contiguous, holds its segments in row-major order: the very
        # result of the flat buffer (Adasum broke the group on both: an abort, or a different error on each rank)
        for layout in ("2-d", "transposed"):
            data = per_worker[rank].to(device, copy=True).view(5, 5)
            if layout == "transposed":
                data = torch.empty(5, 5, device=device).t().copy_(data)
                assert not data.is_contiguous()
            make().all_reduce_flat(data, sizes)
            assert torch.equal(data.reshape(-1).cpu(), buffer), (name, layout)
    if world == 3:  # one world size is enough for the hook; DDP's start-up is slow on gloo
        out["ddp"] = ddp_hook_check(rank, world)
    return out


def _adacons_hook(reducer, bucket):
    buffer = bucket.buffer()
    reducer.all_reduce_flat(buffer, [p.numel() for p in bucket.parameters()], key=f"bucket-{bucket.index()}")
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batch(worker, step):
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def ddp_hook_check(rank, world):
    """AdaCons as a DDP communication hook (one bucket: whole model) equals its single-process form (the model on
    the test backend's device; the single-process replicas on the CPU)."""
    device = distributed.device_for(rank)
    model = torch.nn.parallel.DistributedDataParallel(_model().to(device))
    model.register_comm_hook(adasum.AdaCons(momentum=0.9), _adacons_hook)
    single = adasum.AdaCons(momentum=0.9)
    replicas = [_model() for _ in range(world)]
    results = []
    for step in range(3):
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        grads = []
        for w, replica in enumerate(replicas):
            replica.zero_grad()
            xw, yw = _batch(w, step)
            torch.nn.functional.mse_loss(replica(xw), yw).backward()
            grads.append([p.grad for p in replica.parameters()])
        expected = single.reduce(grads, key="bucket-0")
        with torch.no_grad():
            for p, e in zip(model.parameters(), expected):
                assert rel_err(p.grad.cpu(), e) < 1e-5, (step, rel_err(p.grad.cpu(), e))
                p -= 0.1 * p.grad
                p.grad = None
            for replica in replicas:
                for q, e in zip(replica.parameters(), expected):
                    q -= 0.1 * e
        results.append(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()))
    return b"".join(results)


# gloo: a power of two and a fold; NCCL: every GPU count up to 4
@pytest.mark.parametrize("world", [2, 3] if distributed.BACKEND == "gloo" else distributed.world_sizes(2, 3, 4))
def test_distributed_and_single_process_forms_agree(world):
    if world >= 3:  # the designed data does exercise a sort permutation that is not its own inverse
        data = consensus_data(0, world)
        ref_a = []
        m = sum(torch.cat([t.double().reshape(-1) for t in w]) for w in data) / world
        for w in data:
            g = torch.cat([t.double().reshape(-1) for t in w])
            ref_a.append(float(g @ m / g.norm()))
        idx = np.argsort(ref_a, kind="stable")
        assert list(idx) == [*range(1, world), 0]
        assert not np.array_equal(np.argsort(idx), idx)
    results = distributed.run(world, checks)
    distributed.assert_ranks_agree(results)


def test_keyword_options_the_reducer_does_not_take():
    """Every reducer refuses a keyword option it does not take with one TypeError, before anything is checked or
    moved (no process group needed); AdaCons takes ``key``. Adasum used to drop them: ``nonfinite="raise"`` let
    NaN through, ``transport=`` was ignored."""
    for name, make in REDUCERS.items():
        reducer = make()
        cls = type(reducer).__name__
        takes = "check_layout and key" if cls == "AdaCons" else "check_layout only"
        for keyword, value in (("nonfinite", "raise"), ("transport", "bogus"), ("momentum", 0.9)):
            for method, call in (
                ("all_reduce", lambda: reducer.all_reduce([torch.ones(2)], **{keyword: value})),
                ("all_reduce_flat", lambda: reducer.all_reduce_flat(torch.ones(2), [2], **{keyword: value})),
            ):
                with pytest.raises(TypeError) as info:
                    call()
                assert str(info.value) == (
                    f"adasum.{cls}.{method}: unexpected keyword argument {keyword!r}; {cls} takes {takes}: remove it"
                )
        if cls != "AdaCons":
            with pytest.raises(TypeError, match="unexpected keyword argument 'key'"):
                reducer.all_reduce([torch.ones(2)], key="bucket-0")


def test_adasum_local_size():
    """`local_size` is a positive int, and only with `hierarchical` (as `adasum.ddp.AdasumState` has it)."""
    with pytest.raises(ValueError) as info:
        adasum.Adasum(local_size=4)
    assert str(info.value) == ("local_size needs hierarchical=True or 'exact', got local_size=4 with "
                               "hierarchical=False; pass hierarchical=True too, or drop local_size")
    for bad in (1.5, True, "2"):
        with pytest.raises(TypeError) as info:
            adasum.Adasum(hierarchical=True, local_size=bad)
        assert str(info.value) == (f"local_size must be a positive int or None, got {bad!r}; pass ranks per node, or "
                                   "None")
    for bad in (0, -2):
        with pytest.raises(ValueError) as info:
            adasum.Adasum(hierarchical="exact", local_size=bad)
        assert str(info.value) == f"local_size must be a positive int or None, got {bad}; pass ranks per node, or None"
    assert adasum.Adasum(hierarchical=True, local_size=np.int64(2)).local_size == 2
    assert adasum.Adasum(hierarchical=True).local_size is None and adasum.Adasum().local_size is None


def test_per_tensor_is_a_bool():
    """A string or number for `per_tensor` is refused (``"no"`` was taken as True)."""
    for reducer in (adasum.Adasum, adasum.AdaCons):
        for bad in ("no", 0, None):
            with pytest.raises(TypeError) as info:
                reducer(per_tensor=bad)
            assert str(info.value) == f"per_tensor must be True or False, got {bad!r}; pass a bool"
    assert adasum.Adasum(per_tensor=False).per_tensor is False and adasum.AdaCons(per_tensor=True).per_tensor


def test_state_of_another_reducer_is_refused():
    """`load_state_dict` takes what the reducer's own `state_dict` saves and nothing else: another reducer's
    state, a misspelt key or an empty state for AdaCons raise ValueError naming the keys (they were accepted,
    AdaCons' momentum silently emptied)."""
    adacons = adasum.AdaCons(momentum=0.9)
    adacons.reduce([[torch.ones(2)], [torch.full((2,), 2.0)]])
    state = adacons.state_dict()
    keys = "['momentum', 'per_tensor', 'scale', 'states']"
    for reducer in (adasum.Adasum(), adasum.Mean(), adasum.Sum()):
        cls = type(reducer).__name__
        with pytest.raises(ValueError) as info:
            reducer.load_state_dict(state)
        assert str(info.value) == (f"adasum.{cls}.load_state_dict: the state is not this reducer's: unexpected keys "
                                   f"{keys} ({cls} saves no keys); load it into the reducer that saved it")
        with pytest.raises(ValueError, match=r"unexpected keys \['foo'\]"):
            reducer.load_state_dict({"foo": 1})
        reducer.load_state_dict(reducer.state_dict())  # its own (empty) state
    for bad, wrong in (
        ({}, f"missing keys {keys}"),
        (adasum.Adasum().state_dict(), f"missing keys {keys}"),
        ({**{k: v for k, v in state.items() if k != "states"}, "state": state["states"]},
         "unexpected keys ['state']; missing keys ['states']"),
    ):
        resumed = adasum.AdaCons(momentum=0.9)
        resumed.load_state_dict(state)
        with pytest.raises(ValueError) as info:
            resumed.load_state_dict(bad)
        assert str(info.value) == (f"adasum.AdaCons.load_state_dict: the state is not this reducer's: {wrong} "
                                   f"(AdaCons saves {keys}); load it into the reducer that saved it")
        assert resumed.state_dict()["states"].keys() == state["states"].keys()  # the momentum kept
    with pytest.raises(TypeError, match="state must be a dict"):
        adasum.Mean().load_state_dict([("momentum", 0.9)])
    with pytest.raises(ValueError) as info:
        adasum.AdaCons(momentum=0.5).load_state_dict(state)
    assert str(info.value) == (
        "adasum.AdaCons.load_state_dict: the state has momentum=0.9, this reducer has 0.5; "
        "build AdaCons(momentum=0.9) to load it"
    )


def test_reduce_refuses_workers_whose_tensors_differ():
    """The single-process form refuses what the distributed one refuses (ranks' tensors of another dtype or shape,
    a non-floating tensor), with one message per reducer: Sum, Mean and Adasum promoted mixed dtypes or combined
    a [2, 3] with a [3, 2] silently, and reported other shapes with torch.stack's error."""
    for name, make in REDUCERS.items():
        reducer = make()
        cls = type(reducer).__name__
        for first, other, given in (
            (torch.ones(3), torch.ones(3, dtype=torch.float64), "torch.float32 [3], worker 1 has torch.float64 [3]"),
            (torch.ones(2, 3), torch.ones(3, 2), "torch.float32 [2, 3], worker 1 has torch.float32 [3, 2]"),
            (torch.ones(3), torch.ones(4), "torch.float32 [3], worker 1 has torch.float32 [4]"),
        ):
            with pytest.raises(ValueError) as info:
                reducer.reduce([[torch.ones(1), first], [torch.ones(1), other]])
            assert str(info.value) == (f"adasum.{cls}.reduce: tensor 1: worker 0 has {given}; give every worker the "
                                       "same layout"), name
        with pytest.raises(TypeError) as info:
            reducer.reduce([[torch.ones(2, dtype=torch.int64)]] * 2)
        assert str(info.value) == (f"adasum.{cls}.reduce: tensor 0 has dtype torch.int64; only floating-point "
                                   "tensors can be combined: pass float tensors"), name
        with pytest.raises(TypeError) as info:
            reducer.reduce([[torch.ones(2)], [[1.0, 2.0]]])
        assert str(info.value) == (f"adasum.{cls}.reduce: worker 1's tensor 0 is a list, not a torch.Tensor; pass "
                                   "tensors"), name
        assert [t.shape for t in reducer.reduce([[torch.ones(2), torch.ones(0)]] * 2)] == [(2,), (0,)]


def test_adacons_momentum_and_key_types():
    """AdaCons' `momentum` is a number in [0, 1) and `key` a str (or None), checked before anything moves: a string
    momentum failed with a comparison error, ``momentum=False`` was taken as 0, and an unhashable key failed with
    "unhashable type" after the mean all-reduce and the all-gather."""
    for bad in ("0.5", None, True):
        with pytest.raises(TypeError) as info:
            adasum.AdaCons(momentum=bad)
        assert str(info.value) == f"adasum.AdaCons: momentum must be a number in [0, 1), got {bad!r}; pass a number"
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError) as info:
            adasum.AdaCons(momentum=bad)
        assert str(info.value) == (f"adasum.AdaCons: momentum must be a number in [0, 1), got {bad!r}; pass momentum= "
                                   "a number in [0, 1)")
    assert adasum.AdaCons(momentum=np.float32(0.5)).momentum == 0.5
    reducer = adasum.AdaCons()
    for bad in (["bucket"], 3):
        for method, call in (
            ("all_reduce", lambda: reducer.all_reduce([torch.ones(2)], key=bad)),
            ("all_reduce_flat", lambda: reducer.all_reduce_flat(torch.ones(2), [2], key=bad)),
            ("reduce", lambda: reducer.reduce([[torch.ones(2)]] * 2, key=bad)),
        ):
            with pytest.raises(TypeError) as info:  # no process group: refused before anything is checked or moved
                call()
            assert str(info.value) == f"adasum.AdaCons.{method}: key must be a str or None, got {bad!r}; pass a name"
    assert reducer.state_dict()["states"] == {}
