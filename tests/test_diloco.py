"""DiLoCo (SlowMo with an outer optimizer) against an independent float64 NumPy reference on gloo at P = 2, 3, 5:
inner SGD on each worker's least-squares loss, the deltas combined by the mean, Adasum (tests/reference.py) or
AdaCons (tests/reference_adacons.py), the outer Nesterov SGD written out by hand; the pseudo-gradients sent in
bf16 and fp8 e4m3 (rounded here by torch's dtype conversion, the scale computed here), each rank's deltas before
the combine and the combined result again after it, with and without error feedback (of both roundings). Ranks
end bitwise equal. SlowMo's own update equals the outer optimizer SGD(lr=alpha, momentum=beta)."""

import io

import numpy as np
import pytest
import torch

import adasum

import distributed
from reference import tree
from reference_adacons import AdaConsReference

ROUNDS, H, LR = 3, 3, 0.05
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
SHAPES = [(3, 4), (3,)]


def data(worker):
    rng = np.random.default_rng(100 + worker)
    return rng.standard_normal((8, 4)), rng.standard_normal((8, 3))


def start():
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s) * 0.5 for s in SHAPES]


def grads(params, worker):
    """The gradient of 0.5 * mean |x W^T + b - y|^2 at (W, b)."""
    x, y = data(worker)
    w, b = params
    r = x @ w.T + b - y
    return [r.T @ x / len(x), r.sum(0) / len(x)]


def rounded(values, dtype):
    """`values` (float64 arrays of one worker) through `dtype` as the wire carries them, with the fp8 scales."""
    out = []
    for v, s in zip(values, dtype[1] if isinstance(dtype, tuple) else [None] * len(values)):
        t = torch.from_numpy(np.asarray(v, dtype=np.float32))
        if s is None:
            out.append(t.to(dtype).to(torch.float32).numpy().astype(np.float64))
        else:
            scaled = (t / torch.tensor(s, dtype=torch.float32)).to(torch.float8_e4m3fn).to(torch.float32)
            out.append((scaled * torch.tensor(s, dtype=torch.float32)).numpy().astype(np.float64))
    return out


def through(values, comm):
    """One list of float64 arrays through the wire's dtype: bf16, or fp8 with one scale per array (its largest
    magnitude / 448, computed here)."""
    if comm != "fp8":
        return rounded(values, torch.bfloat16)
    amax = [float(np.abs(np.float32(v)).max()) for v in values]
    return rounded(values, (torch.float8_e4m3fn, [np.float32(a / 448.0) if a > 0 else np.float32(1.0) for a in amax]))


def reference(world, reducer, comm=None, feedback=False, x0=None, buf=None, rounds=ROUNDS, with_buf=False):
    """Every worker's model after `rounds` rounds of H inner SGD steps and the outer Nesterov step (float64), from
    `x0` and the outer momentum `buf` (default: `start()` and none)."""
    x0 = start() if x0 is None else x0
    combine = {
        "mean": lambda ws: [sum(w[k] for w in ws) / len(ws) for k in range(len(SHAPES))],
        "adasum": lambda ws: [
            tree([np.ravel(w[k]) for w in ws]).reshape(SHAPES[k]) for k in range(len(SHAPES))
        ],
        "adacons": AdaConsReference(),
    }[reducer]
    residuals = [[np.zeros(s) for s in SHAPES] for _ in range(world)]
    owed = [np.zeros(s) for s in SHAPES]  # the combined result's rounding residual (error feedback)
    for _ in range(rounds):
        deltas = []
        for j in range(world):
            x = [p.copy() for p in x0]
            for _ in range(H):
                x = [p - LR * g for p, g in zip(x, grads(x, j))]
            deltas.append([np.float32(p) - np.float32(a) for p, a in zip(x, x0)])  # float32 parameters
        if comm is not None:
            values = [[d + r for d, r in zip(ds, rs)] for ds, rs in zip(deltas, residuals)]
            if comm == "fp8":
                amax = [max(float(np.abs(np.float32(v[k])).max()) for v in values) for k in range(len(SHAPES))]
                kind = (None, [np.float32(a / 448.0) if a > 0 else np.float32(1.0) for a in amax])
                sent = [rounded(v, (torch.float8_e4m3fn, kind[1])) for v in values]
            else:
                sent = [rounded(v, torch.bfloat16) for v in values]
            if feedback:
                residuals = [[np.float32(v) - s for v, s in zip(vs, ss)] for vs, ss in zip(values, sent)]
            deltas = sent
        combined = combine(deltas)
        if comm is not None and world > 1:  # the combined chunks cross the wire again
            values = [np.float32(np.float32(c) + np.float32(r)) for c, r in zip(combined, owed)]
            combined = through(values, comm)
            if feedback:
                owed = [v - c for v, c in zip(values, combined)]
        g = [-c for c in combined]  # the pseudo-gradient x0 - x_bar
        buf = [gi.copy() for gi in g] if buf is None else [OUTER_MOMENTUM * b + gi for b, gi in zip(buf, g)]
        step = [gi + OUTER_MOMENTUM * b for gi, b in zip(g, buf)]  # Nesterov
        x0 = [np.float32(a - OUTER_LR * s) for a, s in zip(x0, step)]
    return (x0, buf) if with_buf else x0


