#!/usr/bin/env bash
# Bring up a one-node Slurm cluster on this machine (Debian/Ubuntu, as root), for CI.
#
# Installs slurm-wlm and munge if missing, writes /etc/slurm/slurm.conf for this host
# (SlurmdParameters=config_overrides lets the node declare more CPUs than the machine has,
# so `srun -n 4` fits on a 2-core runner; MpiDefault=pmi2; no cgroups: process tracking by
# /proc, no task plugin), starts munged, slurmctld and slurmd, and waits until the node is
# idle. Idempotent: on a machine where the cluster is already up it only checks the node.
#
# Environment: MPIDOMAIN_SLURM_CPUS (CPUs the node declares, default 8).
set -euo pipefail

cpus="${MPIDOMAIN_SLURM_CPUS:-8}"
host="$(hostname -s)"
conf=/etc/slurm/slurm.conf

# shellcheck source=scripts/ci/ci_slurm_lib.sh
. "$(dirname "$0")/ci_slurm_lib.sh"
install_slurm ci_slurm_up

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
wanted="$(cat <<EOF
# Written by mpidomain's scripts/ci/ci_slurm_up.sh: one node, for CI.
ClusterName=mpidomain-ci
SlurmctldHost=$host
$(slurm_common_settings)
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=60
NodeName=$host CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=60 State=UP
EOF
)"
changed=0
if [ ! -f "$conf" ] || [ "$(cat "$conf")" != "$wanted" ]; then
  printf '%s\n' "$wanted" > "$conf"
  changed=1
fi

start_munged ci_slurm_up
if ! running /run/slurmctld.pid; then
  echo "ci_slurm_up: starting slurmctld"
  /usr/sbin/slurmctld -i
elif [ "$changed" = 1 ]; then
  scontrol reconfigure
fi
if ! running /run/slurmd.pid; then
  echo "ci_slurm_up: starting slurmd"
  /usr/sbin/slurmd
fi

# Wait for the node to register, and resume it if an earlier run left it down or drained.
for _ in $(seq 60); do
  state="$(sinfo -h -n "$host" -o %T 2>/dev/null || true)"
  case "$state" in
    idle|mixed|allocated) break ;;
    down*|drain*|fail*) scontrol update NodeName="$host" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 1
done
case "$state" in
  idle|mixed|allocated) echo "ci_slurm_up: node $host is $state with $cpus CPUs" ;;
  *)
    echo "ci_slurm_up: node $host did not become idle (state '${state}')" >&2
    tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
    exit 1 ;;
esac
