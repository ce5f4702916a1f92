#!/usr/bin/env bash
# Bring up a small multi-node Slurm cluster on this one machine (Debian/Ubuntu, as root), for CI.
#
# Each "node" is a network namespace (ip netns, /run/netns/mpd-nK) with its own loopback and an
# eth0 that is one end of a veth pair; the other ends hang on the Linux bridge mpdbr0 in the
# root namespace. Addresses are private and local: the bridge is 10.77.0.1/24, node K is
# 10.77.0.(10+K)/24; there is no default route and no NAT, so node traffic cannot leave these
# namespaces. Each node also has its own UTS namespace (hostname mpd-nK) and mount namespace
# with a private /dev/shm and its own /proc/sys/kernel/random/boot_id, so that MPI libraries
# cannot take two nodes for one machine and pass messages through shared memory (UCX does,
# given one boot_id and one /dev/shm). They are kept by bind mounts under /run/mpidomain-cluster/ns
# and by one holder process per node (sleep, pid in /run/mpidomain-cluster/holder-mpd-nK.pid),
# through which scripts/ci/cluster_exec.sh enters a node from anywhere, other nodes included. The
# rest of the file system (/tmp, the checkout, /etc) and the PID space are shared, as on a
# cluster with a shared file system. The node names are in a marked block of /etc/hosts, which
# every namespace sees.
#
# Slurm: munged (shared with ci_slurm_up.sh's cluster, if it runs), slurmctld in the root
# namespace (reachable at 10.77.0.1:6917) and one slurmd per node namespace (port 6918, running
# as that node's hostname), all from their own config, /etc/slurm-cluster/slurm.conf; the
# one-node cluster of ci_slurm_up.sh (/etc/slurm/slurm.conf, ports 6817/6818) is left alone
# and can run at the same time. Slurm clients need
#     export SLURM_CONF=/etc/slurm-cluster/slurm.conf
# which this script prints at the end. Like ci_slurm_up.sh: SlurmdParameters=config_overrides
# (each node declares MPIDOMAIN_CLUSTER_CPUS CPUs, more than the machine has), MpiDefault=pmi2,
# proctrack/linuxproc, task/none, no cgroups.
#
# MPICH's mpiexec (Hydra) reaches the nodes through the wrapper in place of ssh; run mpiexec on
# node 0 so that the proxies can call back to it by its host name (from the root namespace, add
# -localhost 10.77.0.1: its own host name resolves to loopback inside the nodes):
#     scripts/ci/cluster_exec.sh mpd-n0 mpiexec -launcher ssh -launcher-exec "$PWD/scripts/ci/cluster_exec.sh" \
#         -hosts mpd-n0:2,mpd-n1:2 -n 4 python ...
# srun -N 3 -n 7 gives the block layout 4,2,1; for 3,2(x2) use SLURM_HOSTFILE with -m arbitrary,
# but then Slurm's pmi2 gives MPICH no process mapping and every rank is a node of its own.
#
# Idempotent: running it again checks and repairs; a different node count adds or removes nodes
# (and restarts this cluster's daemons). Waits until every node is idle, then prints the nodes.
# scripts/ci/ci_cluster_down.sh removes all of it.
#
# Usage: ci_cluster_up.sh [NODES]
# Environment: MPIDOMAIN_CLUSTER_NODES (node count, default 2; the argument wins),
#              MPIDOMAIN_CLUSTER_CPUS (CPUs each node declares, default 4),
#              MPIDOMAIN_CLUSTER_RATE (each node's link, tc tbf on its eth0, default 1gbit).
set -euo pipefail

nodes="${1:-${MPIDOMAIN_CLUSTER_NODES:-2}}"
cpus="${MPIDOMAIN_CLUSTER_CPUS:-4}"
rate="${MPIDOMAIN_CLUSTER_RATE:-1gbit}"
case "$nodes" in ''|*[!0-9]*) echo "ci_cluster_up: node count must be a number, got '$nodes'" >&2; exit 2 ;; esac
if [ "$nodes" -lt 1 ] || [ "$nodes" -gt 50 ]; then
  echo "ci_cluster_up: node count must be 1 to 50, got $nodes" >&2; exit 2
