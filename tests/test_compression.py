"""The compressed combine (`adasum.integrations.compression.CompressedCombine`) on gloo at P = 2, 3, 5 against a
float64 NumPy reference: each rank's values rounded to bf16 or fp8 e4m3 (with the scale agreed over the ranks, as
the reference computes it), combined by the mean, the sum, Adasum (per tensor and whole-model, tests/reference.py)
and AdaCons (tests/reference_adacons.py); the combined result, rounded once more for the all-gather, is within
that rounding's bound of the reference (half an ulp of the dtype relative, fp8's subnormal spacing times the
scale absolute) plus float32's. Ranks end bitwise equal. The bytes each rank receives stay under 2 n of the wire
dtype for every P (a counting wrapper around torch.distributed), where gathering every rank's whole bucket takes
(P - 1) n. Error feedback of both roundings: over K rounds of the same deltas the results add up to K times the
exact combine, up to one rounding of each kind."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

import adasum
from adasum.integrations.compression import FP8, CompressedCombine

import distributed
from reference import tree
from reference_adacons import AdaConsReference

pytestmark = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")

SIZES = [7, 0, 13, 4]  # an empty tensor among them; 24 values: chunks of 12, 8 and 5 (the last padded)
SMALL = [2, 1]  # fewer values than ranks at P = 5: some ranks own an empty chunk
UNIT = {torch.bfloat16: 2.0**-8, FP8: 2.0**-4}  # unit roundoff: 8 and 4 significant bits
FP8_SUBNORMAL_HALF = 2.0**-10  # half of e4m3's subnormal spacing (2^-9), in units of the scale


class GatheredMean(adasum.Mean):
    """A subclass: combined in one process over the gathered copies (its `reduce` might compute anything)."""


def values_of(worker: int, sizes: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(10 + worker)
    shared = np.random.default_rng(0).standard_normal(sum(sizes))  # a common part: the workers correlate
    flat = (0.5 * shared + rng.standard_normal(sum(sizes))) * (1.0 + worker)
    return [np.float32(v) for v in np.split(flat, np.cumsum(sizes)[:-1])]


def rounded(per_worker: list[list[np.ndarray]], dtype: torch.dtype) -> list[list[np.ndarray]]:
    """Every worker's tensors through `dtype` (fp8: one scale per tensor, its largest magnitude over every worker
    / 448), back in float64."""
    count = len(per_worker[0])
    scales = [None] * count
    if dtype == FP8:
        amax = [max(float(np.abs(w[k]).max()) if w[k].size else 0.0 for w in per_worker) for k in range(count)]
        scales = [np.float32(a / 448.0) if a > 0 else np.float32(1.0) for a in amax]
    out = []
    for w in per_worker:
        row = []
        for v, s in zip(w, scales):
            t = torch.from_numpy(np.asarray(v, dtype=np.float32))
            if s is None:
                row.append(t.to(dtype).float().numpy().astype(np.float64))
            else:
                st = torch.tensor(s)
                row.append(((t / st).to(dtype).float() * st).numpy().astype(np.float64))
        out.append(row)
    return out


def combine(name: str, per_worker: list[list[np.ndarray]], adacons: dict) -> list[np.ndarray]:
    count, world = len(per_worker[0]), len(per_worker)
    if name == "mean":
        return [sum(w[k] for w in per_worker) / world for k in range(count)]
    if name == "sum":
        return [sum(w[k] for w in per_worker) for k in range(count)]
    if name == "adasum":
        return [tree([w[k] for w in per_worker]) if per_worker[0][k].size else per_worker[0][k] for k in range(count)]
    if name == "adasum-whole":
        flat = tree([np.concatenate(w) for w in per_worker])
        return np.split(flat, np.cumsum([v.size for v in per_worker[0]])[:-1])
    return adacons.setdefault(name, AdaConsReference(per_tensor=name == "adacons-tensor"))(per_worker)


def reducer_of(name: str) -> adasum.Reducer:
    return {
        "mean": adasum.Mean(), "sum": adasum.Sum(), "adasum": adasum.Adasum(),
        "adasum-whole": adasum.Adasum(per_tensor=False), "adacons": adasum.AdaCons(),
        "adacons-tensor": adasum.AdaCons(per_tensor=True), "gathered": GatheredMean(),
    }[name]


def bound(reference: list[np.ndarray], inputs: list[list[np.ndarray]], dtype: torch.dtype, once: bool) -> np.ndarray:
    """Per element: the second rounding's bound (none with `once`) plus float32's for the combine."""
    ref = np.concatenate(reference)
    spread = np.sum([np.abs(np.concatenate(w)) for w in inputs], axis=0)
    out = 1e-6 * spread + 1e-30
    if once:
        return out
    out = out + UNIT[dtype] * np.abs(ref)
    if dtype == FP8:
        scales = np.concatenate([np.full(r.size, np.abs(r).max() / 448.0 if r.size else 0.0) for r in reference])
        out = out + FP8_SUBNORMAL_HALF * scales * (1 + 1e-3) + UNIT[dtype] * 1e-3 * np.abs(ref)
    return out


def counted(world: int):
    """Wrap torch.distributed's collectives in this process: the bytes this rank receives, by kind."""
    received = {"data": 0, "small": 0}
    real = {name: getattr(dist, name) for name in ("all_to_all_single", "all_gather", "all_reduce")}

    def all_to_all_single(output, input, *args, **kwargs):
        received["data"] += output.numel() * output.element_size() * (world - 1) // world
        return real["all_to_all_single"](output, input, *args, **kwargs)

    def all_gather(outputs, input, *args, **kwargs):
        received["data"] += sum(o.numel() * o.element_size() for o in outputs[1:])
        return real["all_gather"](outputs, input, *args, **kwargs)

    def all_reduce(tensor, *args, **kwargs):
        received["small"] += 2 * tensor.numel() * tensor.element_size() * (world - 1) // world  # a ring's
        return real["all_reduce"](tensor, *args, **kwargs)

    for name, wrapper in (("all_to_all_single", all_to_all_single), ("all_gather", all_gather),
                          ("all_reduce", all_reduce)):
        setattr(dist, name, wrapper)
    return received, lambda: [setattr(dist, name, f) for name, f in real.items()]


