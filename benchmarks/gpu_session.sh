#!/usr/bin/env bash
# One device-machine call: environment, the NCCL correctness suite, the collective benchmark and a
# profile. Usage on the device machine, from the repo root: bash benchmarks/gpu_session.sh [steps...]
# Steps: env tests bench profile (default: all). Results land in $OUT (or ./gpu_out).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
steps=${*:-env tests bench profile}
for step in $steps; do
  case $step in
    env)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
      python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())" | tee -a "$OUT/env.txt" ;;
    tests)
      ADASUM_TEST_BACKEND=nccl timeout 420 python3 -m pytest -m nccl tests -q -x -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/nccl_tests.log" ;;
    bench)
      timeout 420 python3 benchmarks/bench_collective.py --backend nccl --dtypes fp32,bf16 --min-exp 10 --max-exp 28 --step-exp 2 \
        --layouts resnet50,bert-large --repeats 11 --out "$OUT/collective.jsonl" 2>&1 | tee "$OUT/bench.log" ;;
    profile)
      timeout 200 python3 benchmarks/profile_collective.py --backend nccl --numel 67108864 --rows 20 2>&1 | tail -32 | tee "$OUT/profile_flat.log"
      timeout 200 python3 benchmarks/profile_collective.py --backend nccl --layout resnet50 --rows 20 2>&1 | tail -32 | tee "$OUT/profile_resnet.log" ;;
  esac
done
