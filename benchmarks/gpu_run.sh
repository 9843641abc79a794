#!/usr/bin/env bash
# Issue 25's GPU measurements in one command on a lent GPU machine (one H100/H200,
# Python 3.12, torch 2.11+cu130, no network, $OUT comes back; ../shared/gpu/README.md):
#
#   bash ../shared/gpu/prepare.sh $(cat benchmarks/gpu_extra_wheels.txt)   # here, once: the wheels the
#        GPU image lacks, into .whl/ (the extras: what tests/traces.py and the collector import,
#        so that tests/test_trainer_cli.py collects there too)
#   DRY_RUN=1 bash benchmarks/gpu_run.sh     # here: every part at tiny size on the CPU
#   then, through the device tool:  command "bash benchmarks/gpu_run.sh", carry [".whl"], timeout_s 600
#
# Parts, in this order, each under its own `timeout` with its own log in $OUT, so a
# part that hangs or dies costs that part only and every finished part comes back:
#   install    .whl/*.whl into /tmp/site and the project into /tmp/ns (nothing downloaded)
#   gpu-tests  pytest -m gpu on the trainer's and the benchmark's tests (the kernels' CUDA checks among them)
#   bench      benchmarks/train_gpu.py; its --budget-s is what the part has left, so it skips
#              the runs it cannot finish (TRL's peers first) rather than being cut off mid-run
#   kernels    benchmarks/gpu_kernels.py, where it exists (attention and log-prob options timed)
#   suite      every trainer test on the GPU (issue 25, item 8); only when PARTS names it
# Knobs (environment): PARTS (default "gpu-tests bench kernels"), TOTAL_S (540: the
# whole command, under the tool's 600 s), GPU_TESTS_S (90), KERNELS_S (75), SUITE_S
# (240), BENCH_ARGS (added to the benchmark's flags), OUT (default /tmp/nightshift-gpu-run).
# What to read afterwards: $OUT/summary.txt (each part's exit code and seconds),
# $OUT/train.log (the benchmark's report; train_results.jsonl its raw results),
# $OUT/*.log for the rest. The last lines this script prints are the figures.
set -u
cd "$(dirname "$0")/.."
START=$(date +%s)
DRY_RUN=${DRY_RUN:-0}
PARTS=${PARTS:-gpu-tests bench kernels}
TOTAL_S=${TOTAL_S:-540}
GPU_TESTS_S=${GPU_TESTS_S:-90}
KERNELS_S=${KERNELS_S:-75}
SUITE_S=${SUITE_S:-240}
BENCH_ARGS=${BENCH_ARGS:-}
OUT=${OUT:-/tmp/nightshift-gpu-run}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

left() { echo $((TOTAL_S - ($(date +%s) - START))); }
wants() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# part NAME SECONDS LOG COMMAND...: runs it under `timeout` (the whole process group:
# the benchmark's children too), logs its exit code and time; never stops the script
part() {
  local name=$1 limit=$2 logfile=$3 t0 rc
  shift 3
  if [ "$limit" -lt 15 ]; then
    echo "$name: skipped, ${limit} s left" | tee -a "$OUT/summary.txt"
    return 0
  fi
  echo "[$(date +%T)] $name (up to ${limit} s) -> $logfile" >&2
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$logfile" 2>&1
  rc=$?
  local verdict="exit $rc"
  [ $rc -eq 0 ] && verdict=ok
  [ $rc -eq 124 ] && verdict="TIMED OUT"
  [ $rc -eq 5 ] && [ "${name#*tests}" != "$name" ] && verdict="no test selected (pytest exit 5)"
  echo "$name: $verdict in $(( $(date +%s) - t0 )) s (limit ${limit} s)" | tee -a "$OUT/summary.txt"
  return 0
}

if [ "$DRY_RUN" = 1 ]; then
  PY=${PY:-.venv/bin/python}
  BENCH_TINY="--tiny --steps 4 --warmup 1"
  KERNELS_TINY="--tiny"
  export CUDA_VISIBLE_DEVICES=""
