"""adasum.accelerate with the real Accelerate on 2 gloo processes under torchrun: the first step
equals the NumPy reference applied to every rank's local gradients and the parameters end
bitwise identical; the warnings when it would do nothing (one process, a model not prepared)."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("accelerate")  # the accelerate extra (`make install` installs it)

import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

import adasum.accelerate  # noqa: E402

import reference  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEPS, LR = 3, 0.05


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def gathered(tensors: list[torch.Tensor]) -> list[list[np.ndarray]]:
    """Every rank's copy of `tensors`, as float64 arrays: [rank][tensor]."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, [t.detach().double().numpy().reshape(-1) for t in tensors])
    return out


def job() -> None:
    """Run under torchrun with 2 processes."""
    accelerator = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 4 * accelerator.num_processes, 4, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True) ** 2), batch_size=4)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt, data = accelerator.prepare(model, opt, data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert adasum.accelerate.enable(accelerator.unwrap_model(model)) is None
    assert any("not DistributedDataParallel" in str(w.message) for w in caught), [str(w.message) for w in caught]
    state = adasum.accelerate.enable(model)

    params = list(accelerator.unwrap_model(model).parameters())
    for step, (x, y) in enumerate(data):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == 0:
            before = [p.detach().clone() for p in params]
            local = torch.autograd.grad(loss, params, retain_graph=True)  # DDP's hooks do not see this
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        if step == 0:
            grads = gathered(local)
            for i, (p0, p1) in enumerate(zip(before, params)):
                expected = p0.double().numpy().reshape(-1) - LR * reference.pair(grads[0][i], grads[1][i])
                np.testing.assert_allclose(p1.detach().double().numpy().reshape(-1), expected, rtol=1e-5, atol=1e-6)
    assert state.iteration == STEPS
    finals = gathered([torch.cat([p.detach().reshape(-1) for p in params])])
    assert np.array_equal(finals[0][0], finals[1][0]), "parameters differ across ranks"
    print("accelerate: ok")
    accelerator.end_training()  # destroys the process group


def test_enable_on_two_processes():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("accelerate: ok") == 2, done.stdout


def test_enable_warns_on_one_process():
    try:
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(make_model())
        one_process = "enable: only one process.*accelerate launch --cpu starts one process"
        with pytest.warns(UserWarning, match=one_process) as caught:
            assert adasum.accelerate.enable(model) is None
        assert [w.filename for w in caught] == [__file__]  # the user's line, not adasum's
    finally:
        AcceleratorState._reset_state(True)


def test_enable_refuses_a_state_that_is_not_an_adasum_state():
    # refused on one process too (before the warning that there is nothing to combine)
    with pytest.raises(TypeError, match=r"^adasum.accelerate.enable: state must be an adasum.ddp.AdasumState or None, "
                       r"got str \('adacons'\); for another reducer pass AdasumState\(reducer=...\)$"):
        adasum.accelerate.enable(make_model(), "adacons")


if __name__ == "__main__":
    job()
