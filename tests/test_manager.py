"""The manager's layout, lifecycle and argument checks, at whatever world size runs the suite."""

import pytest
from mpi4py import MPI

import mpidomain
from mpidomain import DomainParallelManager, get_domain_parallel_manager, initialize_domain_parallel
from mpidomain._errors import rank_ranges
from mpitest import nth_divisor


@pytest.mark.parametrize("d_index", range(4))
def test_layout_matches_seed(world, d_index):
    d = nth_divisor(world.size, d_index)
    rank = world.rank
    with DomainParallelManager(world.size, d) as m:
        assert (m.world_size, m.domain_parallel_size, m.data_parallel_size) == (world.size, d, world.size // d)
        assert m.shard_dim == -2
        assert m.domain_rank == rank % d and m.dp_rank == rank // d
        assert m.mesh.group_index("domain") == rank // d
        assert m.domain_world_size == d and m.dp_world_size == world.size // d
        assert m.is_first_domain_rank == (rank % d == 0)
        assert m.is_last_domain_rank == (rank % d == d - 1)
        # Membership and order, as ranks of the parent communicator.
        domain_members = m.domain_group.Get_group().Translate_ranks(None, world.Get_group())
        dp_members = m.data_parallel_group.Get_group().Translate_ranks(None, world.Get_group())
        assert list(domain_members) == m.domain_group_ranks() == list(range(rank - rank % d, rank - rank % d + d))
        assert list(dp_members) == m.data_parallel_group_ranks() == list(range(rank % d, world.size, d))
        assert m.domain_group.Get_rank() == m.domain_rank
        assert m.data_parallel_group.Get_rank() == m.dp_rank
        assert m.domain_comm is m.domain_group and m.data_parallel_comm is m.data_parallel_group
        prev_rank, next_rank = m.neighbor_ranks()
        assert prev_rank == (rank - 1 if rank % d else None)
        assert next_rank == (rank + 1 if rank % d != d - 1 else None)
        assert m.comm is world and m.rank == rank


def test_private_communicators(world):
    with DomainParallelManager(world.size, 1) as m:
        # Our traffic runs on a duplicate: it can never match the user's messages.
        assert MPI.Comm.Compare(m.library_comm("world"), world) == MPI.CONGRUENT
        assert m.domain_group.Get_name().startswith("mpidomain.domain")


def test_node_layout(world):
    with DomainParallelManager(world.size, 1) as m:
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        assert (m.local_rank, m.local_size) == (node.rank, node.size)
        roots = sorted(set(world.allgather(node.allreduce(world.rank, op=MPI.MIN))))
        assert m.num_nodes == len(roots) and 0 <= m.node_index < m.num_nodes
        node.Free()
        launcher = mpidomain.detect_launcher()
        known = launcher.local_rank is not None and launcher.name.startswith(("MPICH", "Open MPI", "Slurm"))
        if world.allreduce(int(known), op=MPI.MIN):  # each rank reads its own environment: agree first
            # The launcher numbers a node's processes in its mapping order (Open MPI maps by
            # package, so its local ranks can be a permutation of MPI's); the count agrees.
            mine = [r for n, r in m.comm.allgather((m.node_index, launcher.local_rank)) if n == m.node_index]
            assert launcher.local_size == m.local_size
            assert sorted(mine) == list(range(m.local_size))
            if not launcher.name.startswith("Open MPI"):
                assert launcher.local_rank == m.local_rank


def test_singleton_lifecycle(world, fresh_manager):
    first = initialize_domain_parallel(world.size, 1, abort_on_error=False)
    assert get_domain_parallel_manager() is first
    library = first.library_comm("world")  # the library's duplicate: held here only to see it freed
    second = initialize_domain_parallel(world.size, world.size, shard_dim=-1, abort_on_error=False)
    assert get_domain_parallel_manager() is second and second.shard_dim == -1
    assert first.closed and first.domain_comm == MPI.COMM_NULL and library == MPI.COMM_NULL
    assert first.domain_group is None and first.data_parallel_group is None
    second.close()
    second.close()  # idempotent
    assert get_domain_parallel_manager() is None


def test_module_manager_reads_the_current_one(world, fresh_manager):
    # The seed's module data: CREDIT's code reads credit.domain_parallel.manager._MANAGER.
    import mpidomain.manager as manager_module

    def same():
        return manager_module._MANAGER is get_domain_parallel_manager()

    assert same()
    first = initialize_domain_parallel(world.size, 1, abort_on_error=False)
    assert same() and manager_module._MANAGER is first
    second = initialize_domain_parallel(world.size, world.size, abort_on_error=False)
    assert same() and manager_module._MANAGER is second
    from mpidomain.manager import _MANAGER

    assert _MANAGER is second
    second.close()
    assert same() and manager_module._MANAGER is None
    with pytest.raises(AttributeError, match="has no attribute '_MANAGERS'"):
        manager_module._MANAGERS


def test_tiled_tells_tiles_from_slabs(world):
    # The one test of tiles or slabs every module asks; read-only.
    with DomainParallelManager(world.size, world.size) as slabs, \
            DomainParallelManager(world.size, (1, world.size), (-2, -1)) as tiles:
        assert (slabs.tiled, tiles.tiled) == (False, True)
        assert slabs.domain_coords == (slabs.domain_rank,) and tiles.domain_coords == (0, tiles.domain_rank)
        with pytest.raises(AttributeError):
            tiles.tiled = False


def test_context_manager_frees(world):
    with DomainParallelManager(world.size, 1) as m:
        pass
    # The node communicator has no public accessor (local_rank and local_size read it): users never hold it.
    assert m.closed and m.data_parallel_comm == MPI.COMM_NULL and m._node_comm == MPI.COMM_NULL


def test_subcommunicator_parent(world):
    # A manager over half the world: ranks are those of the parent communicator.
    color = world.rank % 2
    half = world.Split(color, world.rank)
    with DomainParallelManager(half.size, half.size, comm=half) as m:
        assert m.comm is half and m.rank == half.rank
        assert m.domain_group.size == half.size
    half.Free()


def test_managers_used_in_different_orders_raise_at_once(world):
    # Their agreements meet on one communicator, so the mismatch raises on every rank, naming both managers.
    if world.size == 1:
        pytest.skip("needs two ranks to use the managers in different orders")
    import numpy as np

    with DomainParallelManager(world.size, world.size) as a, DomainParallelManager(world.size, world.size) as b:
        assert a.number + 1 == b.number
        odd, even = rank_ranges(list(range(1, world.size, 2))), rank_ranges(list(range(0, world.size, 2)))
        described = f"DomainParallelManager\\(world_size={world.size}, domain_parallel_size={world.size}, shard_dim=-2\\)"
        message = (rf"halo_exchange: the ranks of domain group 0 \(ranks 0-{world.size - 1}\) use different managers in "
                   rf"the same mpidomain call \(manager #{a.number} {described} on ranks? {even}, manager #{b.number} "
                   rf"{described} on ranks? {odd}\)")
        with pytest.raises(RuntimeError, match=message):
            for m in (a, b) if world.rank % 2 == 0 else (b, a):
                mpidomain.halo_exchange(np.ones((4, 3)), 1, 0, manager=m)
        # In the right order, both work.
        for m in (a, b):
            assert mpidomain.halo_exchange(np.ones((4, 3)), 1, 0, manager=m).shape == (6, 3)


@pytest.mark.parametrize(
    "args, kind, words",
    [
        (("world", 0), ValueError, "domain_parallel_size must be >= 1, got 0"),
        (("world", -2), ValueError, ">= 1"),
        (("world", "2"), TypeError, "domain_parallel_size must be an int, got '2'"),
        (("world", 2.0), TypeError, "must be an int"),
        (("world", True), TypeError, "must be an int"),
        (("world+1", 1), ValueError, "but the communicator has"),
        (("world", "world+1"), ValueError, "does not divide world_size"),
        ((None, 1), TypeError, "world_size must be an int"),
    ],
)
def test_bad_arguments_raise_everywhere(world, args, kind, words):
    values = {"world": world.size, "world+1": world.size + 1}
    world_size, d = (values.get(a, a) if isinstance(a, str) and a.startswith("world") else a for a in args)
    with pytest.raises(kind, match=words):
        DomainParallelManager(world_size, d)


def test_bad_shard_dim_and_comm(world):
    with pytest.raises(TypeError, match="shard_dim must be an int"):
        DomainParallelManager(world.size, 1, shard_dim="lat")
    with pytest.raises(TypeError, match="comm must be an mpi4py intracommunicator"):
        DomainParallelManager(world.size, 1, comm="world")


def test_mistake_on_one_rank_raises_on_all(world):
    last = world.size - 1
    d = 0 if world.rank == last else 1
    with pytest.raises(ValueError) as info:
        DomainParallelManager(world.size, d)
    assert ">= 1" in str(info.value)
    if world.size > 1:
        assert f"rank {last}" in str(info.value)


def test_disagreeing_arguments_raise_on_all(world):
    if world.size == 1:
        pytest.skip("needs two ranks to disagree")
    shard_dim = -1 if world.rank == 0 else -2
    with pytest.raises(ValueError, match="must be the same on every rank") as info:
        DomainParallelManager(world.size, 1, shard_dim=shard_dim)
    assert "rank 0: (" in str(info.value) and "rank 1: (" in str(info.value)


def test_torch_bridge_groups_are_torch(world, torch_world):
    with DomainParallelManager(world.size, 1, torch_bridge=True) as m:
        assert isinstance(m.domain_group, torch_world.ProcessGroup)
        assert isinstance(m.data_parallel_group, torch_world.ProcessGroup)
        assert isinstance(m.domain_comm, MPI.Intracomm) and isinstance(m.data_parallel_comm, MPI.Intracomm)
        assert m.torch_bridge


@pytest.mark.parametrize("shared_roots, hosts, expected", [
    ([0, 0, 2, 2], ["a", "a", "b", "b"], [0, 0, 2, 2]),                            # MPI's split is the node
    ([0, 1, 2, 3, 4, 5, 6], list("aaabbcc"), [0, 0, 0, 3, 3, 5, 5]),                # no process mapping: by host
    ([0, 0, 0, 0], ["c1", "c2", "c1", "c2"], [0, 0, 0, 0]),                         # containers on one machine
    ([0, 1, 0, 1], ["a", "b", "a", "b"], [0, 1, 0, 1]),                             # cyclic placement
])
def test_node_roots_join_shared_memory_and_host_names(shared_roots, hosts, expected):
    from mpidomain.binding import node_roots

    assert node_roots(shared_roots, hosts) == expected
