"""The DDP communication hook on real gloo process groups: step by step, every parameter's gradient against the
independent reference (tests/reference.py) of every rank's local gradients, within its error bound, with DDP's
bucket rebuild, no_sync, join, static graphs, gradient-as-bucket-view, fp16/bf16 compression and hierarchical
mode, and with bitwise-identical parameters on every rank."""

import contextlib
import copy
import gc
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_wrapper, fp16_compress_wrapper
from torch.nn.parallel import DistributedDataParallel as DDP

import adasum
from adasum.ddp import BATCH_MB, AdasumState, adasum_hook
from adasum.integrations import ddp as hook_module

import distributed
from reference import combine_with_bound, error_of, half_with_bound, hierarchical_with_bound, mean_with_bound

BUCKET_CAP_MB = 0.001  # about 1 KB: after the rebuild, buckets of several parameters each


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
        torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4),
    )


def batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def record(state, bucket: dist.GradBucket):
    """adasum_hook, also recording how many parameters each bucket held, its bytes and the Future it returned."""
    state.bucket_params.append(len(bucket.gradients()))
    state.bucket_bytes.append(bucket.buffer().numel() * bucket.buffer().element_size())
    future = adasum_hook(state, bucket)
    state.futures.append(future)
    return future


def recording(futures: list):
    """adasum_hook, also appending each Future it returns to `futures` (a bucket waiting in the open batch is one
    not done yet)."""
    def hook(state, bucket: dist.GradBucket):
        futures.append(adasum_hook(state, bucket))
        return futures[-1]

    return hook


@contextlib.contextmanager
def learnt_layouts():
    """The buckets whose segments the hook learns meanwhile (its `adasum.ddp.bucket_sizes` calls, once per buffer
    while DDP keeps it), by index."""
    original, seen = hook_module.bucket_sizes, []
    hook_module.bucket_sizes = lambda bucket: seen.append(bucket.index()) or original(bucket)
    try:
        yield seen
    finally:
        hook_module.bucket_sizes = original


def batches(bucket_bytes, batch_mb) -> int:
    """How many batches the hook forms from buckets of these sizes (one dtype): a batch closes once it holds
    batch_mb MB, and at the last bucket."""
    count, open_bytes = 0, 0
    for i, n in enumerate(bucket_bytes):
        open_bytes += n
        if i == len(bucket_bytes) - 1 or open_bytes >= batch_mb * 2**20:
            count, open_bytes = count + 1, 0
    return count


def count_combines(state) -> list:
    """Wrap the run of the state's group (`Communicator.run`, where every combination goes) so that each collective
    call (a batch of buckets) appends to the returned list: the number of buffers it combines."""
    from adasum.transport.communicator import communicator

    calls: list = []
    comm = communicator(state.group)
    original = comm.run

    def counted(plan, tensors):
        calls.append(len(tensors))
        return original(plan, tensors)

    comm.run = counted
    return calls


class Mixed(torch.nn.Module):
    """A float32 layer and a float64 layer: DDP puts them in buckets of one dtype each."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4).double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).double()).float()


def bf16_adasum(state, bucket: dist.GradBucket):
    # DDP refuses hooks *named* bf16_compress_wrapper_hook without NCCL; the wrapper itself runs on gloo
    return bf16_compress_wrapper(adasum_hook)(state, bucket)


def local_grads(model, rank, step, micros=(0,), device=None):
    """The gradients rank `rank` computes alone (summed over micro-batches), from `model`'s weights."""
    model.zero_grad()
    for micro in micros:
        x, y = batch(rank, step, micro)
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    return [p.grad.clone() for p in model.parameters()]


def check_steps(rank, world, ddp, plain, reference, steps, micros=(0,), opt_lr=0.1, device=None):
    """Run `steps` iterations; after each backward check every gradient of DDP against `reference` (a function of
    the ranks' tensors giving the reference and its error bound, tests/test_hierarchical.py) of every rank's
    local gradients from the same weights (computed here by `plain`, a non-distributed copy): ``||got - ref||_2 <=
    bound``, step by step, so that errors do not compound; return the parameters' bytes."""
    opt = torch.optim.SGD(ddp.parameters(), lr=opt_lr)
    for step in range(steps):
        plain.load_state_dict(ddp.module.state_dict())
        per_rank = [local_grads(plain, r, step, micros, device) for r in range(world)]
        expected = [reference([per_rank[r][i] for r in range(world)]) for i in range(len(per_rank[0]))]
        opt.zero_grad()
        for micro in micros[:-1]:
            with ddp.no_sync():
                x, y = batch(rank, step, micro)
                torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device)).backward()
        x, y = batch(rank, step, micros[-1])
        torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device)).backward()
        for i, p in enumerate(ddp.parameters()):
            ref, bound = expected[i]
            assert error_of(p.grad, ref) <= bound, (step, i, error_of(p.grad, ref), bound)
        opt.step()
    return b"".join(p.detach().cpu().numpy().tobytes() for p in ddp.parameters())


