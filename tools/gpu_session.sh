#!/usr/bin/env bash
# One device call: any of the GPU test tier, the slow tier, the sanitizer runs and the benchmarks.
# Logs and JSON go to $OUT; a short table is printed last. From the repository root on the GPU machine:
#   bash tools/gpu_session.sh [STAGE[,STAGE...]|all] [extra pytest args...]
# Stages: tests  -m "gpu and not slow", the third-party tier included (about 3 min)
#         slow   the random walk, the soak and the quick benchmark run end to end (about 6 min)
#         stress the "gpu and not slow" tier with CGRAW_GC_STRESS=1 (gc at capture boundaries and
#                in allocations made while a capture routes)
#         smoke  tools.sanitize_smoke under compute-sanitizer memcheck (about 1 min)
#         memcheck  the whole "gpu and not slow" tier under compute-sanitizer memcheck
#         threads  python -m benchmarks.allocator_threads (about 1 min)
#         control  tools.probes.conditional_probe (each piece of device control flow in turn), then
#                tests/gpu/test_control_flow.py and the control-flow guide's examples (about 1 min)
#         bench  python -m benchmarks --full, all parts, then the plots (CGRAW_BENCH_ARGS replaces --full: e.g.
#                "--only models,graphed", or "" for the quick run)
#         parallel  every non-slow tier at once on one GPU (about 6 min on the H200; each tier stops
#                at CGRAW_PARALLEL_TIMEOUT seconds, default 540): the GPU
#                tier in seven shards, the random walk, the gc-stress tier without third-party tests (in four shards),
#                the tier with cuda-bindings 12.9.10 (when build/cb12/*.whl was carried; CGRAW_CB12_FILES
#                picks test files, default all) and memcheck of CGRAW_MEMCHECK_FILES (default
#                tests/gpu/test_rebind.py), then tools.call_walk --device; the soak reads device-wide memory,
#                so run "slow" alone after it
#         segv   diagnose an abort of the one-process tier: the tier without third-party
#                tests in one process, five ways at once (all files, and four runs each without some
#                files, to bisect), each with tools/diag's native backtrace handler and per-test
#                log; the full run may leave a core file, which cuda-gdb then reads (about 9 min)
# all = tests,slow,smoke,bench
set -u
stages=${1:-all}; shift || true
[ "$stages" = all ] && stages=tests,slow,smoke,bench
OUT=${OUT:-/tmp/cgraw-out}
mkdir -p "$OUT"
export PYTHONPATH=. CGRAW_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra --strict-markers"
# --show-backtrace no: compute-sanitizer 2025.3's host backtraces keep the Python frames of CUDA
# calls alive, and with them the tests' graphs and pool blocks, which the leak checks then report.
# CGRAW_SANITIZER_ARGS: extra compute-sanitizer options.
SANITIZE="compute-sanitizer --tool memcheck --report-api-errors no --show-backtrace no ${CGRAW_SANITIZER_ARGS:-} --error-exitcode 9"
summary=""
has() { case ",$stages," in *",$1,"*) return 0;; esac; return 1; }
stamp() { echo "$1: rc=$2 in $(( $(date +%s) - $3 ))s: $4"; }
if has tests; then
  t=$(date +%s); timeout ${CGRAW_TESTS_TIMEOUT:-540} $PYTEST --timeout=250 -m "gpu and not slow" "$@" > "$OUT/gpu_tests.log" 2>&1
  summary="$summary
$(stamp "GPU tier" $? $t "$(tail -n 1 "$OUT/gpu_tests.log" | cut -c1-200)")"
fi
if has stress; then
  t=$(date +%s); CGRAW_GC_STRESS=1 timeout ${CGRAW_STRESS_TIMEOUT:-540} $PYTEST --timeout=300 -m "gpu and not slow" "$@" > "$OUT/gpu_stress.log" 2>&1
  summary="$summary
