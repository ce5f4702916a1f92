"""Benchmark gather_tensor and scatter_tensor against raw MPI and torch.distributed (gloo), in one run.

Run under MPI; the domain group is the whole world (D = number of ranks):

    mpiexec -n 2 python scripts/bench/bench_collectives.py
    mpiexec -n 4 python scripts/bench/bench_collectives.py

The field is (1, 64, 720, 1440) float32 (265 MB), split along latitude (dim -2).
Baselines, measured in the same run and interleaved with ours round by round:
raw mpi4py ``Allgather`` / ``Scatter`` of contiguous buffers (the same bytes,
no reassembly, into a reused buffer); torch.distributed on gloo
(``all_gather`` + ``torch.cat``, as CREDIT gathers; ``scatter`` of contiguous
chunks). mpidomain runs with ``out=`` (a reused result, like the raw call's
buffer) and without (a new result each call: on small machines the page
faults of a fresh 265 MB array cost about as much as the transfer). Two gather
designs mpidomain does not use are timed too (``Allgatherv`` with resized row
datatypes; a contiguous ``Allgather`` then a transposing copy). Each time is
the median over rounds of the slowest rank's time. Target: mpidomain within
1.3x of the raw MPI call.
"""

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mpidomain  # noqa: E402
import mpidomain.abort  # noqa: E402
from mpidomain import balanced_split, gather_tensor, scatter_tensor  # noqa: E402

TARGET = 1.3


def _timed(comm, function):
    comm.Barrier()
    start = time.perf_counter()
    function()
    elapsed = time.perf_counter() - start
    return comm.allreduce(elapsed, op=MPI.MAX)


def _gather_cases(comm, manager, shape, torch, dist):
    d, rank = comm.size, comm.rank
    counts, offsets = balanced_split(shape[-2], d)
    local = np.random.default_rng(rank).standard_normal(shape[:2] + (counts[rank], shape[3])).astype(np.float32)
    local_torch = torch.from_numpy(local.copy())
    flat = np.empty(local.size * d, np.float32)
    pieces = [torch.empty_like(local_torch) for _ in range(d)]
    outer, rows, row_bytes = shape[0] * shape[1], shape[2], shape[3] * 4
    row = MPI.BYTE.Create_contiguous(row_bytes)
    recv_vector, send_vector = row.Create_vector(outer, 1, rows), row.Create_vector(outer, 1, counts[rank])
    recv_type = recv_vector.Create_resized(0, row_bytes).Commit()
    send_type = send_vector.Create_resized(0, row_bytes).Commit()
    full = np.empty(shape, np.float32)

    def allgatherv_resized():
        comm.Allgatherv([local, counts[rank], send_type], [full, (counts, offsets), recv_type])

    def allgather_then_transpose():
        comm.Allgather(local, flat)
        np.copyto(full.reshape(outer, d, counts[0], shape[3]),
                  flat.reshape(d, outer, counts[0], shape[3]).transpose(1, 0, 2, 3))

    def gloo():
        dist.all_gather(pieces, local_torch)
        torch.cat(pieces, dim=-2)

    out, out_torch = np.empty(shape, np.float32), torch.empty(shape)
    cases = {
        "raw MPI Allgather": lambda: comm.Allgather(local, flat),
        "mpidomain gather_tensor NumPy, out=": lambda: gather_tensor(local, -2, manager, out=out),
        "mpidomain gather_tensor Torch, out=": lambda: gather_tensor(local_torch, -2, manager, out=out_torch),
        "mpidomain gather_tensor NumPy": lambda: gather_tensor(local, -2, manager),
        "mpidomain gather_tensor Torch": lambda: gather_tensor(local_torch, -2, manager),
        "gloo all_gather + torch.cat": gloo,
        "not chosen: Allgatherv, resized rows": allgatherv_resized,
    }
    if len(set(counts)) == 1:
        cases["not chosen: Allgather + transpose copy"] = allgather_then_transpose
    gathered = gather_tensor(local, -2, manager)
    assert np.array_equal(gathered[:, :, offsets[rank]:offsets[rank] + counts[rank]], local)
    assert np.isclose(gathered.sum(dtype=np.float64), comm.allreduce(local.sum(dtype=np.float64)))
    return cases, [recv_type, send_type, recv_vector, send_vector, row]


