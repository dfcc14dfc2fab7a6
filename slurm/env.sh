# Sourced by every sbatch script: activates the environment and sets what torchrun/DeepSpeed/the stages read.
# Override before sbatch: DRAFTER_VENV (default: <repo>/.venv), CONFIG (run config), ARGS (dotted overrides).
set -euo pipefail
REPO=${DRAFTER_REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}
cd "$REPO"
VENV=${DRAFTER_VENV:-$REPO/.venv}
[ -x "$VENV/bin/drafter" ] && export PATH="$VENV/bin:$PATH"
: "${CONFIG:?set CONFIG=configs/<run>.yaml (sbatch --export=ALL,CONFIG=...)}"
ARGS=${ARGS:-}
export DRAFTER_NO_PROGRESS=${DRAFTER_NO_PROGRESS:-1}   # progress bars make unreadable batch logs
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
# The first node of the allocation is the rendezvous host of multi-node jobs.
MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname -s)}" 2>/dev/null | head -n 1 || hostname -s)
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 10000))}
echo "[slurm] job=${SLURM_JOB_ID:-} array_task=${SLURM_ARRAY_TASK_ID:-} nodes=${SLURM_JOB_NUM_NODES:-1} host=$(hostname -s) master=$MASTER_ADDR:$MASTER_PORT config=$CONFIG"

# requeueable CMD...: run a stage so that a job's time limit does not stop the pipeline. The sbatch scripts ask SLURM
# for USR1 to this shell <margin> seconds before the limit (--signal=B:USR1@<margin>; slurm/pipeline.sh
# --signal-margin). On it the stage is told to stop (SIGTERM: to the job's srun steps when CMD is srun — torchrun
# passes it to every rank —, else to CMD): `drafter train` finishes its step, checkpoints it and exits 75
# (train/preempt.py); the other stages stop at once and resume at their first unfinished unit. Once the stage has
# stopped, a non-zero exit after the warning requeues this job (`scontrol requeue`): it starts again from the top
# and the same command resumes, so a time-limited job continues by itself, at most DRAFTER_MAX_REQUEUES times
# (default 20). Without the warning, the stage's exit status is the job's (a scancel is never requeued).
requeueable() {
  _STAGE_WARNED=0
  "$@" &
  _STAGE_PID=$!
  if [ "$1" = srun ]; then _STAGE_STOP="scancel --signal=TERM $SLURM_JOB_ID"; else _STAGE_STOP="kill -TERM $_STAGE_PID"; fi
  trap '_STAGE_WARNED=1; echo "[slurm] $(date +%T) time limit near (USR1): stopping the stage (it checkpoints or resumes per unit)"; $_STAGE_STOP 2>/dev/null || true' USR1
  local rc=0
  wait "$_STAGE_PID" || rc=$?
  while [ "$rc" -gt 128 ] && kill -0 "$_STAGE_PID" 2>/dev/null; do  # wait was interrupted by the trap: wait on
    rc=0; wait "$_STAGE_PID" || rc=$?
  done
  trap - USR1
  if [ "$_STAGE_WARNED" = 1 ] && [ "$rc" != 0 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    local restarts=${SLURM_RESTART_COUNT:-0}
    if [ "$restarts" -ge "${DRAFTER_MAX_REQUEUES:-20}" ]; then
      echo "[slurm] stage stopped (exit $rc) at the time limit; not requeued: job $SLURM_JOB_ID ran $((restarts + 1)) times (DRAFTER_MAX_REQUEUES)" >&2
      return "$rc"
    fi
    echo "[slurm] $(date +%T) stage stopped (exit $rc) before the time limit: requeueing job $SLURM_JOB_ID (restart $((restarts + 1))); the same command resumes"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
  return "$rc"
}
