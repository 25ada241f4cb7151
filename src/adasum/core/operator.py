r"""Adasum's pairwise operator: the formula, its coefficients and their zero guard. Pure math; the
kernels (`adasum.kernels`) apply it to flat buffers, `adasum.kernels.reduce` to whole tensors, the
collectives slice by slice. No communication happens here.

For two vectors ``a`` and ``b`` standing for ``n_a`` and ``n_b`` workers,
``w_a = n_a / (n_a + n_b)`` and ``w_b = n_b / (n_a + n_b)``::

    adasum(a, b) = (1 - w_a <a,b> / |a|^2) a + (1 - w_b <a,b> / |b|^2) b

With equal counts this is the paper's ``(1 - <a,b>/2|a|^2) a + (1 - <a,b>/2|b|^2) b``: orthogonal
inputs are summed, parallel inputs averaged (worker-weighted), and in between the parallel part
is averaged and the orthogonal part summed.

Numerics: the three reductions are computed in float64 whatever the dtype (products included:
float32 squares underflow and overflow at the ends of float32's range); the coefficients are float64; the combination is
computed in float64 and written back in the tensor's dtype. Zero guard, no epsilon: a side whose
squared norm is below ``sqrt(float64 tiny)`` (about 1.5e-154) gets coefficient 1, so
``adasum(0, b) = b`` and ``adasum(0, 0) = 0``. For float64 inputs this means vectors of norm
below about 1.2e-77 count as zero, and squared norms above float64's range overflow; for
float32, bfloat16 and float16 inputs the whole representable range is safe.
Non-finite inputs propagate: a tensor with a NaN or Inf in either input comes out non-finite.
"""

from __future__ import annotations

import math

import torch

ZERO_NORM = math.sqrt(torch.finfo(torch.float64).tiny)
"""Squared norms below this count as zero: their coefficient is 1."""


def check_floating(dtype: torch.dtype) -> None:
    """Raise TypeError unless `dtype` is a real floating-point dtype."""
    if not dtype.is_floating_point:
        raise TypeError(f"Adasum needs floating-point tensors, got {dtype}; pass float tensors (cast with .float() or "
                        ".to(torch.bfloat16))")


def coefficients(
    partials: torch.Tensor, weight_a: float | torch.Tensor, weight_b: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 coefficients (c_a, c_b) per segment from ``dot_and_norms`` output, zero guard included."""
    dot, norm_a, norm_b = partials[0], partials[1], partials[2]
    one = torch.ones_like(dot)
    coeff_a = torch.where(norm_a >= ZERO_NORM, 1 - weight_a * dot / norm_a.clamp_min(ZERO_NORM), one)
    coeff_b = torch.where(norm_b >= ZERO_NORM, 1 - weight_b * dot / norm_b.clamp_min(ZERO_NORM), one)
    return coeff_a, coeff_b


def pair_coefficients(
    partials: torch.Tensor, workers_a: int | torch.Tensor, workers_b: int | torch.Tensor
) -> torch.Tensor:
    """Adasum's coefficients of a pair as one float64 ``[2, T]`` tensor (rows c_a, c_b): `coefficients` with the
    weights ``w_a = n_a / (n_a + n_b)``, ``w_b = n_b / (n_a + n_b)`` of `workers_a` and `workers_b` (ints, or int64
    tensors with one count per segment). The combine op's question (`adasum.collectives.slices.CombineOp`) as
    Adasum's tree answers it.

    >>> pair_coefficients(torch.tensor([[0.0], [1.0], [1.0]], dtype=torch.float64), 1, 1)   # orthogonal: sum
    tensor([[1.],
            [1.]], dtype=torch.float64)
    """
    total: int | torch.Tensor = workers_a + workers_b
    if isinstance(total, torch.Tensor):
        total = total.to(torch.float64)
    return torch.stack(coefficients(partials, workers_a / total, workers_b / total))
