"""The torch.distributed bridge: PyTorch started from MPI, and CREDIT-style code on the bridged groups.

In-process tests share one gloo default group per session (``torch_world``);
behaviour that needs a fresh process (environment rules, ownership of the
default group, a disagreeing torch.distributed) runs jobs in subprocesses.
"""

import ipaddress
import json
import os
import re
import socket

import pytest
from mpi4py import MPI

import mpidomain
from mpidomain import binding, torch_bridge
from mpitest import REPO, nth_divisor, run_mpi, run_python
from reference import tile_of

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
F = torch.nn.functional


# -- choosing MASTER_ADDR and MASTER_PORT ---------------------------------------
def test_master_address_from_environment():
    assert torch_bridge.master_address({"MASTER_ADDR": "node017.cluster"}) == "node017.cluster"


def test_master_address_skips_loopback_and_link_local(monkeypatch):
    found = ["127.0.0.1", "::1", "fe80::1%eth0", "10.1.2.3", "192.168.0.9"]
    monkeypatch.setattr(torch_bridge, "_host_addresses", lambda: iter(found))
    assert torch_bridge.master_address({}) == "10.1.2.3"
    assert torch_bridge.master_address({"MASTER_ADDR": ""}) == "10.1.2.3"


def test_master_address_falls_back_to_hostname(monkeypatch):
    monkeypatch.setattr(torch_bridge, "_host_addresses", lambda: iter(["127.0.1.1", "::1", "not an address"]))
    monkeypatch.setattr(socket, "gethostname", lambda: "login3")
    assert torch_bridge.master_address({}) == "login3"


def test_master_address_from_the_interfaces_where_names_and_routes_fail(monkeypatch):
    """A cluster node whose name resolves nowhere and that has no default route (scripts/ci/ci_cluster_up.sh's)."""
    interfaces = [a for a in torch_bridge._interface_addresses() if not a.startswith("127.")]
    if not interfaces:
        pytest.skip("no interface with a non-loopback IPv4 address")

    def unresolvable(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    class NoRoute(socket.socket):
        def connect(self, address):
            raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "getaddrinfo", unresolvable)
    monkeypatch.setattr(socket, "socket", NoRoute)
    assert torch_bridge.master_address({}) == interfaces[0]


def test_master_address_of_this_host():
    address = torch_bridge.master_address({})
    if address != socket.gethostname():
        ip = ipaddress.ip_address(address)
        assert not (ip.is_loopback or ip.is_link_local), address
        with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET) as listener:
            listener.bind((address, 0))  # an address of this host


def test_master_port_from_environment():
    assert torch_bridge.master_port({"MASTER_PORT": "29511"}) == 29511


@pytest.mark.parametrize("value", ["http", "0", "65536", "-1"])
def test_master_port_rejects_bad_values(value):
    with pytest.raises(ValueError, match=f"MASTER_PORT must be a port number from 1 to 65535, got '{value}'"):
        torch_bridge.master_port({"MASTER_PORT": value})


def test_master_port_is_free():
    port = torch_bridge.master_port({})
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("", port))


def test_bad_timeout_and_comm():
    with pytest.raises(TypeError, match="timeout must be None, a datetime.timedelta or a positive number"):
        mpidomain.init_torch_distributed(timeout="30s")
    with pytest.raises(TypeError, match="comm must be an mpi4py intracommunicator"):
        mpidomain.init_torch_distributed(comm="world")


def test_bound_device_follows_local_rank(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: chosen[-1])
    assert torch_bridge._bound_device(torch, 6) == torch.device("cuda", 2) and chosen == [2]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert torch_bridge._bound_device(torch, 6) == torch.device("cuda", 3) and chosen == [2]


