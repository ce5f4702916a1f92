"""K-step training rollouts on tiles against CREDIT's pattern (the whole field gathered between steps): memory per rank.

Run with every rank in one domain group (D = the number of ranks; latitude slabs, ``--tiles 2x2`` for tiles)::

    mpiexec -n 1 python scripts/bench/rollout_memory.py
    mpiexec -n 2 python scripts/bench/rollout_memory.py
    mpiexec -n 4 python scripts/bench/rollout_memory.py
    mpiexec -n 4 python scripts/bench/rollout_memory.py --tiles 2x2

Models: :class:`mpidomain.models.UNet` (width 16) on 256 x 512 and, where CREDIT is installed, its
CrossFormer (``mpidomain.models.credit_crossformer``, dims 8/16/32/64) on 256 x 512; 4 channels
(``--channels``; CrossFormer: 1 variable at 2 levels and 2 surface variables), float32, batch 1. The data are smooth
synthetic fields computed from the grid's coordinates, so a rank that loads only its tile computes only
its tile. One training step of a K-step rollout (default K = 4; x_{k+1} = model(x_k), loss = the sum
over the steps of the whole field's mean square error against that step's target), gradients summed
over the domain group (``allreduce_gradients(..., group="domain", op="sum")``). Patterns:

- ``mpidomain``: every rank loads its tile of the input and of each step's target and steps its tile
  forward; nothing is gathered; backward through all K steps.
- ``CREDIT pattern``: what CREDIT's ``trainer_gen2`` does between steps (miles-credit 2026.2.0,
  ``credit/trainers/trainer_gen2.py``): every rank loads the whole sample (input, and each step's whole
  target), cuts its shard before the forward (``shard_spatial``), and after each step all-gathers the
  prediction to the whole field on every rank (``_gather_for_next_step`` -> ``gather_spatial``:
  ``dist.all_gather`` and ``torch.cat``), which the next step cuts again. Here: ``gather_tensor`` and
  ``shard_tensor``. ``shard_tensor`` keeps autograd history; ``gather_tensor`` does not (nor does CREDIT's
  ``gather_spatial``), so to backpropagate through all K steps the gather goes through
  :class:`GatheredWhole`, an autograd Function whose backward is the exact adjoint of an all-gather
  (the whole field's gradients summed over the domain group, this rank's tile kept).
- ``mpidomain per-step`` and ``CREDIT trainer_gen2``: what ``trainer_gen2`` actually trains.
  It detaches the prediction at each step boundary (its gather is not differentiable) and calls
  ``backward()`` on each step's loss (``backprop_on_timestep``): truncated backpropagation, one step's
  graph alive at a time, whose gradients are not the K-step gradients (printed). The first does the
  same on tiles; the second gathers the detached prediction to the whole field and re-shards it.

Baselines, in the same run: the unconverted model on the whole field in one process, with backward
through all K steps and with per-step backward, run by rank 0 alone while the other ranks wait asleep.
Per rank and pattern: activation bytes saved for backward (``SavedActivations``, parameters left out;
with per-step backward the most saved at once, one step's), peak RSS (``ru_maxrss``, reset before the
step by writing 5 to ``/proc/self/clear_refs``, after ``gc.collect`` and ``malloc_trim``), its growth
during the step (the peak minus the RSS just before), the step time, and each against the one-process
step with the same backward. Each pattern runs a warm-up step first (K = 1, a copy of the model) so that
halo plans exist. One torch thread per rank (``--threads``): the one-process step runs on one core,
D ranks on D cores (oversubscribed where D exceeds the cores). Then, not timed: every step's forecast and
the gradients of ``mpidomain`` against ``CREDIT pattern`` (the same tiles, the same operations: equal bit
for bit) and against one process (float32 round-off).
"""

import argparse
import contextlib
import copy
import ctypes
import gc
import os
import resource
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mpidomain  # noqa: E402
from mpidomain import balanced_split, gather_tensor, shard_tensor  # noqa: E402
from mpidomain.models import UNet, convert_model, credit_crossformer, credit_missing  # noqa: E402
from mpidomain.nn import SavedActivations, allreduce_gradients  # noqa: E402

