"""The GPU benchmark scripts run end to end in their CPU dry-run settings (smoke tests: no timings
are checked, only that every row is produced and well formed)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_bench_e2e_dry_run(tmp_path):
    out = tmp_path / "e2e.jsonl"
    printed = run_script("benchmarks/bench_e2e.py", "--dry-run", "--out", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cells = [(r["model"], r["variant"]) for r in rows]
    assert cells == [(m, v) for m in ("resnet50", "bert") for v in ("ddp", "ddp-adasum", "delta")]
    for r in rows:
        assert r["world"] == 2 and r["backend"] == "gloo" and r["dry_run"]
        assert len(r["step_times_s"]) == 2 and all(t > 0 for t in r["step_times_s"])
        assert r["step_s"] == statistics.median(r["step_times_s"])
        assert {"device", "torch", "nccl", "ratio_to_ddp"} <= set(r)
    assert [r["ratio_to_ddp"] for r in rows if r["variant"] == "ddp"] == [1.0, 1.0]
    table = [line.split() for line in printed.splitlines()]
    assert ["bert", "delta"] == [row[:2] for row in table if row[:2] == ["bert", "delta"]][0]


def test_profile_hook_dry_run(tmp_path):
    out = tmp_path / "hook.jsonl"
    run_script("benchmarks/profile_hook.py", "--dry-run", "--batch-mb", "0", "--out", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["ddp", "hook", "hook-b0", "nop"]
    for r in rows:
        assert len(r["step_times_s"]) == 2 and r["step_s"] == statistics.median(r["step_times_s"])
        assert r["backward_host_s"] > 0 and r["hook_host_s"] >= 0
    calls = {r["variant"]: (r["hook_calls"], r["batches"]) for r in rows}
    # the tiny model is one bucket: one hook call and one batch a step; DDP's own path and the no-op hook: none
    assert calls == {"ddp": (0, 0), "hook": (1, 1), "hook-b0": (1, 1), "nop": (1, 0)}, calls


def test_bench_e2e_bad_input_is_refused_before_spawning():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "benchmarks/bench_e2e.py", "--dry-run", "--variants", "ddp,fast"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "choose from ddp, ddp-adasum, delta" in proc.stderr


def test_bench_sim_dry_run_at_64_workers():
    printed = run_script("benchmarks/bench_sim.py", "--dry-run", "--methods", "adasum")
    line = printed.strip().splitlines()[-1]
    assert line.startswith("adasum: P=64 x B=32 on ") and line.endswith("examples/s)")
    assert float(line.split(": ")[-1].split()[0]) > 0  # steps/s


def test_bench_collective_on_gloo(tmp_path):
    """The collective benchmark as `make bench` runs it, cut small: every dtype and size is a row with both timings
    and the ratio between them, the card named, and no kept memory on the CPU."""
    out = tmp_path / "collective.jsonl"
    printed = run_script("benchmarks/bench_collective.py", "--backend", "gloo", "--world", "2", "--exps", "8,10",
                         "--layouts", "", "--dtypes", "fp32,bf16", "--repeats", "2", "--warmup", "1",
                         "--out", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["dtype"], r["layout"]) for r in rows] == [(d, f"flat-2^{e}") for d in ("fp32", "bf16") for e in (8, 10)]
    for r in rows:
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["default"] and r["kept_mib"] is None
        assert r["adasum_s"] > 0 and r["allreduce_s"] > 0 and r["ratio"] == r["adasum_s"] / r["allreduce_s"]
        # on the CPU the call's host time is its time (the slowest rank's median of each)
        assert 0 < r["adasum_host_s"] <= max(r["adasum_all_s"])
        assert 0 < r["allreduce_host_s"] <= max(r["allreduce_all_s"])
        assert {"device", "torch", "nccl", "driver"} <= set(r)
    assert sum("adasum" in line and "ratio" in line for line in printed.splitlines()) == 4, printed
