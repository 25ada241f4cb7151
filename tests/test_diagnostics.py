"""The orthogonality diagnostic against hand computations (its gloo form is in test_sim.py)."""

import math

import pytest
import torch

from adasum.diagnostics import all_reduce_orthogonality, from_norms, orthogonality, orthogonality_stacked

import distributed


def test_hand_computed_values():
    # worker 0: w = [3, 4], b = [1];  worker 1: w = [1, 0], b = [-1]
    # w: sum |g_i|^2 = 25 + 1 = 26, |sum g_i|^2 = |[4, 4]|^2 = 32  -> 26/32
    # b: sum |g_i|^2 = 1 + 1 = 2,   |sum g_i|^2 = 0               -> inf (exact cancellation)
    # model: (26 + 2) / (32 + 0) = 28/32
    result = orthogonality(
        [[torch.tensor([3.0, 4.0]), torch.tensor([1.0])], [torch.tensor([1.0, 0.0]), torch.tensor([-1.0])]]
    )
    assert result.per_tensor[0].item() == pytest.approx(26 / 32)
    assert math.isinf(result.per_tensor[1].item())
    assert result.model == pytest.approx(28 / 32)


def test_orthogonal_gives_one_and_parallel_gives_one_over_p():
    eye = torch.eye(5)
    assert orthogonality_stacked([eye]).model == pytest.approx(1.0)
    same = torch.randn(1, 7).repeat(4, 1)
    assert orthogonality_stacked([same]).model == pytest.approx(1 / 4)


def test_all_zero_is_nan_and_layouts_agree():
    assert math.isnan(orthogonality([[torch.zeros(3)], [torch.zeros(3)]]).model)
    g = torch.randn(6, 3, 2, dtype=torch.float16)
    listed = orthogonality([[g[i]] for i in range(6)])
    stacked = orthogonality_stacked([g])
    assert listed.model == stacked.model
    assert listed.per_tensor.dtype == torch.float64
    expected = (g.double() ** 2).sum() / (g.double().sum(0) ** 2).sum()
    assert stacked.model == pytest.approx(expected.item())


def test_from_norms_and_bad_input():
    assert from_norms(torch.tensor([2.0, 1.0]), torch.tensor([4.0, 4.0])).model == pytest.approx(3 / 8)
    with pytest.raises(ValueError, match="at least one worker"):
        orthogonality([])
    with pytest.raises(ValueError, match="same number"):
        orthogonality([[torch.ones(2)], [torch.ones(2), torch.ones(1)]])


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError) as info:
        orthogonality_stacked([torch.randn(4, 10), torch.randn(3, 10)])  # 4 workers' copies of one, 3 of the other
    assert str(info.value) == (
        "every tensor needs the same number of workers first: tensor 0 has 4, tensor 1 has 3; "
        "pass every tensor stacked over the same workers"
    )
    with pytest.raises(ValueError) as info:
        orthogonality_stacked([torch.randn(4, 10), torch.tensor(2.0)])
    assert str(info.value) == (
        "every tensor needs the worker index first: tensor 1 is a scalar; pass torch.stack of the workers' copies "
        "(shape [workers, ...])"
    )
    with pytest.raises(ValueError) as info:
        from_norms(torch.tensor([2.0, 1.0]), torch.tensor([4.0]))
    assert str(info.value) == (
        "sum_of_squares and square_of_sum need one value per tensor each, got 2 and 1; "
        "pass two 1-D tensors of the same length"
    )


def orthogonality_layouts_body(rank, world):
    """all_reduce_orthogonality on layouts that differ across ranks (the same total size, split differently; or
    another size), and on a dict: each raises, the same on every rank."""
    errors = []
    split = [torch.ones(3), torch.ones(1)] if rank == 0 else [torch.ones(1), torch.ones(3)]
    for tensors in (split, [torch.ones(3 + rank)], {"w": torch.ones(3)}):
        try:
            all_reduce_orthogonality(tensors)
            errors.append(None)
        except (TypeError, ValueError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    # the group is still usable, and equal layouts (dtypes may differ: float64 copies travel) still combine
    mine = torch.tensor([1.0, 0.0]) if rank == 0 else torch.tensor([0.0, 1.0], dtype=torch.float64)
    o = all_reduce_orthogonality([mine])
    return errors, o.model


def test_all_reduce_orthogonality_refuses_layouts_that_differ_across_ranks():
    results = distributed.run(2, orthogonality_layouts_body, timeout_s=30)
    assert results[0] == results[1]
    errors, model = results[0]
    assert errors == [
        "ValueError: adasum.all_reduce_orthogonality: tensors differ across ranks at index 0: rank 0 has float64 [3] "
        "on cpu, rank 1 has float64 [1] on cpu",
        "ValueError: adasum.all_reduce_orthogonality: tensors differ across ranks at index 0: rank 0 has float64 [3] "
        "on cpu, rank 1 has float64 [4] on cpu",
        "TypeError: adasum.all_reduce_orthogonality: takes a tensor or a list of tensors, got a dict; "
        "pass list(d.values())",
    ]
    assert model == 1.0


def test_orthogonality_refuses_workers_of_other_shapes_or_given_as_tensors():
    with pytest.raises(ValueError) as info:
        orthogonality([[torch.ones(2), torch.ones(3)], [torch.ones(2), torch.ones(4)]])
    assert str(info.value) == (
        "every worker needs the same shapes: tensor 1 has shape [3] on worker 0, [4] on worker 1; "
        "pass tensors of one shape at each index"
    )
    with pytest.raises(TypeError) as info:  # was read as two tensors of one element each
        orthogonality([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])])
    assert str(info.value) == (
        "orthogonality takes one list of tensors per worker, got a tensor for worker 0 "
        "(one tensor per worker: pass [[g] for g in tensors])"
    )
    with pytest.raises(TypeError) as info:
        orthogonality([[torch.ones(2)], [2.0]])
    assert str(info.value) == (
        "orthogonality takes tensors: worker 1's tensor 0 is a float; pass torch tensors (torch.as_tensor(x))"
    )