WORLD = MPI.COMM_WORLD
MiB = 2 ** 20
PATTERNS = ("mpidomain", "CREDIT pattern", "mpidomain per-step", "CREDIT trainer_gen2")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
PER_STEP = PATTERNS[2:]  # backward on each step's loss, the prediction detached between steps


class GatheredWhole(torch.autograd.Function):
    """``gather_tensor`` with an exact backward: every rank gets the whole field; the gradient of this
    rank's tile is the sum over the domain group of the whole field's gradients, cut to the tile."""

    @staticmethod
    def forward(ctx, tile, manager):
        ctx.manager = manager
        return gather_tensor(tile, manager=manager)

    @staticmethod
    def backward(ctx, grad):
        summed = mpidomain.allreduce(grad.contiguous(), "sum", "domain", ctx.manager)
        return shard_tensor(summed, manager=ctx.manager, allow_uneven=True), None


def grid(text):
    rows, cols = (int(v) for v in text.lower().split("x"))
    return rows, cols


def build(name, channels, height, width):
    """The model, float32, seeded: ``channels`` in and out (CrossFormer: one variable at ``channels - 2`` levels
    and two surface variables)."""
    torch.manual_seed(0)
    if name == "UNet":
        return UNet(channels=channels, width=16).float()
    return credit_crossformer(1, channels - 2, 2, height, width).float()


def tile_of(manager, height, width):
    """This rank's (rows, columns) of the grid, as ``shard_tensor(..., allow_uneven=True)`` cuts it."""
    if manager is None or manager.domain_parallel_size == 1:
        return torch.arange(height), torch.arange(width)
    shape, coords = manager.domain_shape, manager.domain_coords
    counts, offsets = balanced_split(height, shape[0])
    rows = torch.arange(offsets[coords[0]], offsets[coords[0]] + counts[coords[0]])
    if len(shape) == 1:
        return rows, torch.arange(width)
    counts, offsets = balanced_split(width, shape[1])
    return rows, torch.arange(offsets[coords[1]], offsets[coords[1]] + counts[coords[1]])


def field(step, channels, rows, cols, height, width):
    """Field ``step`` (0: the input, k: the target of step k) at the given rows and columns, (1, C, h, w) float32."""
    lat = (rows.double() + 0.5) / height * torch.pi
    lon = cols.double() / width * 2 * torch.pi
    c = torch.arange(channels, dtype=torch.float64)[:, None, None]
    value = torch.sin((c + 1) * lon[None, None, :] + 0.3 * step * (c + 1)) * torch.cos((c % 3 + 1) * lat[None, :, None])
    return value.unsqueeze(0).float()


def saving(model):
    return SavedActivations(exclude=list(model.parameters()))


def training_step(model, pattern, manager, shape, steps):
    """One K-step training rollout of ``pattern``; return (forecast tiles, most bytes saved at once).

    ``manager`` None: the unconverted model on the whole field (no all-reduce).
    """
    channels, height, width = shape
    numel = channels * height * width
    rows, cols = tile_of(manager, height, width)
    whole_rows, whole_cols = torch.arange(height), torch.arange(width)
    credit = pattern.startswith("CREDIT")
    per_step = pattern in PER_STEP
    if credit:  # the whole sample on every rank, cut before the forward
        whole = field(0, channels, whole_rows, whole_cols, height, width)
        x = shard_tensor(whole, manager=manager, allow_uneven=True)
    else:
        x = field(0, channels, rows, cols, height, width)
    forecasts, saved, loss = [], [], 0
    every_step = saving(model)  # backward through all steps: one count over the whole forward
    with contextlib.nullcontext() if per_step else every_step:
        for k in range(1, steps + 1):
            with saving(model) if per_step else contextlib.nullcontext() as this_step:
                target = (field(k, channels, rows, cols, height, width) if not credit else
                          shard_tensor(field(k, channels, whole_rows, whole_cols, height, width), manager=manager,
                                       allow_uneven=True))
                y = model(x)
                step_loss = (y - target).square().sum() / numel
            forecasts.append(y.detach())
            if per_step:  # trainer_gen2: each step's loss backward, the prediction detached
                saved.append(this_step.nbytes)
                step_loss.backward()
                y = y.detach()
            else:
                loss = loss + step_loss
            if k == steps:
                break
            if pattern == "CREDIT pattern":
                x = shard_tensor(GatheredWhole.apply(y, manager), manager=manager, allow_uneven=True)
            elif credit:
                x = shard_tensor(gather_tensor(y, manager=manager), manager=manager, allow_uneven=True)
            else:
                x = y
    if not per_step:
        saved.append(every_step.nbytes)
        loss.backward()
    if manager is not None:
        allreduce_gradients(model, manager=manager, group="domain", op="sum")
    return forecasts, max(saved)


