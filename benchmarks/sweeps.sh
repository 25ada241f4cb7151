#!/usr/bin/env bash
# The convergence sweeps of docs/results.md (issue 15), resumable: run it again after a timeout or
# a kill and every finished run is kept (`adasum compare --resume` takes exact matches only).
#
#   PARALLEL=5 benchmarks/sweeps.sh cpu # the reduced CPU sweep docs/results.md reports (~20 CPU-minutes)
#   benchmarks/sweeps.sh gpu            # the full GPU-scale sweep (--device cuda), one GPU per job
#   PARALLEL=8 benchmarks/sweeps.sh gpu # the same, 8 jobs at a time, job k on GPU k % 8
#   OUT=/path benchmarks/sweeps.sh gpu  # results under /path (default runs/sweeps)
#   LIST=1 benchmarks/sweeps.sh gpu     # print the jobs, run nothing
#
# The GPU sweep (3 seeds, every method of the CLI but sum, learning-rate grids of 10 points from
# 0.001 to 1): MNIST-1D at P = 16, 32, 64, 128 (32 examples per worker, 20 epochs); digits at
# P = 16, 32 (32 per worker) and 64, 128 (8 per worker: 3,600 training digits hold less than one
# global batch of 64 x 32); the byte-level LM on the standard library's sources with Adam (mean vs
# adasum-delta) and LAMB (mean vs adasum), P = 16 and 64, 3 epochs; word2vec (skip-gram on the same
# sources) at P = 32 against sequential.
# Runtime estimate from the simulator's measured 132 steps/s at P = 64 on an H200
# (docs/benchmarks.md), i.e. 7.6 ms a step, taken as proportional to P plus 2 ms of overhead a step
# (sequential: 2 ms a step):
#   MNIST-1D: 0.35 s an epoch at any P, 7 s a run, 210 runs per P job: 25 min x 4; sequential
#             1,687 steps an epoch, 67 s a run, 11 min per seed job x 3            -> 2.2 h
#   digits:   about 1.5 s a run, 5 min per P job x 4; sequential 2 + 9 min          -> 0.5 h
#   text LM:  the least known (transformer steps guessed at 20 ms at P = 16)      -> 0.5 h
#   word2vec: 270,000 pairs, sequential 8,400 steps an epoch at ~1 ms; P = 32 cheap   -> 0.3 h
# About 3.5 hours on one GPU; with PARALLEL=8 on an 8-GPU host about 30 minutes (the longest job,
# MNIST-1D at P = 16). Each job is one `adasum compare` folder under $OUT; the device
# tool's 10-minute calls simply rerun the script until `LIST=1` reports every job done.
set -u
MODE=${1:-gpu}
OUT=${OUT:-runs/sweeps}
PARALLEL=${PARALLEL:-1}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
SEEDS=0,1,2
ALL=sequential,mean-scaled,mean,adasum,adasum-delta,adacons,localsgd,slowmo
GRID=0.001,0.002,0.005,0.01,0.02,0.05,0.1,0.2,0.5,1

