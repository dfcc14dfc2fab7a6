#!/usr/bin/env bash
# Submit the whole pipeline as one SLURM dependency chain (each job starts only if the previous succeeded):
#   CONFIG=configs/qwen3-8b.yaml slurm/pipeline.sh [--regen-tasks 8] [--extract-tasks 8] [--train-nodes 1] [--gpus-per-node 8]
#       [--eval-tasks 1]    (more than 1: an eval array over the benchmark x method units, then a merge job)
# Extra sbatch flags for every job (partition, account, ...): SBATCH_FLAGS="-p gpu -A myacct".
# Prints the job ids; every stage is resumable, so re-running the script after a failure continues.
set -euo pipefail
: "${CONFIG:?set CONFIG=configs/<run>.yaml}"
REGEN_TASKS=8 EXTRACT_TASKS=8 EVAL_TASKS=1 TRAIN_NODES=1 GPUS_PER_NODE=8 STAGES="curate regen extract train eval"
while [ $# -gt 0 ]; do
  case "$1" in
    --regen-tasks) REGEN_TASKS=$2; shift 2 ;;
    --extract-tasks) EXTRACT_TASKS=$2; shift 2 ;;
    --eval-tasks) EVAL_TASKS=$2; shift 2 ;;
    --train-nodes) TRAIN_NODES=$2; shift 2 ;;
    --gpus-per-node) GPUS_PER_NODE=$2; shift 2 ;;
    --stages) STAGES=$2; shift 2 ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
export DRAFTER_REPO=${DRAFTER_REPO:-$(dirname "$HERE")}
SB="sbatch --parsable --kill-on-invalid-dep=yes --export=ALL,CONFIG=$CONFIG,DRAFTER_REPO=$DRAFTER_REPO ${SBATCH_FLAGS:-}"
dep=""
submit() {  # submit NAME SBATCH-ARGS...: chain on the previous job
  local name=$1; shift
  local id; id=$($SB ${dep:+--dependency=afterok:$dep} "$@")
  echo "$name $id"; dep=$id
}
for s in $STAGES; do
  case "$s" in
    curate)  submit curate "$HERE/curate.sbatch" ;;
    regen)   submit regen --array=0-$((REGEN_TASKS - 1)) "$HERE/regen.sbatch"
             submit regen-merge "$HERE/regen_merge.sbatch" ;;
    extract) submit extract --array=0-$((EXTRACT_TASKS - 1)) "$HERE/extract.sbatch"
             submit extract-merge "$HERE/extract_merge.sbatch" ;;
    train)   submit train --nodes="$TRAIN_NODES" --gpus-per-node="$GPUS_PER_NODE" \
                 --export=ALL,CONFIG=$CONFIG,DRAFTER_REPO=$DRAFTER_REPO,GPUS_PER_NODE=$GPUS_PER_NODE "$HERE/train.sbatch" ;;
    eval)    if [ "$EVAL_TASKS" -gt 1 ]; then
               submit eval --array=0-$((EVAL_TASKS - 1)) "$HERE/eval.sbatch"
               submit eval-merge "$HERE/eval_merge.sbatch"
             else
               submit eval "$HERE/eval.sbatch"
             fi ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