fi
if [ "$(id -u)" != 0 ]; then echo "ci_cluster_up: run as root" >&2; exit 1; fi

prefix=mpd-n                       # node K is mpd-nK: network namespace, hostname and Slurm NodeName
bridge=mpdbr0
net=10.77.0
bridge_addr="$net.1"
state=/run/mpidomain-cluster       # pid files, boot ids; ns/: the UTS and mount namespaces of the nodes
confdir=/etc/slurm-cluster
conf="$confdir/slurm.conf"
spool=/var/spool/slurm-cluster
logs=/var/log/slurm-cluster
ctld_port=6917
slurmd_port=6918
ctl_host="$(hostname -s)"
export SLURM_CONF="$conf"

addr_of() { echo "$net.$((10 + $1))"; }

# shellcheck source=scripts/ci/ci_slurm_lib.sh
. "$(dirname "$0")/ci_slurm_lib.sh"
install_slurm ci_cluster_up
for tool in ip nsenter unshare; do
  command -v "$tool" >/dev/null || { echo "ci_cluster_up: needs $tool (iproute2, util-linux)" >&2; exit 1; }
done

# Whether node $1's holder lives in the node's network namespace (a killed one can linger as a
# zombie where init does not reap; a stale pid file can name an unrelated process).
holder_ok() {
  local f="$state/holder-$1.pid"
  [ -f "$f" ] && [ -e "/run/netns/$1" ] &&
    [ "$(readlink "/proc/$(cat "$f")/ns/net" 2>/dev/null)" = "net:[$(stat -L -c %i "/run/netns/$1")]" ]
}
stop_holder() { if holder_ok "$1"; then stop_pidfile "$state/holder-$1.pid"; else rm -f "$state/holder-$1.pid"; fi; }
drop_node_namespaces() {  # unmount and remove the UTS and mount namespace files of a node
  local f
  for f in "$state/ns/uts-$1" "$state/ns/mnt-$1"; do
    if [ -e "$f" ]; then umount "$f" 2>/dev/null || true; rm -f "$f"; fi
  done
}

# -- Network: bridge, one namespace per node ------------------------------------------------
mkdir -p "$state/ns" "$confdir" "$spool" "$logs"
# Namespace files need a private mount to live on (as ip netns makes /run/netns).
if ! mountpoint -q "$state/ns"; then
  mount --bind "$state/ns" "$state/ns"
fi
mount --make-private "$state/ns"
if ! ip link show "$bridge" >/dev/null 2>&1; then
  ip link add "$bridge" type bridge
fi
ip addr replace "$bridge_addr/24" dev "$bridge"
ip link set "$bridge" up

# Nodes left over from a run with more nodes: stop their slurmd and remove them.
for ns in $(ip netns list | awk '{print $1}' | grep "^$prefix[0-9][0-9]*$" || true); do
  k="${ns#"$prefix"}"
  if [ "$k" -ge "$nodes" ]; then
    echo "ci_cluster_up: removing node $ns (now $nodes nodes)"
    stop_pidfile "$state/slurmd-$ns.pid"
    stop_holder "$ns"
    ip link del "mpd-v$k" 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
    drop_node_namespaces "$ns"
  fi
done