$(stamp "GPU tier, CGRAW_GC_STRESS=1" $? $t "$(tail -n 1 "$OUT/gpu_stress.log" | cut -c1-200)")"
fi
if has parallel; then
  t=$(date +%s); L="$OUT/parallel"; mkdir -p "$L"
  P="timeout ${CGRAW_PARALLEL_TIMEOUT:-540} $PYTEST --timeout=280"
  first="tests/gpu/test_rebind.py tests/gpu/test_tree.py"; second="tests/gpu/test_rng.py"
  third="tests/gpu/test_third_party.py tests/gpu/test_capture.py"
  rest=$(for f in $first $second $third; do echo "--ignore=$f"; done)
  $P -m "gpu and not slow" $first "$@" > "$L/shard1.log" 2>&1 &
  $P -m "gpu and not slow" $second "$@" > "$L/shard2.log" 2>&1 &
  $P -m "gpu and not slow" $third "$@" > "$L/shard3.log" 2>&1 &
  # the compile tests (Inductor's compile time dominates them) apart from the other files
  fourth="tests/gpu/test_compile_backend.py tests/gpu/test_compile_backend_trees.py tests/gpu/test_compiled.py \
    tests/gpu/test_higher_order.py tests/gpu/test_fidelity.py"
  # the backend on the benchmark's models (their compiles take most of its time)
  sixth="tests/gpu/test_third_party_backend.py"
  # the files after test_g* in a seventh shard: the rest took 340-450 s in one shard on a slow host
  seventh=""
  for f in tests/gpu/test_*.py; do
    case "${f##*/test_}" in [h-z]*)
      case " $first $second $third $fourth $sixth " in *" $f "*) ;; *) seventh="$seventh $f";; esac;; esac
  done
  rest="$rest $(for f in $fourth $sixth $seventh; do echo "--ignore=$f"; done)"
  $P -m "gpu and not slow" $fourth "$@" > "$L/shard4.log" 2>&1 &
  $P -m "gpu and not slow" $sixth "$@" > "$L/shard6.log" 2>&1 &
  $P -m "gpu and not slow" tests/gpu $rest "$@" > "$L/shard5.log" 2>&1 &
  $P -m "gpu and not slow" $seventh "$@" > "$L/shard7.log" 2>&1 &
  $P -m "gpu and slow" -s tests/gpu/test_random_walk.py > "$L/walk.log" 2>&1 &
  # the gc-stress tier in four shards (test files dealt round-robin): in two halves it took 206 and 303 s
  k=0; sa=""; sb=""; sc=""; sd=""
  for f in tests/gpu/test_*.py; do
    case $((k % 4)) in 0) sa="$sa $f";; 1) sb="$sb $f";; 2) sc="$sc $f";; 3) sd="$sd $f";; esac; k=$((k + 1))
  done
  for s in a b c d; do
    eval "files=\$s$s"
    CGRAW_GC_STRESS=1 $P -m "gpu and not slow and not third_party" $files > "$L/stress_$s.log" 2>&1 &
  done
  if ls build/cb12/*.whl > /dev/null 2>&1; then
    pip install -q --no-deps --target /tmp/cb12 build/cb12/*.whl > "$L/cb12_pip.log" 2>&1
    PYTHONPATH=/tmp/cb12:. $P -m "gpu and not slow" ${CGRAW_CB12_FILES:-tests/gpu} > "$L/cb12.log" 2>&1 &
  fi
  timeout ${CGRAW_PARALLEL_TIMEOUT:-540} $SANITIZE $PYTEST -m "gpu and not slow and not third_party" ${CGRAW_MEMCHECK_FILES:-tests/gpu/test_rebind.py} \
    > "$L/memcheck.log" 2>&1 &
  wait
  # the replay path of a graphed call, module by module, and its host time on the GPU
  timeout 120 python3 -m tools.call_walk --device --time > "$L/call_walk.log" 2>&1
  for f in "$L"/*.log; do
    case "$f" in *_pip.log) continue;; esac
    summary="$summary
$(basename "$f" .log): $(grep -E 'ERROR SUMMARY' "$f" | head -n 1) $(tail -n 1 "$f" | cut -c1-160)"
  done
  summary="$summary
parallel tiers: in $(( $(date +%s) - t ))s"
  grep -hE "^(FAILED|ERROR)" "$L"/*.log | cut -c1-250 | head -30
  tar czf "$OUT/parallel_logs.tgz" -C "$OUT" parallel && rm -rf "$L"
fi
if has segv; then
  t=$(date +%s); L="$OUT/segv"; mkdir -p "$L"
  gcc -shared -fPIC -O1 -o /tmp/segv_handler.so tools/diag/segv_handler.c -ldl > "$L/gcc.log" 2>&1
  # torch's allocator settings: with expandable segments a MemPool can be erased under a live block
  python3 -c "import os, torch; torch.zeros(1, device='cuda'); print('PYTORCH_CUDA_ALLOC_CONF =', \
os.environ.get('PYTORCH_CUDA_ALLOC_CONF')); print(torch.cuda.memory._snapshot().get('allocator_settings'))" \
    > "$L/allocator_settings.txt" 2>&1; cat "$L/allocator_settings.txt" | cut -c1-300
  diag_run() {  # name, then pytest arguments
    local name=$1; shift
    CGRAW_DIAG_SEGV=/tmp/segv_handler.so CGRAW_DIAG_NATIVE_OUT="$L/$name.native" CGRAW_DIAG_LOG="$L/$name.tests" \
      timeout ${CGRAW_SEGV_TIMEOUT:-540} $PYTEST --timeout=280 -p tools.diag.pytest_diag \
      -m "gpu and not slow and not third_party" "$@" > "$L/$name.log" 2>&1
  }
  G=tests/gpu
  (ulimit -c unlimited; diag_run all $G) &
  (ulimit -c 0; diag_run no_rng $G --ignore=$G/test_rng.py) &
  (ulimit -c 0; diag_run no_capture_hardening $G --ignore=$G/test_capture.py --ignore=$G/test_hardening.py) &
  (ulimit -c 0; diag_run no_rebind_reliability $G --ignore=$G/test_rebind.py --ignore=$G/test_reliability.py) &
  (ulimit -c 0; diag_run no_buckets_foundation_readme $G --ignore=$G/test_buckets.py --ignore=$G/test_foundation.py \
    --ignore=$G/test_readme.py) &
  wait
  for c in core core.*; do
    [ -f "$c" ] || continue
    timeout 120 /usr/local/cuda/bin/cuda-gdb -q -batch -ex "set pagination off" -ex "bt 40" -ex "info registers rip" \
      "$(python3 -c 'import os, sys; print(os.path.realpath(sys.executable))')" "$c" > "$L/gdb_$c.txt" 2>&1
    rm -f "$c"
  done
  for f in "$L"/*.log; do
    case "$f" in */gcc.log) continue;; esac
    n=$(basename "$f" .log)
    echo "== $n: $(tail -n 1 "$f" | cut -c1-150)"
    echo "   last test: $(grep '^START' "$L/$n.tests" 2>/dev/null | tail -n 1)"
    [ -s "$L/$n.native" ] && grep -v '^  #' "$L/$n.native" | head -n 30 | cut -c1-200
  done
  for g in "$L"/gdb_*.txt; do [ -f "$g" ] && grep -E '^#' "$g" | head -n 30 | cut -c1-220; done
  summary="$summary