def current_rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measured(run):
    """Run ``run()`` with the peak RSS reset first; return (its result, seconds, peak RSS, growth of the peak)."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak RSS (VmHWM, ru_maxrss) falls to the current RSS
    before = current_rss()
    started = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result, seconds, peak, peak - before


def wait_asleep(comm):
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)


def run_pattern(model, pattern, manager, shape, steps, convert):
    """Warm up (K = 1 on a copy), then measure one K-step training step; return the stats and the model."""
    warm = convert(copy.deepcopy(model))
    training_step(warm, pattern, manager, shape, 1)
    del warm
    model = convert(copy.deepcopy(model))
    (forecasts, saved), seconds, peak, growth = measured(lambda: training_step(model, pattern, manager, shape, steps))
    return dict(saved=saved, seconds=seconds, peak=peak, growth=growth), forecasts, model


def relative(got, want):
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)


def gradients(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def gradient_difference(got, want):
    return max((a - b).abs().max().item() for a, b in zip(got, want)) / max(b.abs().max().item() for b in want)


def compare(name, shape, steps, manager, layout, patterns):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    model = build(name, *shape)
    one = {}
    if rank == 0:
        for per_step in (False, True):
            pattern = "mpidomain per-step" if per_step else "mpidomain"
            stats, forecasts, reference = run_pattern(model, pattern, None, shape, steps, lambda m: m)
            one[per_step] = (stats, forecasts, gradients(reference))
    wait_asleep(WORLD)
    baselines = WORLD.bcast({per_step: stats for per_step, (stats, _, _) in one.items()})
    results, forecasts, grads = {}, {}, {}
    for pattern in patterns:
        stats, forecasts[pattern], trained = run_pattern(model, pattern, manager, shape, steps,
                                                         lambda m: convert_model(m, manager))
        results[pattern] = WORLD.gather(stats)
        grads[pattern] = gradients(trained)
    checks = []
    for first, second in (("mpidomain", "CREDIT pattern"),
                          ("mpidomain per-step", "CREDIT trainer_gen2")):
        if first in patterns and second in patterns:
            forecast = max((a - b).abs().max().item() for a, b in zip(forecasts[first], forecasts[second]))
            gradient = gradient_difference(grads[second], grads[first])
            checks.append(f"{second} against {first}: max |forecast difference| "
                          f"{WORLD.allreduce(forecast, MPI.MAX):.1e} over the {steps} steps, gradients "
                          f"{WORLD.allreduce(gradient, MPI.MAX):.1e} (relative)")
    for pattern in patterns:
        whole = [gather_tensor(f, manager=manager) for f in forecasts[pattern]]
        if rank == 0:
            per_step = pattern in PER_STEP
            _, want, want_grads = one[per_step]
            checks.append(f"{pattern} against one process ({'per-step' if per_step else 'K-step'} backward): "
                          f"forecast {max(relative(g, w) for g, w in zip(whole, want)):.1e}, gradients "
                          f"{gradient_difference(grads[pattern], want_grads):.1e} (relative, float32)")
            if pattern == "CREDIT trainer_gen2":
                checks.append(f"{pattern}'s gradients against one process's K-step backward: "
                              f"{gradient_difference(grads[pattern], one[False][2]):.1e} (relative): "
                              "truncated backpropagation is another gradient")
    if rank == 0:
        report(name, shape, steps, size, layout, baselines, results, checks)


def cells(stats, one):
    """Saved bytes, peak RSS, its growth and the step time, each with its ratio to the one-process step's."""
    def mib(key):
        return f"{stats[key] / MiB:.1f} MiB ({stats[key] / one[key]:.3f})"
    seconds = f"{stats['seconds']:.2f} s ({stats['seconds'] / one['seconds']:.2f}x)"
    return [mib("saved"), mib("peak"), mib("growth"), seconds]