for k in $(seq 0 $((nodes - 1))); do
  ns="$prefix$k"
  veth="mpd-v$k"              # root end of the pair; the node end is eth0 in the namespace
  addr="$(addr_of "$k")"
  if [ ! -e "/run/netns/$ns" ]; then
    # A new network namespace: processes left in an old one of this node must go.
    stop_pidfile "$state/slurmd-$ns.pid"; stop_holder "$ns"
    ip netns add "$ns"
  fi
  if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
    ip link del "$veth" 2>/dev/null || true
    ip link add "$veth" type veth peer name eth0 netns "$ns"
  fi
  ip link set "$veth" master "$bridge" up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr replace "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  # A network slower than a node's shared memory, as on a real cluster: over a bare veth, libfabric's tcp
  # moves about 4 GB/s, as fast as a shared-memory pair, and mpidomain check's slowest link is then a toss-up.
  ip netns exec "$ns" tc qdisc replace dev eth0 root tbf rate "$rate" burst 256kb latency 100ms
  # The UTS and mount namespaces: a bind mount of each on a file keeps it alive.
  if ! nsenter --uts="$state/ns/uts-$ns" --mount="$state/ns/mnt-$ns" true 2>/dev/null; then
    stop_pidfile "$state/slurmd-$ns.pid"; stop_holder "$ns"
    drop_node_namespaces "$ns"
    touch "$state/ns/uts-$ns" "$state/ns/mnt-$ns"
    [ -s "$state/bootid-$ns" ] || cat /proc/sys/kernel/random/uuid > "$state/bootid-$ns"
    unshare --uts="$state/ns/uts-$ns" --mount="$state/ns/mnt-$ns" --propagation slave sh -c "
      hostname '$ns' &&
      mount -t tmpfs -o mode=1777,nosuid,nodev mpd-shm-$ns /dev/shm &&
      mount --bind '$state/bootid-$ns' /proc/sys/kernel/random/boot_id"
  fi
  nsenter --uts="$state/ns/uts-$ns" hostname "$ns"
  # The holder: a process in all three namespaces, for nsenter -t from inside other nodes too
  # (their mount namespaces do not see the namespace files mounted after them).
  if ! holder_ok "$ns"; then
    rm -f "$state/holder-$ns.pid"
    setsid nsenter --net="/run/netns/$ns" --uts="$state/ns/uts-$ns" --mount="$state/ns/mnt-$ns" --wd=/ -- \
      bash -c "echo \$\$ > '$state/holder-$ns.pid'; exec -a mpidomain-cluster-holder-$ns sleep infinity" \
      </dev/null >/dev/null 2>&1 &
    for _ in $(seq 50); do holder_ok "$ns" && break; sleep 0.1; done
    holder_ok "$ns" || { echo "ci_cluster_up: the holder of $ns did not start" >&2; exit 1; }
  fi
done

# -- /etc/hosts: the node names, in a marked block ---------------------------------------------
hosts_block="$(
  echo "# begin mpidomain-cluster (scripts/ci/ci_cluster_up.sh)"
  for k in $(seq 0 $((nodes - 1))); do echo "$(addr_of "$k") $prefix$k"; done
  echo "# end mpidomain-cluster"
)"
current="$(sed -n '/^# begin mpidomain-cluster/,/^# end mpidomain-cluster/p' /etc/hosts)"
if [ "$current" != "$hosts_block" ]; then
  # Rewrite in place (not mv): /etc/hosts may be a bind mount.
  others="$(sed '/^# begin mpidomain-cluster/,/^# end mpidomain-cluster/d' /etc/hosts)"
  printf '%s\n%s\n' "$others" "$hosts_block" > /etc/hosts
fi

# -- Slurm -----------------------------------------------------------------------------------------
node_lines="$(for k in $(seq 0 $((nodes - 1))); do
  echo "NodeName=$prefix$k NodeAddr=$(addr_of "$k") NodeHostname=$prefix$k CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN"