else
  PY=python3
  BENCH_TINY=""
  KERNELS_TINY=""
  [ -d .whl ] || { echo "no .whl/ here: run ../shared/gpu/prepare.sh \$(cat benchmarks/gpu_extra_wheels.txt) on the CPU machine and carry .whl" >&2; exit 9; }
  t0=$(date +%s)
  if ! { timeout 150 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
         && timeout 120 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/ns . ; } > "$OUT/install.log" 2>&1; then
    echo "install: FAILED (see install.log)" | tee -a "$OUT/summary.txt"
    tail -20 "$OUT/install.log"
    exit 9
  fi
  export PYTHONPATH=/tmp/site:/tmp/ns
  echo "install: ok in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
fi

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, transformers, trl, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), '| transformers', transformers.__version__, '| trl', trl.__version__, \
'| peft', peft.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# the time kept back for the parts after the benchmark
reserve=10
wants kernels && [ -f benchmarks/gpu_kernels.py ] && reserve=$((reserve + KERNELS_S))
wants suite && reserve=$((reserve + SUITE_S))

if wants gpu-tests; then
  limit=$(( $(left) - reserve < GPU_TESTS_S ? $(left) - reserve : GPU_TESTS_S ))
  # files that cannot be collected here (a test dependency the image lacks) are reported, not fatal
  part gpu-tests "$limit" "$OUT/gpu-tests.log" "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider \
    --continue-on-collection-errors --junitxml="$OUT/gpu-tests.xml" tests/test_trainer_*.py tests/test_bench_train.py
fi

if wants bench; then
  limit=$(( $(left) - reserve ))
  budget=$(( limit - 40 ))  # the benchmark's summary and a run's clean-up fit in the rest
  [ "$budget" -lt 30 ] && budget=30
  part bench "$limit" "$OUT/train.err" bash -c "\"$PY\" benchmarks/train_gpu.py $BENCH_TINY --budget-s $budget \
    --results \"$OUT/train_results.jsonl\" $BENCH_ARGS > \"$OUT/train.log\""
fi

if wants kernels; then
  if [ -f benchmarks/gpu_kernels.py ]; then
    after=0
    wants suite && after=$SUITE_S
    limit=$(( $(left) - after - 5 ))
    [ "$limit" -gt "$KERNELS_S" ] && limit=$KERNELS_S
    # shellcheck disable=SC2086  # empty, or --tiny
    part kernels "$limit" "$OUT/kernels.log" "$PY" benchmarks/gpu_kernels.py $KERNELS_TINY
  else
    echo "kernels: skipped, benchmarks/gpu_kernels.py is not in this tree" | tee -a "$OUT/summary.txt"
  fi
fi

if wants suite; then
  part suite "$(( $(left) - 5 ))" "$OUT/suite.log" "$PY" -m pytest -q -p no:cacheprovider \
    --continue-on-collection-errors --junitxml="$OUT/suite.xml" tests/test_trainer_*.py tests/test_bench_train.py
fi

# what comes back in the tool's reply: the verdicts and the figures
echo
echo "== summary ($(( $(date +%s) - START )) s in all; logs in $OUT)"
cat "$OUT/summary.txt"
for f in gpu-tests suite; do
  [ -f "$OUT/$f.log" ] && { echo "== $f"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|error|deselected|no tests ran" "$OUT/$f.log" | tail -15; }
done
if [ -f "$OUT/train.log" ]; then
  echo "== benchmark (train.log from the summary on; the whole report is in the file)"
  if grep -q "^by model" "$OUT/train.log"; then sed -n '/^by model/,$p' "$OUT/train.log"; else tail -40 "$OUT/train.log"; fi
  [ -s "$OUT/train.err" ] && { echo "== benchmark stderr, last lines"; tail -8 "$OUT/train.err"; }
fi
[ -f "$OUT/kernels.log" ] && { echo "== kernels"; tail -30 "$OUT/kernels.log"; }
exit 0
