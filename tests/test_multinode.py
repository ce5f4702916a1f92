"""Several nodes: the node layout against the launcher's, halos and check across nodes, the torch rendezvous, faults.

The in-job tests run when the suite's own job spans several hosts (CI: ``srun -N 2``,
``srun -N 3 -m arbitrary`` and MPICH's ``mpiexec`` across the network-namespace nodes of
``scripts/ci/ci_cluster_up.sh``) and skip, alike on every rank, on one host. The fault tests
start jobs of their own on that cluster, from one process in the root namespace
(``MPIDOMAIN_TEST_CLUSTER=1``).
"""

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpidomain
from mpidomain import DomainParallelManager
from mpidomain.__main__ import main
from mpitest import REPO, launcher_env
from reference import padded_rows

WORLD = MPI.COMM_WORLD
HOSTS = WORLD.allgather(socket.gethostname())
several_hosts = pytest.mark.skipif(len(set(HOSTS)) == 1, reason="needs a job on several hosts (see .ci/run)")
CLUSTER = os.environ.get("MPIDOMAIN_TEST_CLUSTER") == "1"
needs_cluster = pytest.mark.skipif(
    not CLUSTER or WORLD.size > 1,
    reason="needs the namespace cluster of scripts/ci/ci_cluster_up.sh (MPIDOMAIN_TEST_CLUSTER=1), from one process",
)
CLUSTER_EXEC = os.path.join(REPO, "scripts", "ci", "cluster_exec.sh")


def _network_bytes():
    """Bytes received plus sent on this network namespace's interfaces other than loopback."""
    total = 0
    with open("/proc/net/dev") as table:
        for line in table.readlines()[2:]:
            name, counters = line.split(":", 1)
            if name.strip() != "lo":
                fields = counters.split()
                total += int(fields[0]) + int(fields[8])
    return total


# -- In the job: the node layout -------------------------------------------------------

@several_hosts
def test_node_layout_equals_the_launchers_view():
    with DomainParallelManager(WORLD.size, 1) as m:
        assert m.num_nodes == len(set(HOSTS))
        # Ranks on one node share a host name, and node indices follow each node's lowest rank.
        firsts = sorted({host: HOSTS.index(host) for host in HOSTS}.values())
        assert m.node_index == firsts.index(HOSTS.index(HOSTS[m.rank]))
        on_my_host = [r for r, host in enumerate(HOSTS) if host == HOSTS[m.rank]]
        assert (m.local_rank, m.local_size) == (on_my_host.index(m.rank), len(on_my_host))
        launcher = m.launcher
        if "SLURM_NODEID" in os.environ:  # srun: Slurm's own view
            assert launcher.name == "Slurm srun"
            assert m.node_index == int(os.environ["SLURM_NODEID"])
            assert m.local_rank == int(os.environ["SLURM_LOCALID"]) == launcher.local_rank
            assert m.local_size == launcher.local_size  # parsed from SLURM_STEP_TASKS_PER_NODE, e.g. 3,2(x2)
            assert m.num_nodes == int(os.environ["SLURM_STEP_NUM_NODES"])
        else:  # MPICH's Hydra
            assert launcher.name.startswith("MPICH Hydra")
            assert (m.local_rank, m.local_size) == (launcher.local_rank, launcher.local_size)


@several_hosts
def test_domain_groups_across_nodes_exchange_halos_and_shards_exactly():
    d = WORLD.size
    with DomainParallelManager(WORLD.size, d) as m:
        assert len({HOSTS[r] for r in m.domain_group_ranks()}) > 1  # the group spans nodes
        full = np.arange(3 * (4 * d + 1) * 40, dtype=np.float64).reshape(3, 4 * d + 1, 40)
        counts, offsets = mpidomain.balanced_split(full.shape[-2], d)
        start, count = offsets[m.domain_rank], counts[m.domain_rank]
        local = np.ascontiguousarray(full[:, start:start + count])
        for periodic in (False, True):
            padded = mpidomain.halo_exchange(local, 2, periodic=periodic, manager=m)
            expected = padded_rows(full, -2, 2, periodic, start, count)
            assert np.array_equal(padded, expected), periodic
        assert np.array_equal(mpidomain.gather_tensor(local, manager=m), full)
        assert np.array_equal(mpidomain.shard_tensor(full, manager=m, allow_uneven=True), local)


