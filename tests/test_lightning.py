"""adasum.lightning with the real Lightning on 2 gloo processes under torchrun: the callback, the
"ddp_adasum" strategy and the "ddp_adasum_delta" strategy (Adam) each take a first step equal to
the NumPy reference applied to every rank's local gradients, and end with bitwise-identical
parameters; "ddp_adasum_delta" with SGD, accumulation, clipping and an LR scheduler takes each checked step
equal to the reference of the ranks' clipped, accumulated local steps, within a stated float32 bound; the warnings
when they would do nothing (one process, no DDP model)."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("lightning")  # the lightning extra (`make install` installs it)

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402

import adasum.lightning  # noqa: E402

import reference  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEPS, LR = 3, 0.05
CLIP = 11.5  # between the two ranks' first accumulated gradient norms (9.6 and 13.8): one clips, one does not


class Tiny(pl.LightningModule):
    """A two-layer regression that records its parameters around the first step and the local
    gradients of that step (autograd.grad, which DDP's hooks do not see)."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if batch_idx == 0:
            self.before = [p.detach().clone() for p in self.parameters()]
            local = torch.autograd.grad(loss, list(self.parameters()), retain_graph=True)
            self.local = [g.detach().clone() for g in local]
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.after = [p.detach().clone() for p in self.parameters()]

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=LR)
        if self.optimizer == "adam-scheduled":
            opt = torch.optim.Adam(self.parameters(), lr=LR)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]
        if self.optimizer == "sgd-scheduled":
            opt = torch.optim.SGD(self.parameters(), lr=LR)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]
        return torch.optim.SGD(self.parameters(), lr=LR)


class Accumulating(Tiny):
    """Tiny with SGD and a StepLR scheduler (halves the LR at each epoch's end) that records, for the optimizer
    step ending at batch ``accumulate - 1`` of every epoch, the parameters before and after it and the local
    gradient of each of its batches, of the loss as Lightning scales it (divided by `accumulate`)."""

    def __init__(self, accumulate: int) -> None:
        super().__init__("sgd-scheduled")
        self.accumulate = accumulate
        self.steps: dict[int, dict] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if batch_idx < self.accumulate:
            record = self.steps.setdefault(self.current_epoch, {"grads": []})
            if batch_idx == 0:
                record["before"] = [p.detach().clone() for p in self.parameters()]
            local = torch.autograd.grad(loss / self.accumulate, list(self.parameters()), retain_graph=True)
            record["grads"].append([g.detach().clone() for g in local])
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if batch_idx == self.accumulate - 1:
            self.steps[self.current_epoch]["after"] = [p.detach().clone() for p in self.parameters()]


def data(world: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 4 * world, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True) ** 2), batch_size=4)


def fit(module: Tiny, strategy, callbacks=(), devices: int = 2, **options) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, callbacks=list(callbacks), max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **options,
    )
    trainer.fit(module, data(devices))
    return trainer


def gathered(tensors: list[torch.Tensor]) -> list[list[np.ndarray]]:
    """Every rank's copy of `tensors`, as float64 arrays: [rank][tensor]."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, [t.double().numpy() for t in tensors])
    return out


def check_first_step(module: Tiny, step_of_gradient) -> None:
    """The first step moved each parameter by Adasum (per tensor) of the ranks' local steps."""
    steps = [[step_of_gradient(g.reshape(-1)) for g in grads] for grads in gathered(module.local)]
    for i, (before, after) in enumerate(zip(module.before, module.after)):
        expected = before.double().numpy().reshape(-1) + reference.pair(steps[0][i], steps[1][i])
        np.testing.assert_allclose(after.double().numpy().reshape(-1), expected, rtol=1e-5, atol=1e-6)
    finals = gathered([torch.cat([p.detach().reshape(-1) for p in module.parameters()])])
    assert np.array_equal(finals[0][0], finals[1][0]), "parameters differ across ranks"


def sgd_step(g: np.ndarray) -> np.ndarray:
    return -LR * g


def adam_first_step(g: np.ndarray) -> np.ndarray:
    return -LR * g / (np.abs(g) + 1e-8)  # Adam's bias-corrected moments at step 1: m = g, v = g^2