segv diagnosis: in $(( $(date +%s) - t ))s ($(grep -l 'Segmentation fault' "$L"/*.log 2>/dev/null | wc -l) of 5 runs aborted)"
  tar czf "$OUT/segv_logs.tgz" -C "$OUT" segv && rm -rf "$L"
fi
if has slow; then
  t=$(date +%s); timeout ${CGRAW_SLOW_TIMEOUT:-540} $PYTEST --timeout=280 -m "gpu and slow" -s "$@" > "$OUT/gpu_slow.log" 2>&1
  summary="$summary
$(stamp "slow tier" $? $t "$(tail -n 1 "$OUT/gpu_slow.log" | cut -c1-200)")"
fi
if has smoke; then
  t=$(date +%s); timeout 150 $SANITIZE python3 -m tools.sanitize_smoke > "$OUT/sanitizer.log" 2>&1
  summary="$summary
$(stamp "sanitizer smoke" $? $t "$(grep 'ERROR SUMMARY' "$OUT/sanitizer.log")")"
fi
if has memcheck; then
  t=$(date +%s)
  timeout ${CGRAW_MEMCHECK_TIMEOUT:-420} $SANITIZE $PYTEST -m "gpu and not slow" "$@" > "$OUT/memcheck.log" 2>&1
  summary="$summary
$(stamp "GPU tier under memcheck" $? $t "$(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/memcheck.log" | tail -n 2 | tr '\n' ' ' | cut -c1-250)")"
fi
if has control; then
  t=$(date +%s); timeout 200 python3 -m tools.probes.conditional_probe > "$OUT/conditional_probe.log" 2>&1
  summary="$summary
$(stamp "conditional probe" $? $t "$(tail -n 1 "$OUT/conditional_probe.log" | cut -c1-200)")"
  t=$(date +%s); timeout 300 $PYTEST --timeout=120 -m gpu tests/gpu/test_control_flow.py \
    tests/gpu/test_readme.py -k "control_flow or control-flow" "$@" > "$OUT/control_flow.log" 2>&1
  summary="$summary
$(stamp "control flow" $? $t "$(tail -n 1 "$OUT/control_flow.log" | cut -c1-200)")"
fi
if has threads; then
  t=$(date +%s); timeout 200 python3 -m benchmarks.allocator_threads > "$OUT/threads.log" 2>&1
  summary="$summary
$(stamp "allocator threads" $? $t "$(grep -c '"hung": true' benchmarks/results/allocator_threads.json) hung design(s)")"
  cp benchmarks/results/allocator_threads.json "$OUT/" 2>/dev/null
fi
if has bench; then
  t=$(date +%s); timeout ${CGRAW_BENCH_TIMEOUT:-560} python3 -m benchmarks ${CGRAW_BENCH_ARGS---full} > "$OUT/bench.log" 2>&1
  rc=$?; echo "benchmarks rc=$rc" >> "$OUT/bench.log"
  timeout 60 python3 -m benchmarks.plots >> "$OUT/bench.log" 2>&1
  summary="$summary
$(stamp "benchmarks" $rc $t "$(grep -c '^\[benchmarks\] part' "$OUT/bench.log") part(s) ran")"
  # this run's JSON and plots in one archive (the device returns at most 8 files)
  find benchmarks/results \( -name '*.json' -o -name '*.png' \) -newer "$OUT/gpu.txt" -print0 | tar czf "$OUT/results.tgz" --null -T -
fi
echo "==== failures (if any)"
for f in "$OUT/gpu_tests.log" "$OUT/gpu_stress.log" "$OUT/gpu_slow.log" "$OUT/memcheck.log"; do
  [ -f "$f" ] && grep -E "^(FAILED|ERROR)|^E   |what\(\)|Invalid __global__|Program hit" "$f" | head -20
done
[ -f "$OUT/gpu_slow.log" ] && grep -E "^seed [0-9]|soak:" "$OUT/gpu_slow.log" | cut -c1-300
echo "==== bench (tail)"
[ -f "$OUT/bench.log" ] && grep -E "^\[" "$OUT/bench.log" | tail -n 40 | cut -c1-300
cat "$OUT/gpu.txt"
echo "$summary"
