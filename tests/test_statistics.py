"""Per-step statistics of the DDP hook, the optimizer and SlowMo (`adasum.core.statistics`): equal on every
rank, equal to a NumPy reference from the ranks' own gradients, at no extra collective; skipped steps counted;
the single-process tree records what the distributed one records."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

import adasum
from adasum.core.statistics import StepStatistics, recording, summarize
from adasum.ddp import AdasumState, adasum_hook

import distributed


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return (model(x) - y).pow(2).mean()


def local_grads(model, rank, step):
    """This rank's own gradients (nothing combined): what the reference is computed from."""
    model.zero_grad()
    loss_of(model, rank, step).backward()
    return [p.grad.detach().clone().double().numpy().ravel() for p in model.parameters()]


def adasum_reference(per_rank):
    """SPEC 1.1 and 1.7 for two workers, per tensor in float64: the statistics' definitions."""
    coefficients, cosines, squares, sums = [], [], 0.0, 0.0
    for a, b in zip(*per_rank):
        dot, na, nb = float(a @ b), float(a @ a), float(b @ b)
        coefficients += [1 - 0.5 * dot / na, 1 - 0.5 * dot / nb]
        cosines.append(abs(dot) / math.sqrt(na * nb))
        squares += na + nb
        sums += float((a + b) @ (a + b))
    return {
        "coefficient_min": min(coefficients),
        "coefficient_max": max(coefficients),
        "orthogonality": squares / sums,
        "cosine_abs_mean": float(np.mean(cosines)),
    }


def adacons_reference(per_rank):
    """The whole-model AdaCons coefficients c_i of SPEC 2 (no momentum), in float64."""
    g = [np.concatenate(tensors) for tensors in per_rank]
    m = sum(g) / len(g)
    a = np.array([float(x @ m) / math.sqrt(float(x @ x)) for x in g])
    c = np.maximum(a, 0) / np.maximum(a, 0).sum()
    return {"consensus_weight_min": c.min(), "consensus_weight_max": c.max(), "consensus_weights": list(c)}


def assert_close(stats, reference, rel=1e-9):
    for key, value in reference.items():
        assert stats[key] == pytest.approx(value, rel=rel), key


