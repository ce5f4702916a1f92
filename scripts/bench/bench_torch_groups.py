"""Cost of creating the manager's torch groups, three ways, at the world size it runs on.

    mpiexec -n 8 python scripts/bench/bench_torch_groups.py [-D 2] [-T 1] [--repeats 5]

Baseline: ``new_group`` for every domain, tensor- and data-parallel group on every rank
(CREDIT's way, and what mpidomain does). Compared with
``new_subgroups_by_enumeration`` (one call per kind of group) and
``new_group(ranks, use_local_synchronization=True)`` called only for this
rank's three groups. Each way is checked (members, rank order, an all_reduce)
and timed from an MPI barrier to the slowest rank's finish; the ways take
turns, and the median of the repeats is printed with its ratio to the baseline.

The locally synchronised way is timed on its first creation only: its groups
are named by a hash of their ranks, so creating the same membership again in
the same job (re-initialising the manager) reads the old group's rendezvous
keys from the store and hangs (seen with 8 ranks and gloo). That, and NCCL's
communicator splits needing every rank, rule it out whatever its speed.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpidomain
from mpidomain.torch_bridge import destroy_torch_groups, new_torch_groups


def every_group_on_every_rank(axes):
    return new_torch_groups(axes)


def by_enumeration(axes):
    return tuple(dist.new_subgroups_by_enumeration(groups)[0] for groups in axes)


def own_groups_locally_synchronised(axes):
    rank = dist.get_rank()
    mine = [ranks for groups in axes for ranks in groups if rank in ranks]
    return tuple(dist.new_group(ranks, use_local_synchronization=True) for ranks in mine)


# (name, way, whether it can be repeated in one job)
WAYS = (
    ("new_group, every group on every rank (baseline)", every_group_on_every_rank, True),
    ("new_subgroups_by_enumeration", by_enumeration, True),
    ("new_group(use_local_synchronization=True), own groups", own_groups_locally_synchronised, False),
)


def check(groups, expected):
    for group, ranks in zip(groups, expected):
        assert dist.get_process_group_ranks(group) == ranks, (dist.get_process_group_ranks(group), ranks)
        assert dist.get_rank(group) == ranks.index(dist.get_rank())
        total = torch.ones(1)
        dist.all_reduce(total, group=group)
        assert total.item() == len(ranks)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain-parallel-size", "-D", type=int, default=2)
    parser.add_argument("--tensor-parallel-size", "-T", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    manager = mpidomain.DomainParallelManager(world.size, args.domain_parallel_size,
                                              tensor_parallel_size=args.tensor_parallel_size)
    mpidomain.init_torch_distributed(backend="gloo")
    names = ("domain", "tp", "dp")
    axes = [manager.mesh.groups(name) for name in names]
    expected = tuple(manager.mesh.group_ranks(name) for name in names)

    times = {name: [] for name, _, _ in WAYS}
    for repeat in range(args.repeats):
        for name, way, repeatable in WAYS:
            if repeat and not repeatable:
                continue
            world.Barrier()
            start = time.perf_counter()
            groups = way(axes)
            elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
            check(groups, expected)
            world.Barrier()
            destroy_torch_groups(groups)
            times[name].append(elapsed)
    medians = {name: statistics.median(t) for name, t in times.items()}

    if world.rank == 0:
        counts = " + ".join(f"{len(groups)} {name}" for name, groups in zip(names, axes))
        print(f"torch {torch.__version__}, gloo, {world.size} ranks, T={manager.tensor_parallel_size}, "
              f"D={manager.domain_parallel_size}: {counts} groups; slowest rank")
        baseline = medians[WAYS[0][0]]
        for name, _, _ in WAYS:
            print(f"  {name:55s} {medians[name] * 1e3:9.1f} ms   x{medians[name] / baseline:5.2f}"
                  f"   (median of {len(times[name])})")
    dist.destroy_process_group()
    manager.close()


if __name__ == "__main__":
    main()
