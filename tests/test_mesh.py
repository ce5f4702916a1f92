"""The (dp, tp, domain) mesh: its arithmetic, the manager's communicators, the torch DeviceMesh and training on it.

In-process tests run at whatever world size runs the suite (every layout of it);
the 8-rank proofs (every layout of 8 against ``init_device_mesh``, and dp x tp x
domain = 2 x 2 x 2 training) run in fresh jobs from the serial suite.
"""

import gc
import importlib.util
import itertools
import os
import weakref

import pytest
from mpi4py import MPI

import mpidomain
from mpidomain import DomainParallelManager
from mpidomain.__main__ import main
from mpidomain.layout.mesh import AXES, Mesh
from mpitest import REPO, divisors, run_mpi


def layouts(n):
    """Every (dp, tp, domain) with product n."""
    return [(n // (t * d), t, d) for t in divisors(n) for d in divisors(n // t)]


def members(comm, world):
    return list(comm.Get_group().Translate_ranks(None, world.Get_group()))


# -- Pure arithmetic ---------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8, 12])
def test_mesh_is_row_major_with_the_domain_axis_innermost(n):
    for shape in layouts(n):
        dp, tp, domain = shape
        seen = {}
        for g in range(n):
            mesh = Mesh(shape, g)
            # CREDIT's formula (credit.parallel.mesh).
            assert mesh.coords == (g // (tp * domain), (g // domain) % tp, g % domain)
            assert mesh.rank_of(mesh.coords) == g and mesh.coords_of(g) == mesh.coords
            for axis in AXES:
                ranks = mesh.group_ranks(axis)
                assert g in ranks and ranks == sorted(ranks) and len(ranks) == mesh.axis_size(axis)
                # Members differ from g in this axis' coordinate only.
                others = [i for i, name in enumerate(AXES) if name != axis]
                assert all([mesh.coords_of(r)[i] for i in others] == [mesh.coords[i] for i in others] for r in ranks)
                assert ranks.index(g) == mesh.coordinate(axis)
                seen.setdefault(axis, set()).add(tuple(ranks))
        for axis in AXES:
            groups = Mesh(shape, 0).groups(axis)
            assert set(map(tuple, groups)) == seen[axis]
            assert sorted(itertools.chain(*groups)) == list(range(n))  # a partition
            assert [Mesh(shape, 0).group_index(axis, g[0]) for g in groups] == list(range(len(groups)))
        flat = list(itertools.chain.from_iterable(itertools.chain.from_iterable(Mesh(shape, 0).layout())))
        assert flat == list(range(n))


def test_mesh_examples_and_neighbours():
    mesh = Mesh((2, 2, 2), 5)
    assert mesh.coords == (1, 0, 1)
    assert mesh.groups("domain") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.layout() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert (mesh.neighbor("domain", -1), mesh.neighbor("domain", 1)) == (4, None)
    assert mesh.neighbor("domain", 1, periodic=True) == 4
    assert mesh.neighbor("tp", 1) == 7 and mesh.neighbor("dp", -1) == 1
    # T = 1 is the two-axis layout: consecutive domain groups, data-parallel groups striding by D.
    flat = Mesh((4, 1, 2), 3)
    assert flat.groups("domain") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert flat.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert flat.group_index("dp") == 1 and flat.group_ranks("dp", 0) == [0, 2, 4, 6]


@pytest.mark.parametrize("call, words", [
    (lambda: Mesh((2, 2), 0), "three positive ints"),
    (lambda: Mesh((2, 0, 2), 0), "three positive ints"),
    (lambda: Mesh((2, 2, 2), 8), "rank must be an int from 0 to 7"),
    (lambda: Mesh((2, 2, 2), 0).axis("lon"), "axis must be one of"),
    (lambda: Mesh((2, 2, 2), 0).group_ranks("tp", 4), "index must be an int from 0 to 3"),
    (lambda: Mesh((2, 2, 2), 0).rank_of((0, 2, 0)), "coords must be"),
])
def test_mesh_rejects_bad_arguments(call, words):
    with pytest.raises(ValueError, match=words):
        call()


# -- The manager's communicators ---------------------------------------------------

def test_manager_communicators_follow_the_mesh_for_every_layout(world):
    for dp, t, d in layouts(world.size):
        with DomainParallelManager(world.size, d, tensor_parallel_size=t) as m:
            mesh = m.mesh
            assert mesh.shape == (dp, t, d) and mesh.rank == world.rank
            assert (m.data_parallel_size, m.tensor_parallel_size, m.domain_parallel_size) == (dp, t, d)
            assert (m.dp_rank, m.tp_rank, m.domain_rank) == mesh.coords
            assert (m.dp_world_size, m.tp_world_size, m.domain_world_size) == (dp, t, d)
            assert m.data_parallel_coords() == (mesh.coords[0], dp)
            for comm, axis, listed in ((m.domain_comm, "domain", m.domain_group_ranks()),
                                       (m.tensor_parallel_comm, "tp", m.tensor_parallel_group_ranks()),
                                       (m.data_parallel_comm, "dp", m.data_parallel_group_ranks())):
                assert members(comm, world) == mesh.group_ranks(axis) == listed
                assert comm.Get_rank() == mesh.coordinate(axis)
            assert m.tensor_parallel_group is m.tensor_parallel_comm
            assert m.neighbor_ranks() == (mesh.neighbor("domain", -1), mesh.neighbor("domain", 1))
            # The sampler contract: ranks differing only in tp or domain read the same batch.
            coords = m.comm.allgather(m.data_parallel_coords())
            for other, pair in enumerate(coords):
                assert (pair[0] == m.dp_rank) == (Mesh(mesh.shape, other).coords[0] == mesh.coords[0])
            # Library traffic on each axis travels on private duplicates.
            for name, comm in (("domain", m.domain_comm), ("tp", m.tensor_parallel_comm),
                               ("data", m.data_parallel_comm)):
                assert MPI.Comm.Compare(m.library_comm(name), comm) == MPI.CONGRUENT
            total = mpidomain.allreduce(__import__("numpy").ones(1), "sum", "tensor_parallel", m)
            assert total[0] == t


def test_tensor_parallel_size_one_is_the_two_axis_layout(world):
    for d in divisors(world.size):
        with DomainParallelManager(world.size, d) as m:
            assert m.tensor_parallel_size == 1 and m.tp_rank == 0
            assert m.data_parallel_size == world.size // d
            assert m.data_parallel_group_ranks() == list(range(world.rank % d, world.size, d))
            assert [m.domain_group_ranks(i) for i in range(world.size // d)] == \
                [list(range(i * d, (i + 1) * d)) for i in range(world.size // d)]
            assert "tensor_parallel_size" not in repr(m)


@pytest.mark.parametrize("t, d, kind, words", [
    ("world+1", 1, ValueError, r"tensor_parallel_size=\d+ x domain_parallel_size=1 = \d+ does not divide"),
    (0, 1, ValueError, "tensor_parallel_size must be >= 1, got 0"),
    (-2, 1, ValueError, "tensor_parallel_size must be >= 1, got -2"),
    (1.0, 1, TypeError, "tensor_parallel_size must be an int, got 1.0"),
    ("2", 1, TypeError, "tensor_parallel_size must be an int, got '2'"),
])
def test_bad_tensor_parallel_size_raises_on_every_rank(world, t, d, kind, words):
    t = world.size + 1 if t == "world+1" else t
    with pytest.raises(kind, match=words):
        DomainParallelManager(world.size, d, tensor_parallel_size=t)


def test_tensor_times_domain_must_divide_the_world(world):
    d = world.size  # D divides the world, T * D = 2 * world does not
    with pytest.raises(ValueError, match=rf"tensor_parallel_size=2 x domain_parallel_size={d} = {2 * d} does not "
                                         rf"divide world_size={world.size}; choose sizes whose product is one of"):
        DomainParallelManager(world.size, d, tensor_parallel_size=2)


def test_a_mistake_in_t_on_one_rank_raises_on_all(world):
    last = world.size - 1
    with pytest.raises(ValueError) as info:
        DomainParallelManager(world.size, 1, tensor_parallel_size=0 if world.rank == last else 1)
    assert "tensor_parallel_size must be >= 1, got 0" in str(info.value)
    if world.size > 1:
        assert f"rank {last}" in str(info.value)


def test_ranks_disagreeing_on_t_raise_on_all(world):
    if world.size % 2:
        pytest.skip("needs an even world: T=1 and T=2 must both divide it")
    t = 2 if world.rank == 0 else 1
    with pytest.raises(ValueError, match="must be the same on every rank") as info:
        DomainParallelManager(world.size, 1, tensor_parallel_size=t)
    assert "tensor_parallel_size" in str(info.value) and "rank 1: (" in str(info.value)


# -- The torch DeviceMesh ----------------------------------------------------------

def _destroy_mesh_groups(dist, mesh):
    for group in mesh.get_all_groups():
        if group is not dist.group.WORLD and dist.get_process_group_ranks(group) != list(range(dist.get_world_size())):
            dist.destroy_process_group(group)


def test_device_mesh_equals_init_device_mesh_for_every_layout(world, torch_world):
    dist = torch_world
    from torch.distributed.device_mesh import init_device_mesh

    for shape in layouts(world.size):
        dp, t, d = shape
        reference = init_device_mesh("cpu", shape, mesh_dim_names=AXES)
        with DomainParallelManager(world.size, d, tensor_parallel_size=t, torch_bridge=True) as m:
            mesh = m.device_mesh
            assert mesh is m.device_mesh  # built once
            assert mesh.mesh.tolist() == reference.mesh.tolist() == m.mesh.layout()
            assert mesh.mesh_dim_names == AXES and mesh.device_type == "cpu"
            assert tuple(mesh.get_coordinate()) == tuple(reference.get_coordinate()) == m.mesh.coords
            for axis, group, comm in (("dp", m.data_parallel_group, m.data_parallel_comm),
                                      ("tp", m.tensor_parallel_group, m.tensor_parallel_comm),
                                      ("domain", m.domain_group, m.domain_comm)):
                sub, theirs = mesh[axis], reference[axis]
                assert sub.get_group() is group  # the bridged group itself
                assert dist.get_process_group_ranks(sub.get_group()) == \
                    dist.get_process_group_ranks(theirs.get_group()) == members(comm, world)
                assert (sub.size(), sub.get_local_rank()) == (theirs.size(), theirs.get_local_rank())
                assert sub.mesh.tolist() == theirs.mesh.tolist()
            flat = mesh["dp", "tp"]  # FSDP2 with tensor parallelism slices two dims
            assert flat.mesh.tolist() == reference["dp", "tp"].mesh.tolist()
        with pytest.raises(RuntimeError, match="is closed"):
            m.device_mesh
        _destroy_mesh_groups(dist, reference)


def test_a_new_manager_of_the_same_shape_gets_fresh_dtensor_plans(world, torch_world):
    """DTensor caches plans by mesh equality, which ignores the groups; closing must forget them."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    for attempt in range(3):
        with DomainParallelManager(world.size, world.size, torch_bridge=True) as m:
            mesh = m.device_mesh["domain"]
            doubled = distribute_tensor(torch.ones(2 * world.size, 3), mesh, [Shard(0)]) * 2
            assert doubled.device_mesh is mesh, attempt  # not a closed manager's mesh from the cache
            assert float(doubled.full_tensor().sum()) == 12 * world.size


def test_device_mesh_needs_the_bridge(world):
    with DomainParallelManager(world.size, 1) as m:
        with pytest.raises(RuntimeError, match="device_mesh needs torch.distributed groups: build the manager with "
                                               "torch_bridge=True"):
            m.device_mesh


# -- Training on the mesh: FSDP2, tensor parallelism, domain parallelism -------------

def _train_mesh():
    spec = importlib.util.spec_from_file_location("train_mesh", os.path.join(REPO, "scripts", "jobs", "train_mesh.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout_index", range(6))
def test_training_on_the_mesh_equals_one_process(world, torch_world, layout_index):
    options = [shape for shape in layouts(world.size) if 32 % shape[1] == 0 and 16 % shape[2] == 0]
    if layout_index >= len(options):
        pytest.skip(f"a world of {world.size} has {len(options)} layouts")
    dp, t, d = options[layout_index]
    train_mesh = _train_mesh()
    with DomainParallelManager(world.size, d, tensor_parallel_size=t, torch_bridge=True) as m:
        losses, reference, worst = train_mesh.train(m, steps=2, batch=4 * dp)
    assert worst <= 1e-10, (dp, t, d, worst)
    assert all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(losses, reference)), (losses, reference)


def test_a_closed_manager_lets_its_mesh_go(world, torch_world):
    """close() clears DTensor's caches keyed by mesh, so the mesh and its groups (gloo threads each) can be freed."""
    with DomainParallelManager(world.size, 1, torch_bridge=True) as m:
        mesh = weakref.ref(m.device_mesh)
        _train_mesh().train(m, steps=1, batch=4 * m.data_parallel_size)
    gc.collect()
    assert mesh() is None


def test_training_without_the_domain_sum_differs(world, torch_world, monkeypatch):
    """The comparison can fail: skipping the domain ranks' gradient sum must show."""
    if world.size % 2:
        pytest.skip("needs an even world: a domain group of two ranks")
    train_mesh = _train_mesh()
    monkeypatch.setattr(train_mesh, "allreduce_gradients", lambda *args, **kwargs: 0)
    with DomainParallelManager(world.size, 2, torch_bridge=True) as m:
        losses, reference, worst = train_mesh.train(m, steps=2, batch=4 * m.data_parallel_size)
    assert worst > 1e-6


# -- info and check show the three axes --------------------------------------------

def test_info_and_check_take_t(world, capsys, fresh_manager):
    if world.size % 2:
        pytest.skip("needs an even world for T=2")
    d = world.size // 2
    assert main(["info", "-T", "2"]) == 0
    out = capsys.readouterr().out
    status = main(["check", "-T", "2", "--shape", f"1,2,{4 * d},8", "--repeats", "1"])
    checked = capsys.readouterr().out
    assert status == 0
    if world.rank == 0:
        mesh = Mesh((1, 2, d), 0)
        assert f"mesh              : (dp, tp, domain) = (1, 2, {d}), domain innermost" in out
        assert "tensor parallel   : T=2" in out
        assert "tensor-par. grps  : " + " ".join(str(g).replace(" ", "") for g in mesh.groups("tp")) in out
        assert "domain groups     : " + " ".join(str(g).replace(" ", "") for g in mesh.groups("domain")) in out
        header = out.splitlines()[out.splitlines().index("") + 1].split()
        assert header[4:7] == ["dp", "tp", "domain"], header
        assert checked.splitlines()[0].startswith(f"mpidomain check: {world.size} ranks, D={d}, T=2, dp=1, device cpu")
        assert f"D={d}, T=2, dp=1, cpu" in checked.strip().splitlines()[-1]


def test_info_rejects_t_that_does_not_divide(world, capsys, fresh_manager):
    status = main(["info", "-T", str(world.size + 1)])
    err = capsys.readouterr().err
    assert status == 2
    if world.rank == 0:
        assert f"tensor_parallel_size={world.size + 1} x domain_parallel_size={world.size} " in err


# -- 8 ranks, fresh jobs ----------------------------------------------------------

EIGHT_RANK_LAYOUTS = r"""
import mpidomain, torch.distributed as dist
from mpi4py import MPI
from torch.distributed.device_mesh import init_device_mesh
world = MPI.COMM_WORLD
mpidomain.init_torch_distributed(backend="gloo")
checked = 0
for t in (1, 2, 4, 8):
    for d in (1, 2, 4, 8):
        if 8 % (t * d):
            continue
        shape = (8 // (t * d), t, d)
        reference = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp", "domain"))
        with mpidomain.DomainParallelManager(8, d, tensor_parallel_size=t, torch_bridge=True) as m:
            mesh = m.device_mesh
            assert mesh.mesh.tolist() == reference.mesh.tolist()
            for axis, comm in (("dp", m.data_parallel_comm), ("tp", m.tensor_parallel_comm), ("domain", m.domain_comm)):
                ours = dist.get_process_group_ranks(mesh[axis].get_group())
                assert ours == dist.get_process_group_ranks(reference[axis].get_group()), (shape, axis)
                assert ours == list(comm.Get_group().Translate_ranks(None, world.Get_group())), (shape, axis)
        checked += 1
print(f"rank {world.rank}: {checked} layouts equal to init_device_mesh", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.mpi_job
def test_eight_ranks_every_layout_and_all_three_axes(world):
    if world.size != 1:
        pytest.skip("the 8-rank jobs run from the serial suite (python -m pytest, mpiexec -n 1)")
    pytest.importorskip("torch")
    layouts_job = run_mpi(8, ["-c", EIGHT_RANK_LAYOUTS], timeout=300)
    assert layouts_job.returncode == 0, layouts_job.stderr[-3000:]
    assert layouts_job.stdout.count("10 layouts equal to init_device_mesh") == 8, layouts_job.stdout
    training = run_mpi(8, [os.path.join(REPO, "scripts", "jobs", "train_mesh.py"), "-T", "2", "-D", "2"], timeout=300)
    assert training.returncode == 0, training.stdout[-2000:] + training.stderr[-3000:]
    assert "train_mesh: dp 2 x tp 2 x domain 2 on 8 ranks, 3 steps: equal to one process" in training.stdout