REDUCERS = ["mean", "sum", "adasum", "adasum-whole", "adacons", "adacons-tensor", "gathered"]


def body(rank, world):
    out = {}
    for sizes in (SIZES, SMALL):
        n = sum(sizes)
        per_worker = [values_of(j, sizes) for j in range(world)]
        for dtype in (torch.bfloat16, FP8):
            adacons: dict = {}
            for name in REDUCERS:
                combiner = CompressedCombine(reducer_of(name), dtype, None)
                flat = torch.from_numpy(np.concatenate(per_worker[rank]))
                calls = 2  # AdaCons' momentum state: a second call with the same layout
                received, restore = counted(world)
                try:
                    for _ in range(calls):
                        work = flat.clone()
                        combiner(work, sizes)
                finally:
                    restore()
                inputs = rounded(per_worker, dtype)
                for _ in range(calls):
                    reference = combine(name if name != "gathered" else "mean", inputs, adacons)
                once = name == "gathered"
                error = np.abs(work.numpy().astype(np.float64) - np.concatenate(reference))
                limit = bound(reference, inputs, dtype, once)
                assert (error <= limit).all(), (name, str(dtype), sizes, float((error / limit).max()))
                size = dtype.itemsize
                width = math.ceil(n / world)
                if once:  # every rank's whole bucket
                    assert received["data"] == calls * (world - 1) * n * size, (name, received)
                else:  # chunk j of every rank, then every combined chunk: 2 c (P - 1) < 2 (n + P)
                    assert received["data"] == calls * 2 * (world - 1) * width * size, (name, received)
                    assert received["data"] < calls * 2 * (n + world) * size
                out[(name, str(dtype), n)] = work.numpy().tobytes()
    # error feedback of both roundings: K rounds of the same deltas add up to K times the exact combine
    sizes, rounds = SIZES, 6
    per_worker = [values_of(j, sizes) for j in range(world)]
    exact = combine("mean", [[v.astype(np.float64) for v in w] for w in per_worker], {})
    for dtype in (torch.bfloat16, FP8):
        combiner = CompressedCombine(adasum.Mean(), dtype, None, error_feedback=True)
        total = np.zeros(sum(sizes))
        for _ in range(rounds):
            work = torch.from_numpy(np.concatenate(per_worker[rank]))
            combiner(work, sizes)
            total += work.numpy()
        drift = np.abs(total - rounds * np.concatenate(exact))
        # |drift| <= the last round's two residuals: one rounding of the result and the mean of the inputs'
        ref = np.concatenate(exact)
        inputs = np.abs(np.stack([np.concatenate(w) for w in per_worker]))
        limit = 2 * UNIT[dtype] * (np.abs(ref) + inputs.mean(0)) + 1e-6 * rounds * inputs.sum(0)
        if dtype == FP8:
            scale_in = np.concatenate([np.full(k, inputs[:, a:a + k].max() / 448.0 if k else 0.0)
                                       for a, k in zip(np.cumsum([0, *sizes[:-1]]), sizes)])
            scale_out = np.concatenate([np.full(r.size, np.abs(r).max() / 448.0 if r.size else 0.0) for r in exact])
            limit = limit + 2 * FP8_SUBNORMAL_HALF * (scale_in + scale_out)
        assert (drift <= limit).all(), (str(dtype), float((drift / limit).max()))
        without = CompressedCombine(adasum.Mean(), dtype, None)  # no feedback: the rounding adds up K times
        plain = np.zeros(sum(sizes))
        for _ in range(rounds):
            work = torch.from_numpy(np.concatenate(per_worker[rank]))
            without(work, sizes)
            plain += work.numpy()
        assert np.abs(plain - rounds * ref).max() > 2 * drift.max(), str(dtype)
        out[("feedback", str(dtype))] = total.tobytes()
        state = combiner.state_dict()
        assert set(state) == {"residuals", "chunk_residuals"} and 0 in state["chunk_residuals"]
    return out


@pytest.mark.parametrize("world", [2, 3, 5])
def test_compressed_combine_against_the_numpy_reference(world):
    results = distributed.run(world, body, timeout_s=240)
    distributed.assert_ranks_agree(results)
