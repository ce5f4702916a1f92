"""Memory per rank at the scale the library exists for: a slim CrossFormer (or the UNet) at 0.25 degrees.

Run with every rank in one domain group (D = the number of ranks, latitude slabs; ``--tiles`` for tiles)::

    mpiexec -n 1 python scripts/bench/scale_memory.py
    mpiexec -n 2 python scripts/bench/scale_memory.py
    mpiexec -n 4 python scripts/bench/scale_memory.py
    mpiexec -n 4 python scripts/bench/scale_memory.py --tiles 2x2
    mpiexec -n 4 python scripts/bench/scale_memory.py --model unet --grid 1

Each rank builds its own tile of a synthetic float32 field (16 variables: 4 at 3 levels and 4 at the
surface) from the tile's coordinates, so no rank ever holds the whole field. One training step
(forward, latitude-unweighted MSE against the field moved one column east, backward, gradients summed
over the domain group, an SGD step), then a 2-step rollout trained through both steps (forward,
forward on the forecast, the loss of both steps, backward). Models:

- ``crossformer``: CREDIT's CrossFormer, slim (dims 16/32/64/128, depth 1, heads of 8), with the
  earth padding of CREDIT's 0.25-degree config (``wxformer_era5_025deg_6hr.yml``: pad_lat 40/40,
  pad_lon 80/80, global windows 10/5/2/1, local 10) made exact for a converter: pad_lat (39, 40),
  so 721 + 79 = 800 rows reach the decoder's output unchanged (CREDIT pads to 801, loses a row in
  the first stride and interpolates it back, which no rank can do on its own rows), and local
  window 5, so the blocks of 80 padded rows (16 x 5) deal out as 3/3/2/2 of 10 at D = 4 (windows of
  10 would give blocks of 160: 2/1/1/1 of 5). ``--grid 1``: 181 x 360 with CREDIT's 1-degree test
  padding (37, 38) / (76, 76), local window 4, global windows (8, 4, 2, 1).
- ``unet``: :class:`mpidomain.models.UNet` (width 32), which halves the grid once, so each rank needs
  an even number of rows: 720 x 1440 at 0.25 degrees, 184 x 360 at 1 degree (at D = 4 the 180 rows of
  1 degree give 45 per rank, which the skip connection cannot meet).

Per rank: peak RSS (``ru_maxrss``), activation bytes saved for backward (``SavedActivations``, parameters
excluded) by the training step's forward and by the rollout's two forwards, and the prediction of
``mpidomain.nn.estimate_memory`` (made on rank 0 before the manager exists, on the meta device) for one
forward, next to the measurement (for the rollout, twice the prediction). The baseline, in the same run:
the unconverted model on the whole field in one process, run by rank 0 in a child process before the
ranks start (``--no-baseline`` skips it). Seconds per step are reported for orientation only (2 cores
shared by all ranks).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mpidomain.models import UNet, credit_crossformer, custom_converters  # noqa: E402
from mpidomain.nn import SavedActivations, estimate_memory  # noqa: E402
from mpidomain.sharding import balanced_split  # noqa: E402

VARIABLES, LEVELS, SURFACE = 4, 3, 4
CHANNELS = VARIABLES * LEVELS + SURFACE
GRIDS = {  # grid -> model -> (H, W)
    "0.25": {"crossformer": (721, 1440), "unet": (720, 1440)},
    "1": {"crossformer": (181, 360), "unet": (184, 360)},
}
CROSSFORMER = {  # grid -> CREDIT's padding and windows (see the module docstring)
    "0.25": dict(padding_conf=dict(activate=True, mode="earth", pad_lat=[39, 40], pad_lon=[80, 80]),
                 local_window_size=5, global_window_size=(10, 5, 2, 1)),
    "1": dict(padding_conf=dict(activate=True, mode="earth", pad_lat=[37, 38], pad_lon=[76, 76]),
              local_window_size=4, global_window_size=(8, 4, 2, 1)),
}


def build(name, grid):
    """The model (float32, seeded): the same on every rank and in the baseline."""
    torch.manual_seed(0)
    if name == "unet":
        return UNet(channels=CHANNELS, width=32)
    height, width = GRIDS[grid]["crossformer"]
    return credit_crossformer(VARIABLES, LEVELS, SURFACE, height, width, dim=(16, 32, 64, 128), dim_head=8,
                              **CROSSFORMER[grid])


def field(rows, cols, height, width, shift=0):
    """Rows ``rows`` and columns ``cols`` (ranges) of the synthetic (1, C, H, W) field moved ``shift`` columns east."""
    lat = torch.arange(rows.start, rows.stop, dtype=torch.float32).view(1, 1, -1, 1) * (torch.pi / (height - 1))
    lon = (torch.arange(cols.start, cols.stop, dtype=torch.float32) - shift).view(1, 1, 1, -1) * (
        2 * torch.pi / width)
    c = torch.arange(CHANNELS, dtype=torch.float32).view(1, -1, 1, 1)
    return torch.sin(lat * (1 + c % 3)) * torch.cos(lon * (1 + c % 4) + c) + 0.1 * c


def run_steps(model, tile, rollout, count, after_backward):
    """One training step and a ``rollout``-step trained rollout; return (saved step, saved rollout, s per step)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    with SavedActivations(exclude=list(model.parameters())) as saved:
        y = model(tile(0))
    ((y - tile(1)).square().sum() / count).backward()
    after_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del y
    step_seconds = time.perf_counter() - start
    loss, state = 0.0, tile(0)
    with SavedActivations(exclude=list(model.parameters())) as saved_rollout:
        forecasts = []
        for _ in range(rollout):
            state = model(state)
            forecasts.append(state)
    for k, forecast in enumerate(forecasts, start=1):
        loss = loss + (forecast - tile(k)).square().sum() / count
    loss.backward()
    after_backward()
    optimizer.step()
    return saved.nbytes, saved_rollout.nbytes, step_seconds


