#!/usr/bin/env bash
# Submit the whole pipeline as one SLURM dependency chain (each job starts only if the previous succeeded):
#   CONFIG=configs/qwen3-8b.yaml slurm/pipeline.sh [--regen-tasks 8] [--extract-tasks 8] [--train-nodes 1] [--gpus-per-node 8]
#       [--eval-tasks 1]    (more than 1: an eval array over the benchmark x method units, then a merge job)
#       [--time T | --time STAGE=T ...]   SLURM time limit of every job, or of one stage's jobs (curate, regen,
#                                         extract, train, eval; e.g. --time 4:00:00 --time train=2-00:00:00)
#       [--signal-margin S]   seconds before the limit at which a job stops its stage and requeues itself (180)
#       [--stages "curate regen extract train eval"]   [--dry-run]   (print the sbatch commands, submit nothing)
# GPUs per regen / extract task come from the config: <stage>.vllm.tensor_parallel_size with the vllm backend, else 1.
# A job that reaches its time limit checkpoints (train) or stops between units (the other stages), requeues itself
# and resumes (slurm/env.sh, `requeueable`); the chain waits for it. Extra sbatch flags for every job (partition,
# account, ...): SBATCH_FLAGS="-p gpu -A myacct". ARGS: dotted overrides for every stage (and for the GPU counts here).
# Prints "<job> <id>" per job; every stage is resumable, so re-running the script after a failure continues.
set -euo pipefail
: "${CONFIG:?set CONFIG=configs/<run>.yaml}"
REGEN_TASKS=8 EXTRACT_TASKS=8 EVAL_TASKS=1 TRAIN_NODES=1 GPUS_PER_NODE=8 STAGES="curate regen extract train eval"
MARGIN=180 DRY_RUN=0 ALL_TIME=""
declare -A TIME=()
while [ $# -gt 0 ]; do
  case "$1" in
    --regen-tasks) REGEN_TASKS=$2; shift 2 ;;
    --extract-tasks) EXTRACT_TASKS=$2; shift 2 ;;
    --eval-tasks) EVAL_TASKS=$2; shift 2 ;;
    --train-nodes) TRAIN_NODES=$2; shift 2 ;;
    --gpus-per-node) GPUS_PER_NODE=$2; shift 2 ;;
    --stages) STAGES=$2; shift 2 ;;
    --time) case "$2" in
              curate=*|regen=*|extract=*|train=*|eval=*) TIME[${2%%=*}]=${2#*=} ;;
              *=*) echo "--time $2: the stage must be one of curate, regen, extract, train, eval" >&2; exit 2 ;;
              *) ALL_TIME=$2 ;;
            esac; shift 2 ;;
    --signal-margin) MARGIN=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
export DRAFTER_REPO=${DRAFTER_REPO:-$(dirname "$HERE")}
PY=${DRAFTER_VENV:-$DRAFTER_REPO/.venv}/bin/python
[ -x "$PY" ] || PY=python3
# GPUs per regen / extract task from the config (a config error stops here, before anything is submitted)
# shellcheck disable=SC2086
GPUS=$(cd "$DRAFTER_REPO" && "$PY" -c '
import sys
from pipeline.config import ConfigError, load_config
try:
    c = load_config(sys.argv[1], sys.argv[2:])
except ConfigError as e:
    sys.exit(f"slurm/pipeline.sh: {sys.argv[1]}: {e}")
print(*(s.vllm.tensor_parallel_size if s.backend == "vllm" else 1 for s in (c.regen, c.extract)))
' "$CONFIG" ${ARGS:-})
read -r REGEN_GPUS EXTRACT_GPUS <<< "$GPUS"
SB="sbatch --parsable --kill-on-invalid-dep=yes --export=ALL,CONFIG=$CONFIG,DRAFTER_REPO=$DRAFTER_REPO ${SBATCH_FLAGS:-}"
dep=""
submit() {  # submit NAME STAGE SBATCH-ARGS...: chain on the previous job
  local name=$1 stage=$2; shift 2
  local limit=${TIME[$stage]:-$ALL_TIME}
  local args=(${dep:+--dependency=afterok:$dep} --signal="B:USR1@$MARGIN" ${limit:+--time=$limit} "$@")
  local id
  if [ "$DRY_RUN" = 1 ]; then
    id="<$name>"
    echo "$name $id: $SB ${args[*]}"
  else
    id=$($SB "${args[@]}")
    echo "$name $id"
  fi
  dep=$id
}
for s in $STAGES; do
  case "$s" in
    curate)  submit curate curate "$HERE/curate.sbatch" ;;
    regen)   submit regen regen --array=0-$((REGEN_TASKS - 1)) --gpus="$REGEN_GPUS" "$HERE/regen.sbatch"
             submit regen-merge regen "$HERE/regen_merge.sbatch" ;;
    extract) submit extract extract --array=0-$((EXTRACT_TASKS - 1)) --gpus="$EXTRACT_GPUS" "$HERE/extract.sbatch"
             submit extract-merge extract "$HERE/extract_merge.sbatch" ;;
    train)   submit train train --nodes="$TRAIN_NODES" --gpus-per-node="$GPUS_PER_NODE" \
                 --export=ALL,CONFIG=$CONFIG,DRAFTER_REPO=$DRAFTER_REPO,GPUS_PER_NODE=$GPUS_PER_NODE "$HERE/train.sbatch" ;;
    eval)    if [ "$EVAL_TASKS" -gt 1 ]; then
               submit eval eval --array=0-$((EVAL_TASKS - 1)) "$HERE/eval.sbatch"
               submit eval-merge eval "$HERE/eval_merge.sbatch"
             else
               submit eval eval "$HERE/eval.sbatch"
             fi ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
