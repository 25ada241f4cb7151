"""AdaCons's coefficient math and single-process form, against the independent NumPy reference of
`reference_adacons.py`. The distributed form is checked against this one in test_reducers.py."""

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import adasum
from adasum.reducers import adacons
from recording import RecordingMover

from reference_adacons import AdaConsReference, smooth_sorted


def non_involution(a) -> bool:
    idx = np.argsort(a, kind="stable")
    return not np.array_equal(np.argsort(idx, kind="stable"), idx)


def test_sort_momentum_puts_each_worker_at_its_rank_position():
    # argsort([5, 1, 3, 4]) = [1, 2, 3, 0], whose inverse is [3, 0, 1, 2]: not its own inverse
    steps = [[5.0, 1.0, 3.0, 4.0], [0.5, 7.0, -1.0, 2.0], [0.0, 0.0, 1.0, -3.0], [4.0, 3.0, 2.0, 1.0]]
    assert non_involution(steps[0]) and non_involution(steps[1])
    for beta in (0.0, 0.5, 0.9):
        state_ref, state = None, None
        for a in steps:
            expected, state_ref = smooth_sorted(a, state_ref, beta)
            got, state = adacons.sort_momentum(torch.tensor([a], dtype=torch.float64), state, beta)
            assert torch.allclose(got[0], torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0)
            assert torch.allclose(state[0], torch.tensor(state_ref, dtype=torch.float64), rtol=1e-15, atol=0)


def test_sort_momentum_differs_from_the_sample_codes_indexing():
    # the authors' sample code indexes the smoothed sorted vector with the sort permutation itself
    a1 = torch.tensor([[5.0, 1.0, 3.0, 4.0]], dtype=torch.float64)
    a2 = torch.tensor([[0.5, 7.0, -1.0, 2.0]], dtype=torch.float64)
    _, state = adacons.sort_momentum(a1, None, 0.5)
    got, state = adacons.sort_momentum(a2, state, 0.5)
    idx = torch.argsort(a2, dim=-1, stable=True)
    wrong = state[0][idx[0]]
    right = state[0][torch.argsort(idx[0])]
    assert torch.equal(got[0], right)
    assert not torch.allclose(got[0], wrong)
    # with beta = 0 the smoothed values are the inputs themselves
    same, _ = adacons.sort_momentum(a2, state, 0.0)
    assert torch.equal(same, a2)


def test_normalize_rules_for_negative_coefficients_and_non_positive_sums():
    c = adacons.normalize(torch.tensor([[3.0, -1.0, 1.0], [-1.0, 0.0, -2.0], [0.0, 0.0, 0.0], [1.0, 1.0, 2.0]],
                                       dtype=torch.float64))
    expected = torch.tensor([[0.75, 0.0, 0.25], [1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3], [0.25, 0.25, 0.5]],
                            dtype=torch.float64)
    assert torch.allclose(c, expected, rtol=1e-15, atol=0)
    assert torch.allclose(c.sum(-1), torch.ones(4, dtype=torch.float64))


def test_projection_and_weights_zero_guard():
    dots = torch.tensor([[2.0, 0.0, 1.0]], dtype=torch.float64)
    sq = torch.tensor([[4.0, 0.0, 1e-200]], dtype=torch.float64)
    a = adacons.projections(dots, sq)
    assert torch.equal(a, torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64))
    w = adacons.worker_weights(torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64), sq,
                               torch.tensor([9.0], dtype=torch.float64))
    assert torch.equal(w, torch.tensor([[0.5 * 3 / 2, 0.0, 0.0]], dtype=torch.float64))
    assert torch.isfinite(w).all()


def random_workers(seed, workers, shapes, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes] for _ in range(workers)]


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("scale", ["mean_norm", "unit"])
def test_reduce_matches_reference_over_steps_with_momentum(workers, per_tensor, scale):
    shapes = [(3, 4), (7,), (1,), (0,), (2, 2, 2)]
    ours = adasum.AdaCons(momentum=0.8, per_tensor=per_tensor, scale=scale)
    ref = AdaConsReference(0.8, per_tensor, scale)
    for step in range(4):
        data = random_workers(100 * workers + step, workers, shapes)
        got = ours.reduce(data)
        expected = ref([[t.numpy() for t in w] for w in data])
        for t, e, s in zip(got, expected, shapes):
            assert t.shape == s and t.dtype == torch.float64
            assert np.allclose(t.numpy(), e, rtol=1e-12, atol=1e-14)


def test_identical_gradients_aggregate_to_themselves():
    g = random_workers(7, 1, [(5, 3), (4,)], torch.float32)[0]
    for workers in (1, 2, 3, 4, 7):
        for per_tensor in (False, True):
            out = adasum.AdaCons(momentum=0.9, per_tensor=per_tensor).reduce([g] * workers)
            for o, t in zip(out, g):
                assert o.dtype == torch.float32
                assert torch.allclose(o, t, rtol=1e-6, atol=1e-7)
    # "unit" gives the unit direction instead
    out = adasum.AdaCons(scale="unit").reduce([g] * 3)
    flat = torch.cat([t.reshape(-1) for t in g]).double()
    assert torch.allclose(torch.cat([o.reshape(-1) for o in out]).double(), flat / flat.norm(), rtol=1e-6)


