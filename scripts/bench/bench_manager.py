"""Time building the domain-parallel mesh: mpidomain (MPI Split) vs CREDIT (torch new_group on gloo).

Run ``python scripts/bench/bench_manager.py`` (it starts ``mpiexec -n N`` for N in
2, 4, 8 and prints one table), or run one world yourself with
``mpiexec -n 4 python scripts/bench/bench_manager.py --worker``. Each world builds the
mesh with D = 2: mpidomain's ``DomainParallelManager`` (Dup + 3 Splits, a
constant number of collectives), and CREDIT's loop of
``torch.distributed.new_group`` for every domain and data-parallel group on
every rank. Times are medians over repetitions, the ratio is CREDIT / mpidomain.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _median_time(comm, build, repeats):
    times = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        result = build()
        comm.Barrier()
        times.append(time.perf_counter() - start)
        result()
    return statistics.median(times)


def _credit_groups(world_size, d):
    import torch.distributed as dist

    def build():
        groups = [dist.new_group(list(range(i * d, (i + 1) * d))) for i in range(world_size // d)]
        groups += [dist.new_group(list(range(j, world_size, d))) for j in range(d)]

        def free():
            for group in groups:
                if group is not dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(group)

        return free

    return build


def worker(repeats):
    from mpi4py import MPI

    import torch.distributed as dist
    from mpidomain import DomainParallelManager, init_torch_distributed

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    d = 2 if size % 2 == 0 else 1

    def ours():
        manager = DomainParallelManager(size, d)
        return manager.close

    ours()  # warm up MPI's communicator machinery
    mpi_time = _median_time(comm, ours, repeats)

    init_torch_distributed(backend="gloo")
    torch_time = _median_time(comm, _credit_groups(size, d), max(2, repeats // 10))
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"ranks": size, "D": d, "mpidomain_s": mpi_time, "credit_gloo_s": torch_time}), flush=True)


def driver(worlds, repeats):
    launcher = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    launcher = launcher if os.path.exists(launcher) else "mpiexec"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    rows = []
    for n in worlds:
        out = subprocess.run(
            [launcher, "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker", "--repeats", str(repeats)],
            env=env, capture_output=True, text=True, timeout=600, check=True,
        ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"mesh construction, median of repeats (D=2), {socket.gethostname()}, {os.cpu_count()} cores")
    print(f"{'ranks':>5}  {'mpidomain':>12}  {'CREDIT new_group/gloo':>22}  {'ratio':>8}")
    for row in rows:
        ratio = row["credit_gloo_s"] / row["mpidomain_s"]
        print(f"{row['ranks']:>5}  {row['mpidomain_s'] * 1e3:>10.3f}ms  {row['credit_gloo_s'] * 1e3:>20.3f}ms  {ratio:>7.0f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help="measure in the current MPI world")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="world sizes to start")
    parser.add_argument("--repeats", type=int, default=50, help="repetitions of the mpidomain build")
    args = parser.parse_args()
    if args.worker:
        worker(args.repeats)
    else:
        driver(args.ranks, args.repeats)


if __name__ == "__main__":
    main()