def check_clipped_steps(module: Accumulating, clip: float) -> None:
    """Each recorded step (epoch 0 at LR, epoch 1 at LR/2 after the scheduler's step) moved each parameter by the
    reference pair of the ranks' local SGD steps: ``-lr c_r G_r`` with ``G_r`` the sum of rank r's accumulated
    batch gradients and ``c_r = min(1, clip / (|G_r| + 1e-6))`` torch's norm clipping over all parameters.
    In epoch 0 one rank clips and the other does not, so both the clipping and the accumulated sum's scale show.

    Bound (float32, first order), per tensor: rank r's delta is off from ``s_r`` by at most
    ``u |x0 + s_r| + (g_{m+2} + 6u) |s_r|`` (the accumulation's sum, the total norm of m elements with two square
    roots, adding 1e-6 and dividing, the clipping product, the LR in float32, its product, the SGD update stored
    next to x0, and the delta ``x1 - x0``); the pair spreads it by ``1 + w_b + 4 w_a B/A`` and adds its own
    rounding (`reference.tree_with_bound`: float64 arithmetic, stored in float32); ``x0 + combined`` adds
    ``u |after|``."""
    u = reference.U32
    for epoch, lr in ((0, LR), (1, LR / 2)):
        record = module.steps[epoch]
        assert len(record["grads"]) == module.accumulate
        summed = [sum(g.double() for g in batch) for batch in zip(*record["grads"])]  # per tensor, this rank
        ranks = gathered(summed)
        totals = [float(np.sqrt(sum((g**2).sum() for g in grads))) for grads in ranks]
        if epoch == 0:
            assert min(totals) < clip < max(totals), (totals, clip)  # one rank clipped, one not
        coefficients = [min(1.0, clip / (t + 1e-6)) for t in totals]
        m = sum(g.size for g in ranks[0])
        for i, (before, after) in enumerate(zip(record["before"], record["after"])):
            x0 = before.double().numpy().reshape(-1)
            steps = [-lr * c * grads[i].reshape(-1) for c, grads in zip(coefficients, ranks)]
            combined, bound = reference.tree_with_bound(steps, reference.U64, u)
            norms = [np.linalg.norm(s) for s in steps]
            for r, s in enumerate(steps):
                local = u * np.linalg.norm(x0 + s) + (reference.gamma(m + 2, u) + 6 * u) * norms[r]
                bound += local * (1 + 0.5 + 2 * norms[1 - r] / norms[r])
            expected = x0 + combined
            bound += u * np.linalg.norm(expected)
            err = np.linalg.norm(after.double().numpy().reshape(-1) - expected)
            assert err <= bound, f"epoch {epoch} tensor {i}: |error| {err:.3g} > bound {bound:.3g}"
    finals = gathered([torch.cat([p.detach().reshape(-1) for p in module.parameters()])])
    assert np.array_equal(finals[0][0], finals[1][0]), "parameters differ across ranks"


def report(route: str) -> None:
    print(f"[{route}] ok on rank {dist.get_rank()}", flush=True)


def job() -> None:
    """Run under torchrun with 2 processes: every route, checked against the reference."""
    callback = adasum.lightning.AdasumCallback()
    module = Tiny()
    fit(module, "ddp", [callback])
    check_first_step(module, sgd_step)
    assert callback.state.iteration == STEPS
    first = callback.state
    module = Tiny()
    fit(module, "ddp", [callback])  # the same callback in a second fit: a new DDP model, so a new state
    check_first_step(module, sgd_step)
    assert callback.state is not first and callback.state.iteration == STEPS
    report("callback")

    module = Tiny()
    trainer = fit(module, "ddp_adasum")
    check_first_step(module, sgd_step)
    assert isinstance(trainer.strategy, adasum.lightning.AdasumDDPStrategy)
    assert trainer.strategy.adasum_state.iteration == STEPS
    report("ddp_adasum")

    module = Tiny("adam")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(module, "ddp_adasum_delta", [adasum.lightning.AdasumCallback()])
    check_first_step(module, adam_first_step)
    assert isinstance(trainer.optimizers[0], adasum.DistributedOptimizer)
    assert any("not DistributedDataParallel" in str(w.message) for w in caught), [str(w.message) for w in caught]
    report("ddp_adasum_delta")

    # accumulation, clipping, an LR scheduler and a checkpoint with the wrapper
    module = Tiny("adam-scheduled")
    trainer = fit(module, "ddp_adasum_delta", accumulate_grad_batches=2, gradient_clip_val=0.01)
    # 3 batches an epoch, 2 accumulated: steps at batches 2 and 3 (the epoch's end), then 2 of the
    # next epoch; the scheduler, stepped once an epoch, has stepped once
    assert trainer.optimizers[0].param_groups[0]["lr"] == LR / 2
    finals = gathered([torch.cat([p.detach().reshape(-1) for p in module.parameters()])])
    assert np.array_equal(finals[0][0], finals[1][0]), "parameters differ across ranks"
    path = Path(os.environ["CHECKPOINT_DIR"]) / "delta.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["optimizer_states"][0]["optimizer"]["state"], "no Adam state"
    report("ddp_adasum_delta options")

    # the same options with SGD, whose step shows the clipping and the accumulated sum (Adam's does not): two
    # steps against the reference of the ranks' clipped, accumulated local steps
    module = Accumulating(accumulate=2)
    trainer = fit(module, "ddp_adasum_delta", accumulate_grad_batches=2, gradient_clip_val=CLIP)
    assert trainer.optimizers[0].param_groups[0]["lr"] == LR / 2
    check_clipped_steps(module, CLIP)
    report("ddp_adasum_delta clipped")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(Tiny(), "ddp_adasum", [adasum.lightning.AdasumCallback()])
    assert any("registers the Adasum hook already" in str(w.message) for w in caught), [str(w.message) for w in caught]
    report("callback with ddp_adasum")
    dist.barrier()
    dist.destroy_process_group()


