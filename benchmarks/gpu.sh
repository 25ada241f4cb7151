#!/usr/bin/env bash
# The GPU benchmarks and the NCCL correctness suite on one host with 2 or more GPUs. Run from the
# repository root; each step appends rows to $OUT/*.jsonl (default gpu_out) and writes a log beside
# them; copy the rows into benchmarks/results/ and run benchmarks/render.py to update docs/benchmarks.md.
#
#   bash benchmarks/gpu.sh [STEP ...]            # default: env tests collective e2e
#
#   env           cards, driver, torch, CUDA, NCCL and Triton versions                  -> env.txt
#   tests         ADASUM_TEST_BACKEND=nccl pytest -m nccl tests                         -> nccl_tests.log
#   collective    adasum.all_reduce (default transport, checked against adasum.reduce) against NCCL's
#                 all_reduce of the same bytes, 2 ranks                                 -> collective.jsonl, checks.jsonl
#   transports    the same for every transport, and each transport's own time for the
#                 bytes of a 2-rank Adasum (the bound)                                  -> collective.jsonl, checks.jsonl, bounds.jsonl
#   e2e           training steps, ResNet-50 and the BERT-Large-sized stack: DDP, DDP with
#                 adasum_hook, DistributedOptimizer(mode="delta"), stepped in turn       -> e2e.jsonl
#   hook          the hook's host time and its batch sizes on the BERT-sized step        -> hook.jsonl
#   fsdp          FSDP2 across replicas (1 B parameters, bf16) against FSDP's averaging, meshes
#                 MESHES (default 2x1 4x1 2x2) where the GPUs exist (REPEATS alternations) -> fsdp.jsonl
#   jax           adasum.jax.all_reduce against psum                                    -> jax.jsonl
#   sim           the simulator (64 CNN workers) and the single-process tree            -> sim.jsonl, tree.jsonl
#   hierarchical  hierarchical mode on HWORLD GPUs (default 4) as emulated nodes of HLOCAL (default 2),
#                 against flat Adasum                                                   -> hierarchical.jsonl
#   profile       torch.profiler of the collective at 2^26 fp32 and the ResNet-50 layout -> profile_*.log
#   worlds        the NCCL tests of the slice-parallel schedule, then the collective with defaults (and
#                 its memory) at P = 4, 3 and 2 where the GPUs exist                     -> collective.jsonl, worlds.log
#
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and torch symmetric memory's multicast), as in
# every recorded row. LABEL names the rows of collective/transports.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
LABEL=${LABEL:-}
quiet() { grep -v -E "UserWarning|FutureWarning|warn\(|_warn_once|^\[rank"; }
collective() {  # collective TRANSPORTS [extra flags]
  local transports=$1; shift
  timeout 420 $PY benchmarks/bench_collective.py --backend nccl --transports "$transports" --check --dtypes fp32,bf16 \
    --exps 20,26,28 --layouts resnet50,bert-large --repeats 10 --label "$LABEL" --out "$OUT/collective.jsonl" \
    --check-out "$OUT/checks.jsonl" --probe-out "$OUT/bounds.jsonl" "$@" 2>&1 | quiet | tee -a "$OUT/collective.log"
}
for step in ${*:-env tests collective e2e}; do
  case $step in
    env)
      { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m
        $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__)"
      } 2>&1 | tee "$OUT/env.txt" ;;
    tests)
      ADASUM_TEST_BACKEND=nccl timeout 570 $PY -m pytest -q -m nccl tests -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/nccl_tests.log" ;;
    collective)
      collective default ;;
    transports)
      collective default,p2p,collectives,symmetric --probe ;;
    e2e)
      for model in bert resnet50; do  # one process per model, every GPU (WORLD to choose)
        timeout 300 $PY benchmarks/bench_e2e.py --models $model --steps "${STEPS:-30}" --warmup 5 ${WORLD:+--world $WORLD} \
          --out "$OUT/e2e.jsonl" 2>&1 | quiet | tee -a "$OUT/e2e.log"
      done ;;
    hook)
      timeout 400 $PY benchmarks/profile_hook.py --model bert --batch-mb 0,64,128,512 --steps 30 --warmup 6 \
        --out "$OUT/hook.jsonl" 2>&1 | quiet | tee -a "$OUT/hook.log" ;;
    fsdp)
      gpus=$(nvidia-smi -L | wc -l)
      for mesh in ${MESHES:-2x1 4x1 2x2}; do
        ranks=$(( ${mesh%x*} * ${mesh#*x} ))
        [ "$gpus" -ge "$ranks" ] || continue
        timeout 300 $PY -m torch.distributed.run --standalone --nproc-per-node "$ranks" benchmarks/bench_fsdp.py \
          --mesh "$mesh" --repeats "${REPEATS:-2}" --reduce-dtype bfloat16 --variants native,mean,adasum \
          --out "$OUT/fsdp.jsonl" 2>&1 | quiet | tee -a "$OUT/fsdp.log"
      done ;;
    jax)
      timeout 300 $PY benchmarks/bench_jax.py --out "$OUT/jax.jsonl" 2>&1 | quiet | tee -a "$OUT/jax.log" ;;
    sim)
      timeout 120 $PY benchmarks/bench_sim.py --device cuda --out "$OUT/sim.jsonl" 2>&1 | quiet | tee -a "$OUT/sim.log"
      timeout 120 $PY benchmarks/bench_tree.py --device cuda --workers 64 --layout resnet50 --out "$OUT/tree.jsonl" 2>&1 | quiet | tee -a "$OUT/sim.log" ;;
    hierarchical)
      timeout 300 $PY benchmarks/bench_hierarchical.py --world "${HWORLD:-4}" --local-size "${HLOCAL:-2}" --out "$OUT/hierarchical.jsonl" 2>&1 | quiet | tee -a "$OUT/hierarchical.log" ;;
    worlds)
      gpus=$(nvidia-smi -L | wc -l)
      ADASUM_TEST_BACKEND=nccl timeout 240 $PY -m pytest -q -x -m nccl -p no:cacheprovider tests/test_slices.py 2>&1 \
        | tail -15 | tee -a "$OUT/worlds.log"
      for run in ${WORLDS:-"4 default,slices" "3 default" "2 default,slices"}; do
        read -r world transports <<< "$run"
        [ "$gpus" -ge "$world" ] || continue
        timeout 200 $PY benchmarks/bench_collective.py --backend nccl --world "$world" --transports "$transports" --dtypes fp32,bf16 \
          --exps 20,24,26,28 --layouts resnet50,bert-large --out "$OUT/collective.jsonl" 2>&1 | quiet | tee -a "$OUT/worlds.log"
      done ;;
    profile)
      timeout 200 $PY benchmarks/profile_collective.py --backend nccl --numel 67108864 --rows 20 2>&1 | tail -32 | tee "$OUT/profile_flat.log"
      timeout 200 $PY benchmarks/profile_collective.py --backend nccl --layout resnet50 --rows 20 2>&1 | tail -32 | tee "$OUT/profile_resnet50.log" ;;
    *)
      echo "unknown step: $step (env tests collective transports e2e hook fsdp jax sim hierarchical profile worlds)" >&2
      exit 2 ;;
  esac
done
