"""Non-finite values: the cross-rank check (find_nonfinite, check_finite) and all_reduce's policies.
NaN and Inf are injected on one rank (or several); "raise" must name the same tensor and rank on
every rank and change nothing, "propagate" must make each poisoned tensor NaN throughout, bitwise identical on
every rank, and leave the other tensors at the independent reference tree (within its error bound)."""

import math

import pytest
import torch

import adasum
from adasum.checks.nonfinite import NonFinite, check_policy

import distributed
from reference import combine_with_bound

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(5,), (3, 4), (0,), (17,), (2, 2), (40,)]


def clean(seed: int) -> list[torch.Tensor]:
    """Mixed dtypes (so the check's per-dtype batches must be put back in order) and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(d) for s, d in zip(SHAPES, DTYPES)]


def poisoned(rank: int, world: int, bad: dict) -> list[torch.Tensor]:
    """This rank's tensors with `bad[(rank, index)]` written into element 1 (flat)."""
    tensors = clean(100 + rank)
    for (r, index), value in bad.items():
        if r == rank:
            tensors[index].view(-1)[1] = value
    return tensors


# (the injected values {(rank, tensor index): value}, the expected (index, rank, kind)); world >= 2
CASES = [
    ({(1, 3): NAN}, (3, 1, "NaN")),
    ({(0, 5): INF}, (5, 0, "Inf")),
    ({(1, 1): -INF}, (1, 1, "Inf")),
    ({(1, 0): NAN, (0, 0): INF, (1, 3): NAN}, (0, 0, "Inf")),  # lowest index, then lowest rank
    ({(1, 4): INF, (0, 4): NAN, (1, 3): INF}, (3, 1, "Inf")),
    ({(1, 4): NAN, (-1, 4): NAN}, (4, 1, "NaN")),  # rank -1: the last rank
]


