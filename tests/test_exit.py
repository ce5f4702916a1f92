"""A quiet exit: a program that leaves plans, managers and a converted model alive prints nothing at exit.

Fresh jobs (``mpiexec -n 2`` and plain ``python``), ending normally or after an
uncaught exception, in Python's development mode (which shows the
ResourceWarning of a manager dropped unclosed). At exit Python sets module
globals to None before the objects they reach are finalized, and mpi4py
finalises MPI after that.
"""

import pytest

from mpitest import run_mpi, run_python, share

pytestmark = pytest.mark.mpi_job

PROGRAM = """
import sys

import numpy as np
from mpi4py import MPI

import mpidomain
import torch  # after mpidomain: its modules are torn down first at exit
from mpidomain.nn import convert_to_domain_parallel

world = MPI.COMM_WORLD
manager = mpidomain.initialize_domain_parallel(world.size, world.size)
other = mpidomain.DomainParallelManager(world.size, world.size)  # never closed
x = np.full((2, 8, 6), float(world.rank))
padded = mpidomain.halo_exchange(x, 1)  # a plan in the current manager's cache
plans = [mpidomain.HaloPlan(x, 1), mpidomain.HaloPlan(x, 1, manager=other)]
model = convert_to_domain_parallel(torch.nn.Sequential(torch.nn.Conv2d(2, 2, 3, padding=1)), manager=manager)
loss = model(torch.ones(1, 2, 8, 6, requires_grad=True)).sum()  # kept: its graph reaches the plans
loss.backward()
print(f"rank {world.rank}: left alive", flush=True)
if sys.argv[1:] == ["raise"]:
    raise RuntimeError("ends on purpose")
"""


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("ending", ["normal", "raise"])
def test_nothing_printed_at_exit(world, tmp_path_factory, ranks, ending):
    pytest.importorskip("torch")
    result = None
    if world.rank == 0:
        script = tmp_path_factory.mktemp("exit") / "leaves_alive.py"
        script.write_text(PROGRAM)
        args = ["-X", "dev", str(script), ending]
        env = {"MPIDOMAIN_ABORT_ON_ERROR": "0"}  # every rank ends through the interpreter's exit, not Abort
        done = run_python(args, timeout=120, env=env) if ranks == 1 else run_mpi(ranks, args, timeout=120, env=env)
        result = (done.returncode, done.stdout, done.stderr)
    status, stdout, stderr = share(world, result)
    assert stdout.count("left alive") == ranks, stdout + stderr
    assert "Exception ignored" not in stderr, stderr
    assert "Warning" not in stderr, stderr
    if ending == "normal":
        assert status == 0 and stderr == "", stderr
    else:
        assert status != 0
        assert stderr.count("Traceback") == ranks, stderr
        assert stderr.count("RuntimeError: ends on purpose") == ranks, stderr