@several_hosts
def test_traffic_crosses_the_node_boundary():
    # One process per node reads its network namespace's counters around a 16 MiB all-reduce.
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=WORLD.rank)
    first_on_host = HOSTS.index(HOSTS[WORLD.rank]) == WORLD.rank
    values = np.ones(4 * 2**20, dtype=np.float32)
    WORLD.Barrier()
    before = _network_bytes()
    WORLD.Allreduce(MPI.IN_PLACE, values, op=MPI.SUM)
    WORLD.Barrier()
    crossed = _network_bytes() - before
    node.Free()
    assert values[0] == WORLD.size
    if first_on_host:
        assert crossed >= values.nbytes // 2, f"{crossed} bytes crossed {HOSTS[WORLD.rank]}'s interfaces"


@several_hosts
def test_check_names_an_inter_node_pair_as_the_slowest_link(capsys, fresh_manager):
    status = main(["check", "--repeats", "10"])
    out = capsys.readouterr().out
    assert status == 0
    if WORLD.rank == 0:
        verdict = out.strip().splitlines()[-1]
        assert verdict.startswith("check passed:") and f"on {len(set(HOSTS))} node(s)" in verdict, verdict
        slowest = re.search(r"slowest link: rank (\d+) <-> rank (\d+) \((\S+) <-> (\S+)\)", out)
        assert slowest and slowest.group(3) != slowest.group(4), out


@several_hosts
def test_torch_rendezvous_on_an_address_the_other_nodes_reach(torch_world):
    import ipaddress

    import torch

    address = os.environ["MASTER_ADDR"]
    assert WORLD.allgather(address) == [address] * WORLD.size
    assert not ipaddress.ip_address(address).is_loopback, address
    total = torch.ones(1)
    torch_world.all_reduce(total)
    assert total.item() == WORLD.size
    with DomainParallelManager(WORLD.size, WORLD.size, torch_bridge=True) as m:
        total = torch.ones(1)
        torch_world.all_reduce(total, group=m.domain_group)
        assert total.item() == WORLD.size


# -- Faults: jobs of their own on the namespace cluster ---------------------------------

LOOP = r"""
import os, socket, sys, numpy as np, mpidomain
from mpi4py import MPI
world = MPI.COMM_WORLD
manager = mpidomain.initialize_domain_parallel(world.size, world.size)
x = np.ones((8, 4096))
mpidomain.halo_exchange(x, 1, manager=manager)
print(f"ready {world.rank} {os.getpid()} {socket.gethostname()} ;", flush=True)
while True:
    mpidomain.halo_exchange(x, 1, manager=manager)
"""


def _start(command, env):
    keep = {name: os.environ[name] for name in ("SLURM_CONF",) if name in os.environ}  # the cluster's config
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=launcher_env({**env, **keep, "MASTER_ADDR": ""}), start_new_session=True)


