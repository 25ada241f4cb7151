#!/usr/bin/env bash
# The convergence sweeps of docs/results.md, resumable: run it again after a timeout or
# a kill and every finished run is kept (`adasum compare --resume` takes exact matches only).
#
#   PARALLEL=5 benchmarks/sweeps.sh cpu # the reduced CPU sweep docs/results.md reports (~20 CPU-minutes)
#   PARALLEL=2 benchmarks/sweeps.sh cpu-mnist1d # the MNIST-1D cells the GPU runs left (2-core machine:
#                                       # P = 16 AdaCons, P = 32 but the means, P = 64 and 128 four methods on five rates)
#   benchmarks/sweeps.sh gpu            # the GPU-scale sweep (--device cuda), jobs spread over every GPU
#   PARALLEL=48 benchmarks/sweeps.sh gpu # 48 jobs at a time (default: 8 per GPU), job k on GPU k % GPUS
#   SWEEP_DIR=/path benchmarks/sweeps.sh gpu # results under /path (default runs/sweeps)
#   GPU_IDS="2 3" benchmarks/sweeps.sh gpu # only these GPUs (default: every GPU nvidia-smi lists)
#   STOP_AFTER=500 benchmarks/sweeps.sh gpu # start no job after 500 s (running ones go on)
#   LIST=1 benchmarks/sweeps.sh gpu     # print the jobs and their finished runs, run nothing
#   JOB_FILTER='^mnist1d--' benchmarks/sweeps.sh gpu # only the jobs whose names match (bash regex)
#
# The GPU sweep (3 seeds, every method of the CLI but sum, learning-rate grids of 7 points, half a
# decade apart, from 0.001 to 1): MNIST-1D at P = 16, 32, 64, 128 (32 examples per worker, 20
# epochs); digits at P = 16, 32 (32 per worker) and 64, 128 (8 per worker: 3,600 training digits
# hold less than one global batch of 64 x 32); the byte-level LM on the standard library's sources
# with Adam (mean vs adasum-delta) and LAMB (mean vs adasum), P = 16 and 64, 3 epochs; word2vec
# (skip-gram on the same sources) at P = 32 against sequential.
# Jobs are small (one method, one seed, one P; sequential runs one learning rate) so that many
# share a GPU: the simulator's small models leave a GPU mostly idle waiting for one process's
# kernel launches, and several processes fill it. Longest jobs first. Each job is one
# `adasum compare` folder under $SWEEP_DIR named TASK--REST; the report groups folders by TASK.
set -u
MODE=${1:-gpu}
DIR=${SWEEP_DIR:-runs/sweeps}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
SEEDS="0 1 2"
GRID=0.001,0.003,0.01,0.03,0.1,0.3,1
# the unscaled mean, local SGD and SlowMo take the sequential rate's step over P workers' samples, so their best
# rate grows with P: at 16 and 32 workers it is 0.3 on MNIST-1D; at 64 and 128 their grid goes a step higher
GRID_HI=0.003,0.01,0.03,0.1,0.3,1,3
grid() {  # grid P METHOD
  case "$1-$2" in 64-mean|128-mean|64-localsgd|128-localsgd|64-slowmo|128-slowmo) echo $GRID_HI ;; *) echo $GRID ;; esac
}
PARALLEL_METHODS="mean-scaled mean adasum adasum-delta adacons localsgd slowmo"

