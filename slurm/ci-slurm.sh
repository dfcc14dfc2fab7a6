#!/usr/bin/env bash
# A real single-node SLURM cluster on localhost for CI and laptops (recipe from the project docs, tested on Debian 12).
# ci-slurm.sh -- stand up / tear down a real single-node SLURM cluster on localhost.
# Usage: bash ci-slurm.sh install|start|stop|status
#        source ci-slurm.sh; slurm_wait JOBID [TIMEOUT_S]   # exit code of a batch job / whole array
# Idempotent: "start" stops any previous instance, wipes state and starts fresh;
# "stop" is a no-op when nothing runs.  Needs root.  Tested on Debian 12 (slurm 22.05.8, munge 0.5.15).
set -uo pipefail

SLURM_ETC=/etc/slurm
SLURM_STATE=/var/spool/slurm-ci          # StateSaveLocation + SlurmdSpoolDir live below here
SLURM_LOG=/var/log/slurm
SLURM_RUN=/run/slurm
SLURM_PARTITION=${SLURM_PARTITION:-debug}
# Extra partition names that the project's #SBATCH -p lines use (all map to the same node):
SLURM_EXTRA_PARTITIONS=${SLURM_EXTRA_PARTITIONS:-}
# Advertise more CPUs than the machine has (oversubscribe) so scripts asking for e.g. --ntasks=8 still run:
SLURM_FAKE_CPUS=${SLURM_FAKE_CPUS:-}
# Advertise N fake GPUs (GRES backed by dummy char devices) so "#SBATCH --gres=gpu:1" / "--gpus=1" are accepted:
SLURM_FAKE_GPUS=${SLURM_FAKE_GPUS:-0}
# SLURM_CGROUP=1: proctrack/task cgroup (v1) -> --mem is enforced, setsid'ed children are killed too.
# Falls back to proctrack/linuxproc when cgroup v1 controllers are not writable.
SLURM_CGROUP=${SLURM_CGROUP:-0}
# SLURM_CRED_EXPIRE=S: job step credential lifetime, which is also how long a requeued job waits before it starts
# again (SLURM's default 120 s; the requeue test sets 20 so that a job that requeues itself restarts soon)
SLURM_CRED_EXPIRE=${SLURM_CRED_EXPIRE:-}
# SLURM_ACCOUNTING=1: also run mariadb + slurmdbd so that sacct works (+~13 s install, +~1 s start)
SLURM_ACCOUNTING=${SLURM_ACCOUNTING:-0}

