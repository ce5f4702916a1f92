"""Benchmark overlapped halo exchanges: the converted UNet's training step with and without overlap.

Run under MPI, every rank in one domain group (latitude slabs)::

    mpiexec -n 2 python scripts/bench/bench_overlap.py
    mpiexec -n 2 python scripts/bench/bench_overlap.py --height 360 --width 720 --repeats 15

``mpidomain.models.UNet`` converted by ``mpidomain.models.convert_model``; one training step is forward,
a mean-squared loss, backward, ``allreduce_gradients`` and an SGD step. The two settings take turns
(``set_overlap(True)`` / ``set_overlap(False)``), each repeat after a barrier, the order alternating;
each step's time is the slowest rank's. Printed: the median and fastest step of each, and the ratio of
medians (overlap / no overlap: below 1 means overlap is faster).
"""

import argparse
import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mpidomain  # noqa: E402
from mpidomain.models import UNet, convert_model  # noqa: E402
from mpidomain.nn import allreduce_gradients, set_overlap  # noqa: E402

WORLD = MPI.COMM_WORLD


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=180)
    parser.add_argument("--width", type=int, default=360)
    parser.add_argument("--channels", type=int, default=2)
    parser.add_argument("--model-width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20, help="steps per setting (after 2 warm-up steps each)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    manager = mpidomain.initialize_domain_parallel(WORLD.size, WORLD.size)
    torch.manual_seed(0)
    model = convert_model(UNet(args.channels, args.model_width), manager)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    field = torch.randn(args.batch, args.channels, args.height, args.width)
    x = mpidomain.shard_tensor(field, allow_uneven=True, manager=manager)
    target = torch.roll(x, 1, -1)

    def step(overlap):
        set_overlap(overlap)
        WORLD.Barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = ((model(x) - target) ** 2).mean()
        loss.backward()
        allreduce_gradients(model, group="domain", op="sum", manager=manager)
        optimizer.step()
        return WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX)

    for overlap in (True, False, True, False):  # warm-up: plans, allocator
        step(overlap)
    times = {True: [], False: []}
    for r in range(args.repeats):
        for overlap in ((True, False) if r % 2 == 0 else (False, True)):
            times[overlap].append(step(overlap))
    set_overlap(None)
    if WORLD.rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"UNet(channels={args.channels}, width={args.model_width}) training step, field "
              f"({args.batch}, {args.channels}, {args.height}, {args.width}) float32, {WORLD.size} ranks (latitude "
              f"slabs), torch threads {args.threads}, {args.repeats} interleaved repeats, {os.cpu_count()} cores")
        for overlap in (False, True):
            print(f"  overlap={str(overlap):5}  median {med[overlap] * 1e3:9.3f} ms  fastest "
                  f"{min(times[overlap]) * 1e3:9.3f} ms")
        print(f"  ratio overlap / no overlap (medians): {med[True] / med[False]:.3f}")
    manager.close()


if __name__ == "__main__":
    main()