def _scatter_cases(comm, manager, shape, torch, dist):
    d, rank = comm.size, comm.rank
    counts, offsets = balanced_split(shape[-2], d)
    full = np.random.default_rng(0).standard_normal(shape).astype(np.float32) if rank == 0 else None
    full_torch = torch.from_numpy(full) if rank == 0 else None
    mine = np.empty(shape[:2] + (counts[rank], shape[3]), np.float32)
    packed = np.concatenate([full[:, :, o:o + c].reshape(-1) for o, c in zip(offsets, counts)]) if rank == 0 else None
    mine_torch = torch.from_numpy(mine.copy())

    def gloo():
        chunks = [c.contiguous() for c in full_torch.split(counts, dim=-2)] if rank == 0 else None
        dist.scatter(mine_torch, chunks, src=0)

    out, out_torch = np.empty_like(mine), torch.empty_like(mine_torch)
    cases = {
        "raw MPI Scatter": lambda: comm.Scatter(packed, mine, root=0),
        "mpidomain scatter_tensor NumPy, out=": lambda: scatter_tensor(full, -2, 0, manager, out=out),
        "mpidomain scatter_tensor Torch, out=": lambda: scatter_tensor(full_torch, -2, 0, manager, out=out_torch),
        "mpidomain scatter_tensor NumPy": lambda: scatter_tensor(full, -2, 0, manager),
        "mpidomain scatter_tensor Torch": lambda: scatter_tensor(full_torch, -2, 0, manager),
        "gloo scatter (contiguous chunks)": gloo,
    }
    sums = [full[:, :, o:o + c].sum(dtype=np.float64) for o, c in zip(offsets, counts)] if rank == 0 else None
    assert np.isclose(scatter_tensor(full, -2, 0, manager).sum(dtype=np.float64), comm.bcast(sums)[rank], rtol=1e-9)
    return cases, []


def _run(comm, title, cases, rounds):
    """Time every case ``rounds`` times, interleaved; print medians and ratios against the first case."""
    times = {name: [] for name in cases}
    for function in cases.values():  # warm-up
        _timed(comm, function)
    for _ in range(rounds):
        for name, function in cases.items():
            times[name].append(_timed(comm, function))
    medians = {name: float(np.median(values)) for name, values in times.items()}
    baseline = next(iter(medians))
    if comm.rank == 0:
        print(f"\n{title}")
        print(f"  {'case':40s} {'median ms':>10s} {'vs raw MPI':>11s}  target {TARGET}x")
        for name in cases:
            if name == baseline:
                print(f"  {name:40s} {medians[name] * 1e3:10.1f}", flush=True)
                continue
            ratio = medians[name] / medians[baseline]
            verdict = ("pass" if ratio <= TARGET else "MISS") if name.startswith("mpidomain") else ""
            print(f"  {name:40s} {medians[name] * 1e3:10.1f} {ratio:10.2f}x  {verdict}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per case (default 5)")
    parser.add_argument("--shape", type=int, nargs=4, default=[1, 64, 720, 1440], help="B C H W")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    mpidomain.abort.install_abort_on_error()  # a failed check on one rank ends the job, not a hang
    comm = MPI.COMM_WORLD
    import torch.distributed as dist

    mpidomain.init_torch_distributed(backend="gloo", comm=comm)
    shape = tuple(args.shape)
    if comm.rank == 0:
        print(f"bench_collectives: {comm.size} ranks, field {shape} float32 ({np.prod(shape) * 4 / 1e6:.0f} MB), "
              f"dim -2, {args.rounds} rounds")
        print(f"  {MPI.Get_library_version().splitlines()[0]} | mpi4py {sys.modules['mpi4py'].__version__} | "
              f"torch {torch.__version__} | {os.cpu_count()} CPUs")
    with mpidomain.DomainParallelManager(comm.size, comm.size) as manager:
        for title, build in (("gather (all-gather along latitude)", _gather_cases),
                             ("scatter from rank 0 along latitude", _scatter_cases)):
            cases, types = build(comm, manager, shape, torch, dist)
            _run(comm, title, cases, args.rounds)
            for datatype in types:
                datatype.Free()
            del cases
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