def collectives(fn):
    """How many c10d collectives (and point-to-point operations) `fn` runs."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name.startswith("c10d::") for e in prof.events())


def hook_part(rank):
    model = make_model()
    grads = local_grads(model, rank, 1)
    ddp = DDP(model)
    state = AdasumState()
    ddp.register_comm_hook(state, adasum_hook)
    for _ in range(2):  # DDP rebuilds its buckets after the first iteration; each new batch is checked once
        loss_of(ddp, rank, 0).backward()
        ddp.zero_grad()
    step = collectives(lambda: loss_of(ddp, rank, 1).backward())
    reading = collectives(state.statistics)
    bucket = torch.cat([torch.from_numpy(g).float() for g in grads])
    plain = collectives(lambda: adasum.Adasum().all_reduce_flat(bucket, [g.size for g in grads], check_layout=False))
    return state.statistics(), grads, (step, reading, plain)


def test_hook_statistics_equal_the_reference_on_every_rank_at_no_extra_collective(two_ranks):
    (stats0, grads0, counts0), (stats1, grads1, counts1) = (r["hook"] for r in two_ranks)
    assert stats0 == stats1
    assert stats0["step"] == 3 and stats0["skipped_steps"] == 0
    assert_close(stats0, adasum_reference([grads0, grads1]))
    step, reading, plain = counts0
    assert reading == 0 and step == plain > 0, counts0
    assert counts1 == counts0


def nonfinite_hook_part(rank):
    ddp = DDP(make_model())
    state = AdasumState(nonfinite="raise")
    ddp.register_comm_hook(state, adasum_hook)
    loss_of(ddp, rank, 0).backward()
    before = state.statistics()
    ddp.zero_grad()
    x, y = batch(rank, 1)
    if rank == 1:
        x[0, 0] = float("nan")
    with pytest.raises(adasum.NonFiniteError):
        (ddp(x) - y).pow(2).mean().backward()
    return before, state.statistics()


def test_hook_counts_the_backward_passes_stopped_by_a_nonfinite_gradient(two_ranks):
    for before, after in (r["nonfinite hook"] for r in two_ranks):
        assert before["skipped_steps"] == 0 and after["skipped_steps"] == 1
        assert after["coefficient_min"] == before["coefficient_min"]  # the last combined step's, kept


def optimizer_part(rank, reducer):
    model = make_model()
    grads = local_grads(model, rank, 0)
    opt = adasum.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), reducer=reducer, mode="gradient", nonfinite="skip"
    )
    empty = opt.statistics()
    opt.step()  # the gradients local_grads left
    stats = opt.statistics()
    assert collectives(opt.statistics) == 0
    opt.zero_grad()
    x, y = batch(rank, 1)
    if rank == 0:
        x[0, 0] = float("inf")
    (model(x) - y).pow(2).mean().backward()
    opt.step()  # skipped on every rank
    return empty, stats, opt.statistics(), grads


@pytest.mark.parametrize("reducer", ["adasum", "adacons"])
def test_optimizer_statistics_equal_the_reference_and_count_skipped_steps(two_ranks, reducer):
    (empty, stats0, skipped0, grads0), (_, stats1, skipped1, grads1) = (r[reducer] for r in two_ranks)
    assert empty == {"step": 0, "skipped_steps": 0}
    assert stats0 == stats1 and skipped0 == skipped1
    assert stats0["step"] == 1 and stats0["skipped_steps"] == 0
    reference = (adasum_reference if reducer == "adasum" else adacons_reference)([grads0, grads1])
    # Adasum's sums accumulate the float32 gradients in float64, as the reference does; AdaCons' mean m crosses the
    # network as the gradients' float32 sum (SPEC 2), so its coefficients carry float32's rounding of m (2^-24
    # relative per element, about 6e-8) through <g_i, m> and the normalisation: 1e-6 bounds that, 1e-9 does not.
    assert_close(stats0, reference, rel=1e-9 if reducer == "adasum" else 1e-6)
    assert set(stats0) == {"step", "skipped_steps", *reference}
    assert skipped0 == {**stats0, "skipped_steps": 1}  # the skipped step combined nothing


def slowmo_part(rank):
    model = make_model()
    opt = adasum.SlowMo(torch.optim.SGD(model.parameters(), lr=0.1), local_steps=2, reducer="adasum")
    anchor = [p.detach().clone() for p in model.parameters()]
    for step in range(2):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        if step == 1:
            deltas = [(p.detach() - a).double().numpy().ravel() for p, a in zip(model.parameters(), anchor)]
            deltas = [d - 0.1 * p.grad.double().numpy().ravel() for d, p in zip(deltas, model.parameters())]
        opt.step()
    return opt.statistics(), deltas


def two_ranks_body(rank, world):
    return {
        "hook": hook_part(rank),  # first: its collectives are counted
        "nonfinite hook": nonfinite_hook_part(rank),
        "adasum": optimizer_part(rank, "adasum"),
        "adacons": optimizer_part(rank, "adacons"),
        "slowmo": slowmo_part(rank),
    }


@pytest.fixture(scope="module")
def two_ranks():
    """The two-rank cases above, in one run of 2 gloo processes (one start-up for all)."""
    return distributed.run(2, two_ranks_body)


def test_slowmo_statistics_are_those_of_the_model_deltas(two_ranks):
    (stats0, deltas0), (stats1, deltas1) = (r["slowmo"] for r in two_ranks)
    assert stats0 == stats1 and stats0["step"] == 1
    assert_close(stats0, adasum_reference([deltas0, deltas1]), rel=1e-4)  # the deltas are rounded to float32


def slices_body(rank, world):
    tensors = [torch.randn(n, generator=torch.Generator().manual_seed(10 * rank + n)) for n in (7, 33, 2)]
    mine = [t.clone() for t in tensors]
    with recording() as records:
        adasum.all_reduce(mine, transport="slices")
    return summarize(records), tensors


def test_the_distributed_tree_records_what_the_single_process_tree_records():
    results = distributed.run(3, slices_body)
    per_rank = [tensors for _, tensors in results]
    with recording() as records:
        for i in range(3):
            adasum.reduce([tensors[i] for tensors in per_rank])
    single = summarize(records)
    # float32 runs from the Gram matrices (`adasum.collectives.slices.by_gram`): the last level sees the fold's node
    # unrounded, `reduce` sees it rounded to float32 (2**-24 relative per element), so the sums, and the statistics
    # (coefficients 1 - w <a,b>/|a|^2 of inputs of similar norms), differ by a few 2**-24
    for stats, _ in results:
        assert stats == pytest.approx(single, rel=1e-5)
    assert set(single) == {"coefficient_min", "coefficient_max", "orthogonality", "cosine_abs_mean"}


def test_recorded_orthogonality_is_the_diagnostic_for_two_workers():
    g = torch.Generator().manual_seed(3)
    workers = [[torch.randn(4, generator=g), torch.randn(6, generator=g)] for _ in range(2)]
    with recording() as records:
        adasum.Adasum().reduce(workers)
    assert summarize(records)["orthogonality"] == pytest.approx(adasum.orthogonality(workers).model, rel=1e-12)


def test_parallel_and_orthogonal_pairs_give_the_ends_of_the_ranges():
    a = torch.tensor([1.0, 2.0, 0.0])
    with recording() as parallel:
        adasum.reduce([a, a])
    with recording() as orthogonal:
        adasum.reduce([a, torch.tensor([0.0, 0.0, 5.0])])
    assert summarize(parallel) == {
        "coefficient_min": 0.5,
        "coefficient_max": 0.5,
        "orthogonality": 0.5,
        "cosine_abs_mean": 1.0,
    }
    assert summarize(orthogonal) == {
        "coefficient_min": 1.0,
        "coefficient_max": 1.0,
        "orthogonality": 1.0,
        "cosine_abs_mean": 0.0,
    }


def test_a_replayed_call_keeps_the_records_of_its_last_run():
    statistics = StepStatistics()
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])
    with statistics.call("bucket", a.device):
        adasum.reduce([a, b])
    statistics.finish_step()
    first = statistics.summary()
    with statistics.call("bucket", a.device):
        pass  # what a replayed CUDA graph runs of Python
    statistics.finish_step()
    assert statistics.summary() == first and statistics.steps == 2
    with statistics.call("other", a.device):
        pass
    statistics.finish_step()
    assert statistics.summary() == {}


def test_a_state_pickles_without_its_records():
    import pickle

    state = AdasumState()
    state.skipped_steps = 2
    copy = pickle.loads(pickle.dumps(state))
    assert copy.statistics() == {"step": 0, "skipped_steps": 2}


def test_coefficients_of_subtrees_weigh_their_workers():
    """Three workers: the fold (0, 1), then its result (two workers) with worker 2 (one), weights 2/3 and 1/3."""
    g = torch.Generator().manual_seed(5)
    workers = [torch.randn(9, generator=g, dtype=torch.float64) for _ in range(3)]
    a, b, c = (w.numpy() for w in workers)

    def pair(x, y, wx, wy):
        dot = x @ y
        cx, cy = 1 - wx * dot / (x @ x), 1 - wy * dot / (y @ y)
        return cx * x + cy * y, [cx, cy], abs(dot) / np.sqrt((x @ x) * (y @ y))

    folded, first, cos_first = pair(a, b, 0.5, 0.5)
    _, second, cos_second = pair(folded, c, 2 / 3, 1 / 3)
    with recording() as records:
        adasum.reduce(workers)
    stats = summarize(records)
    assert stats["coefficient_min"] == pytest.approx(min(first + second), rel=1e-12)
    assert stats["coefficient_max"] == pytest.approx(max(first + second), rel=1e-12)
    assert stats["cosine_abs_mean"] == pytest.approx((cos_first + cos_second) / 2, rel=1e-12)
    assert stats["orthogonality"] == pytest.approx((a @ a + b @ b) / ((a + b) @ (a + b)), rel=1e-12)


def gathered(tensors):
    """Every rank's copy of `tensors` (one flat gather), as NumPy float64 arrays per rank: the reference's input."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    sizes = [t.numel() for t in tensors]
    return [[p.double().cpu().numpy() for p in f.split(sizes)] for f in everyone]