def test_opposed_and_zero_gradients_never_nan():
    v = torch.randn(6, dtype=torch.float64)
    assert torch.equal(adasum.AdaCons().reduce([[v], [-v]])[0], torch.zeros(6, dtype=torch.float64))
    z = torch.zeros(6, dtype=torch.float64)
    assert torch.equal(adasum.AdaCons(momentum=0.5).reduce([[z], [z], [z]])[0], z)
    # one worker far from the others: the opposed ones get weight 0, the result is the mean
    big, small = torch.tensor([10.0, 0.0], dtype=torch.float64), torch.tensor([-1.0, 0.0], dtype=torch.float64)
    out = adasum.AdaCons().reduce([[big], [small], [small]])[0]
    assert torch.allclose(out, (big + 2 * small) / 3, rtol=1e-15)


def test_whole_model_spans_dtypes_and_per_tensor_does_not():
    data32 = random_workers(3, 3, [(8,)], torch.float32)
    data64 = random_workers(4, 3, [(5,)], torch.float64)
    mixed = [[a[0], b[0]] for a, b in zip(data32, data64)]
    whole = adasum.AdaCons().reduce(mixed)
    ref = AdaConsReference()([[t.double().numpy() for t in w] for w in mixed])
    assert whole[0].dtype == torch.float32 and whole[1].dtype == torch.float64
    assert np.allclose(whole[0].double().numpy(), ref[0], rtol=1e-5)
    assert np.allclose(whole[1].numpy(), ref[1], rtol=1e-5)
    # the whole-model result differs from reducing each dtype group alone
    alone = adasum.AdaCons().reduce([[w[1]] for w in mixed])[0]
    assert not torch.allclose(alone, whole[1])


def test_momentum_state_is_keyed_by_layout():
    a_data = [random_workers(10 + s, 3, [(4,), (6,)]) for s in range(3)]
    b_data = [random_workers(20 + s, 3, [(9,)]) for s in range(3)]
    shared, alone_a, alone_b = (adasum.AdaCons(momentum=0.9) for _ in range(3))
    for s in range(3):  # interleaved calls with two layouts, as two DDP buckets would make
        got_a, got_b = shared.reduce(a_data[s]), shared.reduce(b_data[s])
        for x, y in zip(got_a, alone_a.reduce(a_data[s])):
            assert torch.equal(x, y)
        assert torch.equal(got_b[0], alone_b.reduce(b_data[s])[0])
    assert len(shared.state_dict()["states"]) == 2
    # an explicit key separates calls of one layout
    keyed, plain = adasum.AdaCons(momentum=0.9), adasum.AdaCons(momentum=0.9)
    for s in range(3):
        keyed.reduce(a_data[s], key="other")
        assert all(torch.equal(x, y) for x, y in zip(keyed.reduce(a_data[s], key="mine"), plain.reduce(a_data[s])))
    # without a key, two calls of one layout share one state, updated once per call
    seq, ref = adasum.AdaCons(momentum=0.9), AdaConsReference(0.9)
    for s in (0, 1, 2, 0):
        got = seq.reduce(a_data[s])
        expected = ref([[t.numpy() for t in w] for w in a_data[s]])
        assert all(np.allclose(x.numpy(), e, rtol=1e-12) for x, e in zip(got, expected))


def test_momentum_states_are_bounded_and_release_empties_them():
    """Layouts re-made with new sizes every call keep at most `MOST` momentum states, the most recent (a key used every
    call stays); `adasum.release()` empties them, also those of a copy and of an unpickled object."""
    import copy
    import pickle

    from adasum.transport.caches import MOST

    reducer = adasum.AdaCons(momentum=0.5)
    for n in range(1, MOST + 100):
        reducer.reduce([[torch.ones(n)], [torch.arange(n, dtype=torch.float32)]])
        reducer.reduce([[torch.ones(1)], [torch.full((1,), 2.0)]], key="kept")
    states = reducer.state_dict()["states"]
    assert len(states) == MOST and "kept" in states, len(states)
    copies = [copy.deepcopy(reducer), pickle.loads(pickle.dumps(reducer))]
    assert all(len(c.state_dict()["states"]) == MOST for c in copies)
    adasum.release()
    assert reducer.state_dict()["states"] == {} and all(c.state_dict()["states"] == {} for c in copies)


def test_state_dict_round_trip_continues_identically():
    data = [random_workers(30 + s, 4, [(5,), (3, 3)]) for s in range(5)]
    whole = adasum.AdaCons(momentum=0.7, per_tensor=True)
    outs = [whole.reduce(d) for d in data]
    first = adasum.AdaCons(momentum=0.7, per_tensor=True)
    for d in data[:2]:
        first.reduce(d)
    buf = __import__("io").BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = adasum.AdaCons(momentum=0.7, per_tensor=True)
    resumed.load_state_dict(torch.load(buf))
    for d, expected in zip(data[2:], outs[2:]):
        assert all(torch.equal(x, y) for x, y in zip(resumed.reduce(d), expected))
    with pytest.raises(ValueError, match="momentum"):
        adasum.AdaCons(momentum=0.1).load_state_dict(first.state_dict())


