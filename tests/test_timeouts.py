"""Every wait inside mpidomain gives up after MPIDOMAIN_TIMEOUT: one fresh 4-rank job per wait site.

In each job one rank skips a call, or is stuck in something else, and the others wait for it in
the site under test. They must raise a RuntimeError naming the call, the group and what they still
await, and the abort-on-error hook must then end the job, within seconds of MPIDOMAIN_TIMEOUT=2.
And where ranks use two managers in different orders, they raise at once, naming both.

The jobs run only when the suite's world has one rank (serial, ``mpiexec -n 1``): CI's other
runs would start the same jobs again and learn nothing more. They run side by side, as their
ranks mostly sleep.
"""

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mpitest import run_mpi

SCRIPT = """
import sys, time
import numpy as np
from mpi4py import MPI
import mpidomain
from mpidomain import devices, sharding

def stall(*_, **__):  # a rank stuck in something else
    time.sleep(300)

site, rank = sys.argv[1], MPI.COMM_WORLD.rank
tiles = site == "exchange-tiles"
# Built directly, the manager installs the abort-on-error hook as initialize_domain_parallel does.
manager = mpidomain.DomainParallelManager(4, (2, 2) if tiles else 4, (-2, -1) if tiles else -2)
x = np.ones((4, 6))
if site.startswith("exchange"):  # the issue's case: rank 3 skips one exchange, then all exchange once more
    plan = mpidomain.HaloPlan(x, 1, manager=manager)
    padded = plan.pad(x)
    for _ in range(1 if rank == 3 else 2):
        plan.exchange(padded)
elif site == "adjoint":
    plan = mpidomain.HaloPlan(x, 1, manager=manager)
    padded = plan.pad(x)
    for _ in range(1 if rank == 3 else 2):
        plan.adjoint(padded)
elif site == "scatter-receive":  # the root is stuck before sending
    if rank == 0:
        sharding._scatter_send = stall
    mpidomain.scatter_tensor(np.ones((16, 6)) if rank == 0 else None, manager=manager)
elif site == "scatter-send":  # rank 3 is stuck before receiving its rows (too large to be sent eagerly)
    if rank == 3:
        devices.empty = stall
    mpidomain.scatter_tensor(np.ones((4 * 1024, 1024)) if rank == 0 else None, manager=manager)
elif site == "gather":  # rank 3 is stuck before the all-to-all
    if rank == 3:
        sharding._alltoallw = stall
    mpidomain.gather_tensor(x, manager=manager)
elif site == "manager":  # rank 3 skips building the second manager
    if rank != 3:
        mpidomain.DomainParallelManager(4, 2)
elif site == "order":  # two managers used in different orders: no wait, an error at once on every rank
    other = mpidomain.DomainParallelManager(4, 4)
    try:
        for m in (manager, other) if rank % 2 == 0 else (other, manager):
            mpidomain.halo_exchange(x, 1, manager=m)
    except RuntimeError as error:
        print(f"RANK {rank}: {error}", flush=True)
    MPI.COMM_WORLD.Barrier()
    sys.exit(0)
print(f"rank {rank} went on", flush=True)
time.sleep(300)  # only the abort ends the job
"""

GROUP = r"domain group 0 \(ranks 0-3\)"
WAITED = r"waited 2 s for the other ranks \(MPIDOMAIN_TIMEOUT=2\)"
# site: (a rank that times out, the rest of its message after the call)
CASES = {
    "exchange-slabs": (2, rf"halo exchange: rank 2 of {GROUP} {WAITED}, still awaiting the message from domain rank 3 "),
    "exchange-tiles": (0, rf"halo exchange: rank 0 of {GROUP} {WAITED}, still awaiting the message from domain rank 3 "),
    "adjoint": (2, rf"HaloPlan.adjoint: rank 2 of {GROUP} {WAITED}, still awaiting the message from domain rank 3 "),
    "scatter-receive": (1, rf"scatter_tensor: rank 1 of {GROUP} {WAITED}, still awaiting its rows from the root "
                           r"\(rank 0 of the group\);"),
    "scatter-send": (0, rf"scatter_tensor: rank 0 of {GROUP} {WAITED}, still awaiting rank 3 of the group to take "
                        r"its rows;"),
    "gather": (0, rf"gather_tensor: rank 0 of {GROUP} {WAITED}, still awaiting the shards of every other rank"),
    "manager": (0, rf"DomainParallelManager: rank 0 of MPI_COMM_WORLD {WAITED}; a rank skipped this call"),
}


ORDER = (r"halo_exchange: the ranks of domain group 0 \(ranks 0-3\) use different managers in the same mpidomain "
         r"call \(manager #1 DomainParallelManager\(world_size=4, domain_parallel_size=4, shard_dim=-2\) on ranks 0,2, "
         r"manager #2 DomainParallelManager\(world_size=4, domain_parallel_size=4, shard_dim=-2\) on ranks 1,3\); "
         r"every rank must use its managers in the same order")


def _run(script, site):
    started = time.monotonic()
    # The order case waits for nothing: the default timeout (600 s) must not matter.
    env = {} if site == "order" else {"MPIDOMAIN_TIMEOUT": "2"}
    result = run_mpi(4, [str(script), site], timeout=90, env=env)
    return result, time.monotonic() - started


@pytest.mark.mpi_job
def test_every_wait_site_times_out_and_ends_the_job(world, tmp_path_factory):
    # And two managers used in different orders raise at once, on every rank, naming both.
    if world.size != 1:
        pytest.skip("fresh-job timeout tests run only when the suite's world has one rank")
    script = tmp_path_factory.mktemp("timeouts") / "stuck.py"
    script.write_text(SCRIPT)
    sites = [*CASES, "order"]
    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(sites, pool.map(lambda site: _run(script, site), sites)))
    result, elapsed = results["order"]
    output = f"order: {elapsed:.1f} s, rc {result.returncode}\n{result.stdout}\n{result.stderr}"
    failures = [] if result.returncode == 0 and elapsed < 30 and all(
        re.search(rf"RANK {rank}: {ORDER}", result.stdout) for rank in range(4)) else [output]
    for site, (rank, message) in CASES.items():
        result, elapsed = results[site]
        output = f"{site}: {elapsed:.1f} s, rc {result.returncode}\n{result.stdout}\n{result.stderr}"
        if not (result.returncode != 0 and elapsed < 60 and "aborting all ranks" in result.stderr
                and re.search(rf"\[rank {rank}\] RuntimeError: {message}", result.stderr)):
            failures.append(output)
    assert not failures, "\n\n".join(failures)
