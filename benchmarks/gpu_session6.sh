# Session 6's final device call (2 GPUs of one host), on the defaults (the push protocol for groups of two):
# the NCCL tests of the collectives, the optimizer and the reducers; the collective benchmark twice with checks;
# the training-step benchmark, BERT-sized stack twice and ResNet-50 once, each model in its own process with the
# variants stepped in turn. Run with carry [".whl"]; results under $OUT/s6.tgz.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/site
P=/tmp/s6; mkdir -p $P; S=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $P/machine.txt
python3 -c "import torch, triton; print(torch.__version__, torch.cuda.nccl.version(), triton.__version__)" >> $P/machine.txt
ADASUM_TEST_BACKEND=nccl timeout 220 python3 -m pytest -q tests/test_collectives.py tests/test_optim.py tests/test_reducers.py -m nccl -p no:cacheprovider > $P/tests.log 2>&1
echo "tests rc $? $((SECONDS-S)) s" >> $P/times.txt
for R in a b; do
timeout 75 python3 benchmarks/bench_collective.py --backend nccl --transports default --check --dtypes fp32,bf16 \
  --exps 20,26,28 --layouts resnet50,bert-large --repeats 10 --label "session 6 default (push) $R" --out $P/collective.jsonl --check-out $P/checks.jsonl > $P/bench-$R.log 2>&1
echo "bench $R rc $? $((SECONDS-S)) s" >> $P/times.txt
done
for M in bert bert resnet50; do
timeout 120 python3 benchmarks/bench_e2e.py --models $M --steps 40 --warmup 3 --watchdog 100 --out $P/e2e.jsonl > $P/e2e-$M-$SECONDS.log 2>&1
echo "e2e $M rc $? $((SECONDS-S)) s" >> $P/times.txt
done
tar czf $OUT/s6.tgz -C /tmp s6; cat $P/machine.txt $P/times.txt; tail -n 3 $P/tests.log
grep -h -E "ratio|check" $P/bench-*.log; grep -h -E "^(bert|resnet50) " $P/e2e-*.log
