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
