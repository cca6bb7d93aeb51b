#!/usr/bin/env bash
# A single-node Slurm on this host for CI's Slurm tests: Debian's slurm-wlm and munge, slurmctld and
# slurmd as root, CPU-only, every daemon on loopback. Idempotent: does nothing when Slurm already answers.
set -euo pipefail
if command -v scontrol >/dev/null && scontrol ping 2>/dev/null | grep -q UP && sinfo -h -o %t 2>/dev/null | grep -qxE "idle|mix|alloc"; then
  echo "slurm_up: Slurm already running"; exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
HOST=$(hostname -s)
CPUS=${SLURM_UP_CPUS:-8}  # more CPUs than the host has (config_overrides): CPU jobs oversubscribe on purpose
# ports of this project's range, so a Slurm already on the default ports (6817/6818) is not disturbed
CTLD_PORT=${SLURM_UP_CTLD_PORT:-32817}
SLURMD_PORT=${SLURM_UP_SLURMD_PORT:-32818}

mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key; chmod 0755 /run/munge
if ! pgrep -x -r S,R,D munged >/dev/null; then
  runuser -u munge -- /usr/sbin/munged
fi

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=ci
SlurmctldHost=${HOST}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmdPort=${SLURMD_PORT}
SrunPortRange=32830-32899
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=4096 State=UNKNOWN
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
rm -f /etc/slurm/cgroup.conf  # cgroup plugin autodetected (22.05 has no "disabled")

pgrep -x -r S,R,D slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x -r S,R,D slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 60); do
  if sinfo -h -o %t 2>/dev/null | grep -qxE "idle|mix|alloc"; then
    echo "slurm_up: Slurm running (node ${HOST}, ${CPUS} CPUs, partition ci)"; exit 0
  fi
  scontrol update nodename="${HOST}" state=resume >/dev/null 2>&1 || true
  sleep 1
done
echo "slurm_up: Slurm did not come up; logs:" >&2
tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
