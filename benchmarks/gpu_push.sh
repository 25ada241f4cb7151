# The push protocol against the pull protocol (2 GPUs of one host): the NCCL tests with push on, an A/B of the
# default all_reduce alternated twice, a profile of 2^28 fp32 with push, then the NCCL tests not reached before
# (test_reducers, test_slowmo) on the defaults. Run with carry [".whl"]; results under $OUT/push.tgz.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/site
P=/tmp/push; mkdir -p $P; S=$SECONDS
q() { grep -v -E "Warning|warn\(|^\s*$|_warn_once"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $P/machine.txt
python3 -c "import torch, triton; print(torch.__version__, torch.cuda.nccl.version(), triton.__version__)" >> $P/machine.txt
ADASUM_SYMMETRIC_PUSH=1 ADASUM_TEST_BACKEND=nccl timeout 150 python3 -m pytest -q -x tests/test_collectives.py tests/test_optim.py -m nccl -p no:cacheprovider > $P/tests-push.log 2>&1
echo "push tests rc $? $((SECONDS-S)) s" >> $P/times.txt
ADASUM_SYMMETRIC_PUSH=1 ADASUM_SYMMETRIC_CHUNK_BYTES=4096 ADASUM_TEST_BACKEND=nccl timeout 90 python3 -m pytest -q -x tests/test_collectives.py -m nccl -p no:cacheprovider > $P/tests-push-4k.log 2>&1
echo "push 4k tests rc $? $((SECONDS-S)) s" >> $P/times.txt
for R in 1a 0a 1b 0b; do X=${R:0:1}
ADASUM_SYMMETRIC_PUSH=$X timeout 75 python3 benchmarks/bench_collective.py --backend nccl --transports default --check --dtypes fp32,bf16 \
  --exps 20,26,28 --layouts resnet50,bert-large --repeats 10 --label "ADASUM_SYMMETRIC_PUSH=$X" --out $P/collective.jsonl --check-out $P/checks.jsonl > $P/bench-$R.log 2>&1
q < $P/bench-$R.log | grep -E "ratio|check" | sed "s/^/push$X /" >> $P/bench.log
echo "bench push=$X $((SECONDS-S)) s" >> $P/times.txt
done
ADASUM_SYMMETRIC_PUSH=1 timeout 40 python3 benchmarks/profile_collective.py --numel 268435456 --rows 12 > $P/profile28-push.txt 2>&1
echo "profile $((SECONDS-S)) s" >> $P/times.txt
ADASUM_TEST_BACKEND=nccl timeout $((570 - SECONDS + S)) python3 -m pytest -q tests/test_reducers.py tests/test_slowmo.py -m nccl -p no:cacheprovider > $P/tests-rest.log 2>&1
echo "rest tests rc $? $((SECONDS-S)) s" >> $P/times.txt
tar czf $OUT/push.tgz -C /tmp push; cat $P/machine.txt $P/times.txt; tail -3 $P/tests-*.log; cat $P/bench.log; grep -E "kernel|memcpy|host|Self CUDA" $P/profile28-push.txt | cut -c1-200 | head -30
