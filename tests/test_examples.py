"""The examples run end to end under torchrun on 2 CPU processes (gloo); the framework ones only
where Lightning / Accelerate are installed (optional extras)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def torchrun(script: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, str(ROOT / "examples" / script), *args], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize(
    "script, framework",
    [("ddp_hook.py", None), ("lightning_adasum.py", "lightning"), ("accelerate_adasum.py", "accelerate")],
)
def test_hook_examples(script, framework):
    if framework:
        pytest.importorskip(framework)
    out = torchrun(script, "--steps", "30")
    assert "parameters identical on 2 ranks: True" in out
    assert "Adasum combined the gradients of 30 iterations" in out  # the hook really ran


def test_delta_adam_example():
    out = torchrun("delta_adam.py", "--steps", "30", "--local-steps", "2")
    assert "parameters identical on 2 ranks: True" in out
    first, last = [float(line.split("loss")[1]) for line in out.splitlines() if line.startswith("step")]
    assert last < first / 5


def test_fsdp_example():
    out = torchrun("fsdp_transformer.py", "--steps", "20")  # the default mesh on 2 processes: 2 replicas x 1 shard
    assert "parameters identical on 2 ranks: True" in out
    assert "Adasum combined 60 unit gradients across 2 replicas" in out  # 3 units x 20 steps


def test_horovod_port_example():
    out = torchrun("horovod_port.py", "--steps", "30")
    assert "parameters identical on 2 ranks: True" in out
    line = out.split("loss averaged over 2 ranks: ")[1].splitlines()[0]  # "first 1.0966, last 0.1503"
    first, last = (float(part.split()[-1]) for part in line.split(","))
    assert last < first / 2, out  # it learns (1.22 to 0.44 over 30 steps)


ADASUM_BF16 = ("--reduce", "adasum", "--outer-lr", "0.35", "--communication-dtype", "bf16", "--error-feedback")


@pytest.mark.parametrize("args", [(), ADASUM_BF16])
def test_diloco_example(args):
    out = torchrun("diloco.py", "--steps", "100", "--local-steps", "5", *args)
    assert "parameters identical on 2 ranks: True" in out
    first, last = [float(line.split("loss")[1]) for line in out.splitlines() if line.startswith("step")]
    assert last < first / 5