def _bits(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _resolve(bad: dict, world: int) -> dict:
    return {(r % world, i): v for (r, i), v in bad.items()}


def checks(rank, world):
    out = {}
    names = [f"p{i}" for i in range(len(SHAPES))]

    # nothing non-finite: None everywhere, and "raise" leaves the result bitwise equal to the default
    assert adasum.find_nonfinite(clean(100 + rank)) is None
    a, b = clean(100 + rank), clean(100 + rank)
    adasum.all_reduce([t for t in a if t.numel()], nonfinite="raise")
    adasum.all_reduce([t for t in b if t.numel()])
    assert all(torch.equal(x, y) for x, y in zip(a, b))

    # "raise": every rank names the same first tensor and lowest rank; the tensors stay unchanged
    for case, (bad, expected) in enumerate(CASES):
        bad = _resolve(bad, world)
        index, bad_rank, kind = expected
        bad_rank %= world
        found = adasum.find_nonfinite(poisoned(rank, world, bad), names=names)
        assert found == NonFinite(index, bad_rank, kind, f"p{index}"), (case, found)
        tensors = poisoned(rank, world, bad)
        before = [t.clone() for t in tensors]
        with pytest.raises(adasum.NonFiniteError) as raised:
            adasum.all_reduce(tensors, nonfinite="raise")
        message = str(raised.value)
        assert message == (
            f"adasum.all_reduce: tensor {index} has {kind} on rank {bad_rank} "
            "(the first such tensor, lowest such rank); nothing was changed on any rank (nonfinite='raise')"
        ), message
        assert raised.value.found == NonFinite(index, bad_rank, kind)
        assert all(_bits(x) == _bits(y) for x, y in zip(tensors, before))
        out[f"raise-{case}"] = message
    with pytest.raises(adasum.NonFiniteError, match=r"tensor 1 \('p1'\) has NaN on rank 0"):
        adasum.check_finite(poisoned(rank, world, {(0, 1): NAN}), names=names)

    # integer tensors never count as non-finite; a single tensor may be passed alone
    assert adasum.find_nonfinite([torch.arange(3), torch.ones(2)]) is None
    single = torch.ones(4)
    if rank == world - 1:
        single[0] = NAN
    assert adasum.find_nonfinite(single) == NonFinite(0, world - 1, "NaN")

    # "propagate": a poisoned tensor comes out NaN in every element (a NaN or Inf in a dot product makes both
    # coefficients of the tensor NaN; test_collectives checks the same for a NaN), bitwise identical on every
    # rank; the others in the same fused buffer are untouched by it and equal the independent reference tree
    # within its bound (computed in float64, stored in their dtype)
    bad = {(world - 1, 0): NAN, (0, 3): INF, (1, 5): -INF}
    tensors = poisoned(rank, world, bad)
    adasum.all_reduce(tensors)
    everyone = [poisoned(r, world, bad) for r in range(world)]
    for i, t in enumerate(tensors):
        if i in (0, 3, 5):
            assert torch.isnan(t).all(), (i, t)
        elif t.numel():
            ref, bound = combine_with_bound([w[i] for w in everyone])
            err = float((t.double() - ref).norm())
            assert torch.isfinite(t).all() and err <= bound, (i, err, bound)
    out["propagate"] = b"".join(_bits(t) for t in tensors)

    # bad policies
    for policy in ("skip", "ignore"):
        with pytest.raises(ValueError, match="nonfinite must be one of"):
            adasum.all_reduce([torch.ones(2)], nonfinite=policy)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_nonfinite_raise_names_tensor_and_rank_everywhere_and_propagate_is_identical(world):
    results = distributed.run(world, checks)
    distributed.assert_ranks_agree(results)


def test_single_process_and_world_one():
    """Without torch.distributed the check looks at the local tensors, as rank 0."""
    tensors = [torch.ones(3), torch.tensor([1.0, INF]), torch.tensor([NAN], dtype=torch.bfloat16)]
    assert adasum.find_nonfinite(tensors, names=["a", "b", "c"]) == NonFinite(1, 0, "Inf", "b")
    assert adasum.find_nonfinite(tensors[2:]) == NonFinite(0, 0, "NaN")
    assert adasum.find_nonfinite([]) is None
    assert adasum.find_nonfinite([torch.zeros(0), torch.full((3,), 3e38)]) is None
    assert adasum.find_nonfinite([torch.tensor([1 + 1j, complex(0, math.inf)])]) == NonFinite(0, 0, "Inf")
    with pytest.raises(adasum.NonFiniteError, match=r"adasum.check_finite: tensor 1 \('b'\) has Inf on rank 0"):
        adasum.check_finite(tensors, names=["a", "b", "c"])
    with pytest.raises(ValueError, match="2 names for 3 tensors"):
        adasum.find_nonfinite(tensors, names=["a", "b"])
    check_policy("skip")
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        check_policy("skip", ("propagate", "raise"))


def world_one_body(rank, world):
    t = torch.tensor([1.0, NAN])
    adasum.all_reduce(t)  # propagate: unchanged
    try:
        adasum.all_reduce(t, nonfinite="raise")
    except adasum.NonFiniteError as e:
        return str(e)
    return None


def test_world_one_raise_still_checks():
    [message] = distributed.run(1, world_one_body)
    assert message is not None and "tensor 0 has NaN on rank 0" in message


def test_sparse_tensors_are_checked_by_their_values_and_other_inputs_refused():
    """check_finite and find_nonfinite look at a sparse tensor's stored values (as the training steps' policies
    do); a dict, a non-tensor element or a group that is not a process group raise TypeError naming the call."""
    sparse = torch.tensor([0.0, NAN, 0.0]).to_sparse()
    assert adasum.find_nonfinite([torch.ones(2), sparse]) == NonFinite(1, 0, "NaN")
    assert adasum.find_nonfinite(torch.ones(3).to_sparse()) is None
    with pytest.raises(adasum.NonFiniteError, match=r"^adasum.check_finite: tensor 0 has NaN on rank 0 "):
        adasum.check_finite([sparse])
    with pytest.raises(TypeError) as info:
        adasum.check_finite({"w": torch.tensor([NAN])})
    assert str(info.value) == (
        "adasum.check_finite: takes a tensor or a list of tensors, got a dict; pass list(d.values())"
    )
    with pytest.raises(TypeError) as info:
        adasum.find_nonfinite([torch.ones(1), 2.0])
    assert str(info.value) == "adasum.find_nonfinite: element 1 is a float, not a torch.Tensor; pass tensors only"
    with pytest.raises(TypeError) as info:
        adasum.find_nonfinite([torch.ones(1)], group="world")
    assert str(info.value) == (
        "adasum.find_nonfinite: group must be a torch.distributed ProcessGroup or None, got 'world'; pass "
        "dist.new_group(...) or None"
    )
    with pytest.raises(TypeError) as info:  # a string was read as one name a character
        adasum.find_nonfinite([torch.ones(1), torch.ones(1)], names="ab")
    assert str(info.value) == (
        "adasum.find_nonfinite: names must be a list of names, one per tensor, got 'ab'; pass [name, ...]"
    )
