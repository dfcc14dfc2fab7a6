#!/usr/bin/env bash
# Multi-GPU benchmarks of one host (issue 7): data-parallel drafter training (1 GPU and N GPUs, ZeRO-2 and
# ZeRO-3, torchrun -> train.engine's env handling) and split extraction (N independent ranks, one GPU each,
# RANK/WORLD_SIZE like an array job, one shared stage dir, then the merge). Prints the training table with
# scaling efficiency = tokens/s at N / (N x tokens/s at 1), and the extraction's aggregate tokens/s with the
# exactly-once check of the merged index. Results (tables, JSON, logs) go to --out; shards to --work-dir.
#
#   bash benchmarks/multi_gpu.sh --gpus 2 --out $OUT                                        (H200 host, defaults)
#   bash benchmarks/multi_gpu.sh --gpus 2 --device cpu --shape tiny --extract-shape tiny --stages 2 \
#        --steps 2 --warmup 0 --tokens-per-rank 5000 --out /tmp/mg                                     (CPU, gloo)
#
# Options: --gpus N (required)  --out DIR (results, default ./multi_gpu_out)  --work-dir DIR (shards, default
# /tmp/bench-multi-gpu: local disk, never $OUT)  --device cuda|cpu  --shape qwen3-8b|tiny (drafter)
# --extract-shape qwen3-8b|tiny|...  --stages "2 3"  --steps 3  --warmup 2  --compile auto|yes|no (auto: compiled layers on cuda for ZeRO<3)
# --tokens-per-rank 150000  --storage-dtype bfloat16|fp8  --run-timeout 300 (s per training run)
# --skip-train  --skip-extract  --no-single (no 1-GPU training baseline)  --keep (keep the feature shards)
# PYTHON=... picks the interpreter.
# Exit status 1 when a run failed, replicas differ, or the merged index does not cover every sample once.
set -uo pipefail

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off
export PYTHONUNBUFFERED=1 DRAFTER_NO_PROGRESS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT  # torchrun / the ranks below set their own

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python}"

GPUS="" OUT="multi_gpu_out" WORK="/tmp/bench-multi-gpu" DEVICE="cuda" SHAPE="qwen3-8b" XSHAPE="qwen3-8b"
STAGES="2 3" STEPS=3 WARMUP=2 COMPILE="auto" TPR=150000 SDTYPE="bfloat16" RUN_TIMEOUT=300
DO_TRAIN=1 DO_EXTRACT=1 KEEP="" SINGLE=1
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) GPUS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --work-dir) WORK="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --shape) SHAPE="$2"; shift 2 ;;
    --extract-shape) XSHAPE="$2"; shift 2 ;;
    --stages) STAGES="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    --compile) COMPILE="$2"; shift 2 ;;
    --tokens-per-rank) TPR="$2"; shift 2 ;;
    --storage-dtype) SDTYPE="$2"; shift 2 ;;
    --run-timeout) RUN_TIMEOUT="$2"; shift 2 ;;
    --skip-train) DO_TRAIN=0; shift ;;
    --skip-extract) DO_EXTRACT=0; shift ;;
    --no-single) SINGLE=0; shift ;;
    --keep) KEEP="--keep"; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$GPUS" ] && [ "$GPUS" -ge 1 ] 2>/dev/null || { echo "--gpus N (>= 1) is required" >&2; exit 2; }
export DS_ACCELERATOR="$DEVICE"
mkdir -p "$OUT" "$WORK"
OUT="$(cd "$OUT" && pwd)" WORK="$(cd "$WORK" && pwd)"
FAILED=0
T0=$SECONDS
echo "multi-GPU benchmark: $GPUS x $DEVICE, drafter $SHAPE, ZeRO stages [$STAGES], $STEPS steps after $WARMUP," \
     "extraction $XSHAPE x $TPR tokens/rank -> $OUT" | tee "$OUT/summary.txt"
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader >> "$OUT/summary.txt" 2>&1