jobs_gpu() {  # name|arguments; sequential training once per task (split by seed), the rest per P
  PARALLEL_METHODS=mean-scaled,mean,adasum,adasum-delta,adacons,localsgd,slowmo
  for seed in 0 1 2; do
    echo "mnist1d-seq-s$seed|--task mnist1d --methods sequential --lr $GRID --epochs 20 --batch-size 32 --seeds $seed"
  done
  for P in 16 32 64 128; do
    echo "mnist1d-P$P|--task mnist1d --methods $PARALLEL_METHODS --workers $P --lr $GRID --epochs 20 \
--batch-size 32 --seeds $SEEDS"
  done
  echo "digits-seq|--task digits --methods sequential --lr $GRID --epochs 20 --batch-size 32 --seeds $SEEDS"
  echo "digits-b8-seq|--task digits --methods sequential --lr $GRID --epochs 20 --batch-size 8 --seeds $SEEDS"
  for P in 16 32; do
    echo "digits-P$P|--task digits --methods $PARALLEL_METHODS --workers $P --lr $GRID --epochs 20 --batch-size 32 \
--seeds $SEEDS"
  done
  for P in 64 128; do
    echo "digits-b8-P$P|--task digits --methods $PARALLEL_METHODS --workers $P --lr $GRID --epochs 20 --batch-size 8 \
--seeds $SEEDS"
  done
  echo "word2vec-seq|--task word2vec --methods sequential --lr 0.01,0.02,0.05,0.1,0.2,0.5,1 --epochs 3 \
--batch-size 32 --seeds $SEEDS"
  echo "word2vec-P32|--task word2vec --methods mean-scaled,adasum --workers 32 --lr 0.01,0.02,0.05,0.1,0.2,0.5,1 \
--epochs 3 --batch-size 32 --seeds $SEEDS"
  for opt in adam lamb; do
    if [ $opt = adam ]; then lrs=0.0001,0.0003,0.001,0.003,0.01; combine=adasum-delta
    else lrs=0.001,0.003,0.01,0.03,0.1; combine=adasum; fi
    echo "text-$opt-seq|--task text --optimizer $opt --methods sequential --lr $lrs --epochs 3 --batch-size 16 \
--seeds $SEEDS"
    for P in 16 64; do
      echo "text-$opt-P$P|--task text --optimizer $opt --methods mean,$combine --workers $P --lr $lrs --epochs 3 \
--batch-size 16 --seeds $SEEDS"
    done
  done
}

jobs_cpu() {
  CPU_GRID=0.005,0.01,0.02,0.05,0.1
  echo "cpu-digits|--task digits --methods sequential --lr $CPU_GRID --epochs 8 --batch-size 32 --seeds $SEEDS"
  for P in 16 32; do
    echo "cpu-digits-P$P|--task digits --methods mean-scaled,adasum,adacons --workers $P --lr $CPU_GRID --epochs 8 \
--batch-size 32 --seeds $SEEDS"
  done
  echo "cpu-digits-local|--task digits --methods localsgd,slowmo --workers 16 --lr $CPU_GRID --epochs 8 \
--batch-size 32 --seeds $SEEDS"
  echo "cpu-digits-local-P32|--task digits --methods localsgd,slowmo --workers 32 --lr $CPU_GRID --epochs 8 \
--batch-size 32 --seeds $SEEDS"
}

case "$MODE" in
  gpu) JOBS=$(jobs_gpu); DEVICE=cuda ;;
  cpu) JOBS=$(jobs_cpu); DEVICE=cpu ;;
  *) echo "usage: $0 [cpu|gpu]" >&2; exit 2 ;;
esac

mkdir -p "$OUT"
k=0
while IFS='|' read -r name args; do
  [ -z "$name" ] && continue
  if [ -n "${LIST:-}" ]; then
    done_runs=$(cat "$OUT/$name/results.jsonl" 2>/dev/null | wc -l)
    echo "$name: $done_runs runs finished: adasum compare $args --device $DEVICE"
    continue
  fi
  gpu=$((k % PARALLEL))
  # shellcheck disable=SC2086  # $args is a list of flags
  ( [ "$DEVICE" = cuda ] && export CUDA_VISIBLE_DEVICES=$gpu
    nice -n 10 $PY -m adasum compare $args --device $DEVICE --out "$OUT/$name" --resume \
      --no-progress --quiet > "$OUT/$name.log" 2>&1
    echo "$name: exit $? ($(wc -l < "$OUT/$name/results.jsonl") runs)" ) &
  k=$((k + 1))
  if [ $((k % PARALLEL)) -eq 0 ]; then wait; fi
done <<< "$JOBS"
wait
[ -n "${LIST:-}" ] && exit 0
# one report per task over its jobs (sequential included): $OUT/report-TASK/report.md
for task in $(echo "$JOBS" | cut -d'|' -f1 | sed -E 's/(-(seq(-s[0-9])?|P[0-9]+|local))+$//' | sort -u); do
  dirs=$(ls -d "$OUT/$task" "$OUT/$task"-* 2>/dev/null | grep -v '\.log$' | grep -E "/$task(-(seq|P|local).*)?$")
  [ -n "$dirs" ] && $PY -m adasum report $dirs --out "$OUT/report-$task" --quiet > /dev/null
done
