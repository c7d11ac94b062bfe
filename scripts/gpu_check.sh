#!/usr/bin/env bash
# The checks of a session with a CUDA machine, in one call (its device time is scarce):
# the environment, the CUDA tests, then benchmarks/gpu_stream.py. Logs go to $OUT
# (the device tool brings that folder back) or to /tmp/gpu_check elsewhere.
#
#   bash scripts/gpu_check.sh                      # tests, then the 1b benchmark
#   TESTS=0 BENCH="--sizes 1b --profile" bash scripts/gpu_check.sh
#   BENCH2="--sizes 1b --peers '' --update-in-backward" bash scripts/gpu_check.sh  # a second run
#   BENCH="--sizes 5b --peers '' --device-tier 40" bash scripts/gpu_check.sh  # WS with and without a 40 GiB device tier
#   BENCH="--sizes 1b --batch 8 --peers eager --device-tier auto" ...  # a model the device holds: WS + tier / eager
#   BENCH="--sizes 5b --batch 16 --peers '' --vs-state bf16 --device-tier auto" ...  # fp32 vs compact state, tier off and on
#   BENCH="--sizes 5b --peers '' --state bf16 --checkpoint /tmp/ws_ckpt" ...  # save (vs the disk's rate), resume exactly
#   BENCH="--sizes 13b --peers '' --state bf16-int8 --activation-checkpointing" ...  # the 13B in RAM
#   BENCH="--sizes 20b --peers '' --state bf16-int8 --store disk --store-dir /tmp/ws_store --activation-checkpointing" ...
#   RSS="--size 1b" bash scripts/gpu_check.sh  # then benchmarks/sharded_rss.py: host RSS, 2 ranks vs 1
#   TEST_ARGS="-k tier" BENCH="--sizes 1b --state bf16 --stacks 20" ...  # some tests; a slow run's stacks
#
# Each part has its own limit (TEST_S, FUSED_S, BENCH_S, BENCH2_S .. BENCH4_S, RSS_S seconds) so that one
# part running long leaves the next its time; what each printed is in $OUT.
#
# Uses the machine's own python3 with PYTHONPATH=src (no set-up: the GPU machine
# has torch, h5py, safetensors, transformers, tensorboard, tqdm and pytest).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
TESTS=${TESTS:-1}
TEST_S=${TEST_S:-300}  # 240 before tests/test_sharded_store_cuda.py, which starts two ranks
BENCH=${BENCH:---sizes 1b}
BENCH_S=${BENCH_S:-300}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nproc
  free -g | head -2
} 2>&1 | tee "$OUT/env.txt"

if [ "$TESTS" = 1 ]; then
  echo "== CUDA tests at ${SECONDS} s"
  # A per-test limit where pytest-timeout is installed (nothing here installs it; the
  # outer timeout bounds the whole run either way).
  per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 120")
  timeout "$TEST_S" python3 -m pytest -q -m cuda tests/test_cuda.py tests/test_sharded_store_cuda.py \
    -p no:cacheprovider -o addopts="" -ra $per_test ${TEST_ARGS:-} 2>&1 | tee "$OUT/cuda_tests.txt"
  # The compiled update of compact state runs on the host: built by this machine's torch
  # and compiler, or not (then every step falls back to the chunks, several times slower).
  echo "== compiled host kernels at ${SECONDS} s"
  timeout "${FUSED_S:-180}" python3 -m pytest -q tests/test_fused_kernels.py -p no:cacheprovider \
    -o addopts="" -ra 2>&1 | tee "$OUT/fused_tests.txt"
fi

# BENCH, then BENCH2 .. BENCH4 where given, each under its own limit; the scratch
# directories of the examples (a checkpoint, a disk store) go after each part, so that
# one part's files do not fill the disk the next needs.
for part in "" 2 3 4; do
  var="BENCH$part" limit="BENCH${part}_S"
  [ -n "${!var:-}" ] || continue
  echo "== gpu_stream.py ${!var} at ${SECONDS} s"
  eval "set -- ${!var}"  # quoted arguments (an empty --peers '') survive
  timeout "${!limit:-$BENCH_S}" python3 benchmarks/gpu_stream.py "$@" 2>&1 | tee "$OUT/gpu_stream$part.txt"
  rm -rf ${SCRATCH:-/tmp/ws_ckpt /tmp/ws_store}
done
if [ -n "${RSS:-}" ]; then
  echo "== sharded_rss.py $RSS at ${SECONDS} s"
  eval "set -- $RSS"
  timeout "${RSS_S:-120}" python3 benchmarks/sharded_rss.py "$@" 2>&1 | tee "$OUT/sharded_rss.txt"
fi
echo "== done at ${SECONDS} s"