class _NoProcessMapping:
    """``comm``, but its shared-memory split leaves every rank alone, as MPICH's does without a process mapping
    from the launcher (srun -m arbitrary over pmi2): only the host names join a node's ranks."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Split_type(self, split_type, key=0, info=None):
        return MPI.COMM_SELF.Dup()


@pytest.mark.parametrize("mapped", [True, False], ids=["shared-memory", "host-names"])
def test_local_rank_follows_the_one_node_rule(world, mapped):
    # LOCAL_RANK and LOCAL_WORLD_SIZE (init_torch_distributed) are binding.node_of's node, as the
    # manager's local_rank and local_size (bind_device binds by them) are: they cannot disagree.
    comm = world if mapped else _NoProcessMapping(world)
    node, _, _ = binding.node_of(comm)
    expected = node.Get_rank(), node.Get_size()
    node.Free()
    assert torch_bridge._local_layout(comm) == expected
    if mapped:
        with mpidomain.DomainParallelManager(world.size, 1, abort_on_error=False) as manager:
            assert (manager.local_rank, manager.local_size) == expected
    else:  # every rank alone in shared memory: the host name makes the node
        host = MPI.Get_processor_name()
        on_my_host = [r for r, h in enumerate(world.allgather(host)) if h == host]
        assert expected == (on_my_host.index(world.rank), len(on_my_host))


# -- the default group -------------------------------------------------------
def test_torch_ranks_equal_mpi_ranks(world, torch_world):
    assert (torch_world.get_rank(), torch_world.get_world_size()) == (world.rank, world.size)
    assert torch_world.get_backend() == "gloo"
    # Already initialised and agreeing with MPI: nothing to do, on every rank.
    assert mpidomain.init_torch_distributed() is False
    total = torch.tensor([float(world.rank)])
    torch_world.all_reduce(total)
    assert total.item() == world.size * (world.size - 1) / 2


# -- bridged groups ------------------------------------------------------------
@pytest.mark.parametrize("d_index", range(3))
def test_bridged_groups_mirror_the_communicators(world, torch_world, d_index):
    d = nth_divisor(world.size, d_index)
    with mpidomain.DomainParallelManager(world.size, d, torch_bridge=True) as m:
        for group, comm, ranks, rank in (
            (m.domain_group, m.domain_comm, m.domain_group_ranks(), m.domain_rank),
            (m.data_parallel_group, m.data_parallel_comm, m.data_parallel_group_ranks(), m.dp_rank),
        ):
            assert isinstance(group, torch_world.ProcessGroup) and isinstance(comm, MPI.Intracomm)
            assert torch_world.get_process_group_ranks(group) == ranks
            assert list(comm.Get_group().Translate_ranks(None, world.Get_group())) == ranks
            assert torch_world.get_rank(group) == rank == comm.Get_rank()
            assert torch_world.get_world_size(group) == len(ranks) == comm.Get_size()
            gathered = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
            torch_world.all_gather(gathered, torch.tensor([world.rank]), group=group)
            assert [int(t) for t in gathered] == ranks
        groups = (m.domain_group, m.data_parallel_group)
    for group in groups:
        with pytest.raises((KeyError, ValueError, RuntimeError)):
            torch_world.get_process_group_ranks(group)
    assert torch_world.is_initialized()  # the session's default group is not the manager's to destroy


def test_reinitialising_destroys_the_previous_groups(world, torch_world, fresh_manager):
    first = mpidomain.initialize_domain_parallel(world.size, world.size, torch_bridge=True, abort_on_error=False)
    old = first.domain_group
    second = mpidomain.initialize_domain_parallel(world.size, world.size, torch_bridge=True, abort_on_error=False)
    assert first.closed and first.domain_group is None
    with pytest.raises((KeyError, ValueError, RuntimeError)):
        torch_world.get_process_group_ranks(old)
    assert torch_world.get_process_group_ranks(second.domain_group) == list(range(world.size))
    assert torch_world.is_initialized()


# -- CREDIT-style code on the bridged groups -------------------------------------
def swap_with_neighbours(to_prev, to_next, manager):
    """Send rows to the neighbours and receive theirs with ``dist.P2POp``, as CREDIT does.

    Returns (rows from prev, rows from next), zeros where there is no neighbour.
    """
    prev_rank, next_rank = manager.neighbor_ranks()
    from_prev, from_next = torch.zeros_like(to_prev), torch.zeros_like(to_next)
    ops = []
    if prev_rank is not None:
        ops.append(dist.P2POp(dist.isend, to_prev.contiguous(), prev_rank, group=manager.domain_group))
        ops.append(dist.P2POp(dist.irecv, from_prev, prev_rank, group=manager.domain_group))
    if next_rank is not None:
        ops.append(dist.P2POp(dist.isend, to_next.contiguous(), next_rank, group=manager.domain_group))
        ops.append(dist.P2POp(dist.irecv, from_next, next_rank, group=manager.domain_group))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return from_prev, from_next


class P2PHaloExchange(torch.autograd.Function):
    """Pad dim -2 with ``halo`` rows from each neighbour (zeros at the edges); backward returns them."""

    @staticmethod
    def forward(ctx, x, halo, manager):
        ctx.halo, ctx.manager = halo, manager
        from_prev, from_next = swap_with_neighbours(x[..., :halo, :], x[..., -halo:, :], manager)
        return torch.cat([from_prev, x, from_next], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        halo = ctx.halo
        core = grad[..., halo:-halo, :].clone()
        from_prev, from_next = swap_with_neighbours(grad[..., :halo, :], grad[..., -halo:, :], ctx.manager)
        core[..., :halo, :] += from_prev
        core[..., -halo:, :] += from_next
        return core, None, None


def global_field(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.fixture(params=[0, 1, 2], ids=lambda i: f"d_index{i}")
def bridged(request, world, torch_world):
    with mpidomain.DomainParallelManager(world.size, nth_divisor(world.size, request.param), torch_bridge=True) as m:
        yield m


def test_p2p_halo_exchange_delivers_neighbour_rows(bridged):
    m, halo = bridged, 2
    field = torch.arange(2 * 3 * 4 * m.domain_parallel_size * 5, dtype=torch.float32).reshape(2, 3, -1, 5)
    field = field + 1000 * m.mesh.group_index("domain")  # each domain group exchanges its own sample
    padded = P2PHaloExchange.apply(tile_of(field, m), halo, m)
    zeros = torch.zeros(2, 3, halo, 5)
    rows = 4
    start = m.domain_rank * rows
    expected_top = zeros if m.is_first_domain_rank else field[..., start - halo:start, :]
    expected_bottom = zeros if m.is_last_domain_rank else field[..., start + rows:start + rows + halo, :]
    torch.testing.assert_close(padded, torch.cat([expected_top, tile_of(field, m), expected_bottom], dim=-2))


def test_all_gather_on_domain_group_reassembles_the_field(bridged):
    m = bridged
    field = global_field((2, 3, 3 * m.domain_parallel_size, 8), seed=7 + m.mesh.group_index("domain"), dtype=torch.float32)
    pieces = [torch.empty_like(tile_of(field, m)) for _ in range(m.domain_parallel_size)]
    dist.all_gather(pieces, tile_of(field, m).contiguous(), group=m.domain_group)
    torch.testing.assert_close(torch.cat(pieces, dim=-2), field, rtol=0, atol=0)


def test_domain_parallel_convolution_matches_single_process(bridged):
    m = bridged
    field = global_field((2, 3, 4 * m.domain_parallel_size, 6), seed=1)
    weight = global_field((5, 3, 3, 3), seed=2)
    upstream = global_field((2, 5, 4 * m.domain_parallel_size, 6), seed=3)

    whole = field.clone().requires_grad_()
    whole_weight = weight.clone().requires_grad_()
    expected = F.conv2d(whole, whole_weight, padding=1)
    (expected * upstream).sum().backward()

    part = tile_of(field, m).clone().requires_grad_()
    part_weight = weight.clone().requires_grad_()
    padded = P2PHaloExchange.apply(part, 1, m)
    out = F.conv2d(padded, part_weight, padding=(0, 1))
    (out * tile_of(upstream, m)).sum().backward()
    weight_grad = part_weight.grad.clone()
    dist.all_reduce(weight_grad, group=m.domain_group)

    torch.testing.assert_close(out, tile_of(expected, m))
    torch.testing.assert_close(part.grad, tile_of(whole.grad, m))
    torch.testing.assert_close(weight_grad, whole_weight.grad)


# -- fresh processes ---------------------------------------------------------
ENV_SCRIPT = """
import json, os
import mpidomain, torch, torch.distributed as dist
from mpi4py import MPI
created = mpidomain.init_torch_distributed(timeout=60)
total = torch.ones(1)
dist.all_reduce(total)
store = dist.distributed_c10d._get_default_store()
while not hasattr(store, "port"):
    store = store.underlying_store
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
report = {"created": created, "torch": [dist.get_rank(), dist.get_world_size()], "backend": dist.get_backend(),
          "sum": total.item(), "store_port": store.port, "env": {n: os.environ.get(n) for n in names}}