def device_body(rank, world):
    """Step after step on the backend's device (NCCL: batches and buckets captured as CUDA graphs at their second
    sighting, replayed after), the statistics of each step against the reference of that step's local gradients:
    the DDP hook, and the optimizer in delta mode with buckets of one layout that share delta buffers (the
    same graph replayed twice in a step)."""
    device = distributed.device_for(rank)
    ddp = DDP(make_model().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    state = AdasumState()
    ddp.register_comm_hook(state, adasum_hook)
    plain = make_model().to(device)
    for step in range(6):
        plain.zero_grad()
        x, y = (t.to(device) for t in batch(rank, step))
        (plain(x) - y).pow(2).mean().backward()
        reference = adasum_reference(gathered([p.grad for p in plain.parameters()]))
        ddp.zero_grad()
        (ddp(x) - y).pow(2).mean().backward()
        assert_close(state.statistics(), reference, rel=1e-6)

    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)]).to(device)
    cap = (64 + 8) * 4 / 2**20  # one bucket per layer, all of one layout
    opt = adasum.DistributedOptimizer(torch.optim.SGD(layers.parameters(), lr=1.0), bucket_cap_mb=cap)
    g = torch.Generator().manual_seed(rank)
    for step in range(5):
        opt.zero_grad()
        x, y = torch.randn(4, 8, generator=g).to(device), torch.randn(4, 8, generator=g).to(device)
        (layers(x) - y).pow(2).mean().backward()
        reference = adasum_reference(gathered([p.grad for p in layers.parameters()]))
        opt.step()
        assert_close(opt.statistics(), reference, rel=1e-4)  # the deltas: -grad rounded to float32
    return state.statistics(), opt.statistics()


