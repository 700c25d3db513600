#!/usr/bin/env bash
# One device call: the GPU test tier, then the benchmarks. Logs and JSON go to $OUT; a short
# table is printed last. Run from the repository root on the GPU machine:
#   bash benchmarks/gpu_session.sh [tests|bench|all] [extra pytest args...]
set -u
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/cgraw-out}
mkdir -p "$OUT"
export PYTHONPATH=. CGRAW_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
summary=""
if [ "$what" = tests ] || [ "$what" = all ]; then
  start=$(date +%s)
  timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra --strict-markers" \
      --timeout=150 "$@" > "$OUT/gpu_tests.log" 2>&1
  rc=$?
  summary="GPU tier: rc=$rc in $(( $(date +%s) - start ))s: $(tail -n 1 "$OUT/gpu_tests.log")"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 400 python3 -m benchmarks > "$OUT/bench.log" 2>&1
  echo "benchmarks rc=$?" >> "$OUT/bench.log"
  cp benchmarks/results/*.json "$OUT/" 2>/dev/null
fi
echo "==== failures (if any)"
[ -f "$OUT/gpu_tests.log" ] && grep -E "^(FAILED|ERROR)|Error|error:" "$OUT/gpu_tests.log" | head -40
echo "==== bench (tail)"
[ -f "$OUT/bench.log" ] && tail -n 45 "$OUT/bench.log"
cat "$OUT/gpu.txt"
echo "$summary"
