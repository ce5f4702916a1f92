"""Benchmark domain-parallel convolutions: exchange-then-convolve against an overlapped variant.

Run under MPI with every rank in one domain group (latitude, dim -2, sharded)::

    mpiexec -n 2 python scripts/bench/bench_layers.py
    mpiexec -n 4 python scripts/bench/bench_layers.py

Each rank holds one float32 shard of the given shape; a 3x3 convolution (C -> C, padding 1).
Rows, all measured in the same run, taking turns after a barrier (slowest rank's median):

- local convolution: the same layer on the shard alone, no communication (the compute floor);
- DomainParallelConv2d: what the library runs (halo exchange, then one convolution);
- overlapped: the layer's agreement steps, then ``HaloPlan.start``, the interior rows
  convolved while the halos travel, ``wait``, then the two boundary rows;
- overlapped with progress: the same, the interior convolved in four chunks with an MPI
  call between them, so that MPI can move the halos during the computation;
- forward and backward of DomainParallelConv2d against the local layer's.

The library keeps exchange-then-convolve unless an overlapped variant's median is below
exchange-then-convolve's fastest call (the verdict line: a win beyond this machine's noise).
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mpidomain  # noqa: E402
from bench_halo import timed  # noqa: E402
from mpidomain._agreement import agree  # noqa: E402
from mpidomain.halo.call import cached_plan  # noqa: E402
from mpidomain.manager import library_comm  # noqa: E402
from mpidomain.nn import DomainParallelConv2d  # noqa: E402

WORLD = MPI.COMM_WORLD


def layer_plan(x, manager):
    """What DomainParallelConv2d does before its halo exchange: agree, then find the halo plan (agreed too)."""
    agree(library_comm(manager), "DomainParallelConv2d (overlapped)", (tuple(x.shape[:-2]), x.shape[-1]))
    return cached_plan(x, 1, -2, manager=manager)


def bench(shape, repetitions, manager, rows):
    torch.manual_seed(0)
    channels = shape[1]
    conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
    layer = DomainParallelConv2d(conv, manager=manager)
    x = torch.randn(shape)
    weight, bias = conv.weight.detach(), conv.bias.detach()
    comm = manager.domain_comm
    padded = layer_plan(x, manager).empty()

    def overlapped(chunks=1):
        # The same agreement steps as the layer (its own, then the halo plan cache's), so that the
        # rows compare overlap alone: only the order of halo transfer and computation differs.
        plan = layer_plan(x, manager)
        plan.interior(padded)[...] = x
        plan.start(padded)
        n = x.shape[-2]
        bounds = [1 + (n - 2) * i // chunks for i in range(chunks + 1)]
        inner = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            inner.append(F.conv2d(x[..., lo - 1:hi + 1, :], weight, bias, padding=(0, 1)))
            if chunks > 1:
                comm.Iprobe()  # any MPI call lets MPI progress the halos
        plan.wait()
        top = F.conv2d(padded[..., 0:3, :], weight, bias, padding=(0, 1))
        bottom = F.conv2d(padded[..., -3:, :], weight, bias, padding=(0, 1))
        return torch.cat([top, *inner, bottom], dim=-2)

    def forward_backward(module, source):
        source = source.detach().requires_grad_()
        module(source).sum().backward()

    with torch.no_grad():
        expected = layer(x)
        assert torch.equal(overlapped(), expected) and torch.allclose(overlapped(4), expected)
        measured = timed({
            "local convolution": lambda: conv(x),
            "DomainParallelConv2d": lambda: layer(x),
            "overlapped": overlapped,
            "overlapped with progress": lambda: overlapped(4),
        }, repetitions)
    measured.update(timed({
        "local forward+backward": lambda: forward_backward(conv, x),
        "DomainParallelConv2d forward+backward": lambda: forward_backward(layer, x),
    }, repetitions))
    label = f"{shape}"
    for name, (median, fastest) in measured.items():
        rows.append((label, name, f"{median * 1e3:9.3f}", f"{fastest * 1e3:9.3f}", ""))
    m = {name: median for name, (median, _) in measured.items()}
    for name, baseline in (("DomainParallelConv2d", "local convolution"),
                           ("overlapped", "DomainParallelConv2d"),
                           ("overlapped with progress", "DomainParallelConv2d"),
                           ("DomainParallelConv2d forward+backward", "local forward+backward")):
        rows.append((label, f"{name} / {baseline}", "", "", f"{m[name] / m[baseline]:6.2f}x"))
    best = min(("overlapped", "overlapped with progress"), key=m.get)
    fastest = measured["DomainParallelConv2d"][1]
    wins = m[best] < fastest  # beyond the noise: its median under exchange-then-convolve's fastest call
    rows.append((label, f"verdict: {best} {'wins' if wins else 'does not win'} "
                        f"({m[best] / m['DomainParallelConv2d']:.2f}x of exchange-then-convolve's median, "
                        f"{m[best] / fastest:.2f}x of its fastest)", "", "", ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=None, help="repetitions per row (default: by size)")
    parser.add_argument("--small-only", action="store_true", help="only the small shape (a quick check)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank
    manager = mpidomain.initialize_domain_parallel(WORLD.size, WORLD.size)
    rows = []
    for shape in ((2, 16, 64, 128),) if args.small_only else ((1, 64, 180, 1440), (2, 16, 64, 128)):
        large = shape[-2] * shape[-1] >= 100_000
        bench(shape, args.repetitions or (5 if large else 50), manager, rows)
    if WORLD.rank == 0:
        print(f"ranks: {WORLD.size} (one domain group), float32, 3x3 convolution C->C, latitude sharded, "
              "torch threads 1")
        print(f"MPI: {MPI.Get_library_version().splitlines()[0]}; torch {torch.__version__}; {os.cpu_count()} cores")
        print(f"{'shard':20} {'measurement (ratios of medians)':62} {'median ms':>9} {'min ms':>9} {'ratio':>7}")
        for label, name, median, fastest, ratio in rows:
            print(f"{label:20} {name:62} {median:>9} {fastest:>9} {ratio:>7}")
    manager.close()


if __name__ == "__main__":
    main()