# ---------------------------------------------------------------------------------------------- training
train_run() {  # n_gpus zero_stage yes|no -> appends a row to train.jsonl (a FAILED row when the run fails)
  local n=$1 stage=$2 comp=$3 flag mode log rc
  [ "$comp" = yes ] && flag=--compile mode=compile || flag=--no-compile mode=eager
  log="$OUT/train-n$n-zero$stage-$mode.log"
  echo "[$((SECONDS - T0)) s] train: $n rank(s), ZeRO-$stage, $mode" | tee -a "$OUT/summary.txt"
  timeout "$RUN_TIMEOUT" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
    benchmarks/bench_multi_gpu_train.py --device "$DEVICE" --shape "$SHAPE" --zero-stage "$stage" \
    --steps "$STEPS" --warmup "$WARMUP" "$flag" --json "$OUT/train.jsonl" > "$log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "  FAILED (rc $rc$([ $rc -eq 124 ] && echo ', timeout')); last lines of $log:" | tee -a "$OUT/summary.txt"
    tail -n 5 "$log" | sed 's/^/    /' | tee -a "$OUT/summary.txt"
    printf '{"ok": false, "world_size": %d, "zero_stage": %d, "mode": "%s", "error": "rc %d, see %s"}\n' \
      "$n" "$stage" "$mode" "$rc" "$(basename "$log")" >> "$OUT/train.jsonl"
  else
    grep -A1 '^GPUs' "$log" | tail -n 1 | sed 's/^/  /'
  fi
  return $rc
}

if [ "$DO_TRAIN" = 1 ]; then
  : > "$OUT/train.jsonl"
  for stage in $STAGES; do
    comp=$COMPILE
    if [ "$comp" = auto ]; then  # ZeRO-3's partitioning hooks break compiled graphs (pytorch#115484): eager there
      [ "$DEVICE" = cuda ] && [ "$stage" -lt 3 ] && comp=yes || comp=no
    fi
    if [ "$SINGLE" = 1 ] && ! train_run 1 "$stage" "$comp"; then
      FAILED=1
      if [ "$comp" = yes ]; then  # e.g. compiled layers under ZeRO-3 hooks: measure both sizes eager instead
        comp=no
        train_run 1 "$stage" "$comp" || continue
      else
        continue
      fi
    fi
    if [ "$GPUS" -gt 1 ]; then train_run "$GPUS" "$stage" "$comp" || FAILED=1; fi
  done
  echo | tee -a "$OUT/summary.txt"
  "$PY" benchmarks/bench_multi_gpu_train.py --summarize "$OUT/train.jsonl" | tee "$OUT/train.txt" | tee -a "$OUT/summary.txt"
  if grep -q '"weights_identical": false' "$OUT/train.jsonl"; then
    echo "REPLICAS DIFFER in at least one run" | tee -a "$OUT/summary.txt"; FAILED=1
  fi
fi

# ---------------------------------------------------------------------------------------------- extraction
if [ "$DO_EXTRACT" = 1 ]; then
  X="$PY benchmarks/bench_multi_gpu_extract.py"
  echo -e "\n[$((SECONDS - T0)) s] extract: $GPUS ranks, $XSHAPE" | tee -a "$OUT/summary.txt"
  if $X prepare --work-dir "$WORK/extract" --shape "$XSHAPE" --device "$DEVICE" --world-size "$GPUS" \
       --tokens-per-rank "$TPR" --storage-dtype "$SDTYPE" > "$OUT/extract-prepare.log" 2>&1; then
    tail -n 1 "$OUT/extract-prepare.log"
    pids=()
    for ((r = 0; r < GPUS; r++)); do  # one process per GPU, rank/world from the environment like an array task
      CUDA_VISIBLE_DEVICES=$r RANK=$r WORLD_SIZE=$GPUS $X rank --work-dir "$WORK/extract" \
        > "$OUT/extract-rank$r.log" 2>&1 &
      pids+=($!)
    done
    for ((r = 0; r < GPUS; r++)); do
      if ! wait "${pids[$r]}"; then
        echo "  rank $r FAILED; last lines of extract-rank$r.log:" | tee -a "$OUT/summary.txt"
        tail -n 5 "$OUT/extract-rank$r.log" | sed 's/^/    /' | tee -a "$OUT/summary.txt"
        FAILED=1
      else
        grep '^rank ' "$OUT/extract-rank$r.log" | sed 's/^/  /'
      fi
    done
    $X merge --work-dir "$WORK/extract" --json "$OUT/extract.json" $KEEP > "$OUT/extract.txt" 2> "$OUT/extract-merge.log" \
      || FAILED=1
    cat "$OUT/extract.txt" >> "$OUT/summary.txt"
    cat "$OUT/extract.txt"
    [ -s "$OUT/extract.txt" ] || tail -n 5 "$OUT/extract-merge.log"
  else
    echo "  prepare FAILED:" | tee -a "$OUT/summary.txt"; tail -n 5 "$OUT/extract-prepare.log"; FAILED=1
  fi
fi

echo -e "\ntotal $((SECONDS - T0)) s; $([ $FAILED = 0 ] && echo 'all runs and checks passed' || echo 'SOMETHING FAILED (see above)')" \
  | tee -a "$OUT/summary.txt"
exit $FAILED
