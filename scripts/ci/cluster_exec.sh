#!/usr/bin/env bash
# Run a command on a node of the namespace cluster of scripts/ci/ci_cluster_up.sh: in the node's
# network namespace, UTS namespace (its hostname) and mount namespace (its /dev/shm), entered
# through the node's holder process (so it works from the root namespace and from inside any
# node alike), as root, with the caller's environment and working directory (the nodes share the
# rest of the file system).
#
# Usage: cluster_exec.sh NODE COMMAND [ARG...]          runs the words as they are (argv)
#        cluster_exec.sh -x [SSH-OPTION...] NODE WORD...  as ssh: joins the words, runs them by sh -c
#
# The second form stands in for ssh, so that MPICH's Hydra can start its proxies on the nodes
# (Hydra's ssh launcher passes -x and shell-quoted words, such as "/path/hydra_pmi_proxy"):
#     mpiexec -launcher ssh -launcher-exec /path/to/scripts/ci/cluster_exec.sh -hosts mpd-n0:2,mpd-n1:2 ...
# Any option before NODE selects it; the options themselves are ignored. A single COMMAND word
# with spaces is also run by sh -c. NODE is a node name (mpd-n0), user@name or an address
# (10.77.0.10).
set -euo pipefail

state=/run/mpidomain-cluster
ssh_style=0
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F|-E|-J) ssh_style=1; shift 2 ;;   # ssh options with an argument
    -*) ssh_style=1; shift ;;
    *) break ;;
  esac
done
if [ $# -lt 2 ]; then
  echo "usage: cluster_exec.sh NODE COMMAND [ARG...]" >&2
  exit 2
fi
node="$1"
shift
case "$node" in
  *@*) node="${node#*@}" ;;      # user@host: the user is ignored (everything runs as root)
esac
if [ ! -f "$state/holder-$node.pid" ]; then
  # An address, or a name /etc/hosts gives an address of a node: find that node.
  addr="$(getent ahostsv4 "$node" 2>/dev/null | awk 'NR == 1 {print $1}')"
  name="$(awk -v a="${addr:-$node}" '$1 == a && $2 ~ /^mpd-n[0-9]+$/ {print $2; exit}' /etc/hosts)"
  if [ -n "$name" ] && [ -f "$state/holder-$name.pid" ]; then
    node="$name"
  else
    echo "cluster_exec.sh: no node '$node' (is scripts/ci/ci_cluster_up.sh up? nodes:" \
      "$(cd "$state" 2>/dev/null && ls holder-*.pid 2>/dev/null | sed 's/^holder-//; s/\.pid$//' | tr '\n' ' '))" >&2
    exit 255
  fi
fi
if [ "$ssh_style" = 1 ] || { [ $# -eq 1 ] && [[ "$1" == *[[:space:]]* ]]; }; then
  set -- /bin/sh -c "$*"
fi
holder="$(cat "$state/holder-$node.pid")"
if ! readlink "/proc/$holder/ns/net" >/dev/null 2>&1; then
  echo "cluster_exec.sh: the holder process of $node ($holder) is gone; run scripts/ci/ci_cluster_up.sh again" >&2
  exit 255
fi
exec nsenter --target="$holder" --net --uts --mount --wd="$PWD" -- "$@"