def test_sort_momentum_takes_the_first_call_rule_where_a_row_is_not_primed():
    """The first call's rule as a device flag per row (`primed`): a primed row blends its state, an unprimed one
    takes ``sort(a)`` as with no state at all, bit for bit, whatever the state holds (the same launches either
    way, so a CUDA graph replays both)."""
    a = [[5.0, 1.0, 3.0, 4.0], [0.5, 7.0, -1.0, 2.0]]
    state = [[1.0, 2.0, 3.0, 4.0], [float("nan"), 9.0, 9.0, 9.0]]  # the unprimed row's state is never read
    got, new = adacons.sort_momentum(torch.tensor(a, dtype=torch.float64), torch.tensor(state, dtype=torch.float64),
                                     0.6, torch.tensor([True, False]))
    want_0, state_0 = smooth_sorted(a[0], state[0], 0.6)
    want_1, state_1 = smooth_sorted(a[1], None, 0.6)
    assert np.allclose(got[0].numpy(), want_0, rtol=1e-15, atol=0) and np.allclose(new[0].numpy(), state_0)
    assert got[1].tolist() == want_1 and new[1].tolist() == state_1
    alone, alone_state = adacons.sort_momentum(torch.tensor(a[1:], dtype=torch.float64), None, 0.6)
    assert torch.equal(got[1:], alone) and torch.equal(new[1:], alone_state)


def test_load_state_dict_copies_into_the_live_state_and_keeps_the_first_call_rule():
    """`load_state_dict` writes into the tensors the reducer holds (what a captured CUDA graph of its calls reads):
    the same objects afterwards, with the loaded values, and the calls continue as the state's owner's, bit for bit;
    a key the loaded state lacks keeps its tensors, unprimed, so its next call is a first call (a fresh reducer's,
    and the NumPy reference's), and it may then change its number of workers; pickling keeps all of it."""
    import pickle

    shapes, cpu = [(5,), (2, 3)], torch.device("cpu")
    data = [random_workers(40 + s, 3, shapes) for s in range(8)]
    key = adacons.layout_key([(torch.float64, 5), (torch.float64, 6)], True)

    def held(reducer, workers=3):  # the key's live state, as the movers' combine op reads it
        op = adacons.Consensus(reducer, key, 2, workers, cpu)
        return op.state, op.momentum.primed

    live, owner = (adasum.AdaCons(momentum=0.7, per_tensor=True) for _ in range(2))
    for d in data[:2]:
        live.reduce(d)
    for d in data[2:5]:
        owner.reduce(d)
    values, primed = held(live)
    live.load_state_dict(owner.state_dict())
    assert held(live)[0] is values and held(live)[1] is primed and bool(primed.all())
    assert torch.equal(values, owner.state_dict()["states"][key])
    assert all(torch.equal(x, y) for x, y in zip(live.reduce(data[5]), owner.reduce(data[5])))
    resumed = pickle.loads(pickle.dumps(live))
    assert all(torch.equal(x, y) for x, y in zip(resumed.reduce(data[6]), owner.reduce(data[6])))

    live.load_state_dict({**live.state_dict(), "states": {}})  # what an elastic restart loads (docs/faults.md)
    assert live.state_dict()["states"] == {}
    assert held(live)[0] is values and not bool(primed.any())
    fresh, reference = adasum.AdaCons(momentum=0.7, per_tensor=True), AdaConsReference(0.7, True)
    for d in data[:3]:
        got = live.reduce(d)
        assert all(torch.equal(x, y) for x, y in zip(got, fresh.reduce(d)))
        want = reference([[t.numpy() for t in w] for w in d])
        assert all(np.allclose(x.numpy(), e, rtol=1e-12, atol=1e-14) for x, e in zip(got, want))
    live.load_state_dict({**live.state_dict(), "states": {}})
    four = [random_workers(60, 4, shapes)[j] for j in range(4)]
    assert all(torch.equal(x, y) for x, y in zip(live.reduce(four),
                                                 adasum.AdaCons(momentum=0.7, per_tensor=True).reduce(four)))
    with pytest.raises(ValueError, match="number of workers"):  # now the key holds momentum of 4 workers
        live.reduce(data[0])


def test_an_earlier_pickle_with_a_tensor_per_key_loads():
    """A reducer pickled when a state was one tensor per key loads with every row of each primed."""
    from adasum.transport.caches import Released

    data = [random_workers(70 + s, 2, [(4,)]) for s in range(3)]
    reducer = adasum.AdaCons(momentum=0.5)
    reducer.reduce(data[0])
    states: Released = Released()
    states.update(reducer.state_dict()["states"])
    old = adasum.AdaCons.__new__(adasum.AdaCons)
    old.__setstate__({"momentum": 0.5, "per_tensor": False, "scale": "mean_norm", "_states": states})
    got, want = old.state_dict()["states"], reducer.state_dict()["states"]
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    for d in data[1:]:
        assert all(torch.equal(x, y) for x, y in zip(old.reduce(d), reducer.reduce(d)))


