"""The GPU Triton kernels, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1 in a child
process, since the flag must be set before Triton is imported), against the CPU kernels.

The interpreter computes scalars in float64 where compiled kernels would use float32, so argument
typing is checked on GPUs by the NCCL suite (its zero-input case), not here."""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import torch
from adasum import ops, triton_kernels as tk
g = torch.Generator().manual_seed(3)
# tiles of 16384 elements: segments spanning several tiles, tile-sized ones, empty ones, many tiny ones
cases = [[5, 0, 33000, 1, 0, 300], [16384, 16385, 1], [0], [7] * 40, [], [3, 0, 4]]
for number, lengths in enumerate(cases):
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)[: 4 if number == 0 else 2]:
        n = sum(lengths)
        a = torch.randn(n, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        if lengths == [3, 0, 4]:  # zero inputs: the zero guard inside the fused kernel
            a.zero_()
        ref = ops.dot_and_norms(a, b, lengths)
        got = tk.dot_and_norms(a, b, lengths)
        assert got.shape == (3, len(lengths)), got.shape
        assert torch.allclose(got, ref, rtol=1e-12, atol=1e-9), (lengths, dtype, (got - ref).abs().max())
        acc = torch.ones(3, len(lengths) + 2, dtype=torch.float64)[:, 1:-1]  # a strided [3, T] view
        tk.dot_and_norms(a, b, lengths, out=acc)
        assert torch.allclose(acc, ref + 1, rtol=1e-12, atol=1e-9)
        ca, cb = ops.coefficients(ref, 2 / 5, 3 / 5)
        want, out = torch.empty_like(a), torch.full_like(a, float("nan"))
        ops.scale_add(a, b, ca, cb, lengths, want)
        tk.combine(a, b, ref, 2, 3, lengths, out)
        # float64 -> float32 -> dtype may round twice for half types: one unit in the last place
        ulp = torch.finfo(dtype).eps * want.double().abs().clamp_min(torch.finfo(dtype).tiny)
        assert torch.isfinite(out).all() or n == 0
        assert ((out.double() - want.double()).abs() <= 2 * ulp).all(), (lengths, dtype)
        # per-segment worker counts (the batched single-process tree)
        counts_a = torch.arange(1, len(lengths) + 1, dtype=torch.int64)
        counts_b = torch.full((len(lengths),), 3, dtype=torch.int64)
        total = (counts_a + counts_b).double()
        ca, cb = ops.coefficients(ref, counts_a / total, counts_b / total)
        ops.scale_add(a, b, ca, cb, lengths, want)
        tk.combine(a, b, ref, counts_a, counts_b, lengths, out)
        ulp = torch.finfo(dtype).eps * want.double().abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((out.double() - want.double()).abs() <= 2 * ulp).all(), (lengths, dtype, "per segment")
print("ok")
"""


def test_triton_kernels_match_cpu_kernels_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is in the test extra on Linux x86_64")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