def make(reducer, **options):
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p, v in zip(model.parameters(), start()):
            p.copy_(torch.from_numpy(v))
    outer = options.pop("outer", adasum.diloco_outer(OUTER_LR, OUTER_MOMENTUM))
    opt = adasum.SlowMo(torch.optim.SGD(model.parameters(), lr=LR), local_steps=H, reducer=reducer,
                        outer_optimizer=outer, **options)
    return model, opt


def train(model, opt, rank, rounds=ROUNDS):
    x, y = (torch.from_numpy(a).float() for a in data(rank))
    for _ in range(rounds * H):
        opt.zero_grad()
        (0.5 * (model(x) - y).pow(2).sum(1).mean()).backward()
        opt.step()


CASES = [
    ("mean", None, False),
    ("adasum", None, False),
    ("adacons", None, False),
    ("mean", "bf16", False),
    ("adasum", "bf16", True),
    ("mean", "fp8", False),
    ("adasum", "fp8", True),
    ("adacons", "fp8", True),
]


def diloco_body(rank, world):
    out = {}
    for reducer, comm, feedback in CASES:
        options = {"communication_dtype": comm, "error_feedback": feedback} if comm else {}
        model, opt = make(reducer, **options)
        train(model, opt, rank)
        expected = reference(world, reducer, comm, feedback)
        for p, e in zip(model.parameters(), expected):
            # float32 inner steps against float64 ones, compounded over the rounds: far below one bf16 ulp
            assert np.allclose(p.detach().numpy(), e, rtol=2e-4, atol=2e-5), (reducer, comm, feedback)
        out[(reducer, comm, feedback)] = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    return out


@pytest.mark.parametrize("world", [2, 3, 5])
def test_diloco_against_the_numpy_reference(world):
    results = distributed.run(world, diloco_body, timeout_s=240)
    distributed.assert_ranks_agree(results)