def test_bad_input_and_names():
    with pytest.raises(ValueError, match="momentum"):
        adasum.AdaCons(momentum=1.0)
    with pytest.raises(ValueError, match="scale"):
        adasum.AdaCons(scale="norm")
    with pytest.raises(ValueError, match="worker 1"):
        adasum.AdaCons().reduce([[torch.ones(3)], [torch.ones(4)]])
    with pytest.raises(TypeError):
        adasum.AdaCons().reduce([[torch.ones(3, dtype=torch.int64)]] * 2)
    with pytest.raises(ValueError, match="workers"):
        r = adasum.AdaCons(momentum=0.5)
        r.reduce([[torch.ones(3)]] * 2)
        r.reduce([[torch.ones(3)]] * 3)
    assert adasum.AdaCons().reduce([[], []]) == []


def test_get_reducer_knows_adacons_without_importing_it():
    code = "from adasum.reducers import get_reducer; print(type(get_reducer('adacons')).__name__)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "AdaCons"


def movers_body(rank, world, per_tensor, memory_mb):
    """AdaCons' flat form over three steps with momentum, against the NumPy reference; which movers the group
    built (the slice-parallel schedule's where the buffer fits one round of its rows)."""
    from adasum.settings import override
    from adasum.transport.communicator import communicator

    sizes = [5, 0, 17, 3, 40]
    reference = AdaConsReference(0.9, per_tensor, "mean_norm")
    reducer = adasum.AdaCons(momentum=0.9, per_tensor=per_tensor)
    errors = []
    with override(memory_mb=memory_mb, transport_first="slices"):  # the slice movers on gloo too
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + world)
            per_worker = [torch.randn(sum(sizes), generator=g, dtype=torch.float64) * (1 + j) for j in range(world)]
            per_worker[0] += 3 * per_worker[-1]  # the workers differ in direction and length
            buffer = per_worker[rank].clone()
            reducer.all_reduce_flat(buffer, sizes)
            ref = np.concatenate(reference([[t.numpy() for t in w.split(sizes)] for w in per_worker]))
            errors.append(float(np.linalg.norm(buffer.cpu().numpy() - ref) / np.linalg.norm(ref)))
    movers = sorted({type(m).__name__ for m in communicator().transports.values()})
    with override(transport_first=""):  # gloo's default: the two all-reduces
        before = len(communicator().transports)
        buffer = per_worker[rank].clone()
        reducer.all_reduce_flat(buffer, sizes)
        assert len(communicator().transports) == before
    return max(errors), movers, buffer.numpy().tobytes()


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_the_flat_form_runs_on_the_slice_movers_and_matches_the_reference(world, per_tensor):
    import distributed

    results = distributed.run(world, movers_body, per_tensor, 512)
    assert all(err < 1e-12 for err, _, _ in results), [err for err, _, _ in results]
    assert all(movers == ["C10dSlices"] for _, movers, _ in results), results[0][1]
    assert all(r[2] == results[0][2] for r in results)  # ranks end bitwise equal


def test_a_buffer_past_one_round_of_the_movers_runs_the_two_all_reduces():
    """A budget whose rows hold less than the buffer: the movers are asked, and the two all-reduces combine it."""
    import distributed

    results = distributed.run(3, movers_body, False, 0.0001)
    assert all(err < 1e-12 for err, _, _ in results), [err for err, _, _ in results]
    assert all(r[2] == results[0][2] for r in results)


def _capacity(world: int, element_size: int) -> int:
    """Elements one round of the c10d slice movers holds under the current budget."""
    from adasum.transport.slices import round_elements

    return round_elements(world, world, element_size)


def _counting_gathers():
    """Count the calls of ``dist.all_gather`` (only the two all-reduces' form gathers): (restore, counts)."""
    import torch.distributed as dist

    counts = {"all_gather": 0}
    original = dist.all_gather

    def counted(*args, **kwargs):
        counts["all_gather"] += 1
        return original(*args, **kwargs)

    dist.all_gather = counted

    def restore() -> None:
        dist.all_gather = original

    return restore, counts


