#!/usr/bin/env bash
# On a machine of 2 or more NVLink GPUs: the NCCL tests of the slice-parallel schedule, then the collective
# benchmark (adasum.all_reduce with defaults against NCCL's all_reduce of the same bytes, kept memory) at
# P = 4, 3 and 2 where the GPUs exist. Rows and logs go to $OUT (default gpu_out).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(nvidia-smi -L | wc -l)
quiet() { grep -v -E "UserWarning|FutureWarning|warnings.warn|return func|^\[rank"; }
nvidia-smi -L | tee "$OUT/node.log"
ADASUM_TEST_BACKEND=nccl timeout 240 python3 -m pytest -q -x -m nccl -p no:cacheprovider tests/test_slices.py 2>&1 \
  | tail -15 | tee -a "$OUT/node.log"
bench() {  # world, transports, extra arguments
  local world=$1 transports=$2; shift 2
  [ "$GPUS" -ge "$world" ] || return 0
  timeout 200 python3 benchmarks/bench_collective.py --backend nccl --world "$world" --transports "$transports" \
    --dtypes fp32,bf16 --exps 20,24,26,28 --layouts resnet50,bert-large --out "$OUT/collective.jsonl" "$@" 2>&1 \
    | quiet | tee -a "$OUT/node.log"
}
bench 4 default,symmetric
bench 3 default
bench 2 slices,symmetric