def test_routes_on_two_processes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}"}
    env["CHECKPOINT_DIR"] = str(tmp_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for route in ("callback", "ddp_adasum", "ddp_adasum_delta", "ddp_adasum_delta options", "ddp_adasum_delta clipped",
                  "callback with ddp_adasum"):
        assert all(f"[{route}] ok on rank {rank}" in done.stdout for rank in (0, 1)), done.stdout


@pytest.mark.parametrize("strategy", ["ddp_adasum", "ddp_adasum_delta"])
def test_strategies_warn_on_one_process(strategy, one_process_group):
    with pytest.warns(UserWarning, match="only one process, so Adasum has nothing to combine") as caught:
        fit(Tiny(), strategy, devices=1)
    ours = [w for w in caught if str(w.message).startswith("adasum.")]
    # one warning (the optimizer under the delta strategy adds no one-rank warning of its own), at trainer.fit
    assert len(ours) == 1 and ours[0].filename == __file__, [(w.filename, w.lineno, str(w.message)) for w in ours]


def test_callback_warns_on_one_process():
    with pytest.warns(UserWarning, match="AdasumCallback: only one process") as caught:
        fit(Tiny(), "auto", [adasum.lightning.AdasumCallback()], devices=1)
    ours = [w for w in caught if str(w.message).startswith("adasum.")]
    assert len(ours) == 1 and ours[0].filename == __file__, [(w.filename, w.lineno, str(w.message)) for w in ours]


def test_strategies_refuse_options_that_do_not_apply():
    with pytest.raises(ValueError, match="pass adasum_state="):
        adasum.lightning.AdasumDDPStrategy(ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(ValueError, match="builds no DDP model"):
        adasum.lightning.AdasumDeltaStrategy(find_unused_parameters=True)


def test_strategies_refuse_lightnings_comm_hook_options():
    # DDPStrategy's own hook options, which neither strategy would apply (Lightning keeps them, unused)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper

    for option, value in [("ddp_comm_wrapper", fp16_compress_wrapper), ("model_averaging_period", 4)]:
        with pytest.raises(ValueError) as e:
            adasum.lightning.AdasumDDPStrategy(**{option: value})
        assert str(e.value).startswith(f"adasum.lightning.AdasumDDPStrategy: {option}= is not applied"), str(e.value)
    for option in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
        with pytest.raises(ValueError) as e:
            adasum.lightning.AdasumDeltaStrategy(**{option: object()})
        assert str(e.value).startswith(f"adasum.lightning.AdasumDeltaStrategy: {option}= does not apply"), str(e.value)


def test_a_state_that_is_not_an_adasum_state_is_refused():
    with pytest.raises(TypeError, match=r"^adasum.lightning.AdasumCallback: state must be an adasum.ddp.AdasumState "
                       r"or None, got str \('adacons'\); for another reducer pass AdasumState\(reducer=...\)$"):
        adasum.lightning.AdasumCallback("adacons")
    with pytest.raises(TypeError, match=r"^adasum.lightning.AdasumDDPStrategy: adasum_state must be an "
                       r"adasum.ddp.AdasumState or None, got Adasum \(Adasum\(per_tensor=True\)\)"):
        adasum.lightning.AdasumDDPStrategy(adasum_state=adasum.Adasum())


def test_options_are_checked_at_construction():
    name = "adasum.lightning.AdasumDeltaStrategy"
    with pytest.raises(ValueError, match=f"^{name}: local_steps must be an integer >= 1, got 0; pass local_steps=1 or "
                                         "more$"):
        adasum.lightning.AdasumDeltaStrategy(local_steps=0)
    with pytest.raises(TypeError, match=f"^{name}: local_steps must be an integer >= 1, got 2.0; pass local_steps= a "
                                        "whole number$"):
        adasum.lightning.AdasumDeltaStrategy(local_steps=2.0)
    with pytest.raises(ValueError, match=r"^nonfinite must be one of \['propagate', 'raise', 'skip'\], got 'ignore'; "
                                         r"pass one of them$"):
        adasum.lightning.AdasumDeltaStrategy(nonfinite="ignore")
    with pytest.raises(ValueError, match="unknown reducer 'adasun'"):
        adasum.lightning.AdasumDeltaStrategy(reducer="adasun")
    name = "adasum.lightning.AdasumStatistics"
    with pytest.raises(TypeError, match=f"^{name}: every_n_steps must be an integer >= 1, got 2.5; pass "
                                        "every_n_steps= a whole number$"):
        adasum.lightning.AdasumStatistics(every_n_steps=2.5)
    with pytest.raises(TypeError, match=f"^{name}: every_n_steps must be an integer >= 1, got '2'; pass "
                                        "every_n_steps= a whole number$"):
        adasum.lightning.AdasumStatistics(every_n_steps="2")
    with pytest.raises(ValueError, match=f"^{name}: every_n_steps must be an integer >= 1, got 0; pass "
                                         "every_n_steps=1 or more$"):
        adasum.lightning.AdasumStatistics(every_n_steps=0)


if __name__ == "__main__":
    job()