def rounds_body(rank, world, per_tensor, memory_mb, sizes, dtypes):
    """AdaCons' list form over three steps with momentum on the slice movers, tensors of `dtypes` in turn, against
    the float64 NumPy reference on the dtype-rounded inputs: the largest element-wise error in units of each
    element's bound (module doc of the test), the result's bytes, how many rounds the largest buffer took and the
    all-gathers the two all-reduces' form would have made."""
    from adasum.settings import override

    import distributed

    device = distributed.device_for(rank)  # on NCCL the GPU's movers (symmetric memory inside one host)
    reference = AdaConsReference(0.9, per_tensor, "mean_norm")
    reducer = adasum.AdaCons(momentum=0.9, per_tensor=per_tensor)
    worst, on_movers, (restore, counts) = 0.0, 0, _counting_gathers()
    try:
        with override(memory_mb=memory_mb, transport_first="slices"):
            capacity = min(_capacity(world, torch.empty(0, dtype=d).element_size()) for d in dtypes)
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + world)
                per_worker = []
                for j in range(world):
                    tensors = [torch.randn(n, generator=g, dtype=torch.float64) * (1 + j) for n in sizes]
                    per_worker.append([t.to(dtypes[i % len(dtypes)]) for i, t in enumerate(tensors)])
                for i, t in enumerate(per_worker[0]):  # the workers differ in direction and length
                    per_worker[0][i] = (t.double() + 3 * per_worker[-1][i].double()).to(t.dtype)
                mine = [t.to(device, copy=True) for t in per_worker[rank]]
                before = counts["all_gather"]
                reducer.all_reduce(mine)
                on_movers += counts["all_gather"] - before
                ref = reference([[t.double().numpy() for t in w] for w in per_worker])
                peak = max(float(np.abs(r).max()) for r in ref if r.size)
                for got, want in zip(mine, ref):
                    eps = torch.finfo(got.dtype).eps  # the result rounded once to its dtype: at most an ulp
                    bound = eps * np.abs(want) + 1e-12 * peak  # plus the float64 sums' error
                    error = np.abs(got.double().cpu().numpy() - want)
                    worst = max(worst, float((error / bound).max()) if error.size else 0.0)
    finally:
        restore()
    (state,) = reducer.state_dict()["states"].values()  # the momentum of every tensor, empty ones included
    (want,) = reference.states.values()
    assert np.allclose(state.numpy(), np.array(want, dtype=np.float64), rtol=1e-10, atol=1e-300), (state, want)
    out = b"".join(t.cpu().view(torch.uint8).numpy().tobytes() for t in mine)
    return worst, out, -(-max(sizes) // capacity) if capacity else 0, on_movers


@pytest.mark.nccl
@pytest.mark.parametrize("world", [2, 5])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_several_rounds_run_on_the_movers_and_match_the_reference(world, per_tensor):
    """A budget whose rounds hold about a hundred elements: whole-model weights take the two sweeps (rounds cut the
    tensors), per-tensor ones rounds of whole tensors (the 300-element tensor in place, a zero-size tensor beside
    it); the momentum states those of the reference. No all-gather on the movers: the two all-reduces never ran
    there."""
    import distributed

    if world not in distributed.world_sizes(world):
        pytest.skip(f"{world} ranks need {world} GPUs on NCCL")
    results = distributed.run(world, rounds_body, per_tensor, 0.002, [0, 300, 5, 0, 17, 3, 40, 0], [torch.float64])
    assert all(err <= 1 for err, *_ in results), [err for err, *_ in results]
    assert all(r[1] == results[0][1] for r in results)  # ranks end bitwise equal
    assert all(rounds > 2 for *_, rounds, _ in results), results[0][2]
    assert all(gathers == 0 for *_, gathers in results)


@pytest.mark.nccl
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("memory_mb", [512, 0.001])
def test_several_dtypes_run_on_the_movers_and_match_the_reference(per_tensor, memory_mb):
    """float32, bfloat16, float64 and (empty) float16 tensors in one call: whole-model weights couple the buffers
    (two sweeps), per-tensor ones run each buffer on its own; each result within an ulp of its dtype of the
    reference, the momentum of every tensor (the empty ones' too) the reference's."""
    import distributed

    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.float16]  # the float16 tensors are empty
    if 3 not in distributed.world_sizes(3):
        pytest.skip("3 ranks need 3 GPUs on NCCL")
    results = distributed.run(3, rounds_body, per_tensor, memory_mb, [7, 64, 1, 0, 33, 50, 9, 0], dtypes)
    assert all(err <= 1 for err, *_ in results), [err for err, *_ in results]
    assert all(r[1] == results[0][1] for r in results)
    assert all(gathers == 0 for *_, gathers in results)