jobs_gpu() {  # name|arguments, longest first
  for seed in $SEEDS; do for lr in ${GRID//,/ }; do
    echo "mnist1d--seq-s$seed-lr$lr|--task mnist1d --methods sequential --lr $lr --epochs 20 --batch-size 32 --seeds $seed"
  done; done
  for opt in adam lamb; do
    if [ $opt = adam ]; then lrs=0.0001,0.0003,0.001,0.003,0.01; combine=adasum-delta
    else lrs=0.001,0.003,0.01,0.03,0.1; combine=adasum; fi
    for seed in $SEEDS; do
      for lr in ${lrs//,/ }; do
        echo "text-$opt--seq-s$seed-lr$lr|--task text --optimizer $opt --methods sequential --lr $lr --epochs 3 \
--batch-size 16 --seeds $seed"
      done
      for P in 16 64; do for m in mean $combine; do
        echo "text-$opt--P$P-$m-s$seed|--task text --optimizer $opt --methods $m --workers $P --lr $lrs --epochs 3 \
--batch-size 16 --seeds $seed"
      done; done
    done
  done
  for seed in $SEEDS; do
    for lr in 0.01 0.03 0.1 0.3 1; do
      echo "word2vec--seq-s$seed-lr$lr|--task word2vec --methods sequential --lr $lr --epochs 3 --batch-size 32 \
--seeds $seed"
    done
    echo "word2vec--P32-s$seed|--task word2vec --methods mean-scaled,adasum --workers 32 --lr 0.01,0.03,0.1,0.3,1 \
--epochs 3 --batch-size 32 --seeds $seed"
  done
  for P in 16 32 64 128; do for m in $PARALLEL_METHODS; do for seed in $SEEDS; do
    echo "mnist1d--P$P-$m-s$seed|--task mnist1d --methods $m --workers $P --lr $(grid $P $m) --epochs 20 --batch-size 32 \
--seeds $seed"
  done; done; done
  for seed in $SEEDS; do
    echo "digits--seq-s$seed|--task digits --methods sequential --lr $GRID --epochs 20 --batch-size 32 --seeds $seed"
    echo "digits-b8--seq-s$seed|--task digits --methods sequential --lr $GRID --epochs 20 --batch-size 8 --seeds $seed"
  done
  for P in 16 32 64 128; do
    if [ $P -le 32 ]; then task=digits; b=32; else task=digits-b8; b=8; fi
    for m in $PARALLEL_METHODS; do for seed in $SEEDS; do
      echo "$task--P$P-$m-s$seed|--task digits --methods $m --workers $P --lr $(grid $P $m) --epochs 20 --batch-size $b \
--seeds $seed"
    done; done
  done
}

jobs_cpu() {
  CPU_GRID=0.005,0.01,0.02,0.05,0.1
  S=0,1,2
  echo "cpu-digits--seq|--task digits --methods sequential --lr $CPU_GRID --epochs 8 --batch-size 32 --seeds $S"
  for P in 16 32; do
    echo "cpu-digits--P$P|--task digits --methods mean-scaled,adasum,adacons --workers $P --lr $CPU_GRID --epochs 8 \
--batch-size 32 --seeds $S"
  done
  echo "cpu-digits--local|--task digits --methods localsgd,slowmo --workers 16 --lr $CPU_GRID --epochs 8 \
--batch-size 32 --seeds $S"
  echo "cpu-digits--local-P32|--task digits --methods localsgd,slowmo --workers 32 --lr $CPU_GRID --epochs 8 \
--batch-size 32 --seeds $S"
}

jobs_cpu_mnist1d() {  # the MNIST-1D cells the GPU calls did not reach, on a 2-core machine (each run < 1 min)
  for seed in $SEEDS; do
    echo "mnist1d--P16-adacons-s$seed|--task mnist1d --methods adacons --workers 16 --lr $GRID --epochs 20 \
--batch-size 32 --seeds $seed"
  done
  for m in adasum adasum-delta adacons localsgd slowmo; do for seed in $SEEDS; do
    [ "$m-$seed" = adasum-0 ] && continue  # run on the GPU
    echo "mnist1d--P32-$m-s$seed|--task mnist1d --methods $m --workers 32 --lr $GRID --epochs 20 --batch-size 32 \
--seeds $seed"
  done; done
  # P = 64, 128: four methods on five rates (x P where scaled: lower rates), every best one inside
  for P in 64 128; do for m in mean-scaled adasum adasum-delta adacons; do for seed in $SEEDS; do
    case $m in mean-scaled|adacons) lrs=0.001,0.003,0.01,0.03,0.1 ;; *) lrs=0.003,0.01,0.03,0.1,0.3 ;; esac
    echo "mnist1d--P$P-$m-s$seed|--task mnist1d --methods $m --workers $P --lr $lrs --epochs 20 \
--batch-size 32 --seeds $seed"
  done; done; done
}

case "$MODE" in
  gpu) JOBS=$(jobs_gpu); DEVICE=cuda
       GPU_IDS=${GPU_IDS:-$(seq -s " " 0 $(($(nvidia-smi -L 2>/dev/null | wc -l) - 1)) 2>/dev/null)}
       read -r -a IDS <<< "${GPU_IDS:-0}"; [ ${#IDS[@]} -ge 1 ] || IDS=(0); GPUS=${#IDS[@]}
       PARALLEL=${PARALLEL:-$((8 * GPUS))} ;;
  cpu) JOBS=$(jobs_cpu); DEVICE=cpu; IDS=(0); GPUS=1; PARALLEL=${PARALLEL:-1} ;;
  cpu-mnist1d) JOBS=$(jobs_cpu_mnist1d); DEVICE=cpu; IDS=(0); GPUS=1; PARALLEL=${PARALLEL:-1} ;;
  *) echo "usage: $0 [cpu|cpu-mnist1d|gpu]" >&2; exit 2 ;;
esac

mkdir -p "$DIR"
start=$SECONDS
k=0
while IFS='|' read -r name args; do
  [ -z "$name" ] && continue
  if [ -n "${JOB_FILTER:-}" ] && ! [[ $name =~ $JOB_FILTER ]]; then continue; fi
  if [ -n "${LIST:-}" ]; then
    echo "$name: $(cat "$DIR/$name/results.jsonl" 2>/dev/null | wc -l) runs finished: adasum compare $args"
    continue
  fi
  if [ -n "${STOP_AFTER:-}" ] && [ $((SECONDS - start)) -ge "$STOP_AFTER" ]; then
    echo "STOP_AFTER reached: not starting $name and later jobs"; break
  fi
  while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n; done
  gpu=${IDS[$((k % GPUS))]}
  # shellcheck disable=SC2086  # $args is a list of flags
  ( [ "$DEVICE" = cuda ] && export CUDA_VISIBLE_DEVICES=$gpu
    nice -n 10 $PY -m adasum compare $args --device $DEVICE --out "$DIR/$name" --resume \
      --no-progress --quiet > "$DIR/$name.log" 2>&1
    echo "$name: exit $? ($(cat "$DIR/$name/results.jsonl" 2>/dev/null | wc -l) runs)" ) &
  k=$((k + 1))
done <<< "$JOBS"
wait
[ -n "${LIST:-}" ] && exit 0
# one report per task over its jobs (sequential included): $DIR/report-TASK/report.md
for task in $(echo "$JOBS" | sed -E 's/--.*//' | sort -u); do
  dirs=$(ls -d "$DIR/$task"--* 2>/dev/null | grep -v '\.log$')
  # shellcheck disable=SC2086
  [ -n "$dirs" ] && $PY -m adasum report $dirs --out "$DIR/report-$task" --quiet > /dev/null
done
