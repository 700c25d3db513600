#!/usr/bin/env bash
# One device call: the GPU test tier, the slow tier, the sanitizer smoke and the benchmarks.
# Logs and JSON go to $OUT; a short table is printed last. From the repository root on the GPU machine:
#   bash benchmarks/gpu_session.sh [tests|slow|bench|all] [extra pytest args...]
# tests: -m "gpu and not slow" (about 1 min); slow: the random walk, the soak and compute-sanitizer
# (about 3 min); bench: python -m benchmarks (about 3 min).
set -u
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/cgraw-out}
mkdir -p "$OUT"
export PYTHONPATH=. CGRAW_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra --strict-markers --timeout=200"
summary=""
if [ "$what" = tests ] || [ "$what" = all ]; then
  start=$(date +%s)
  timeout 300 $PYTEST -m "gpu and not slow" "$@" > "$OUT/gpu_tests.log" 2>&1
  summary="GPU tier: rc=$? in $(( $(date +%s) - start ))s: $(tail -n 1 "$OUT/gpu_tests.log" | cut -c1-200)"
fi
if [ "$what" = slow ] || [ "$what" = all ]; then
  start=$(date +%s)
  timeout 300 $PYTEST -m "gpu and slow" -s "$@" > "$OUT/gpu_slow.log" 2>&1
  summary="$summary
slow tier: rc=$? in $(( $(date +%s) - start ))s: $(tail -n 1 "$OUT/gpu_slow.log" | cut -c1-200)"
  timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
      python3 -m benchmarks.sanitize_smoke > "$OUT/sanitizer.log" 2>&1
  summary="$summary
sanitizer smoke: rc=$? $(grep 'ERROR SUMMARY' "$OUT/sanitizer.log")"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 400 python3 -m benchmarks > "$OUT/bench.log" 2>&1
  echo "benchmarks rc=$?" >> "$OUT/bench.log"
  # this run's JSON in one archive (the device returns at most 8 files)
  find benchmarks/results -name '*.json' -newer "$OUT/gpu.txt" -print0 | tar czf "$OUT/results.tgz" --null -T -
fi
echo "==== failures (if any)"
for f in "$OUT/gpu_tests.log" "$OUT/gpu_slow.log"; do
  [ -f "$f" ] && grep -E "^(FAILED|ERROR)|^E   |what\(\)" "$f" | head -20
done
[ -f "$OUT/gpu_slow.log" ] && grep -E "^seed [0-9]|soak:" "$OUT/gpu_slow.log" | cut -c1-300
echo "==== bench (tail)"
[ -f "$OUT/bench.log" ] && grep -E "^\[" "$OUT/bench.log" | tail -n 30 | cut -c1-300
cat "$OUT/gpu.txt"
echo "$summary"
