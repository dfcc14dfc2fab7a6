#!/usr/bin/env bash
# A hybrid (Gated-DeltaNet) target's GPU numbers in one command (one device call): the CUDA-only hybrid tests (the
# Triton tree kernels compiled and checked up to the Qwen3.6-27B shape, the tree-aware cache against the
# path-batched reference with no host sync, greedy hybrid decoding with one sync per round, hybrid extraction on
# fla's kernels against transformers' torch definition), then benchmarks/bench_hybrid.py on a random-init
# Qwen3.6-27B-shape target with the Qwen3-8B-shape reference, which writes --out/summary.json
# (docs/results/hybrid-h200/summary.json's keys), then its verify section again on the static K/V cache with CUDA
# graphs (`--cache graphs`: --out/graphs/summary.json; --no-graphs skips it). Logs under --out.
#
#   bash benchmarks/hybrid_gpu.sh --out $OUT       (H200: ~1.5 min of tests, then the bench: ~5 min, ~85 GB peak)
#   bash benchmarks/hybrid_gpu.sh --out $OUT --skip-tests --bench-args "--budgets 16,64,256 --iters 10"
#
# Needs fla-core (pyproject's gpu-hybrid extra) importable: exits 2 without it. PYTHON=... picks the interpreter.
# Exit status 1 when a test or the bench failed.
set -uo pipefail
export PYTHONUNBUFFERED=1 DRAFTER_NO_PROGRESS=1 HF_HUB_OFFLINE=1

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
OUT="hybrid_gpu_out" TESTS=1 BENCH_ARGS="" GRAPHS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --skip-tests) TESTS=""; shift ;;
    --bench-args) BENCH_ARGS="$2"; shift 2 ;;
    --no-graphs) GRAPHS=""; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
"$PY" -c "import fla.ops.gated_delta_rule, fla; print('fla-core', fla.__version__)" \
  || { echo "fla-core is not importable: install the gpu-hybrid extra (or its wheel)" >&2; exit 2; }
status=0

if [ -n "$TESTS" ]; then
  "$PY" -m pytest -q -p no:cacheprovider --tb=short tests/eval/test_tree_recurrent.py \
    tests/eval/test_tree_recurrent_triton.py tests/eval/test_hybrid_cache.py tests/eval/test_decode_greedy.py \
    tests/extract/test_hf.py -k "(cuda and not graph) or fla_kernels or hybrid_rounds_on_cuda_graphs" > "$OUT/tests.log" 2>&1 || status=1
  grep -E "^E |passed|failed" "$OUT/tests.log" | tail -12
fi
# shellcheck disable=SC2086
"$PY" benchmarks/bench_hybrid.py --device cuda --shape qwen3.6-27b --out "$OUT" $BENCH_ARGS \
  2>&1 | tee "$OUT/bench.log" | grep -vE "Warning|warn\(" || status=1
[ -f "$OUT/summary.json" ] || status=1
if [ -n "$GRAPHS" ]; then
  # shellcheck disable=SC2086
  "$PY" benchmarks/bench_hybrid.py --device cuda --shape qwen3.6-27b --out "$OUT/graphs" --sections verify \
    --cache graphs $BENCH_ARGS 2>&1 | tee "$OUT/bench-graphs.log" | grep -vE "Warning|warn\(" || status=1
  [ -f "$OUT/graphs/summary.json" ] || status=1
fi
exit $status
