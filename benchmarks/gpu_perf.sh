#!/bin/bash
# One device call for issue 13 (2 GPUs of one host): transports checked against adasum.reduce, each
# transport's own time for the same bytes (the bound), the collective timed per transport, then
# (STAGE=2) the NCCL suite and end-to-end steps. Results go to $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print(torch.__version__, torch.cuda.nccl.version(), triton.__version__)'
if [ "${STAGE:-1}" = 1 ]; then
  timeout 420 python3 benchmarks/bench_collective.py --backend nccl --transports "${TRANSPORTS:-default,p2p,collectives,symmetric}" \
    --check --probe --dtypes fp32,bf16 --exps "${EXPS:-20,26,28}" --layouts resnet50,bert-large --repeats 10 \
    --label "${LABEL:-issue 13}" --out "$OUT/collective.jsonl" --probe-out "$OUT/bounds.jsonl" \
    --check-out "$OUT/checks.jsonl" 2>&1 | tee "$OUT/bench.log"
elif [ "$STAGE" = final ]; then
  # the merged code: the NCCL suite, the collective per default transport with its check, the e2e steps
  (ADASUM_TEST_BACKEND=nccl timeout 130 python3 -m pytest -q -x -m nccl tests/test_collectives.py \
    tests/test_reducers.py tests/test_slowmo.py 2>&1 | tail -15) | tee "$OUT/nccl_suite.log"
  timeout 140 python3 benchmarks/bench_collective.py --backend nccl --transports default --check --dtypes fp32,bf16 \
    --exps 20,26,28 --layouts resnet50,bert-large --repeats 10 --label "${LABEL:-final}" \
    --out "$OUT/collective.jsonl" --check-out "$OUT/checks.jsonl" 2>&1 | grep -v Warn | tee "$OUT/bench.log"
  timeout 150 python3 benchmarks/bench_e2e.py --steps 15 --warmup 5 --out "$OUT/e2e.jsonl" 2>&1 | tail -12 | tee "$OUT/e2e.log"
elif [ "$STAGE" = 3 ]; then
  timeout 150 python3 benchmarks/bench_collective.py --backend nccl --transports default --check --dtypes fp32,bf16 \
    --exps 20,26,28 --layouts resnet50,bert-large --repeats 10 --label "${LABEL:-issue 13}" \
    --out "$OUT/collective.jsonl" --check-out "$OUT/checks.jsonl" 2>&1 | grep -v Warn | tee "$OUT/bench.log"
  timeout 150 python3 benchmarks/bench_e2e.py --steps 15 --warmup 5 --out "$OUT/e2e.jsonl" 2>&1 | tail -12 | tee "$OUT/e2e.log"
  (python3 -m pytest --version && ADASUM_TEST_BACKEND=nccl timeout 120 python3 -m pytest -q -x -m nccl tests/test_collectives.py tests/test_ddp.py 2>&1 | tail -15) | tee "$OUT/nccl_suite.log"
else
  (python3 -m pytest --version && ADASUM_TEST_BACKEND=nccl timeout 200 python3 -m pytest -q -x -m nccl tests 2>&1 | tail -30) | tee "$OUT/nccl_suite.log"
  timeout 300 python3 benchmarks/bench_e2e.py --steps 15 --warmup 5 --out "$OUT/e2e.jsonl" 2>&1 | tail -20 | tee "$OUT/e2e.log"
fi
