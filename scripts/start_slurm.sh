#!/usr/bin/env bash
# scripts/start_slurm.sh
# Starts a one-node SLURM cluster on this machine for hydra/launcher=submitit_slurm and its tests,
# unless one already answers with an idle node:
#   munged; slurmctld; slurmd -N localhost   (SlurmctldHost=localhost, NodeName=localhost NodeAddr=127.0.0.1)
# The node offers all of this machine's CPUs and most of its memory (no GPUs). Jobs run as the
# user who submits them, with that user's environment, so they see the same .venv.
# Installs Debian's slurm-wlm and munge when missing. Writes /etc/slurm/slurm.conf only when there
# is none or it is one this script wrote (a real cluster's configuration is never touched).
# Idempotent; needs root. Logs: /var/log/slurm/{slurmctld,slurmd}.log and $TBEXP_SLURM_LOG.
set -euo pipefail
CONF=/etc/slurm/slurm.conf
MARK="# written by tbexp scripts/start_slurm.sh"
LOG=${TBEXP_SLURM_LOG:-/var/log/tbexp-slurm.log}

idle() { timeout 10 sinfo -h -n localhost -o %t 2>/dev/null | grep -Eq '^(idle|mix|alloc)'; }
node_answers() { command -v sinfo >/dev/null && idle; }

source "$(dirname "${BASH_SOURCE[0]}")/start_once.sh"
start_once slurm "the SLURM node" node_answers

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  echo "installing slurm-wlm and munge..." >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

# munge: authenticates slurmctld, slurmd and the clients to each other.
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=128 count=1 status=none
fi
chown -R munge:munge /etc/munge && chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/lib/munge /var/log/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge
if ! timeout 5 munge -n </dev/null >/dev/null 2>&1; then
  echo "starting munged" >&2
  runuser -u munge -- munged >>"$LOG" 2>&1 9>&-
  for _ in $(seq 20); do timeout 5 munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.25; done
fi

if [ ! -f "$CONF" ] || head -1 "$CONF" | grep -qF "$MARK"; then
  cpus=$(nproc)
  mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)  # leave a fifth to the system
  mkdir -p /etc/slurm
  cat >"$CONF" <<EOF
$MARK
ClusterName=tbexp
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
# linuxproc and task/none need no cgroup set-up, which containers and VMs often do not allow.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
# Batch jobs may be requeued (preemption, node failure, scontrol requeue). SLURM holds a requeued job
# back for two minutes (BeginTime); 'scontrol update jobid=J StartTime=now' releases it sooner.
JobRequeue=1
# Seconds between SIGTERM and SIGKILL (SLURM's default): a training loop saves a checkpoint in between.
KillWait=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
fi
mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm

if ! timeout 10 scontrol ping 2>/dev/null | grep -q UP; then
  echo "starting slurmctld (log: /var/log/slurm/slurmctld.log)" >&2
  slurmctld >>"$LOG" 2>&1 9>&-  # 9>&-: the lock is not the daemon's to keep
fi
if ! pgrep -x slurmd >/dev/null; then
  echo "starting slurmd -N localhost (log: /var/log/slurm/slurmd.log)" >&2
  slurmd -N localhost >>"$LOG" 2>&1 9>&-
fi
for _ in $(seq 60); do
  if idle; then
    exit 0
  fi
  # A node that slurmctld remembers as down (an earlier slurmd was killed) is put back to work.
  if timeout 10 sinfo -h -n localhost -o %t 2>/dev/null | grep -Eq '^(down|drain|unk)'; then
    scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true
  fi
  sleep 0.5
done
echo "start_slurm.sh: the node did not become idle:" >&2
sinfo -N -l >&2 || true
tail -10 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
