"""Halo exchange of CUDA tensors: mpidomain against a hand-written mpi4py exchange and the device copy floor.

Run on a machine with a CUDA device, every rank in one domain group (ranks share the devices)::

    mpiexec -n 2 python scripts/bench/bench_halo_gpu.py
    mpiexec -n 4 python scripts/bench/bench_halo_gpu.py

Float32 Torch tensors on the GPU, halo 1 along latitude (dim -2), both shapes of
``bench_halo.py``: small (2, 16, 64, 128) and large (1, 64, 180, 1440) per rank. Rows, median
time per call over the repetitions (each call ends with ``torch.cuda.synchronize()``):

- ``floor``: the padded result built on the device with no messages (``torch.cat`` of zero rows
  and the shard): what any exchange that returns a new tensor must at least cost;
- ``hand``: what a user writes with mpi4py where MPI is not CUDA-aware: the edge rows copied to
  the host (``.cpu()``), ``Isend``/``Irecv`` of NumPy buffers, ``Waitall``, the received rows
  copied back and ``torch.cat``;
- ``mpidomain``: ``halo_exchange(x, 1)`` (new result) and ``halo_exchange(x, 1, out=buf)``,
  with the transport ``cuda_aware_decision()`` picks (staged where MPI is not CUDA-aware).

Prints the ratios against ``hand`` and ``floor`` measured in the same run, and checks that each
result equals the hand-written one bit for bit (the verdict is agreed across ranks).
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mpidomain  # noqa: E402
from mpidomain import DomainParallelManager, halo_exchange  # noqa: E402

WORLD = MPI.COMM_WORLD
SHAPES = {"small": (2, 16, 64, 128), "large": (1, 64, 180, 1440)}


def hand_written(x, comm):
    """The staged exchange a user writes: edge rows to the host, mpi4py, back to the device, ``torch.cat``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    up, down = rank - 1, rank + 1
    edge = x[..., :1, :].shape
    received = {}
    requests = []
    for peer, rows in ((up, x[..., :1, :]), (down, x[..., -1:, :])):
        if 0 <= peer < size:
            buffer = np.empty(edge, np.float32)
            received[peer] = buffer
            requests.append(comm.Irecv(buffer, source=peer, tag=7))
            requests.append(comm.Isend(np.ascontiguousarray(rows.cpu().numpy()), dest=peer, tag=7))
    MPI.Request.Waitall(requests)
    zeros = torch.zeros(edge, dtype=x.dtype, device=x.device)
    top = torch.from_numpy(received[up]).to(x.device) if up in received else zeros
    bottom = torch.from_numpy(received[down]).to(x.device) if down in received else zeros
    return torch.cat([top, x, bottom], dim=-2)


def timed(call, repetitions):
    """Median seconds of ``call()`` over ``repetitions`` after two warm-ups, the ranks started together."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repetitions):
        WORLD.Barrier()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return WORLD.allreduce(statistics.median(times), op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_halo_gpu.py needs a CUDA device")
    torch.cuda.set_device(WORLD.rank % torch.cuda.device_count())
    decision = mpidomain.devices.cuda_aware_decision()
    if WORLD.rank == 0:
        print(f"{WORLD.size} ranks on {torch.cuda.device_count()} x {torch.cuda.get_device_name()}; "
              f"CUDA-aware MPI: {decision.enabled} ({decision.reason})")
    ok = True
    with DomainParallelManager(WORLD.size, WORLD.size) as manager:
        comm = manager.domain_comm
        for name, shape in SHAPES.items():
            generator = torch.Generator(device="cuda").manual_seed(WORLD.rank)
            x = torch.randn(shape, device="cuda", generator=generator)
            zeros = torch.zeros(shape[:-2] + (1, shape[-1]), device="cuda")
            out = torch.empty(shape[:-2] + (shape[-2] + 2, shape[-1]), device="cuda")
            reference = hand_written(x, comm)
            ok &= torch.equal(halo_exchange(x, 1, manager=manager), reference)
            ok &= torch.equal(halo_exchange(x, 1, manager=manager, out=out), reference)
            rows = {
                "floor": timed(lambda: torch.cat([zeros, x, zeros], dim=-2), args.repetitions),
                "hand": timed(lambda: hand_written(x, comm), args.repetitions),
                "mpidomain": timed(lambda: halo_exchange(x, 1, manager=manager), args.repetitions),
                "mpidomain out=": timed(lambda: halo_exchange(x, 1, manager=manager, out=out), args.repetitions),
            }
            if WORLD.rank == 0:
                print(f"\n{name} {shape} float32 on the GPU, halo 1, {WORLD.size} ranks")
                for row, seconds in rows.items():
                    print(f"  {row:15s} {seconds * 1e6:10.1f} us   /hand {seconds / rows['hand']:5.2f}   "
                          f"/floor {seconds / rows['floor']:6.2f}")
    ok = WORLD.allreduce(bool(ok), op=MPI.LAND)
    if WORLD.rank == 0:
        print("\nresults equal the hand-written exchange bit for bit:", ok)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