def check_join(rank, world, ddp, plain, batches_of, device=None):
    """Train under ``ddp.join()`` with `batches_of(r)` batches on rank r, checking each step's gradients against the
    reference Adasum of the local ones within its bound, finished ranks counting as zero buckets; return the
    parameters' bytes."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join():
        for step in range(batches_of(rank)):
            plain.load_state_dict(ddp.module.state_dict())
            per_rank = [
                local_grads(plain, r, step, device=device) if step < batches_of(r)
                else [torch.zeros_like(p) for p in plain.parameters()]
                for r in range(world)
            ]
            opt.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device)).backward()
            for i, p in enumerate(ddp.parameters()):
                ref, bound = combine_with_bound([per_rank[r][i] for r in range(world)])
                assert torch.isfinite(p.grad).all()
                assert error_of(p.grad, ref) <= bound, (step, i, error_of(p.grad, ref), bound)
            opt.step()
    params = list(ddp.parameters())
    assert all(torch.isfinite(p).all() for p in params)
    return b"".join(p.detach().cpu().numpy().tobytes() for p in params)


def ddp_body(rank, world):
    out = {}
    plain = make_model()

    # plain hook, tiny buckets; the buckets are rebuilt after the first iteration. Batches: the default
    # (the whole model is one batch, closed by the last bucket), bucket by bucket, and two buckets a batch
    for name, batch_mb in [("basic", BATCH_MB), ("per-bucket", 0), ("pairs", 1.5 * BUCKET_CAP_MB)]:
        state = AdasumState(batch_mb=batch_mb)
        state.bucket_params, state.bucket_bytes, state.futures = [], [], []
        ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
        ddp.register_comm_hook(state, record)
        out[name] = check_steps(rank, world, ddp, plain, combine_with_bound, steps=3)
        state.bucket_params.clear()
        state.bucket_bytes.clear()
        calls = count_combines(state)
        with learnt_layouts() as learnt:
            out[name] += check_steps(rank, world, ddp, plain, combine_with_bound, steps=1)
        buckets = len(state.bucket_params)
        assert max(state.bucket_params) >= 2 and buckets >= 3, state.bucket_params
        assert state.iteration == 4
        assert learnt == [], learnt  # a bucket's segments are learnt once while DDP keeps its buffer
        expected = batches(state.bucket_bytes, batch_mb)
        assert expected == {"basic": 1, "per-bucket": buckets}.get(name, expected), (name, expected)
        if name == "pairs":
            assert 1 < expected < buckets, state.bucket_bytes
        assert len(calls) == expected, (name, calls, state.bucket_bytes)
        assert all(future.done() for future in state.futures)  # no bucket left in an open batch

    # a float32 and a float64 layer: a batch holds one dtype, so two batches an iteration
    state = AdasumState()
    ddp = DDP(Mixed(), bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(state, adasum_hook)
    out["mixed"] = check_steps(rank, world, ddp, Mixed(), combine_with_bound, steps=2)
    calls = count_combines(state)
    out["mixed"] += check_steps(rank, world, ddp, Mixed(), combine_with_bound, steps=1)
    assert len(calls) == 2, calls

    # static graph with gradients as bucket views
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB, static_graph=True, gradient_as_bucket_view=True)
    ddp.register_comm_hook(AdasumState(), adasum_hook)
    out["static"] = check_steps(rank, world, ddp, plain, combine_with_bound, steps=3)

    # no_sync accumulation over three micro-batches: Adasum of the accumulated local gradients
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(AdasumState(), adasum_hook)
    out["no_sync"] = check_steps(rank, world, ddp, plain, combine_with_bound, steps=3, micros=(0, 1, 2))

    # torch's compression wrappers: Adasum of the gradients rounded to the half dtype, stored in it, cast back
    for name, wrapped, dtype in [
        ("fp16", fp16_compress_wrapper(adasum_hook), torch.float16),
        ("bf16", bf16_adasum, torch.bfloat16),
    ]:
        ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
        ddp.register_comm_hook(AdasumState(), wrapped)
        out[name] = check_steps(rank, world, ddp, plain, lambda gs, dtype=dtype: half_with_bound(gs, dtype), steps=3)

    # the mean reducer is DDP's own average
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(AdasumState(reducer="mean"), adasum_hook)
    out["mean"] = check_steps(rank, world, ddp, plain, mean_with_bound, steps=2)

    if world == 4:  # 2 emulated nodes of 2 ranks: the mean inside each, Adasum across
        ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
        ddp.register_comm_hook(AdasumState(hierarchical=True, local_size=2), adasum_hook)
        out["hierarchical"] = check_steps(
            rank, world, ddp, plain, lambda gs: hierarchical_with_bound(gs, 2), steps=3
        )

    # join with uneven inputs: rank r has 2 + r batches; finished ranks contribute zero buckets
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(AdasumState(), adasum_hook)
    out["join"] = check_join(rank, world, ddp, plain, lambda r: 2 + r)

    # the state pickles without its process group
    state = AdasumState(dist.new_group(list(range(world))), reducer=adasum.Adasum(hierarchical=False), batch_mb=64)
    state.iteration = 7
    restored = pickle.loads(pickle.dumps(state))
    assert restored.process_group is None and restored.iteration == 7
    assert restored.batch_mb == 64 and restored.batch_bytes == 64 << 20
    assert isinstance(restored.reducer, adasum.Adasum)
    restored.process_group = state.group  # set again, by torch's states' name for it
    assert restored.group is state.group
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(restored, adasum_hook)
    out["restored"] = check_steps(rank, world, ddp, plain, combine_with_bound, steps=2)
    copy.deepcopy(AdasumState(hierarchical=True, local_size=1))
    return out


def stale_batch_body(rank, world):
    """A backward pass that raised in the hook leaves buckets in the open batch; the next pass drops them."""
    plain, model = make_model(), make_model()
    state = AdasumState(nonfinite="raise")
    futures: list = []
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(state, recording(futures))
    check_steps(rank, world, ddp, plain, combine_with_bound, steps=1)  # the buckets are rebuilt after this one
    # the first layer's gradient comes last, in the last bucket: the buckets before it wait in the open batch
    handle = model[0].weight.register_hook(lambda g: g * float("nan")) if rank == world - 1 else None
    x, y = batch(rank, 5)
    futures.clear()
    with pytest.raises(adasum.NonFiniteError, match="has NaN on rank"):
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    left = list(futures)  # the Futures of the buckets before the last one, in the open batch
    assert left and not any(future.done() for future in left)
    pickle.dumps(state)  # the open batch stays out of the state's pickle (a Future cannot be pickled)
    if handle is not None:
        handle.remove()
    del ddp  # as the docs say: a new DDP model after the error (the old one's reducer is mid-iteration)
    gc.collect()
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(state, recording(futures))
    out = check_steps(rank, world, ddp, plain, combine_with_bound, steps=2)
    assert len(futures) > len(left) and all(future.done() for future in futures)  # the stale ones dropped too
    with pytest.raises(RuntimeError, match="ended before its last bucket"):
        left[0].wait()
    return out


def device_body(rank, world):
    """The hook on the backend's device (NCCL: CUDA graphs of batches captured and replayed, lists of segments
    read in place by the symmetric-memory transport): batched, bucket by bucket and under fp16 compression,
    against the reference of the ranks' local gradients computed on the same device, within its bound."""
    device = distributed.device_for(rank)
    out = {}
    for name, batch_mb, wrap, reference in [
        ("batched", BATCH_MB, None, combine_with_bound),
        ("pairs", 1.5 * BUCKET_CAP_MB, None, combine_with_bound),
        ("per-bucket", 0, None, combine_with_bound),
        ("fp16", BATCH_MB, fp16_compress_wrapper, lambda gs: half_with_bound(gs, torch.float16)),
    ]:
        ddp = DDP(make_model().to(device), bucket_cap_mb=BUCKET_CAP_MB,
                  device_ids=[device.index] if device.type == "cuda" else None)
        state = AdasumState(batch_mb=batch_mb)
        ddp.register_comm_hook(state, adasum_hook if wrap is None else wrap(adasum_hook))
        # five steps: the first is eager, a batch is captured at its second sighting and replayed after
        out[name] = check_steps(rank, world, ddp, make_model().to(device), reference, steps=5, device=device)
    # join: the last rank trains four batches more, its batches captured and replayed while the others, finished,
    # contribute zero buckets (new buffers every step)
    ddp = DDP(make_model().to(device), bucket_cap_mb=BUCKET_CAP_MB,
              device_ids=[device.index] if device.type == "cuda" else None)
    ddp.register_comm_hook(AdasumState(), adasum_hook)
    out["join"] = check_join(rank, world, ddp, make_model().to(device), lambda r: 2 + 4 * (r == world - 1), device)
    return out