_alive() {  # pid alive and not a zombie
  local p=$1; [ -n "$p" ] && [ -r "/proc/$p/status" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$p/status"
}
_pid() { cat "$1" 2>/dev/null || true; }

slurm_install() {
  local pkgs="slurmctld slurmd slurm-client munge"
  [ "$SLURM_ACCOUNTING" = 1 ] && pkgs="$pkgs slurmdbd mariadb-server"
  local missing="" p
  for p in $pkgs; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing="$missing $p"; done
  [ -z "$missing" ] && return 0
  apt-get update -qq
  # slurmctld+slurmd+slurm-client is all that is needed; the slurm-wlm metapackage also works (more plugins, ~same time)
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
}

_write_conf() {
  local H CPUS SOCK CORES THREADS MEM
  H=$(hostname -s)
  # slurmd -C prints the real hardware; RealMemory must not exceed it or the node is drained
  eval "$(slurmd -C | head -1 | tr ' ' '\n' | grep -E '^(CPUs|SocketsPerBoard|CoresPerSocket|ThreadsPerCore|RealMemory)=' \
          | sed -e 's/^CPUs=/CPUS=/' -e 's/^SocketsPerBoard=/SOCK=/' -e 's/^CoresPerSocket=/CORES=/' \
                -e 's/^ThreadsPerCore=/THREADS=/' -e 's/^RealMemory=/MEM=/')"
  MEM=$(( MEM * 85 / 100 ))
  local NODELINE="NodeName=${H} NodeAddr=127.0.0.1 CPUs=${CPUS} Sockets=${SOCK} CoresPerSocket=${CORES} ThreadsPerCore=${THREADS} RealMemory=${MEM} State=UNKNOWN"
  local EXTRA=""
  if [ -n "$SLURM_FAKE_CPUS" ]; then
    NODELINE="NodeName=${H} NodeAddr=127.0.0.1 CPUs=${SLURM_FAKE_CPUS} RealMemory=${MEM} State=UNKNOWN"
    EXTRA="SlurmdParameters=config_overrides"
  fi
  rm -f "$SLURM_ETC/gres.conf"
  if [ "${SLURM_FAKE_GPUS}" -gt 0 ]; then
    NODELINE="${NODELINE} Gres=gpu:${SLURM_FAKE_GPUS}"
    EXTRA="${EXTRA}
GresTypes=gpu"
    # slurmd drops file-less GPUs ("Removing file-less GPU"), so give it fake char devices (major/minor of /dev/null)
    mkdir -p "$SLURM_RUN/fakegpu"; local i
    for i in $(seq 0 $((SLURM_FAKE_GPUS - 1))); do
      [ -c "$SLURM_RUN/fakegpu/gpu$i" ] || mknod "$SLURM_RUN/fakegpu/gpu$i" c 1 3
    done
    echo "NodeName=${H} Name=gpu File=${SLURM_RUN}/fakegpu/gpu[0-$((SLURM_FAKE_GPUS - 1))]" > "$SLURM_ETC/gres.conf"
  fi
  local PROCTRACK=proctrack/linuxproc TASK=task/none SELP=CR_Core GATHER=jobacct_gather/none MEMLINE=""
  rm -f "$SLURM_ETC/cgroup.conf"
  local ACCTLINES="AccountingStorageType=accounting_storage/none"
  if [ "$SLURM_ACCOUNTING" = 1 ]; then
    ACCTLINES="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819"
    GATHER=jobacct_gather/linux
  fi
  if [ "$SLURM_CGROUP" = 1 ] && [ -n "$SLURM_FAKE_CPUS" ]; then
    # task/cgroup+affinity cannot bind 8 fake CPUs to 2 real ones ("only 2 bits in avail_map for 8 tasks")
    echo "ci-slurm: SLURM_FAKE_CPUS is incompatible with SLURM_CGROUP=1; using proctrack/linuxproc" >&2
  elif [ "$SLURM_CGROUP" = 1 ] && [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = tmpfs ] \
     && mkdir /sys/fs/cgroup/freezer/ci-slurm-probe 2>/dev/null && rmdir /sys/fs/cgroup/freezer/ci-slurm-probe; then
    PROCTRACK=proctrack/cgroup TASK=task/cgroup,task/affinity SELP=CR_Core_Memory GATHER=jobacct_gather/cgroup
    MEMLINE="DefMemPerCPU=1000"
    printf 'CgroupPlugin=cgroup/v1\nConstrainCores=yes\nConstrainRAMSpace=yes\nConstrainSwapSpace=no\nConstrainDevices=no\n' > "$SLURM_ETC/cgroup.conf"
  elif [ "$SLURM_CGROUP" = 1 ]; then
    echo "ci-slurm: cgroup v1 not usable here, using proctrack/linuxproc" >&2
  fi
  mkdir -p "$SLURM_ETC"
  cat > "$SLURM_ETC/slurm.conf" <<EOF
# generated by ci-slurm.sh
ClusterName=ci
SlurmctldHost=${H}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
${SLURM_CRED_EXPIRE:+AuthInfo=cred_expire=${SLURM_CRED_EXPIRE}}
CredType=cred/munge
MpiDefault=none
ProctrackType=${PROCTRACK}
TaskPlugin=${TASK}
JobAcctGatherType=${GATHER}
${ACCTLINES}
JobCompType=jobcomp/filetxt
JobCompLoc=${SLURM_LOG}/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=${SELP}
${MEMLINE}
SchedulerType=sched/backfill
# defaults (batch_sched_delay=3s) add ~2 s to every batch job; 0 is fine for a 1-node CI cluster
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
DependencyParameters=kill_invalid_depend
ReturnToService=2
MailProg=/bin/true
StateSaveLocation=${SLURM_STATE}/ctld
SlurmdSpoolDir=${SLURM_STATE}/d
SlurmctldPidFile=${SLURM_RUN}/slurmctld.pid
SlurmdPidFile=${SLURM_RUN}/slurmd.pid
SlurmctldLogFile=${SLURM_LOG}/slurmctld.log
SlurmdLogFile=${SLURM_LOG}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MinJobAge=3600
KillWait=5
InactiveLimit=0
SlurmdTimeout=60
${EXTRA}
${NODELINE}
PartitionName=${SLURM_PARTITION} Nodes=${H} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  local p
  for p in $SLURM_EXTRA_PARTITIONS; do
    echo "PartitionName=${p} Nodes=${H} Default=NO MaxTime=INFINITE State=UP" >> "$SLURM_ETC/slurm.conf"
  done
}

slurm_start() {
  slurm_install || { echo "ci-slurm: install failed" >&2; return 1; }
  slurm_stop >/dev/null 2>&1 || true
  local H; H=$(hostname -s)
  # the node name must resolve, else slurmctld/slurmd refuse to start
  getent hosts "$H" >/dev/null || echo "127.0.0.1 $H" >> /etc/hosts
  rm -rf "$SLURM_STATE"
  mkdir -p "$SLURM_STATE/ctld" "$SLURM_STATE/d" "$SLURM_LOG" "$SLURM_RUN"
  : > "$SLURM_LOG/slurmctld.log"; : > "$SLURM_LOG/slurmd.log"
  # --- munge (no systemd here: start it by hand) ---
  if [ ! -s /etc/munge/munge.key ]; then mungekey -c -k /etc/munge/munge.key; fi
  chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge; chmod 0755 /run/munge
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    rm -f /run/munge/munged.pid /run/munge/munge.socket.2*
    runuser -u munge -- /usr/sbin/munged || { echo "ci-slurm: munged failed" >&2; cat /var/log/munge/munged.log >&2; return 1; }
  fi
  _write_conf
  if [ "$SLURM_ACCOUNTING" = 1 ]; then _start_accounting || return 1; fi
  local t0=$SECONDS
  /usr/sbin/slurmctld || { echo "ci-slurm: slurmctld failed" >&2; tail -n 50 "$SLURM_LOG/slurmctld.log" >&2; return 1; }
  /usr/sbin/slurmd    || { echo "ci-slurm: slurmd failed" >&2; tail -n 50 "$SLURM_LOG/slurmd.log" >&2; return 1; }
  local s=""
  while [ $((SECONDS - t0)) -lt 60 ]; do
    s=$(sinfo -h -N -n "$H" -o '%T' 2>/dev/null | sort -u | head -n 1)
    [ "$s" = "idle" ] && { echo "ci-slurm: node $H idle after $((SECONDS - t0))s"; return 0; }
    sleep 0.5
  done
  echo "ci-slurm: node $H not idle after 60s (state='$s')" >&2
  scontrol show node "$H" >&2; tail -n 30 "$SLURM_LOG/slurmctld.log" "$SLURM_LOG/slurmd.log" >&2
  return 1
}

_start_accounting() {
  local i
  mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
  [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql >/dev/null
  if ! mariadb -e 'select 1' >/dev/null 2>&1; then
    ( setsid /usr/sbin/mariadbd --user=mysql --skip-networking --socket=/run/mysqld/mysqld.sock \
        --pid-file=/run/mysqld/mysqld.pid > "$SLURM_LOG/mariadb.log" 2>&1 < /dev/null & )
    for i in $(seq 1 120); do mariadb -e 'select 1' >/dev/null 2>&1 && break; sleep 0.25; done
  fi
  mariadb -e "DROP DATABASE IF EXISTS slurm_acct_db; CREATE DATABASE slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'ci';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;" \
    || { echo "ci-slurm: mariadb not usable" >&2; tail -n 30 "$SLURM_LOG/mariadb.log" >&2; return 1; }
  cat > "$SLURM_ETC/slurmdbd.conf" <<DBDEOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
LogFile=${SLURM_LOG}/slurmdbd.log
PidFile=${SLURM_RUN}/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=ci
StorageLoc=slurm_acct_db
DBDEOF
  chmod 600 "$SLURM_ETC/slurmdbd.conf"        # slurmdbd refuses a world-readable config
  /usr/sbin/slurmdbd || { echo "ci-slurm: slurmdbd failed" >&2; tail -n 30 "$SLURM_LOG/slurmdbd.log" >&2; return 1; }
  for i in $(seq 1 120); do sacctmgr -n show cluster >/dev/null 2>&1 && break; sleep 0.25; done
  sacctmgr -i add cluster ci >/dev/null || { echo "ci-slurm: sacctmgr add cluster failed" >&2; return 1; }
}

slurm_stop() {
  local c d m i
  c=$(_pid "$SLURM_RUN/slurmctld.pid"); d=$(_pid "$SLURM_RUN/slurmd.pid"); m=$(_pid /run/munge/munged.pid)
  if _alive "$c"; then
    squeue -h -o %A 2>/dev/null | xargs -r scancel 2>/dev/null || true
    # let slurmd kill the job steps (slurmstepd) before shutting down
    for i in $(seq 1 75); do squeue -h -o %A 2>/dev/null | grep -q . || break; sleep 0.2; done
    scontrol shutdown >/dev/null 2>&1 || true   # stops slurmctld and every slurmd
  fi
  for i in $(seq 1 50); do _alive "$c" || _alive "$d" || break; sleep 0.2; done
  for p in "$c" "$d"; do _alive "$p" && kill -TERM "$p" 2>/dev/null; done
  sleep 0.5
  for p in "$c" "$d"; do _alive "$p" && kill -KILL "$p" 2>/dev/null; done
  local b y; b=$(_pid "$SLURM_RUN/slurmdbd.pid"); y=$(_pid /run/mysqld/mysqld.pid)
  for p in "$b" "$y"; do
    if _alive "$p"; then kill -TERM "$p"; for i in $(seq 1 100); do _alive "$p" || break; sleep 0.2; done; fi
  done
  rm -f "$SLURM_RUN/slurmdbd.pid"
  if _alive "$m"; then kill -TERM "$m"; for i in $(seq 1 25); do _alive "$m" || break; sleep 0.2; done; fi
  rm -f "$SLURM_RUN/slurmctld.pid" "$SLURM_RUN/slurmd.pid"
  # empty cgroup dirs left by proctrack/cgroup (harmless, but keep the machine clean)
  find /sys/fs/cgroup/*/slurm_* -depth -type d -exec rmdir {} \; 2>/dev/null || true
  return 0
}

slurm_status() {
  echo "slurmctld pid=$(_pid $SLURM_RUN/slurmctld.pid) slurmd pid=$(_pid $SLURM_RUN/slurmd.pid) munged pid=$(_pid /run/munge/munged.pid) slurmdbd pid=$(_pid $SLURM_RUN/slurmdbd.pid) mariadbd pid=$(_pid /run/mysqld/mysqld.pid)"
  sinfo 2>&1; squeue 2>&1
}

# slurm_wait JOBID [TIMEOUT]: block until the job (or every task of an array) is finished.
# Returns 0 iff all are COMPLETED with ExitCode 0:0; prints one line per job/task.
slurm_wait() {
  local j=$1 to=${2:-3600} t0=$SECONDS out bad=0
  while squeue -h -j "$j" -o %i 2>/dev/null | grep -q .; do
    if [ $((SECONDS - t0)) -ge "$to" ]; then echo "slurm_wait: timeout on $j" >&2; scancel "$j"; return 124; fi
    sleep 1
  done
  out=$(scontrol -o show job "$j" 2>/dev/null) || { grep -E "JobId=${j}[ _]" "$SLURM_LOG/jobcomp.log" >&2; return 2; }
  echo "$out" | awk '{for(i=1;i<=NF;i++) if($i ~ /^(JobId|ArrayTaskId|JobState|ExitCode)=/) printf "%s ", $i; print ""}' >&2
  echo "$out" | grep -qvE 'JobState=COMPLETED .*ExitCode=0:0' && bad=1
  return $bad
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    install) slurm_install ;;
    start)   slurm_start ;;
    stop)    slurm_stop ;;
    status)  slurm_status ;;
    *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
  esac
fi