def slowmo_equals_sgd_body(rank, world):
    """SlowMo's update (slow_lr alpha, slow_momentum beta, constant base lr) is the outer optimizer
    SGD(lr=alpha, momentum=beta) on the pseudo-gradients; and a DiLoCo state resumes bitwise."""
    out = {}
    for reducer in ("mean", "adasum"):
        model, opt = make(reducer, outer=None, slow_lr=0.8, slow_momentum=0.5)
        train(model, opt, rank)
        sgd = lambda ps: torch.optim.SGD(ps, lr=0.8, momentum=0.5)  # noqa: E731
        other, opt2 = make(reducer, outer=sgd)
        train(other, opt2, rank)
        for p, q in zip(model.parameters(), other.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), reducer
    # resume mid-round: the outer state, its parameters and the residuals checkpoint with the rest
    model, opt = make("adasum", communication_dtype="bf16", error_feedback=True)
    train(model, opt, rank, rounds=3)
    straight = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    model, opt = make("adasum", communication_dtype="bf16", error_feedback=True)
    x, y = (torch.from_numpy(a).float() for a in data(rank))
    for _ in range(H + 1):
        opt.zero_grad()
        (0.5 * (model(x) - y).pow(2).sum(1).mean()).backward()
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    model, opt = make("adasum", communication_dtype="bf16", error_feedback=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    for _ in range(3 * H - H - 1):
        opt.zero_grad()
        (0.5 * (model(x) - y).pow(2).sum(1).mean()).backward()
        opt.step()
    assert b"".join(p.detach().numpy().tobytes() for p in model.parameters()) == straight
    out["resumed"] = straight
    return out


def test_slowmo_update_is_outer_sgd_and_diloco_resumes():
    results = distributed.run(2, slowmo_equals_sgd_body)
    distributed.assert_ranks_agree(results)


def test_options_refused():
    model = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="slow_lr and slow_momentum"):
        adasum.SlowMo(sgd, local_steps=2, slow_momentum=0.5, outer_optimizer=adasum.diloco_outer())
    with pytest.raises(ValueError, match="error_feedback=True needs a communication_dtype"):
        adasum.SlowMo(sgd, local_steps=2, error_feedback=True)
    with pytest.raises(ValueError, match="communication_dtype must be"):
        adasum.SlowMo(sgd, local_steps=2, communication_dtype="int8")
    with pytest.raises(TypeError, match="outer_optimizer must be a factory"):
        adasum.SlowMo(sgd, local_steps=2, outer_optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    saved = adasum.SlowMo(sgd, local_steps=2, outer_optimizer=adasum.diloco_outer()).state_dict()
    with pytest.raises(ValueError, match="outer_optimizer"):
        adasum.SlowMo(sgd, local_steps=2).load_state_dict(saved)


class FP16Compressor:  # Horovod's hvd.Compression.fp16 is a class of this name
    pass


def compression_body(rank, world):
    """DistributedOptimizer(compression=) in delta mode: every rank's SGD step, rounded to the wire's dtype, combined
    by the reference Adasum; the ranks bitwise equal."""
    out = {}
    for compression, dtype in (("bf16", torch.bfloat16), (FP16Compressor, torch.float16), (torch.bfloat16, None)):
        model = torch.nn.Linear(4, 3)
        with torch.no_grad():
            for p, v in zip(model.parameters(), start()):
                p.copy_(torch.from_numpy(v))
        opt = adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), compression=compression)
        x, y = (torch.from_numpy(a).float() for a in data(rank))
        (0.5 * (model(x) - y).pow(2).sum(1).mean()).backward()
        opt.step()
        x0 = start()
        wire = dtype or torch.bfloat16
        deltas = []
        for j in range(world):
            step = [np.float32(a - LR * g) - np.float32(a) for a, g in zip(x0, grads(x0, j))]
            deltas.append(rounded(step, wire))
        combined = [tree([np.ravel(d[k]) for d in deltas]).reshape(SHAPES[k]) for k in range(len(SHAPES))]
        combined = rounded(combined, wire)  # the combined chunks cross the wire again
        for p, a, c in zip(model.parameters(), x0, combined):
            assert np.allclose(p.detach().numpy(), np.float32(a) + c, rtol=1e-5, atol=1e-6), compression
        out[str(compression)] = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    with pytest.raises(ValueError, match="compression= sends delta mode's weight changes"):
        adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), mode="gradient", compression="fp16")
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_optimizer_compression_in_delta_mode(world):
    results = distributed.run(world, compression_body)
    distributed.assert_ranks_agree(results)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_the_simulator_runs_the_same_diloco(world):
    """`SimulatedWorkers(outer_optimizer=, communication_dtype=, error_feedback=)` against the same reference (its
    outer step and its wire rounding are the distributed path's functions)."""
    for reducer, comm, feedback in CASES:
        model = torch.nn.Linear(4, 3)
        with torch.no_grad():
            for p, v in zip(model.parameters(), start()):
                p.copy_(torch.from_numpy(v))
        sim = adasum.SimulatedWorkers(
            model, world, lambda ps: torch.optim.SGD(ps, lr=LR), reducer=reducer, combine="delta", local_steps=H,
            outer_optimizer=adasum.diloco_outer(OUTER_LR, OUTER_MOMENTUM), communication_dtype=comm,
            error_feedback=feedback, loss_fn=lambda out, y: 0.5 * (out - y).pow(2).sum(-1).mean(), diagnostics=False,
        )
        xs = torch.stack([torch.from_numpy(data(j)[0]).float() for j in range(world)])
        ys = torch.stack([torch.from_numpy(data(j)[1]).float() for j in range(world)])
        for _ in range(ROUNDS * H):
            sim.step(xs, ys)
        for p, e in zip(model.parameters(), reference(world, reducer, comm, feedback)):
            assert np.allclose(p.detach().numpy(), e, rtol=2e-4, atol=2e-5), (reducer, comm, feedback)


