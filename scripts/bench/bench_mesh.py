"""Time building the (dp, tp, domain) mesh: MPI communicators two ways, then with torch groups vs init_device_mesh.

    mpiexec -n 8 python scripts/bench/bench_mesh.py -T 2 -D 2 [--repeats 20]

Phase 1, MPI only (the manager's communicators, from a duplicate of COMM_WORLD):

- ``Split`` x 3: one ``Split`` per axis, coloured by the rank's group index
  along it (what :class:`mpidomain.DomainParallelManager` does);
- ``Create_cart`` + ``Sub`` x 3: one Cartesian communicator of shape
  (dp, tp, domain), without reordering, and a ``Sub`` per axis;
- the whole ``DomainParallelManager`` (node communicator, private duplicates).

Phase 2, torch.distributed (gloo) started once from MPI:

- ``DomainParallelManager(..., torch_bridge=True)`` and its ``device_mesh``;
- ``init_device_mesh("cpu", (dp, tp, domain), mesh_dim_names=...)`` (the baseline).

Both phases check that each way's groups have the same members, time every
repetition from a barrier to the slowest rank's finish, take turns, and print
medians with ratios to the first row of the phase.
"""

import argparse
import statistics
import time

from mpi4py import MPI

import mpidomain
from mpidomain.layout.mesh import AXES, Mesh


def _timed(comm, build):
    comm.Barrier()
    start = time.perf_counter()
    result = build()
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX), result


def _members(comm, world):
    return list(comm.Get_group().Translate_ranks(None, world.Get_group()))


def by_split(world, mesh):
    parent = world.Dup()
    return parent, [parent.Split(mesh.group_index(axis), world.rank) for axis in AXES]


def by_cart(world, mesh):
    parent = world.Dup()
    cart = parent.Create_cart(list(mesh.shape), periods=[False] * 3, reorder=False)
    subs = [cart.Sub([axis == keep for axis in AXES]) for keep in AXES]
    return parent, [cart, *subs]


def _report(world, title, rows):
    if world.rank != 0:
        return
    print(title, flush=True)
    baseline = statistics.median(rows[0][1])
    for name, times in rows:
        median = statistics.median(times)
        print(f"  {name:58s} {median * 1e3:9.3f} ms   x{median / baseline:5.2f}   (median of {len(times)})",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-parallel-size", "-T", type=int, default=2)
    parser.add_argument("--domain-parallel-size", "-D", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    t, d = args.tensor_parallel_size, args.domain_parallel_size
    if world.size % (t * d):
        raise SystemExit(f"-T {t} x -D {d} must divide the {world.size} ranks")
    mesh = Mesh((world.size // (t * d), t, d), world.rank)

    # -- Phase 1: MPI ------------------------------------------------------------
    ways = [("Split x 3 (the manager's way)", by_split), ("Create_cart + Sub x 3", by_cart)]
    times = {name: [] for name, _ in ways}
    manager_times = []
    for repeat in range(args.repeats + 1):  # the first round warms MPI up and is not counted
        for name, way in ways:
            elapsed, (parent, comms) = _timed(world, lambda: way(world, mesh))
            axes = comms[-3:]
            assert [_members(c, world) for c in axes] == [mesh.group_ranks(axis) for axis in AXES], name
            for comm in comms:
                comm.Free()
            parent.Free()
            if repeat:
                times[name].append(elapsed)
        elapsed, manager = _timed(world, lambda: mpidomain.DomainParallelManager(
            world.size, d, tensor_parallel_size=t, bind_device="none"))
        manager.close()
        if repeat:
            manager_times.append(elapsed)
    _report(world, f"{world.size} ranks, mesh (dp, tp, domain) = {mesh.shape}: MPI communicators, slowest rank",
            [*times.items(), ("DomainParallelManager (all its communicators)", manager_times)])

    # -- Phase 2: torch groups and the DeviceMesh -----------------------------------
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mpidomain.init_torch_distributed(backend="gloo")
    bridged, reference_times = [], []
    for repeat in range(max(3, args.repeats // 2)):
        def ours():
            manager = mpidomain.DomainParallelManager(world.size, d, tensor_parallel_size=t, torch_bridge=True,
                                                      bind_device="none")
            return manager, manager.device_mesh

        def theirs():
            return init_device_mesh("cpu", mesh.shape, mesh_dim_names=AXES)

        if repeat % 2:  # alternate which goes first
            elapsed, reference = _timed(world, theirs)
            reference_times.append(elapsed)
        elapsed, (manager, device_mesh) = _timed(world, ours)
        bridged.append(elapsed)
        if not repeat % 2:
            elapsed, reference = _timed(world, theirs)
            reference_times.append(elapsed)
        for axis in AXES:
            ranks = dist.get_process_group_ranks(device_mesh[axis].get_group())
            assert ranks == dist.get_process_group_ranks(reference[axis].get_group()) == mesh.group_ranks(axis)
        check = torch.ones(1)
        dist.all_reduce(check, group=device_mesh["tp"].get_group())
        assert check.item() == t
        manager.close()
        for group in reference.get_all_groups():
            if dist.get_process_group_ranks(group) != list(range(world.size)):
                dist.destroy_process_group(group)
    _report(world, f"{world.size} ranks, torch {torch.__version__}, gloo: the mesh with torch groups, slowest rank",
            [("init_device_mesh (baseline)", reference_times),
             ("DomainParallelManager(torch_bridge=True) + device_mesh", bridged)])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
