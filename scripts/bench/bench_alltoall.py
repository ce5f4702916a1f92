#!/usr/bin/env python
"""The window attention's all-to-all on tiles: both dims at once against one dim after the other.

    mpiexec -n 4 python scripts/bench/bench_alltoall.py [--tiles 2x2] [--grid 181x360]

CREDIT's CrossFormer at 1 degree (the configuration of ``scripts/bench/bench_step.py``; skipped with the
install line where CREDIT is missing) converted on latitude x longitude tiles. One training step
records every ``DomainParallelWindowAttention`` call (its kind, window and this rank's input shape);
then, for each, the bytes this rank sends (:class:`mpidomain.nn.CommStats`) for the move that deals
whole windows out and its inverse, done two ways: one all-to-all over both dims (``redistribute`` with
a pair of moves: what the layer does) and one along latitude then one along longitude. Forward and
backward each make the move and its inverse, so a step sends twice each row's sum. The table shows
the busiest rank (the most bytes one dim after the other); the last line checks every rank's sum of the
pair column against CommStats of a real training step.
Counts are exact (no timing).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench_step import build  # noqa: E402

import mpidomain  # noqa: E402
from mpidomain import DomainParallelManager, redistribute  # noqa: E402
from mpidomain.models import convert_model, credit_missing  # noqa: E402
from mpidomain.nn import CommStats, DomainParallelWindowAttention, allreduce_gradients  # noqa: E402
from mpidomain.nn.redistribution import inverse_move  # noqa: E402
from mpidomain.nn.stats import LABELS  # noqa: E402
from mpidomain.layout.moves import window_move  # noqa: E402

ALLTOALL = "all-to-all"


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", default=None, help="D_lat x D_lon; default 2 x (ranks // 2)")
    parser.add_argument("--grid", default="181x360", help="H x W; default 181x360 (1 degree)")
    return parser.parse_args(argv)


def sent(stats):
    """All-to-all bytes this rank sent while ``stats`` was open."""
    return sum(v for k, v in stats.by_kind.items() if k.startswith(ALLTOALL))


def main(argv=None):
    from mpi4py import MPI

    args = parse(argv)
    world = MPI.COMM_WORLD
    size = world.Get_size()
    tiles = tuple(int(v) for v in args.tiles.split("x")) if args.tiles else (2, size // 2)
    if len(tiles) != 2 or tiles[0] * tiles[1] != size or min(tiles) < 2:
        if world.Get_rank() == 0:
            print(f"--tiles {args.tiles or tiles}: needs two counts >= 2 whose product is the {size} ranks, "
                  "e.g. mpiexec -n 4 ... --tiles 2x2", file=sys.stderr)
        return 2
    missing = credit_missing()
    if missing is not None:
        if world.Get_rank() == 0:
            print(f"CrossFormer: skipped ({missing})")
        return 0
    shape = tuple(int(v) for v in args.grid.split("x"))
    torch.set_num_threads(1)
    with DomainParallelManager(size, tiles, (-2, -1)) as manager:
        model, field = build("crossformer", shape)
        model = convert_model(model, manager)
        x = mpidomain.shard_tensor(field, dim=(-2, -1), manager=manager, allow_uneven=True)
        calls = []
        hooks = [m.register_forward_pre_hook(lambda m, a: calls.append((m.kind, m.window_size, tuple(a[0].shape))))
                 for m in model.modules() if isinstance(m, DomainParallelWindowAttention)]

        def step():
            model.zero_grad(set_to_none=True)
            model(x).square().sum().backward()
            allreduce_gradients(model, group="domain", op="sum", manager=manager)

        with CommStats(manager) as whole:
            step()
        for hook in hooks:
            hook.remove()
        shapes = manager.domain_comm.allgather([s for _, _, s in calls])
        i_lat, i_lon = manager.domain_coords
        rows = []
        for n, (kind, window, mine) in enumerate(calls):
            lat = [shapes[r * tiles[1]][n][-2] for r in range(tiles[0])]
            lon = [shapes[c][n][-1] for c in range(tiles[1])]
            pair = (window_move(kind, lat, window), window_move(kind, lon, window))
            y = torch.zeros(mine)
            counts = []
            for moves in ([((-2, -1), pair)], [(-2, pair[0]), (-1, pair[1])]):
                with CommStats(manager) as stats:
                    z = y
                    for dim, move in moves:
                        z = redistribute(z, move, dim, manager=manager)
                    for dim, move in reversed(moves):
                        z = redistribute(z, inverse_move(move), dim, manager=manager)
                counts.append(2 * sent(stats))  # forward and backward
            rows.append((kind, window, mine, *counts))
        measured = whole.by_kind.get(LABELS[("alltoall", "attention")], 0)
        table = manager.domain_comm.gather(rows, root=0)
        totals = manager.domain_comm.gather(measured, root=0)
        if manager.domain_rank == 0:
            # The busiest rank: the most bytes sent one dim after the other over the whole step.
            busiest = max(range(size), key=lambda r: (sum(row[4] for row in table[r]), -r))
            print(f"CREDIT's CrossFormer {shape[0]} x {shape[1]}, {tiles[0]} x {tiles[1]} tiles, float32, batch 1: "
                  f"window attention all-to-all bytes per step (forward + backward), busiest rank ({busiest})")
            print(f"{'layer':>5} {'kind':>5} {'window':>6} {'input':>22} {'one dim, then the other':>24} "
                  f"{'both at once':>13} {'ratio':>6}")
            one = both = 0
            for n, (kind, window, mine, b, a) in enumerate(table[busiest]):
                one, both = one + a, both + b
                print(f"{n:>5} {kind:>5} {window:>6} {str(mine):>22} {a:>24,} {b:>13,} "
                      f"{b / a if a else 1:>6.3f}")
            print(f"{'total':>5} {'':>5} {'':>6} {'':>22} {one:>24,} {both:>13,} {both / one if one else 1:>6.3f}")
            pairs = [sum(table[r][n][3] for n in range(len(rows))) for r in range(size)]
            print(f"check: CommStats of a training step counts {totals} bytes per rank for the window attention's "
                  f"all-to-all; the pair column sums to {pairs}: {'equal' if pairs == totals else 'DIFFERENT'}")
            if pairs != totals:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