done)"
wanted="$(cat <<EOF
# Written by mpidomain's scripts/ci/ci_cluster_up.sh: $nodes nodes in network namespaces, for CI.
# Use with: export SLURM_CONF=$conf
ClusterName=mpidomain-cluster
SlurmctldHost=$ctl_host($bridge_addr)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
$(slurm_common_settings)
StateSaveLocation=$spool/slurmctld
SlurmdSpoolDir=$spool/slurmd-%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd-%n.pid
SlurmctldLogFile=$logs/slurmctld.log
SlurmdLogFile=$logs/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=60
$node_lines
PartitionName=debug Nodes=ALL Default=YES MaxTime=60 State=UP
EOF
)"
changed=0
if [ ! -f "$conf" ] || [ "$(cat "$conf")" != "$wanted" ]; then
  printf '%s\n' "$wanted" > "$conf"
  changed=1
fi

mkdir -p "$spool/slurmctld"
start_munged ci_cluster_up

# A changed node list needs a restart of slurmctld and of every slurmd (scontrol reconfigure
# does not add or remove nodes).
if [ "$changed" = 1 ]; then
  for pidfile in "$state"/slurmd-*.pid; do [ -e "$pidfile" ] && stop_pidfile "$pidfile"; done
  stop_pidfile "$state/slurmctld.pid"
fi
if ! running "$state/slurmctld.pid"; then
  echo "ci_cluster_up: starting slurmctld at $bridge_addr:$ctld_port"
  /usr/sbin/slurmctld -i -f "$conf"
fi
for k in $(seq 0 $((nodes - 1))); do
  ns="$prefix$k"
  if ! running "$state/slurmd-$ns.pid"; then
    echo "ci_cluster_up: starting slurmd on $ns"
    mkdir -p "$spool/slurmd-$ns"
    nsenter --net="/run/netns/$ns" --uts="$state/ns/uts-$ns" --mount="$state/ns/mnt-$ns" --wd=/ -- \
      /usr/sbin/slurmd -f "$conf" -N "$ns"
  fi
done

# -- Wait for every node, resuming those an earlier run left down or drained ------------------------
all_idle=0
for _ in $(seq 90); do
  states="$(sinfo -h -N -o '%N %T' 2>/dev/null || true)"
  ok=0
  for k in $(seq 0 $((nodes - 1))); do
    st="$(printf '%s\n' "$states" | awk -v n="$prefix$k" '$1 == n {print $2; exit}')"
    case "$st" in
      idle|mixed|allocated|completing) ok=$((ok + 1)) ;;
      down*|drain*|fail*) scontrol update NodeName="$prefix$k" State=RESUME 2>/dev/null || true ;;
    esac
  done
  if [ "$ok" = "$nodes" ]; then all_idle=1; break; fi
  sleep 1
done
if [ "$all_idle" != 1 ]; then
  echo "ci_cluster_up: not every node became idle:" >&2
  printf '%s\n' "$states" >&2
  tail -n 20 "$logs"/*.log >&2 || true
  exit 1
fi

# -- Wait until every node reaches every other node's slurmd (a link just brought back up can
# drop packets for a few seconds, and a launcher connecting then gets "No route to host") ----------
reached=0
for _ in $(seq 60); do
  reached=1
  for i in $(seq 0 $((nodes - 1))); do
    for j in $(seq 0 $((nodes - 1))); do
      ip netns exec "$prefix$i" timeout 2 bash -c "</dev/tcp/$(addr_of "$j")/$slurmd_port" 2>/dev/null \
        || { reached=0; break 2; }
    done
  done
  [ "$reached" = 1 ] && break
  sleep 1
done
if [ "$reached" != 1 ]; then
  echo "ci_cluster_up: node $prefix$i does not reach $prefix$j ($(addr_of "$j"):$slurmd_port)" >&2
  exit 1
fi

echo "ci_cluster_up: $nodes nodes up, $cpus CPUs each (slurmctld at $bridge_addr:$ctld_port, bridge $bridge):"
for k in $(seq 0 $((nodes - 1))); do
  st="$(printf '%s\n' "$states" | awk -v n="$prefix$k" '$1 == n {print $2; exit}')"
  echo "  $prefix$k $(addr_of "$k") $st"
done
echo "export SLURM_CONF=$conf"
