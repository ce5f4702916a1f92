#!/usr/bin/env bash
# Tear down the namespace cluster of scripts/ci/ci_cluster_up.sh: its jobs and processes, its
# slurmd and slurmctld, the node namespaces (network, UTS, mount), their veth pairs, the bridge
# mpdbr0, the holder processes, the /etc/hosts block and its run-time state (the config in /etc/slurm-cluster, logs and
# spool stay, for post-mortems). Idempotent. Leaves munged and the one-node cluster of
# scripts/ci/ci_slurm_up.sh (/etc/slurm/slurm.conf) alone.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then echo "ci_cluster_down: run as root" >&2; exit 1; fi
prefix=mpd-n
bridge=mpdbr0
state=/run/mpidomain-cluster
conf=/etc/slurm-cluster/slurm.conf

# shellcheck source=scripts/ci/ci_slurm_lib.sh
. "$(dirname "$0")/ci_slurm_lib.sh"

# Cancel this cluster's jobs while slurmctld still answers (best effort, short).
if [ -f "$conf" ] && [ -f "$state/slurmctld.pid" ] && kill -0 "$(cat "$state/slurmctld.pid")" 2>/dev/null; then
  SLURM_CONF="$conf" timeout 10 scancel --full --quiet --user=root 2>/dev/null || true
fi

namespaces="$(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$prefix[0-9][0-9]*$" || true)"
for ns in $namespaces; do
  stop_pidfile "$state/slurmd-$ns.pid"
done
stop_pidfile "$state/slurmctld.pid"

for ns in $namespaces; do
  # Whatever still runs in the node (job steps, MPI proxies and ranks): these processes belong
  # to this cluster alone, since nothing else enters its namespaces.
  pids="$(ip netns pids "$ns" 2>/dev/null || true)"
  if [ -n "$pids" ]; then
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    sleep 1
    pids="$(ip netns pids "$ns" 2>/dev/null || true)"
    # shellcheck disable=SC2086
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
  fi
  k="${ns#"$prefix"}"
  ip link del "mpd-v$k" 2>/dev/null || true
  ip netns del "$ns"
  echo "ci_cluster_down: removed node $ns"
done
# veths whose namespace went some other way
for veth in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep '^mpd-v[0-9][0-9]*$' || true); do
  ip link del "$veth" 2>/dev/null || true
done
if ip link show "$bridge" >/dev/null 2>&1; then
  ip link del "$bridge"
  echo "ci_cluster_down: removed bridge $bridge"
fi
if [ -d "$state/ns" ]; then
  for f in "$state"/ns/*; do
    [ -e "$f" ] || continue
    umount "$f" 2>/dev/null || true
    rm -f "$f"
  done
  ! mountpoint -q "$state/ns" || umount "$state/ns"
fi
rm -rf "$state" 2>/dev/null || echo "ci_cluster_down: could not remove $state" >&2
if grep -q '^# begin mpidomain-cluster' /etc/hosts; then
  others="$(sed '/^# begin mpidomain-cluster/,/^# end mpidomain-cluster/d' /etc/hosts)"
  printf '%s\n' "$others" > /etc/hosts
fi
echo "ci_cluster_down: the namespace cluster is down"