@pytest.mark.nccl
@pytest.mark.parametrize("world", distributed.world_sizes(2))
def test_hook_on_the_backend_device(world):
    distributed.assert_ranks_agree(distributed.run(world, device_body))


def batch_mismatch_body(rank, world):
    """Ranks with different batch limits would pair different collectives: the state's construction raises, the
    same error on every rank; so does the first bucket of unpickled states that differ. A state whose limit
    agrees trains on."""
    with pytest.raises(ValueError) as at_construction:
        AdasumState(batch_mb=64 if rank == 1 else BATCH_MB)
    with pytest.raises(AttributeError):
        AdasumState().batch_mb = 64  # fixed at construction, where it was checked
    # rank 1's state as if saved from another configuration: made (and checked) on a group of each rank's own
    alone = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    state = AdasumState(alone[rank], batch_mb=64 if rank == 1 else BATCH_MB)
    state.group = None  # the default group, which pickling keeps out of the state anyway
    state = pickle.loads(pickle.dumps(state))  # not checked yet: its first bucket checks it, on every rank alike
    futures: list = []
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(state, recording(futures))
    x, y = batch(rank, 0)
    with pytest.raises(ValueError) as in_the_hook:
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    assert all(future.done() for future in futures)  # no bucket left waiting in an open batch
    del ddp
    gc.collect()
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(pickle.loads(pickle.dumps(AdasumState())), adasum_hook)
    steps = check_steps(rank, world, ddp, make_model(), combine_with_bound, steps=2)
    return str(at_construction.value), str(in_the_hook.value), steps


