#!/usr/bin/env bash
# Everything the eval stage's GPU numbers need, in one command (one device call): the CUDA-only eval tests
# (Triton kernels compiled, fused verify, CUDA-graph rounds with one sync), then the verify-forward table
# (benchmarks/profile_eval_round.py) and the per-round overhead table (benchmarks/bench_eval_overhead.py), each
# into its own log under --out. Prints the summary lines of each.
#
#   bash benchmarks/eval_gpu.sh --out $OUT        (H200: ~9 min, ~5.5 of them the tests, before the two-way bench)
#   bash benchmarks/eval_gpu.sh --out $OUT --budgets 16,64,256,1024 --skip-tests
#
# Options: --out DIR (default ./eval_gpu_out)  --budgets LIST (bench, default 16,64,256,1024)
# --profile-budgets LIST (default 16,256)  --iters N (default 10)  --skip-tests  --skip-profile  --skip-bench
# PYTHON=... picks the interpreter. Exit status 1 when a test or a script failed.
set -uo pipefail
export PYTHONUNBUFFERED=1 DRAFTER_NO_PROGRESS=1 HF_HUB_OFFLINE=1

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
OUT="eval_gpu_out" BUDGETS="16,64,256,1024" PBUDGETS="16,256" ITERS=10 TESTS=1 PROFILE=1 BENCH=1
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --budgets) BUDGETS="$2"; shift 2 ;;
    --profile-budgets) PBUDGETS="$2"; shift 2 ;;
    --iters) ITERS="$2"; shift 2 ;;
    --skip-tests) TESTS=""; shift ;;
    --skip-profile) PROFILE=""; shift ;;
    --skip-bench) BENCH=""; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
status=0

if [ -n "$TESTS" ]; then
  "$PY" -m pytest -q -p no:cacheprovider --tb=short tests/eval/test_triton_kernels.py tests/eval/test_tree_builder.py \
    tests/eval/test_target_forward.py tests/eval/test_decode_greedy.py tests/eval/test_round_capture_safety.py \
    tests/pipeline/test_regen_hf.py \
    -k "cuda or builder or brute or heap or fused or graph" \
    > "$OUT/tests.log" 2>&1 || status=1
  grep -E "^E |passed|failed" "$OUT/tests.log" | tail -12
fi
if [ -n "$PROFILE" ]; then
  "$PY" benchmarks/profile_eval_round.py --shape qwen3-8b --past 1024 --budgets "$PBUDGETS" --drafter-logits --wall \
    --best-file "$OUT/fastest_attention" > "$OUT/profile.log" 2>&1 || status=1
  grep -E "^ +[0-9]+ +[0-9]+ |^budget|fastest|replay|: wall" "$OUT/profile.log" | head -30
fi
if [ -n "$BENCH" ]; then
  "$PY" benchmarks/bench_eval_overhead.py --device cuda --shape qwen3-8b --past 1024 --budgets "$BUDGETS" \
    --iters "$ITERS" --new-tokens 0 > "$OUT/bench.log" 2>&1 || status=1
  grep -E "^ +[0-9]+ +[0-9]+ |^budget|^target|Targets" "$OUT/bench.log"
  # the selection's worst case: every depth keeps live candidates
  "$PY" benchmarks/bench_eval_overhead.py --device cuda --shape qwen3-8b --past 1024 --budgets "$BUDGETS" \
    --iters "$ITERS" --new-tokens 0 --skip-reference --draft two-way > "$OUT/bench_two_way.log" 2>&1 || status=1
  grep -E "^ +[0-9]+ +[0-9]+ |^target" "$OUT/bench_two_way.log"
fi
exit $status