def shards_body(rank, world, shards, per_tensor, budgets):
    """AdaCons' sharded form on the movers on a grid of ``world // shards`` replicas of `shards` ranks (rank =
    replica * shards + shard), two steps with momentum under each memory budget, against the reference over the
    replicas' whole tensors: this rank's shard of it (padded shards, as FSDP's). Per budget: the error, the result's
    bytes and how many rounds the buffer took; and the all-gathers of the two all-reduces' form (none ran)."""
    import torch.distributed as dist

    from adasum.reducers.base import ShardGroups
    from adasum.settings import override

    import distributed

    device = distributed.device_for(rank)
    replicas = world // shards
    replica, shard = divmod(rank, shards)
    replicate_groups = [dist.new_group([r * shards + s for r in range(replicas)]) for s in range(shards)]
    shard_groups = [dist.new_group([r * shards + s for s in range(shards)]) for r in range(replicas)]
    peers = tuple(r * shards + shard for r in range(replicas))
    grid = ShardGroups(None, replicate_groups[shard], shard_groups[replica], peers, replicas, shards)
    sizes = [10, 7, 133, 1]
    widths = [-(-n // shards) for n in sizes]  # padded shard sizes
    out, (restore, counts) = [], _counting_gathers()
    try:
        for memory_mb in budgets:
            reference = AdaConsReference(0.9, per_tensor, "mean_norm")
            reducer = adasum.AdaCons(momentum=0.9, per_tensor=per_tensor)
            worst = 0.0
            with override(memory_mb=memory_mb, transport_first="slices"):
                rounds = -(-sum(widths) // _capacity(replicas, 8))
                for step in range(2):
                    g = torch.Generator().manual_seed(7 + step)
                    whole = [[torch.randn(n, generator=g, dtype=torch.float64) * (1 + r) for n in sizes]
                             for r in range(replicas)]
                    for i in range(len(sizes)):
                        whole[0][i] += 2 * whole[-1][i]
                    buffer = torch.cat([
                        torch.nn.functional.pad(t, (0, w * shards - t.numel()))[shard * w : (shard + 1) * w]
                        for t, w in zip(whole[replica], widths)
                    ]).to(device)
                    reducer.all_reduce_shards(buffer, widths, grid)
                    buffer = buffer.cpu()
                    ref = reference([[t.numpy() for t in w] for w in whole])
                    want = np.concatenate([
                        np.pad(r, (0, w * shards - r.size))[shard * w : (shard + 1) * w] for r, w in zip(ref, widths)
                    ])
                    worst = max(worst, float(np.abs(buffer.numpy() - want).max() / np.abs(want).max()))
            out.append((worst, buffer.numpy().tobytes(), rounds))
    finally:
        restore()
    return out, counts["all_gather"]


@pytest.mark.nccl
@pytest.mark.parametrize("replicas,shards,per_tensor", [(2, 2, True), (3, 2, False)])
def test_the_sharded_form_runs_on_the_movers_and_matches_the_whole_tensors(replicas, shards, per_tensor):
    """Shards on the slice movers over the replicate group, their Gram sums added up over the shard group: the
    coefficients of the whole tensors, in one round and, through a small budget, in several (two sweeps for
    whole-model weights); the ranks holding one shard end bitwise equal; the two all-reduces never ran."""
    import distributed

    world = replicas * shards
    if world not in distributed.world_sizes(world):
        pytest.skip(f"{world} ranks need {world} GPUs on NCCL")
    results = distributed.run(world, shards_body, shards, per_tensor, [512, 0.001])
    for budget in range(2):
        assert all(out[budget][0] < 1e-12 for out, _ in results), [out[budget][0] for out, _ in results]
        for s in range(shards):
            assert all(results[r * shards + s][0][budget][1] == results[s][0][budget][1] for r in range(replicas))
    assert results[0][0][0][2] == 1 and results[0][0][1][2] > 1  # one round, then several
    assert all(gathers == 0 for _, gathers in results)


def test_the_op_updates_the_momentum_state_in_place_and_keys_it_by_call():
    """The combine rule the movers ask (`adacons.Consensus`): its weights are those of the NumPy reference from the
    Gram sums, step after step with momentum, and the momentum state is one tensor written in place (what a
    replayed CUDA graph, which runs no Python, updates too); a new state starts without momentum."""
    reducer = adasum.AdaCons(momentum=0.5, per_tensor=True)
    reference = AdaConsReference(0.5, True, "mean_norm")
    g = torch.Generator().manual_seed(3)
    states = []
    for _ in range(3):
        per_worker = [[torch.randn(4, generator=g, dtype=torch.float64) * (1 + j) for _ in range(2)]
                      for j in range(3)]
        gram = torch.stack([torch.stack([torch.stack([a[i] @ b[i] for i in range(2)]) for b in per_worker])
                            for a in per_worker])  # [P, P, T]
        op = adacons.Consensus(reducer, "k", 2, 3, torch.device("cpu"))
        weights = op.weights(gram.clone(), 0)  # [P, T]
        got = [sum(weights[j, i] * per_worker[j][i] for j in range(3)) for i in range(2)]
        want = reference([[t.numpy() for t in w] for w in per_worker])
        assert all(np.allclose(a.numpy(), b, rtol=1e-12, atol=0) for a, b in zip(got, want))
        states.append(op.state)
    assert states[1] is states[2] and states[0] is states[1]  # one tensor, written in place
    assert adacons.Consensus(reducer, "other", 2, 3, torch.device("cpu")).fresh


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA graphs)")
def test_a_captured_graph_of_the_op_replays_the_momentum():
    """On a GPU: the op's weights captured in a CUDA graph once and replayed give, step after step, the eager op's
    weights and momentum (the state is read and written in place; nothing of it lives in Python)."""
    device = torch.device("cuda")
    eager, captured = (adasum.AdaCons(momentum=0.9) for _ in range(2))
    g = torch.Generator().manual_seed(5)
    grams = []
    for _ in range(5):
        x = torch.randn(3, 2, 16, generator=g, dtype=torch.float64)
        grams.append(torch.einsum("itn,jtn->ijt", x, x).to(device))
    static = grams[0].clone()
    op = adacons.Consensus(captured, "k", 2, 3, device)
    op.weights(static.clone(), 0)  # the first call, eager: makes the state
    op = adacons.Consensus(captured, "k", 2, 3, device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        out = op.weights(static, 0)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    adacons.Consensus(eager, "k", 2, 3, device).weights(grams[0].clone(), 0)
    for gram in grams[1:]:
        static.copy_(gram)
        graph.replay()
        want = adacons.Consensus(eager, "k", 2, 3, device).weights(gram.clone(), 0)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(captured.state_dict()["states"]["k"], eager.state_dict()["states"]["k"])


def replay_body(rank, world):
    """Five calls of AdaCons' flat form on the movers through the group's capture point (the whole call: AdaCons is
    capturable), with a capture stand-in that logs which calls ran eagerly, were captured and were replayed, and
    replays by running the captured call's function again (on the captured call's buffer, as a graph works on the
    captured call's memory); then another reducer's call on the same buffer."""
    from adasum.settings import override
    from adasum.transport.communicator import communicator
    from adasum.transport.graphs import Graphs

    log: list = []

    class Graph:
        def __init__(self, fn) -> None:
            self.fn = fn

        def replay(self) -> None:
            log.append("replay")
            self.fn()

    class StandIn:
        def enabled(self, device) -> bool:
            return True

        def capturing(self) -> bool:
            return False

        def capture(self, fn, device):
            log.append("capture")
            return Graph(fn)

        def free(self, graph) -> None:
            pass

    sizes = [5, 0, 17, 3, 40]
    reference = AdaConsReference(0.9, False, "mean_norm")
    reducer = adasum.AdaCons(momentum=0.9)
    import distributed

    device = distributed.device_for(rank)
    buffer = torch.empty(sum(sizes), dtype=torch.float64, device=device)
    errors = []
    with override(transport_first="slices"):
        comm = communicator()
        if device.type == "cpu":  # on a GPU the real capture point: CUDA graphs captured and replayed
            comm.graphs = Graphs(StandIn())
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            per_worker = [torch.randn(sum(sizes), generator=g, dtype=torch.float64) * (1 + j) for j in range(world)]
            buffer.copy_(per_worker[rank])
            before = len(log)
            reducer.all_reduce_flat(buffer, sizes)
            log.append("eager" if len(log) == before else "")
            ref = np.concatenate(reference([[t.numpy() for t in w.split(sizes)] for w in per_worker]))
            errors.append(float(np.linalg.norm(buffer.cpu().numpy() - ref) / np.linalg.norm(ref)))
        before = len(log)
        adasum.AdaCons(momentum=0.5).all_reduce_flat(buffer, sizes)  # another rule: another key, eager
        other = log[before:]
    return [entry for entry in log if entry], other, max(errors)


@pytest.mark.nccl
def test_a_repeated_call_on_the_movers_reaches_the_capture_points_replay():
    """The whole call runs through the group's capture point (`Communicator.run`) with one key per (entry point and
    reducer, layout, buffers): the first call (a new momentum state) runs eagerly, the second (the state primed on
    the device, the same launches) is captured, the third to fifth replay from the fast path, each result the
    reference's; another reducer's call gets a key of its own."""
    import distributed

    if 2 not in distributed.world_sizes(2):
        pytest.skip("2 ranks need 2 GPUs on NCCL")
    for log, other, error in distributed.run(2, replay_body):
        assert error < 1e-12
        if distributed.BACKEND == "gloo":
            assert log == ["eager", "capture", "replay", "replay", "replay", "replay"], log
            assert other == []


def no_host_tensors_body(rank, world):
    """Each form (a list of two dtypes, a flat buffer) on both roads (the movers, the two all-reduces) and both
    granularities: the first call of a layout, then a second one with `torch.tensor` refusing to run, the
    host-to-device copy that a CUDA graph cannot capture (the index tensors come from the reducer's cache); the
    results against the NumPy reference."""
    from unittest import mock

    from adasum.settings import override

    sizes = [5, 0, 17, 3, 40]
    errors = []
    for first in ("slices", ""):
        for per_tensor in (False, True):
            reducer, reference = adasum.AdaCons(momentum=0.9, per_tensor=per_tensor), None
            reference = AdaConsReference(0.9, per_tensor, "mean_norm")
            with override(transport_first=first):
                for step in range(2):
                    g = torch.Generator().manual_seed(10 * step + world)
                    per_worker = [[torch.randn(n, generator=g, dtype=torch.float64) * (1 + j) for n in sizes[:3]]
                                  + [torch.randn(4, generator=g)] for j in range(world)]
                    tensors = [t.clone() for t in per_worker[rank]]
                    refuse = mock.patch.object(torch, "tensor", side_effect=AssertionError("torch.tensor called"))
                    with refuse if step else contextlib.nullcontext():
                        reducer.all_reduce(tensors, check_layout=False)
                    want = reference([[t.numpy() for t in w] for w in per_worker])
                    got = np.concatenate([t.numpy().reshape(-1) for t in tensors])
                    ref = np.concatenate([e.reshape(-1) for e in want])
                    errors.append(float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
    return max(errors)


def test_a_repeated_call_builds_no_tensor_on_the_host():
    import distributed

    errors = distributed.run(2, no_host_tensors_body)
    assert all(error < 1e-6 for error in errors), errors  # one float32 tensor among float64 ones


def cuda_graph_body(rank, world, per_tensor):
    """On one GPU (a group of one rank, NCCL): a list of two dtypes and a flat buffer, each combined six times by one
    reducer through its CUDA graphs (captured on the second call, replayed after) and by another with graphs off,
    both inside the owners' statistics (`StepStatistics`); after the third step both load the same altered state
    (copied into the live tensors), after the fifth an empty one (every row unprimed: a first call again). Returns
    per step whether results and states are bitwise equal, how often the captured reducer's Python ran, the graphs
    alive and both summaries."""
    from unittest import mock

    from adasum.core.statistics import StepStatistics
    from adasum.settings import override
    from adasum.transport.communicator import communicator

    device = torch.device("cuda", torch.cuda.current_device())
    sizes = [5, 0, 17, 3, 40]
    captured, eager = (adasum.AdaCons(momentum=0.9, per_tensor=per_tensor) for _ in range(2))
    ran = []  # the captured reducer's Python runs of the weights (one per call on one rank)
    python = adacons.consensus

    def counted(*args, **kwargs):
        ran.append(1)
        return python(*args, **kwargs)

    statistics = {"captured": StepStatistics(), "eager": StepStatistics()}
    flat = torch.empty(sum(sizes), device=device)
    listed = [torch.empty(5, device=device), torch.empty(3, 4, dtype=torch.float64, device=device),
              torch.empty(7, device=device)]
    steps = []
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        values = [torch.randn(sum(sizes), generator=g) * (1 + step)] + [
            torch.randn(t.shape, generator=g, dtype=t.dtype) + step for t in listed]
        flat.copy_(values[0])
        for t, v in zip(listed, values[1:]):
            t.copy_(v)
        with mock.patch.object(adacons, "consensus", counted):  # the eager reducer's calls are not counted
            with statistics["captured"].call("flat", device):
                captured.all_reduce_flat(flat, sizes)
            with statistics["captured"].call("list", device):
                captured.all_reduce(listed)
        statistics["captured"].finish_step()
        with override(cuda_graphs=False):
            other_flat, other_list = values[0].to(device), [v.to(device) for v in values[1:]]
            with statistics["eager"].call("flat", device):
                eager.all_reduce_flat(other_flat, sizes)
            with statistics["eager"].call("list", device):
                eager.all_reduce(other_list)
            statistics["eager"].finish_step()
        torch.cuda.synchronize()
        mine, theirs = captured.state_dict()["states"], eager.state_dict()["states"]
        steps.append(torch.equal(flat, other_flat) and all(map(torch.equal, listed, other_list))
                     and list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine))
        if step == 2:
            state = eager.state_dict()
            state = {**state, "states": {k: v * 0.5 + 1 for k, v in state["states"].items()}}
            captured.load_state_dict(state)
            eager.load_state_dict(state)
        if step == 4:
            captured.load_state_dict({**captured.state_dict(), "states": {}})
            eager.load_state_dict({**eager.state_dict(), "states": {}})
    summaries = {name: s.summary() for name, s in statistics.items()}
    return steps, len(ran), communicator().graphs.count(), summaries


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA graphs capture CUDA work only")
@pytest.mark.parametrize("per_tensor", [False, True])
def test_a_captured_call_replays_as_eager_calls_do_through_state_loads(per_tensor):
    """AdaCons is capturable: on one GPU each form's repeated call is captured once and replayed (its Python ran
    twice: the first call, eager, and the capture), and every step's results and momentum states equal, bit for
    bit, those of calls with graphs off, also after a state is loaded into the live tensors and after an empty
    one (the first-call rule, on the device, under replay); the consensus weights the owners' statistics read
    from the replayed graphs are the eager calls' (1 for one worker)."""
    import distributed

    ((steps, ran, graphs, summaries),) = distributed.run(1, cuda_graph_body, per_tensor, backend="nccl")
    assert steps == [True] * 6, steps
    assert ran == 4 and graphs >= 2, (ran, graphs)  # two forms: each eager once, captured once
    assert summaries["captured"] == summaries["eager"], summaries
    assert summaries["captured"]["consensus_weight_min"] == summaries["captured"]["consensus_weight_max"] == 1.0


class _Recording(RecordingMover):
    """The recording mover (`recording.RecordingMover`) that also logs the sums' all-reduce and discards, and
    refuses a reserve while rounds are in flight."""

    def reserve(self, row: int, like, ahead: int = 1) -> None:
        assert not self.waiting, "a reserve with rounds in flight"
        super().reserve(row, like, ahead)

    def all_reduce_sums(self, sums) -> None:
        self.calls.append("sums")

    def discard(self, buffer, bounds) -> None:
        self.done(bounds, "discard")


@pytest.mark.parametrize("ahead", [1, 2])
def test_the_two_sweeps_keep_rounds_in_flight_and_let_each_go_in_order(ahead):
    """Whole-model weights over rounds that cut the tensors (a capacity of 8): the first sweep scatters round
    k + ahead - 1 before round k's join and discard, one all-reduce of the call's sums follows, then the second
    sweep scatters and gathers the rounds the same way; equal workers aggregate to themselves."""
    from adasum.collectives.slices import combine_slices_
    from adasum.core.layout import Layout

    calls: list[str] = []
    mover = _Recording(ahead, 8, calls)
    sizes = (3, 30, 7)
    buffer = torch.randn(sum(sizes), dtype=torch.float64)
    before = buffer.clone()
    op = adacons.Consensus(adasum.AdaCons(), "k", len(sizes), 2, torch.device("cpu"))
    combine_slices_([(buffer, Layout(sizes))], mover, op)

    def sweep(done: str) -> list[str]:
        out = [f"reserve {ahead}"]
        for k in range(5):
            out += [f"rows {k}", f"scatter {k}"]
            if k >= ahead - 1:
                out += [f"join {k - ahead + 1}", f"{done} {k - ahead + 1}"]
        for k in range(5 - ahead + 1, 5):
            out += [f"join {k}", f"{done} {k}"]
        return out

    assert calls == [*sweep("discard"), "sums", *sweep("gather")], calls
    lo, hi = 0, 0
    for k in range(5):  # rank 0's slice of each round holds the result
        lo, hi = 8 * k, 8 * k + 4
        torch.testing.assert_close(buffer[lo:hi], before[lo:hi], rtol=1e-15, atol=0)