def test_hook_refuses_batch_limits_that_differ_across_ranks():
    results = distributed.run(3, batch_mismatch_body)
    differ = (f"the configuration differs across ranks: rank 0 has reducer=Adasum(per_tensor=True) "
              f"nonfinite=propagate batch_mb={BATCH_MB:g}, rank 1 has reducer=Adasum(per_tensor=True) "
              "nonfinite=propagate batch_mb=64")
    construction, hook, _ = results[0]
    assert construction == f"adasum.ddp.AdasumState: {differ}", construction
    assert hook == f"adasum_hook: {differ}", hook
    assert all(r[:2] == (construction, hook) for r in results)
    assert len({r[2] for r in results}) == 1


def test_hook_drops_the_batch_of_a_failed_backward():
    distributed.assert_ranks_agree(distributed.run(2, stale_batch_body))


@pytest.mark.parametrize("world", [3, 4])
def test_hook_matches_per_parameter_adasum(world):
    results = distributed.run(world, ddp_body)
    distributed.assert_ranks_agree(results)


def test_state_options():
    with pytest.raises(ValueError, match="hierarchical=True goes with reducer='adasum'"):
        AdasumState(reducer="mean", hierarchical=True)
    with pytest.raises(ValueError, match="local_size needs hierarchical=True"):
        AdasumState(local_size=2)
    with pytest.raises(ValueError, match="unknown reducer"):
        AdasumState(reducer="median")
    assert isinstance(AdasumState(reducer=adasum.Sum()).reducer, adasum.Sum)
    for bad in (-1, float("nan"), float("inf")):  # inf: no byte count; it would fail at the first bucket
        with pytest.raises(ValueError) as e:
            AdasumState(batch_mb=bad)
        assert str(e.value) == (f"adasum.ddp.AdasumState: batch_mb must be a finite number >= 0 (MB), got {bad!r}; "
                                "pass batch_mb= a finite number >= 0 (MB)")
    for bad in (True, "64", None):
        with pytest.raises(TypeError) as e:
            AdasumState(batch_mb=bad)
        assert str(e.value) == (f"adasum.ddp.AdasumState: batch_mb must be a finite number >= 0 (MB), got {bad!r}; "
                                "pass a number")
    assert AdasumState(batch_mb=0).batch_mb == 0.0 and AdasumState(batch_mb=64).batch_mb == 64.0
    # whole-model reducers combine bucket by bucket whatever batch_mb says: their coefficients span a call
    assert AdasumState(reducer=adasum.Adasum(per_tensor=False)).batch_bytes == 0
    assert AdasumState(reducer="adacons").batch_bytes == 0
    assert AdasumState().batch_bytes == int(BATCH_MB * 2**20)