def _ready(job, ranks, limit=120):
    """Read the job's output until every rank said ready; return {rank: (pid, host)}.

    Ranks' lines can arrive run together, so the output is searched, not split into lines.
    """
    seen, deadline = b"", time.monotonic() + limit
    while True:
        found = {int(r): (int(pid), host.decode())
                 for r, pid, host in re.findall(rb"ready (\d+) (\d+) (\S+) ;", seen)}
        if len(found) == ranks:
            return found
        waiting = select.select([job.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]
        chunk = os.read(job.stdout.fileno(), 65536) if waiting else b""
        if not chunk:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            pytest.fail(f"the job did not get ready within {limit} s: {found}; its output: {seen[-2000:]!r}")
        seen += chunk


def _ended_within(job, limit):
    """Wait for the job; return (seconds it took, its output); kill it and fail past ``limit``."""
    started = time.monotonic()
    try:
        rest, _ = job.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        pytest.fail(f"the job was still running {limit} s after the fault")
    return time.monotonic() - started, rest.decode(errors="replace")


# PyPI's mpich speaks PMI1 to srun --mpi=pmi2 and its default UCX netmod puts each rank's address in ~1 KB
# pieces, which Slurm's pmi2 plugin sometimes cannot parse (docs/clusters.md, "Running on several nodes"): libfabric's address is short
# (its tcp provider: the default, "sockets", hangs).
SRUN_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


def _srun(ranks, nodes, *options):
    return ["srun", "-N", str(nodes), "-n", str(ranks), "--mpi=pmi2", *options, sys.executable, "-c", LOOP]


@needs_cluster
@pytest.mark.mpi_job
def test_killing_one_nodes_processes_ends_the_srun_job():
    job = _start(_srun(4, 2, "-K"), SRUN_ENV)
    ranks = _ready(job, 4)
    victims = [pid for pid, host in ranks.values() if host == "mpd-n1"]
    assert victims, ranks
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    seconds, output = _ended_within(job, 60)
    print(f"\nfault: srun -K, mpd-n1's ranks killed: the job ended {seconds:.2f} s later (exit {job.returncode})")
    assert job.returncode != 0
    assert seconds < 30, (seconds, output[-2000:])


@needs_cluster
@pytest.mark.mpi_job
def test_a_node_that_loses_its_link_ends_the_job_within_the_timeout():
    """No -K and no error to see: the survivors' halo waits give up after MPIDOMAIN_TIMEOUT and abort the job."""
    job = _start(_srun(4, 2), {**SRUN_ENV, "MPIDOMAIN_TIMEOUT": "5"})
    ranks = _ready(job, 4)
    survivors = [pid for pid, host in ranks.values() if host == "mpd-n0"]
    subprocess.run(["ip", "link", "set", "mpd-v1", "down"], check=True)
    try:
        started = time.monotonic()
        while any(os.path.exists(f"/proc/{pid}") for pid in survivors) and time.monotonic() - started < 60:
            time.sleep(0.2)
        gone_after = time.monotonic() - started
        print(f"\nfault: srun, mpd-n1's link down, MPIDOMAIN_TIMEOUT=5: mpd-n0's ranks ended {gone_after:.2f} s later")
        assert gone_after < 30, f"node 0's ranks still ran {gone_after:.0f} s after the link went down"
    finally:
        subprocess.run(["ip", "link", "set", "mpd-v1", "up"], check=True)
        seconds, output = _ended_within(job, 120)
        subprocess.run(["bash", os.path.join(REPO, "scripts", "ci", "ci_cluster_up.sh"), "3"], check=True,
                       capture_output=True)  # resumes a node Slurm marked down
    assert "waited 5 s" in output, output[-3000:]
    assert job.returncode != 0


@needs_cluster
@pytest.mark.mpi_job
def test_killing_one_nodes_processes_ends_the_mpiexec_job():
    launcher = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    command = [CLUSTER_EXEC, "mpd-n0", launcher, "-launcher", "ssh", "-launcher-exec", CLUSTER_EXEC,
               "-hosts", "mpd-n0:2,mpd-n1:2", "-n", "4", sys.executable, "-c", LOOP]
    job = _start(command, {})
    ranks = _ready(job, 4)
    for pid in [pid for pid, host in ranks.values() if host == "mpd-n1"]:
        os.kill(pid, signal.SIGKILL)
    seconds, output = _ended_within(job, 60)
    print(f"\nfault: mpiexec, mpd-n1's ranks killed: the job ended {seconds:.2f} s later (exit {job.returncode})")
    assert job.returncode != 0
    assert seconds < 30, (seconds, output[-2000:])