# Streaming DiLoCo: a model of three tensors (two halves of the weight and the bias), so that it splits into 2 or 3
# fragments
SPLIT_SHAPES = [(3, 2), (3, 2), (3,)]
BOUNDS = {2: [(0, 2), (2, 3)], 3: [(0, 1), (1, 2), (2, 3)]}  # by size: [6, 6, 3] elements


class Split(torch.nn.Module):
    def __init__(self):
        super().__init__()
        values = start3()
        self.w1, self.w2, self.b = (torch.nn.Parameter(torch.from_numpy(v).float()) for v in values)

    def forward(self, x):
        return x[:, :2] @ self.w1.T + x[:, 2:] @ self.w2.T + self.b


def start3():
    rng = np.random.default_rng(1)
    return [np.float32(rng.standard_normal(s) * 0.5).astype(np.float64) for s in SPLIT_SHAPES]


def grads3(params, worker):
    x, y = data(worker)
    w1, w2, b = params
    r = x[:, :2] @ w1.T + x[:, 2:] @ w2.T + b - y
    return [r.T @ x[:, :2] / len(x), r.T @ x[:, 2:] / len(x), r.sum(0) / len(x)]


def streaming_reference(world, reducer, fragments, delay, mixing, local_steps, steps):
    """Every worker's model after `steps` inner SGD steps of Streaming DiLoCo, written out (float32 values)."""
    f32 = np.float32
    xs = [start3() for _ in range(world)]
    anchor = start3()
    outer = [a.copy() for a in anchor]
    buf = [None] * len(SPLIT_SHAPES)
    offsets = [(k * local_steps) // fragments for k in range(fragments)]
    combine = {"mean": lambda ts: sum(ts) / len(ts), "adasum": lambda ts: tree([np.ravel(t) for t in ts])}[reducer]
    pending = {}

    def apply(k):
        _, g = pending.pop(k)
        for i in range(*BOUNDS.get(fragments, [(0, 3)])[k]) if fragments > 1 else range(3):
            buf[i] = g[i].copy() if buf[i] is None else f32(OUTER_MOMENTUM * buf[i] + g[i])
            outer[i] = f32(outer[i] - OUTER_LR * f32(g[i] + OUTER_MOMENTUM * buf[i]))
            anchor[i] = outer[i].copy()
            for j in range(world):
                xs[j][i] = anchor[i].copy() if mixing == 1.0 else f32((1 - mixing) * xs[j][i] + mixing * anchor[i])

    for s in range(1, steps + 1):
        for j in range(world):
            xs[j] = [f32(p - LR * g) for p, g in zip(xs[j], grads3(xs[j], j))]
        for k in sorted(k for k, (due, _) in pending.items() if due <= s):
            apply(k)
        for k, offset in enumerate(offsets):
            if s % local_steps == offset:
                members = range(*BOUNDS[fragments][k]) if fragments > 1 else range(3)
                g = {i: -np.reshape(combine([f32(xs[j][i] - anchor[i]) for j in range(world)]), SPLIT_SHAPES[i])
                     for i in members}
                pending[k] = (s + delay, g)
                if delay == 0:
                    apply(k)
    return xs, anchor


STREAMS = [("mean", 2, 0, 1.0), ("adasum", 2, 1, 1.0), ("mean", 3, 2, 0.5), ("adasum", 3, 1, 1.0)]
STREAM_H, STREAM_STEPS = 6, 20  # ends with fragments in flight


def streaming_body(rank, world):
    out = {}
    x, y = (torch.from_numpy(a).float() for a in data(rank))
    for reducer, fragments, delay, mixing in STREAMS:
        model = Split()
        opt = adasum.SlowMo(torch.optim.SGD(model.parameters(), lr=LR), local_steps=STREAM_H, reducer=reducer,
                            outer_optimizer=adasum.diloco_outer(OUTER_LR, OUTER_MOMENTUM), fragments=fragments,
                            delay=delay, mixing=mixing)
        for _ in range(STREAM_STEPS):
            opt.zero_grad()
            (0.5 * (model(x) - y).pow(2).sum(1).mean()).backward()
            opt.step()
        xs, anchor = streaming_reference(world, reducer, fragments, delay, mixing, STREAM_H, STREAM_STEPS)
        case = (reducer, fragments, delay, mixing)
        for p, e in zip(model.parameters(), xs[rank]):
            assert np.allclose(p.detach().numpy(), e, rtol=1e-4, atol=1e-5), case
        for a, e in zip(opt.last_combined(), anchor):
            assert np.allclose(a.numpy(), e, rtol=1e-4, atol=1e-5), case
        out[case] = b"".join(a.numpy().tobytes() for a in opt.last_combined())  # the synced fragments
    return out


@pytest.mark.parametrize("world", [2, 3, 5])
def test_streaming_diloco_against_the_numpy_reference(world):
    results = distributed.run(world, streaming_body, timeout_s=240)
    distributed.assert_ranks_agree(results)


def test_streaming_options_refused_and_one_worker():
    model = Split()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match="Streaming DiLoCo's: give outer_optimizer"):
        adasum.SlowMo(sgd, local_steps=4, fragments=2)
    with pytest.raises(ValueError, match="delay=4 must be below local_steps=4"):
        adasum.SlowMo(sgd, local_steps=4, outer_optimizer=adasum.diloco_outer(), fragments=2, delay=4)
    with pytest.raises(ValueError, match="buffers='average'"):
        adasum.SlowMo(sgd, local_steps=4, outer_optimizer=adasum.diloco_outer(), fragments=2, buffers="average")
    # one worker, no process group: each fragment's pseudo-gradient is its own delta (the reference at P = 1)
    opt = adasum.SlowMo(sgd, local_steps=STREAM_H, outer_optimizer=adasum.diloco_outer(OUTER_LR, OUTER_MOMENTUM),
                        fragments=3, delay=1)
    x, y = (torch.from_numpy(a).float() for a in data(0))
    for _ in range(STREAM_STEPS):
        opt.zero_grad()
        (0.5 * (model(x) - y).pow(2).sum(1).mean()).backward()
        opt.step()
    xs, _ = streaming_reference(1, "mean", 3, 1, 1.0, STREAM_H, STREAM_STEPS)
    for p, e in zip(model.parameters(), xs[0]):
        assert np.allclose(p.detach().numpy(), e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_the_simulator_streams_as_the_reference(world):
    """`SimulatedWorkers(fragments=, delay=, mixing=)` against the same written-out schedule, every worker."""
    for reducer, fragments, delay, mixing in STREAMS:
        model = Split()
        sim = adasum.SimulatedWorkers(
            model, world, lambda ps: torch.optim.SGD(ps, lr=LR), reducer=reducer, combine="delta",
            local_steps=STREAM_H, outer_optimizer=adasum.diloco_outer(OUTER_LR, OUTER_MOMENTUM), fragments=fragments,
            delay=delay, mixing=mixing, loss_fn=lambda out, y: 0.5 * (out - y).pow(2).sum(-1).mean(), diagnostics=False,
        )
        xs_in = torch.stack([torch.from_numpy(data(j)[0]).float() for j in range(world)])
        ys = torch.stack([torch.from_numpy(data(j)[1]).float() for j in range(world)])
        for _ in range(STREAM_STEPS):
            sim.step(xs_in, ys)
        xs, anchor = streaming_reference(world, reducer, fragments, delay, mixing, STREAM_H, STREAM_STEPS)
        for j in range(world):
            for stacked, e in zip(sim.stacked, xs[j]):
                assert np.allclose(stacked[j].detach().numpy(), e, rtol=1e-4, atol=1e-5), (reducer, fragments, j)
        for p, e in zip(model.parameters(), anchor):
            assert np.allclose(p.detach().numpy(), e, rtol=1e-4, atol=1e-5)
