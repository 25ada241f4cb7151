# the push protocol (branch wip-symmetric-push): NCCL tests with it on, then A/B against the pull protocol, alternated twice
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/site
P=/tmp/push; mkdir -p $P; S=$SECONDS
q() { grep -v -E "Warning|warn\(|^\s*$|_warn_once"; }
ADASUM_SYMMETRIC_PUSH=1 ADASUM_TEST_BACKEND=nccl timeout 90 python3 -m pytest -q -x tests/test_collectives.py tests/test_optim.py -m nccl -p no:cacheprovider 2>&1 | tail -3 > $P/tests.log
ADASUM_SYMMETRIC_PUSH=1 ADASUM_SYMMETRIC_CHUNK_BYTES=4096 ADASUM_TEST_BACKEND=nccl timeout 60 python3 -m pytest -q -x tests/test_collectives.py -m nccl -p no:cacheprovider 2>&1 | tail -3 >> $P/tests.log
echo "tests $((SECONDS-S)) s" >> $P/times.txt
for X in 1 0 1 0; do
ADASUM_SYMMETRIC_PUSH=$X timeout 60 python3 benchmarks/bench_collective.py --backend nccl --transports default --check --dtypes fp32,bf16 \
  --exps 26,28 --layouts resnet50,bert-large --repeats 10 --label "ADASUM_SYMMETRIC_PUSH=$X" --out $P/collective.jsonl 2>&1 | q | grep -E "ratio|check" | sed "s/^/push$X /" >> $P/bench.log
done
echo "bench $((SECONDS-S)) s" >> $P/times.txt
ADASUM_SYMMETRIC_PUSH=1 timeout 30 python3 benchmarks/profile_collective.py --numel 268435456 --rows 8 2>&1 | q | grep -E "kernel|memcpy|host" | cut -c1-60,150-200 > $P/profile28.txt
tar czf $OUT/push.tgz -C /tmp push; cat $P/times.txt $P/tests.log $P/bench.log $P/profile28.txt