@pytest.mark.nccl
@pytest.mark.parametrize("world", distributed.world_sizes(2))
def test_statistics_step_after_step_on_the_backend_device(world):
    results = distributed.run(world, device_body)
    assert all(r == results[0] for r in results)


def hierarchical_body(rank, world):
    g = torch.Generator().manual_seed(21)
    data = [[torch.randn(n, generator=g) for n in (5, 40, 3)] for _ in range(world)]
    out = {}
    for mode in (True, "exact"):
        mine = [t.clone() for t in data[rank]]
        with recording() as records:
            adasum.Adasum(hierarchical=mode, local_size=2).all_reduce(mine)
        out[mode] = summarize(records)
    return out, [[t.numpy() for t in w] for w in data]  # by value: a tensor's shared storage dies with its process


def test_hierarchical_statistics_are_the_levels_across_nodes():
    """4 ranks as 2 nodes x 2: node means (the tree over the means), and the exact two tiers (the levels inside a
    node are each node's own, so only the level across nodes counts): the same on every rank, and equal to what
    the single-process trees record at those levels."""
    results = distributed.run(4, hierarchical_body)
    data = [[torch.from_numpy(a) for a in w] for w in results[0][1]]
    with recording() as means:
        adasum.Adasum(hierarchical=True, local_size=2).reduce(data)
    with recording() as flat:
        adasum.Adasum().reduce(data)
    across = [r for r in flat if r.workers == ((2, 2),)]
    for stats, _ in results:
        assert stats[True] == pytest.approx(summarize(means), rel=1e-10)
        assert stats["exact"] == pytest.approx(summarize(across), rel=1e-10)
    assert "orthogonality" not in results[0][0]["exact"]  # no pair of single workers across nodes


def test_a_nonfinite_combination_gives_nan():
    with recording() as records:
        adasum.reduce([torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])])
    stats = summarize(records)
    assert set(stats) == {"coefficient_min", "coefficient_max", "orthogonality", "cosine_abs_mean"}
    assert all(math.isnan(v) for v in stats.values())
