#!/usr/bin/env bash
# One call on a 4-GPU machine: the NCCL correctness suite (1-4 ranks), the collective at 4 and 2
# ranks, end-to-end training steps on 2 GPUs, the simulator and the single-process tree.
# Results land in $OUT (the device tool brings back at most 8 files).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
quiet() { grep -v -E "UserWarning|warn|return func|^\[rank"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } > "$OUT/bench.log" 2>&1
ADASUM_TEST_BACKEND=nccl timeout 150 python3 -m pytest -m nccl tests/test_collectives.py -q -x -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/nccl_tests.log"
timeout 150 python3 benchmarks/bench_collective.py --backend nccl --world 4 --dtypes fp32 --min-exp 20 --max-exp 28 --step-exp 2 \
  --layouts resnet50,bert-large --repeats 7 --label "v3: 4 ranks" --out "$OUT/collective.jsonl" 2>&1 | quiet | tee -a "$OUT/bench.log"
timeout 100 python3 benchmarks/bench_collective.py --backend nccl --world 2 --dtypes fp32 --min-exp 24 --max-exp 28 --step-exp 2 \
  --layouts resnet50,bert-large --repeats 7 --label "v3: 2 ranks" --out "$OUT/collective.jsonl" 2>&1 | quiet | tee -a "$OUT/bench.log"
timeout 200 python3 benchmarks/bench_e2e.py --world 2 --steps 15 --warmup 5 --out "$OUT/e2e.jsonl" 2>&1 | quiet | tee "$OUT/e2e.log"
timeout 60 python3 benchmarks/bench_sim.py --device cuda --out "$OUT/sim.jsonl" 2>&1 | quiet | tee "$OUT/sim.log"
timeout 60 python3 benchmarks/bench_tree.py --device cuda --workers 64 --layout resnet50 --out "$OUT/tree.jsonl" 2>&1 | quiet | tee -a "$OUT/sim.log"
