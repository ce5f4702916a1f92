# Shell functions shared by scripts/ci/ci_slurm_up.sh, ci_cluster_up.sh and ci_cluster_down.sh
# (sourced, not run): installing Slurm and munge, starting munged, the slurm.conf settings both
# CI clusters share, and stopping a daemon by its pid file.

# Install Debian's slurm-wlm and munge where slurmctld, slurmd or munged is missing. $1: who says so.
install_slurm() {
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    echo "$1: installing slurm-wlm and munge"
    DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null
  fi
}

# Whether the process of pid file $1 runs.
running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Start munged unless it runs (one munged serves both clusters). $1: who says so.
start_munged() {
  mkdir -p /run/munge
  chown munge:munge /run/munge
  if ! running /run/munge/munged.pid; then
    echo "$1: starting munged"
    runuser -u munge -- /usr/sbin/munged
  fi
}

# The slurm.conf lines both CI clusters share: munge, pmi2, no cgroups (process tracking by
# /proc, no task plugin), nodes that may declare more CPUs than the machine has
# (config_overrides), short timeouts.
slurm_common_settings() {
  cat <<'SETTINGS'
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=pmi2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SETTINGS
}

# Stop the process of pid file $1 and wait (up to 10 s) until it is gone; remove the file.
stop_pidfile() {
  local pid
  [ -f "$1" ] || return 0
  pid="$(cat "$1")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}