def report(name, shape, steps, size, layout, baselines, results, checks):
    title = f"{name} {shape[1]} x {shape[2]}, {shape[0]} channels"
    print(f"\n{title}, float32, K = {steps}, D = {size} ({layout}), {torch.get_num_threads()} torch thread(s) a rank")
    for per_step in (False, True):
        one = baselines[per_step]
        print(f"  one process, {'per-step' if per_step else 'K-step'} backward: saved {one['saved'] / MiB:.1f} MiB, "
              f"peak RSS {one['peak'] / MiB:.0f} MiB (growth {one['growth'] / MiB:.0f} MiB), {one['seconds']:.2f} s")
    print("  per rank: saved for backward, peak RSS, growth of the peak during the step, step time "
          "(in brackets: against one process with the same backward)")
    rows = []
    for pattern, stats in results.items():
        one = baselines[pattern in PER_STEP]
        for domain_rank, mine in enumerate(stats):
            print(f"  {pattern:20s} rank {domain_rank}: " + ", ".join(cells(mine, one)))
        worst = {key: max(mine[key] for mine in stats) for key in ("saved", "peak", "growth", "seconds")}
        rows.append(" | ".join(["", title, layout, pattern] + cells(worst, one) + [""]).strip())
    for line in checks:
        print("  " + line)
    print("  table rows (the worst rank):")
    for row in rows:
        print("  " + row)
    sys.stdout.flush()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=grid, help="latitude x longitude ranks, e.g. 2x2 (default: latitude slabs)")
    parser.add_argument("--models", default="UNet,CrossFormer", help="comma-separated: UNet, CrossFormer")
    parser.add_argument("--unet-grid", type=grid, default=(256, 512), help="rows x columns (default 256x512)")
    parser.add_argument("--crossformer-grid", type=grid, default=(256, 512), help="rows x columns (default 256x512)")
    parser.add_argument("--channels", type=int, default=4, help="channels in and out (default 4; at least 3)")
    parser.add_argument("--steps", type=int, default=4, help="rollout steps K (default 4)")
    parser.add_argument("--patterns", default=",".join(PATTERNS),
                        help="comma-separated subset of: " + ", ".join(PATTERNS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # a fixed threshold: freed blocks go back to the system
    patterns = [p.strip() for p in args.patterns.split(",")]
    unknown = [p for p in patterns if p not in PATTERNS]
    if unknown:
        parser.error(f"--patterns: unknown {unknown}; choose from {list(PATTERNS)}")
    size = WORLD.Get_size()
    if args.tiles and args.tiles[0] * args.tiles[1] != size:
        parser.error(f"--tiles {args.tiles[0]}x{args.tiles[1]} needs {args.tiles[0] * args.tiles[1]} ranks, got {size}")
    domain, shard_dim = (tuple(args.tiles), (-2, -1)) if args.tiles else (size, -2)
    layout = f"{args.tiles[0]} x {args.tiles[1]} tiles" if args.tiles else "latitude slabs"
    if args.channels < 3:
        parser.error(f"--channels: at least 3 (CrossFormer: levels and 2 surface variables), got {args.channels}")
    grids = {name: (args.channels,) + shape for name, shape in (("UNet", args.unet_grid),
                                                                ("CrossFormer", args.crossformer_grid))}
    missing = WORLD.bcast(credit_missing() if WORLD.Get_rank() == 0 else None)
    with mpidomain.DomainParallelManager(size, domain, shard_dim=shard_dim) as manager:
        for name in (m.strip() for m in args.models.split(",")):
            if name == "CrossFormer" and missing:
                if WORLD.Get_rank() == 0:
                    print(f"\nCrossFormer skipped: {missing}")
                continue
            compare(name, grids[name], args.steps, manager, layout, patterns)


if __name__ == "__main__":
    main()
