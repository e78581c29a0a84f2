#!/usr/bin/env bash
# The GPU host's full check: build fusedist, run the GPU test tiers, compute-sanitizer, the
# quick benchmarks, and benchmarks/compare.py of their results against the committed ones;
# a short summary table comes last. (bash tests/run.sh runs the whole suite, CPU and GPU
# tiers, without the sanitizer and the benchmarks.)
#
#   bash tests/gpu/run.sh                 # logs and results land in $OUT (default ./_out)
#   FUSEDIST_GPU_STAGES="build tests bench" bash tests/gpu/run.sh   # a subset
#
# Stages (FUSEDIST_GPU_STAGES; default: build tests sanitizer bench gemm compare with two or
# more GPUs, build tests sanitizer gate compare with one): build, tests, sanitizer,
# bench (all-reduce), gemm (GEMM + collective), gate (one GPU: the quick benchmarks whose
# results are committed for one H200 and one H100, each run as its committed file records;
# FUSEDIST_GATE_SET, '|'-separated, replaces the set), gemm_only (fusedist.gemm, one GPU), attn
# (decode attention, --quick), model (the Llama-3-8B step beside torch and torch.compile),
# quickstart (launchers/quickstart.sh), compare, waves, trace, ncu. Offline hosts install the wheels they lack (nccl4py, the CUTLASS headers)
# from ./.whl or $FUSEDIST_WHEELS (launchers/download-wheels.sh makes it).
#
# Exit status: the worst of the stages (the GPU tiers, the sanitizer runs, the benchmarks and
# compare): 0 only when every stage that ran exited 0. Every stage runs even after another
# failed (one run shows every failure); a failed build stops the run with status 1.
set -uo pipefail
cd "$(dirname "$0")/../.."
source launchers/setup.sh
OUT=${OUT:-$PWD/_out}
LOGS=${FUSEDIST_LOG_DIR:-/tmp/fusedist-gpu-logs}
mkdir -p "$OUT" "$LOGS"
: > "$OUT/summary.txt"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
fd_python
fd_gpus
(( NGPU > 0 )) || fd_die "tests/gpu/run.sh needs a GPU host (nvidia-smi lists no GPU); on a CPU machine run bash tests/run.sh"
fd_torch
fd_install numpy pytest timeout
fd_install_soft mpi
fd_install_soft hf
fd_install_soft matplotlib
fd_install_soft serve openai
fd_nccl4py
fd_cutlass
if (( NGPU >= 2 )); then
  STAGES=${FUSEDIST_GPU_STAGES:-"build tests sanitizer bench gemm compare"}
else
  STAGES=${FUSEDIST_GPU_STAGES:-"build tests sanitizer gate compare"}
