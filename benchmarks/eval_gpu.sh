#!/usr/bin/env bash
# Everything the eval stage's GPU numbers need, in one command (one device call): the CUDA-only eval tests
# (Triton kernels compiled, fused verify, CUDA-graph rounds with one sync, the drafter's graph steps, warm-up
# coverage, regen's graphed decode step), the full-round table (benchmarks/bench_round.py: drafter, build+walk,
# verify, round vs an AR step, syncs, and the draft step kernel by kernel; its JSON in --out), then the
# verify-forward table (benchmarks/profile_eval_round.py) and the per-round overhead table
# (benchmarks/bench_eval_overhead.py), each into its own log under --out. Prints the summary lines of each.
#
#   bash benchmarks/eval_gpu.sh --out $OUT        (H200: ~12 min: ~6 the tests, ~3 the round bench)
#   bash benchmarks/eval_gpu.sh --out $OUT --skip-tests --skip-profile --skip-bench     (the round bench alone)
#   bash benchmarks/eval_gpu.sh --out $OUT --export runs/<run>/train/export --config configs/<run>.yaml
#                                                 (+ the round of a trained drafter on GSM8K prompts)
#
# Options: --out DIR (default ./eval_gpu_out)  --budgets LIST (bench, default 16,64,256,1024)
# --round-budgets LIST (default 16,64,256)  --profile-budgets LIST (default 16,256)  --iters N (default 10)
# --export DIR --config FILE (a trained drafter for bench_round's export mode, budget 64)
# --skip-tests  --skip-round  --skip-profile  --skip-bench
# PYTHON=... picks the interpreter. Exit status 1 when a test or a script failed.
set -uo pipefail
export PYTHONUNBUFFERED=1 DRAFTER_NO_PROGRESS=1 HF_HUB_OFFLINE=1

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
OUT="eval_gpu_out" BUDGETS="16,64,256,1024" RBUDGETS="16,64,256" PBUDGETS="16,256" ITERS=10 TESTS=1 ROUND=1
PROFILE=1 BENCH=1 EXPORT="" CONFIG=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --budgets) BUDGETS="$2"; shift 2 ;;
    --profile-budgets) PBUDGETS="$2"; shift 2 ;;
    --round-budgets) RBUDGETS="$2"; shift 2 ;;
    --export) EXPORT="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --iters) ITERS="$2"; shift 2 ;;
    --skip-tests) TESTS=""; shift ;;
    --skip-round) ROUND=""; shift ;;
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
    tests/eval/test_draft_forward.py tests/pipeline/test_regen_hf.py \
    -k "cuda or builder or brute or heap or fused or graph" \
    > "$OUT/tests.log" 2>&1 || status=1
  grep -E "^E |passed|failed" "$OUT/tests.log" | tail -12
fi
if [ -n "$ROUND" ]; then
  "$PY" benchmarks/bench_round.py --device cuda --shape qwen3-8b --budgets "$RBUDGETS" --past 1024 --new-tokens 128 \
    --profile-drafter 20 --out "$OUT/round_qwen3_8b.json" > "$OUT/round.log" 2>&1 || status=1
  grep -E "^ +(ar|chain|ddtree@[0-9]+) |^random-init|^-+$|method" "$OUT/round.log"
  sed -n '/^draft step profile/,/the bound/p' "$OUT/round.log"
  if [ -n "$EXPORT" ]; then
    "$PY" benchmarks/bench_round.py --device cuda --config "$CONFIG" --export "$EXPORT" --budgets 64 --prompts 8 \
      --new-tokens 256 --out "$OUT/round_export.json" > "$OUT/round_export.log" 2>&1 || status=1
    grep -E "^ +(ar|chain|ddtree@[0-9]+) | GSM8K prompts" "$OUT/round_export.log"
  fi
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