reports = MPI.COMM_WORLD.gather(report)
if MPI.COMM_WORLD.rank == 0:
    print("reports:", json.dumps(reports), flush=True)
dist.destroy_process_group()
"""


def _reports(result, n):
    assert result.returncode == 0, result.stderr
    reports = json.loads(result.stdout.split("reports:", 1)[1])
    assert len(reports) == n, result.stdout
    return reports


@pytest.mark.mpi_job
def test_environment_chosen_and_broadcast(world):
    # MASTER_ADDR stays loopback here (the address choice is unit-tested above): the port and
    # every other variable are chosen on rank 0 and broadcast.
    if world.rank == 0:
        reports = _reports(run_mpi(2, ["-c", ENV_SCRIPT], timeout=120), 2)
        first = reports[0]["env"]
        assert first["MASTER_ADDR"] == "127.0.0.1" and int(first["MASTER_PORT"]) > 0
        for rank, report in enumerate(reports):
            assert report["created"] is True and report["torch"] == [rank, 2]
            assert report["backend"] == "gloo" and report["sum"] == 2.0
            env = report["env"]
            assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (first["MASTER_ADDR"], first["MASTER_PORT"])
            assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
            assert env["LOCAL_RANK"] == str(rank) and env["LOCAL_WORLD_SIZE"] == "2"
            assert report["store_port"] == int(first["MASTER_PORT"])


@pytest.mark.mpi_job
def test_preset_environment_is_used_and_kept(world):
    if world.rank == 0:
        port = torch_bridge.master_port({})
        preset = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        reports = _reports(run_mpi(2, ["-c", ENV_SCRIPT], timeout=120, env=preset), 2)
        for rank, report in enumerate(reports):
            assert report["torch"] == [rank, 2] and report["sum"] == 2.0
            assert report["env"]["MASTER_ADDR"] == "127.0.0.1" and report["env"]["MASTER_PORT"] == str(port)
            assert report["store_port"] == port
            assert report["env"]["RANK"] == str(rank)


@pytest.mark.mpi_job
def test_plain_python_starts_a_world_of_one(world):
    if world.rank == 0:
        reports = _reports(run_python(["-c", ENV_SCRIPT], timeout=120), 1)
        assert reports[0]["torch"] == [0, 1] and reports[0]["env"]["RANK"] == "0"


MISMATCH_SCRIPT = r"""
import mpidomain, torch.distributed as dist
from mpi4py import MPI
world = MPI.COMM_WORLD
port = world.bcast(mpidomain.torch_bridge.master_port({}) if world.rank == 0 else None)