fi
export FUSEDIST_COMMIT=${FUSEDIST_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
RESULTS="$OUT/results"   # <gpu>-w<N>/<bench>.{json,md,png}, as benchmarks/results

WORST=0     # the exit status of the run: the largest of the stages'
FAILED=""   # the stages that exited non-zero
# The line of a stage's log its summary quotes: pytest's counts, the sanitizer's summary, a
# compiler's or CMake's error, an uncaught exception (not a benchmark's row that records a
# baseline's error as text).
SUMMARY_LINE='[0-9]+ (passed|failed|errors?)\b|ERROR SUMMARY|: error:|^CMake Error|^[A-Za-z_.]*(Error|Exception):'
stage() {  # stage NAME TIMEOUT_S CMD...: log to $LOGS/NAME.log, one summary line
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  if (( rc != 0 )); then
    FAILED+=" $name"
    (( rc > WORST )) && WORST=$rc
  fi
  printf '%-12s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E "$SUMMARY_LINE" "$LOGS/$name.log" | tail -1 | cut -c1-90)" \
    >> "$OUT/summary.txt"
  return $rc
}

want() { [[ " $STAGES " == *" $1 "* ]]; }
SAN=${FUSEDIST_SAN:-"allreduce gemm_ar ag rs ce gemm attn"}  # which sanitizer runs the sanitizer stage does
want_san() { [[ " $SAN " == *" $1 "* ]]; }

# $OUT gets summary.txt (nvidia-smi, ptxas spills, sanitizer summaries, stage results),
# tests.log, bench.log, compare.txt and results/ (the benchmarks' json/md/png).
{ nvidia-smi; nvidia-smi topo -m; } > "$OUT/summary.txt.head" 2>&1
if want build; then
  FUSEDIST_BUILD_LOG="$LOGS/build.pip.log" stage build 900 bash -c 'source launchers/setup.sh && fd_build' \
    || { cat "$LOGS/build.pip.log" >> "$LOGS/build.log" 2>/dev/null; tail -40 "$LOGS/build.log"; cat "$OUT/summary.txt"
cat "$OUT/summary.txt.head" "$OUT/summary.txt" > "$OUT/summary.tmp" && mv "$OUT/summary.tmp" "$OUT/summary.txt"
rm -f "$OUT/summary.txt.head"; exit 1; }
  grep -E "spill|stack frame" "$LOGS/build.pip.log" | sort -u | sed 's/^ */ptxas: /' >> "$OUT/summary.txt.head" || true
fi
if want tests; then
  # -P: keep the source tree off sys.path so the installed fusedist (with _C) is imported.
  # FUSEDIST_TESTS narrows the run to some test files (default: all of tests/).
  # Workers' output goes to $LOGS/workers as it is written: a stage killed at its timeout
  # still shows the last checks each worker finished (appended to the summary on failure).
  rm -rf "$LOGS/workers"
  FUSEDIST_WORKER_LOG_DIR="$LOGS/workers" stage tests "${FUSEDIST_TESTS_TIMEOUT:-1500}" \
    python3 -P -m pytest -q -rs -m "gpu or gpu2 or gpu4 or gpu8" ${FUSEDIST_TESTS:-tests} \
    -p no:cacheprovider --durations=20 \
    || for f in "$LOGS"/workers/*.log; do
         [[ -e $f ]] && { echo "== tail of $(basename "$f")"; tail -5 "$f"; } >> "$OUT/summary.txt.head"
       done
fi
if want sanitizer && [[ $NGPU -ge 2 ]]; then
  want_san allreduce && for tool in memcheck racecheck; do
    FUSEDIST_TEST_ONLY=eager_all FUSEDIST_TEST_MAX_N=65537 FUSEDIST_TEST_SEED=7 stage "san_$tool" "${FUSEDIST_SAN_TIMEOUT:-600}" \
      python3 -m torch.distributed.run --nproc-per-node 2 --no-python \
      compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 3 \
      --report-api-errors no \
      python3 tests/dist/worker_allreduce.py
    { echo "== compute-sanitizer $tool"; grep -E "^=========" "$LOGS/san_$tool.log" | head -40; } \
      >> "$OUT/summary.txt.head"
  done
  # The fused GEMM + collective kernels under memcheck (memcheck slows a GEMM ~100x, so the
  # largest shapes are left out): san_fused NAME LABEL CHECK [ENV=VALUE ...]
  san_fused() {
    local name=$1 label=$2 only=$3; shift 3
    want_san "$name" || return 0
    stage "san_$name" "${FUSEDIST_SAN_TIMEOUT:-600}" env "$@" FUSEDIST_TEST_ONLY="$only" \
      FUSEDIST_TEST_SEED=7 python3 -m torch.distributed.run --nproc-per-node 2 --no-python \
      compute-sanitizer --tool memcheck --target-processes all --error-exitcode 3 \
      --report-api-errors no python3 tests/dist/worker_gemm_comm.py
    { echo "== compute-sanitizer memcheck ($label)"; grep -E "^=========" "$LOGS/san_$name.log" | head -20; } \
      >> "$OUT/summary.txt.head"
  }
  # TMA, mbarriers and the symmetric exchange of the decode kernel.
  san_fused gemm_ar "gemm_ar fused" gemm_ar_fused_matches
  # The CUTLASS TMA/wgmma GEMM waiting on copy-engine flags.
  san_fused ag "ag_gemm fused" ag_gemm_fused_matches FUSEDIST_TEST_MAX_ROWS=1100
  # Tiles counted on their owners as their TMA stores land, counter waits, C-row waits.
  san_fused rs "gemm_rs fused" gemm_rs_fused_matches FUSEDIST_TEST_MAX_ROWS=1100
  # The copy-engine pipelines, with gemm_ar's closing gather kernel (per-block handshakes).
  san_fused ce "copy-engine pipelines" copy_engine_transport
fi
if want sanitizer && want_san attn; then  # bad paged metadata: no access leaves the tensors
  stage san_attn "${FUSEDIST_SAN_TIMEOUT:-600}" compute-sanitizer --tool memcheck \
    --error-exitcode 3 --report-api-errors no python3 -P -m pytest -q -p no:cacheprovider \
    -m gpu tests/ops/test_attention_metadata.py
  { echo "== compute-sanitizer memcheck (attention metadata)"; grep -E "^=========" "$LOGS/san_attn.log" | head -20; } \
    >> "$OUT/summary.txt.head"
fi
if want sanitizer && want_san gemm; then  # every Hopper GEMM tile, one GPU
  stage san_gemm "${FUSEDIST_SAN_TIMEOUT:-600}" compute-sanitizer --tool memcheck \
    --error-exitcode 3 --report-api-errors no python3 -P -m pytest -q -p no:cacheprovider \
    -m gpu tests/ops/test_gemm.py -k "every_tile or larger_buffer"
  { echo "== compute-sanitizer memcheck (gemm tiles)"; grep -E "^=========" "$LOGS/san_gemm.log" | head -20; } \
    >> "$OUT/summary.txt.head"
fi
if want bench && [[ $NGPU -ge 2 ]]; then
  FUSEDIST_RESULTS_DIR="$RESULTS" stage bench_ar "${FUSEDIST_BENCH_TIMEOUT:-900}" python3 -m torch.distributed.run \
    --nproc-per-node "$NGPU" benchmarks/allreduce.py ${FUSEDIST_BENCH_ARGS:---quick --fused}
fi
if want gemm && [[ $NGPU -ge 2 ]]; then
  FUSEDIST_RESULTS_DIR="$RESULTS" stage bench_gemm "${FUSEDIST_BENCH_TIMEOUT:-900}" python3 -m torch.distributed.run \
    --nproc-per-node "$NGPU" benchmarks/gemm_comm.py ${FUSEDIST_GEMM_ARGS:---quick}
fi
if want gate; then  # one GPU: the quick benchmarks with committed results, as those were run
  GATE_SET=${FUSEDIST_GATE_SET:-"add_rmsnorm.py --quick|silu_mul.py --quick|attention.py --quick --no-flashinfer|attention_prefill.py --quick --no-flashinfer|moe.py --quick --what gating,permute|moe_gemm.py --quick --no-compile|gemv.py --ms 1,16 --stages 2,3|model.py --quantize fp8 --baselines torch"}
  IFS='|' read -ra gate_cmds <<< "$GATE_SET"
  for cmd in "${gate_cmds[@]}"; do
    # shellcheck disable=SC2086 - the command's words
    FUSEDIST_RESULTS_DIR="$RESULTS" stage "bench_${cmd%%.py*}" "${FUSEDIST_BENCH_TIMEOUT:-900}" \
      python3 -P benchmarks/$cmd
  done
fi
if want gemm_only; then  # one GPU: fusedist's GEMMs (every Hopper tile) against torch.matmul
  FUSEDIST_RESULTS_DIR="$RESULTS" stage bench_gemm_only "${FUSEDIST_BENCH_TIMEOUT:-900}" \
    python3 benchmarks/gemm.py ${FUSEDIST_GEMM_ONLY_ARGS:-}
fi
if want attn; then  # one GPU: decode attention beside cuDNN / flash SDPA
  FUSEDIST_RESULTS_DIR="$RESULTS" stage bench_attn "${FUSEDIST_BENCH_TIMEOUT:-900}" \
    python3 benchmarks/attention.py ${FUSEDIST_ATTN_ARGS:---quick}
fi
if want model; then  # the model's decode step beside torch and torch.compile
  FUSEDIST_RESULTS_DIR="$RESULTS" stage bench_model "${FUSEDIST_BENCH_TIMEOUT:-900}" \
    python3 benchmarks/model.py ${FUSEDIST_MODEL_ARGS:-}
fi
if want quickstart; then  # the README's main job, after the build
  stage quickstart "${FUSEDIST_BENCH_TIMEOUT:-900}" bash launchers/quickstart.sh
  cp "$LOGS/quickstart.log" "$OUT/" 2>/dev/null
fi
if want ncu; then  # one GPU: Nsight Compute counters of cuBLAS and every sm90 tile (FUSEDIST_NCU_MS)
  stage ncu "${FUSEDIST_BENCH_TIMEOUT:-900}" ncu --clock-control none --print-kernel-base function \
    -k regex:"nvjet|device_kernel|splitK" --section SpeedOfLight --section MemoryWorkloadAnalysis \
    python3 benchmarks/profile_gemm.py --ms "${FUSEDIST_NCU_MS:-128,256}"
  cp "$LOGS/ncu.log" "$OUT/" 2>/dev/null
fi
if want waves; then  # one GPU: cuBLAS's waves against the tuning table's model
  FUSEDIST_RESULTS_DIR="$RESULTS" stage bench_waves "${FUSEDIST_BENCH_TIMEOUT:-900}" \
    python3 benchmarks/gemm_waves.py
fi
if want trace && [[ $NGPU -ge 2 ]]; then  # FUSEDIST_TRACE_ARGS: --cfg op:M:N:K:transport:chunks ...
  FUSEDIST_RESULTS_DIR="$RESULTS" stage trace "${FUSEDIST_BENCH_TIMEOUT:-900}" python3 -m torch.distributed.run \
    --nproc-per-node "$NGPU" benchmarks/trace_gemm_comm.py ${FUSEDIST_TRACE_ARGS:---cfg gemm_ar:2048:8192:4096:copy_engine:2}
  cp "$LOGS/trace.log" "$OUT/" 2>/dev/null
fi
if want compare && [[ -d $RESULTS ]]; then  # same-run ratios against the committed results
  stage compare 120 python3 benchmarks/compare.py benchmarks/results "$RESULTS"
  cp "$LOGS/compare.log" "$OUT/compare.txt" 2>/dev/null
fi
cp "$LOGS/tests.log" "$OUT/" 2>/dev/null
cat "$LOGS"/bench_*.log > "$OUT/bench.log" 2>/dev/null

grep -E "^(FAILED|ERROR)|Error:|\[FAIL\]|^rank [0-9]+ [a-z_]+: " "$LOGS/tests.log" 2>/dev/null | head -30
echo "=================== fusedist GPU run ($FUSEDIST_COMMIT, $NGPU GPU) ==================="
grep -E '^\|' "$OUT/bench.log" 2>/dev/null | head -90
echo
if (( WORST != 0 )); then
  echo "FAILED stages:$FAILED (exit $WORST)" >> "$OUT/summary.txt"
fi
cat "$OUT/summary.txt"
cat "$OUT/summary.txt.head" "$OUT/summary.txt" > "$OUT/summary.tmp" && mv "$OUT/summary.tmp" "$OUT/summary.txt"
rm -f "$OUT/summary.txt.head"
exit "$WORST"