def peak_rss():
    """This process's peak resident set, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def baseline(args):
    """The unconverted model on the whole field, one process: print its numbers as JSON."""
    height, width = GRIDS[args.grid][args.model]
    model = build(args.model, args.grid)
    count = CHANNELS * height * width
    saved, rollout, seconds = run_steps(model, lambda k: field(range(height), range(width), height, width, k),
                                        args.rollout, count, lambda: None)
    print(json.dumps(dict(saved=saved, rollout=rollout, rss=peak_rss(), seconds=seconds)))


def run_baseline(args):
    """Rank 0: the baseline in a child process without the launcher's variables (it is no MPI rank)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDI_", "HYDRA_", "OMPI_"))}
    command = [sys.executable, os.path.abspath(__file__), "--baseline", "--model", args.model, "--grid", args.grid,
               "--rollout", str(args.rollout)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the one-process baseline failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_quietly(comm, seconds=0.05):
    """A barrier that sleeps while it waits (an MPI barrier spins, and the baseline needs the cores)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("crossformer", "unet"), default="crossformer")
    parser.add_argument("--grid", choices=tuple(GRIDS), default="0.25", help="degrees (default 0.25)")
    parser.add_argument("--tiles", help="D_latxD_lon tiles (e.g. 2x2), their product the number of ranks; "
                                        "default: latitude slabs of every rank")
    parser.add_argument("--rollout", type=int, default=2, help="steps of the trained rollout (default 2)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the one-process baseline")
    parser.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline:
        return baseline(args)

    from mpi4py import MPI

    import mpidomain
    from mpidomain.models import convert_model
    from mpidomain.nn import allreduce_gradients

    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    if args.tiles:
        shape = tuple(int(n) for n in args.tiles.lower().split("x"))
        if len(shape) != 2 or shape[0] * shape[1] != size:
            parser.error(f"--tiles {args.tiles}: D_lat x D_lon must multiply to the {size} ranks")
        domain, shard_dim = shape, (-2, -1)
    else:
        domain, shard_dim = size, -2
    height, width = GRIDS[args.grid][args.model]
    layout = "x".join(map(str, domain)) if args.tiles else str(size)

    estimate = None
    one = None
    if rank == 0:  # before launch: one process, the meta device
        start = time.perf_counter()
        estimate = estimate_memory(build(args.model, args.grid), (1, CHANNELS, height, width), domain,
                                   custom_converters=custom_converters)
        print(f"{estimate} (estimated in {time.perf_counter() - start:.1f} s)", flush=True)
        if not args.no_baseline:
            one = run_baseline(args)
    wait_quietly(world)

    with mpidomain.DomainParallelManager(size, domain, shard_dim=shard_dim) as manager:
        model = convert_model(build(args.model, args.grid), manager)
        coords = manager.domain_coords if args.tiles else (manager.domain_rank, 0)
        row_counts, row_starts = balanced_split(height, domain[0] if args.tiles else size)
        col_counts, col_starts = balanced_split(width, domain[1]) if args.tiles else ((width,), (0,))
        rows = range(row_starts[coords[0]], row_starts[coords[0]] + row_counts[coords[0]])
        cols = range(col_starts[coords[1]], col_starts[coords[1]] + col_counts[coords[1]])
        count = CHANNELS * height * width
        saved, rollout, seconds = run_steps(
            model, lambda k: field(rows, cols, height, width, k), args.rollout, count,
            lambda: allreduce_gradients(model, manager=manager, group="domain", op="sum"))
        mine = (manager.domain_rank, saved, rollout, peak_rss(), seconds, (len(rows), len(cols)))
    everyone = world.gather(mine, root=0)
    if rank != 0:
        return
    print(f"{args.model} at {args.grid} degree ({height} x {width}, {CHANNELS} channels, float32), D={layout} "
          f"({'tiles' if args.tiles else 'slabs'}), one training step + a {args.rollout}-step rollout:")
    if one:
        print(f"  one process (unconverted, whole field): peak RSS {one['rss'] / 2**20:.0f} MiB, saved "
              f"{one['saved'] / 2**20:.1f} MiB (step) / {one['rollout'] / 2**20:.1f} MiB (rollout), "
              f"{one['seconds']:.1f} s per step")
    for domain_rank, mine_saved, mine_rollout, rss, step_seconds, tile in sorted(everyone):
        predicted = estimate.rank_bytes[domain_rank]
        against = (f", {rss / one['rss']:.3f} of one process's RSS, saved {mine_saved / one['saved']:.3f} of one "
                   f"process's") if one else ""
        print(f"  rank {domain_rank}: tile {tile[0]} x {tile[1]}, peak RSS {rss / 2**20:.0f} MiB, saved "
              f"{mine_saved / 2**20:.1f} MiB (step; estimate {predicted / 2**20:.1f} MiB, "
              f"{predicted / mine_saved - 1:+.2%}) / {mine_rollout / 2**20:.1f} MiB (rollout; "
              f"{args.rollout} x estimate {args.rollout * predicted / mine_rollout - 1:+.2%}){against}, "
              f"{step_seconds:.1f} s per step")
    worst = max(everyone, key=lambda row: row[1])
    worst_rss = max(row[3] for row in everyone)
    rss_ratio, saved_ratio = ((f" ({worst_rss / one['rss']:.3f})", f" ({worst[1] / one['saved']:.3f})") if one
                              else ("", ""))
    # A row of the table in docs/forecast.md: the largest rank's numbers, ratios to one process in parentheses.
    print(f"| {args.model} | {args.grid} | {layout} | {'tiles' if args.tiles else 'slabs'} | "
          f"{worst_rss / 2**20:.0f}{rss_ratio} | {worst[1] / 2**20:.1f}{saved_ratio} | {worst[2] / 2**20:.1f} | "
          f"{estimate.bytes_per_rank / 2**20:.1f} | {estimate.bytes_per_rank / worst[1] - 1:+.2%} |")

if __name__ == "__main__":
    main()
