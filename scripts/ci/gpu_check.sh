#!/usr/bin/env bash
# GPU checks, on a machine with a CUDA device, from the repository root: bash scripts/ci/gpu_check.sh
#
# 1. The tests that move CUDA arrays (halo exchange of Torch and CuPy device arrays against the
#    NumPy reference, staged and CUDA-aware; sharding round trips; reductions; gradient all-reduces),
#    which skip on machines without a device, at 1, 2 and 4 ranks (the ranks share the devices).
# 2. scripts/bench/bench_halo_gpu.py at 2 and 4 ranks.
# 3. Where CREDIT is installed (pip install --no-deps miles-credit): its CrossFormer at 1 degree,
#    domain-parallel on the GPU against one process, with each rank's peak CUDA memory
#    (scripts/credit/credit_parity.py --device cuda) at 1, 2 and 4 ranks.
# Each step's exit status is printed; the script fails if any step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0
step() {
  echo "== $*"
  "$@"
  local rc=$?
  echo "== exit $rc: $*"
  [ "$rc" = 0 ] || failed=1
}
python - <<'EOF'
import torch, mpi4py
from mpi4py import MPI
import mpidomain
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "|", torch.cuda.get_device_name(), "| mpi4py",
      mpi4py.__version__, "|", MPI.Get_library_version().splitlines()[0])
print("mpidomain:", mpidomain.devices.cuda_aware_decision())
try:
    import cupy
    print("cupy", cupy.__version__)
except ImportError:
    print("cupy: not installed")
EOF
tests="tests/test_halo.py tests/test_sharding.py tests/test_reduce.py tests/test_gradients.py"
for n in 1 2 4; do
  # shellcheck disable=SC2086
  step timeout 300 mpiexec -n "$n" python -m pytest -q -rs -p no:cacheprovider $tests -k "gpu or device or cuda"
done
for n in 2 4; do
  step timeout 300 mpiexec -n "$n" python scripts/bench/bench_halo_gpu.py
done
if python -c "import credit" 2>/dev/null; then
  for n in 1 2 4; do
    step timeout 300 mpiexec -n "$n" python scripts/credit/credit_parity.py --configs 1deg --skip-credit --device cuda
  done
else
  echo "== CREDIT (miles-credit) is not installed: its CrossFormer on the GPU is left out"
fi
exit "$failed"