def attempt(what, call):
    try:
        call()
        line = f"rank {world.rank} {what}: no error"
    except (RuntimeError, ValueError) as error:
        line = f"rank {world.rank} {what}: {type(error).__name__}: {' | '.join(str(error).splitlines())}"
    lines = world.gather(line)
    if world.rank == 0:
        print("\n".join(lines), flush=True)

attempt("backends", lambda: mpidomain.init_torch_distributed("gloo" if world.rank else "mpi"))
# Ranks 0 and 2 swapped; rank 1 agrees with MPI but must raise too.
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.size - 1 - world.rank,
                        world_size=world.size)
attempt("swapped", mpidomain.init_torch_distributed)
attempt("bridged manager", lambda: mpidomain.DomainParallelManager(world.size, 1, torch_bridge=True))
dist.destroy_process_group()
port = world.bcast(mpidomain.torch_bridge.master_port({}) if world.rank == 0 else None)
if world.rank == 0:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
attempt("rank 0 only", mpidomain.init_torch_distributed)
"""


@pytest.mark.mpi_job
def test_disagreeing_torch_distributed_raises_on_every_rank(world):
    if world.rank == 0:
        result = run_mpi(3, ["-c", MISMATCH_SCRIPT], timeout=120)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        for rank in range(3):
            line = next(l for l in lines if l.startswith(f"rank {rank} backends:"))
            assert "ValueError: backend must be the same on every rank, got rank 0: 'mpi', rank 1: 'gloo'" in line
            for what in ("swapped", "bridged manager"):
                line = next(l for l in lines if l.startswith(f"rank {rank} {what}:"))
                assert "2 of 3 ranks rejected the call" in line and "already initialised with rank" in line, line
            line = next(l for l in lines if l.startswith(f"rank {rank} rank 0 only:"))
            assert "initialised on some ranks but not on ranks [1, 2]" in line, line
        assert "torch.distributed is already initialised with rank 2 of 3, but this process is MPI rank 0 of 3" \
            in result.stdout


LIFECYCLE_SCRIPT = """
import sys
import mpidomain
from mpi4py import MPI
plain = mpidomain.initialize_domain_parallel(2, 1, abort_on_error=False)
assert 'torch' not in sys.modules, "a manager without the bridge imported torch"
import torch.distributed as dist
first = mpidomain.initialize_domain_parallel(2, 2, torch_bridge=True, abort_on_error=False)
assert dist.is_initialized() and dist.get_rank() == MPI.COMM_WORLD.rank
second = mpidomain.initialize_domain_parallel(2, 1, torch_bridge=True, abort_on_error=False)
assert first.closed and dist.is_initialized(), "the default group must outlive a replaced manager"
assert dist.get_process_group_ranks(second.data_parallel_group) == [0, 1]
second.close()
assert not dist.is_initialized(), "the last bridged manager must destroy the default group it created"
again = mpidomain.DomainParallelManager(2, 2, torch_bridge=True)
assert dist.is_initialized()
again.close()
assert not dist.is_initialized()
assert mpidomain.init_torch_distributed() is True
user_owned = mpidomain.DomainParallelManager(2, 2, torch_bridge=True)
user_owned.close()
assert dist.is_initialized(), "a manager must not destroy a default group it did not create"
dist.destroy_process_group()
print(f"rank {MPI.COMM_WORLD.rank} ok", flush=True)
"""


@pytest.mark.mpi_job
def test_default_group_destroyed_only_by_its_creator(world):
    if world.rank == 0:
        result = run_mpi(2, ["-c", LIFECYCLE_SCRIPT], timeout=180)
        assert result.returncode == 0, result.stderr
        assert "rank 0 ok" in result.stdout and "rank 1 ok" in result.stdout, result.stdout


@pytest.mark.mpi_job
def test_ddp_example_matches_single_process(world):
    pytest.importorskip("mpidomain.nn")
    if world.rank == 0:
        script = os.path.join(REPO, "scripts", "jobs", "train_ddp_domain.py")
        result = run_mpi(4, [script, "--domain-parallel-size", "2", "--steps", "4"], timeout=240)
        assert result.returncode == 0, result.stderr
        steps = [re.fullmatch(r"step (\d+): loss ([\d.]+) \(single process ([\d.]+)\)", line)
                 for line in result.stdout.splitlines() if line.startswith("step ")]
        assert [int(m.group(1)) for m in steps] == [0, 1, 2, 3], result.stdout
        losses = [(float(m.group(2)), float(m.group(3))) for m in steps]
        for loss, reference in losses:
            assert loss == pytest.approx(reference, rel=1e-9)
        assert all(later[0] < earlier[0] for earlier, later in zip(losses, losses[1:])), losses


NCCL_SCRIPT = """
import torch, torch.distributed as dist
import mpidomain
assert mpidomain.init_torch_distributed() is True
assert dist.get_backend() == "nccl", dist.get_backend()
device = torch.device("cuda", torch.cuda.current_device())
assert dist.group.WORLD.bound_device_id == device, (dist.group.WORLD.bound_device_id, device)
total = torch.ones(1, device=device)
dist.all_reduce(total)
assert total.item() == 1.0
dist.destroy_process_group()
print("nccl ok", flush=True)
"""


@pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs CUDA and NCCL")
@pytest.mark.mpi_job
def test_nccl_with_bound_device_where_cuda_exists(world):
    if world.rank == 0:
        result = run_python(["-c", NCCL_SCRIPT], timeout=180)
        assert result.returncode == 0 and "nccl ok" in result.stdout, result.stderr


@pytest.mark.bench
@pytest.mark.mpi_job
def test_group_creation_benchmark_prints_ratios(world):
    if world.rank == 0:
        script = os.path.join(REPO, "scripts", "bench", "bench_torch_groups.py")
        result = run_mpi(4, [script, "--repeats", "2"], timeout=240)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert "4 ranks, T=1, D=2: 2 domain + 4 tp + 2 dp groups" in lines[0], result.stdout
        assert "(baseline)" in lines[1] and "x 1.00" in lines[1]
        assert "new_subgroups_by_enumeration" in lines[2] and "use_local_synchronization" in lines[3]
