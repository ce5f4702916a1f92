#!/usr/bin/env python
"""One training step of a converted model at D=1 and D=world size, in one run, on the same cores.

    mpiexec -n 2 python scripts/bench_step.py [--model cnn|crossformer|both] [--repeats 5] [--grid 181x360]
    python scripts/bench_step.py --bytes            # projected bytes per rank, CrossFormer, D = 2 .. 64

A step is forward, loss (this rank's share of the whole field's mean square), backward and the
all-reduce of the parameter gradients over the domain group (``allreduce_gradients``). Models:
``cnn``, :class:`mpidomain.models.UNet` (width 32, 4 channels; even sizes: 180 x 360 at 1 degree) converted by
:func:`mpidomain.models.convert_model`; ``crossformer``, CREDIT's CrossFormer at 1 degree (181 x 360,
earth padding (37, 38) x (76, 76), dims (8, 16, 32, 64), windows 4 / (8, 4, 2, 1), 7 channels; on
another ``--grid``, unpadded with windows 2 / (4, 2, 2, 1)), skipped with a reason line where CREDIT is
missing. float32, batch 1.

D=1 runs on rank 0 alone (a manager over ``MPI.COMM_SELF``, ``torch.set_num_threads(cores)``) while the
other ranks wait sleeping (a polled ``Ibarrier``, no busy poll); D=n runs on every rank with ``cores // n``
threads each, so both use the same cores. The two alternate within each repeat; the table gives the
median seconds per step of each rank, the slowest rank's as the step time, the parallel efficiency
``time(D=1) / time(D)`` (1.00: D ranks on the cores take as long as one process on all of them; the
cores are the same, so this is the ideal) and the share of the step spent waiting for messages: the
seconds inside the library's MPI waits and blocking collectives (a :class:`mpidomain.comm_stats.WaitTimer`,
timed where the library completes requests: halo exchanges, all-to-alls, all-reduces, agreement steps).
Then :class:`mpidomain.nn.CommStats` of one more step: bytes each rank sends, by kind.
"""

import argparse
import math
import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mpidomain  # noqa: E402
from mpidomain import comm_stats  # noqa: E402
from mpidomain.models import UNet, convert_model, credit_crossformer_module, credit_missing  # noqa: E402
from mpidomain.nn import CommStats, allreduce_gradients  # noqa: E402

ONE_DEGREE = (181, 360)
CROSSFORMER_1DEG = dict(pad_lat=(37, 38), pad_lon=(76, 76), dim=(8, 16, 32, 64), dim_head=8, local_window_size=4,
                        global_window_size=(8, 4, 2, 1), cross_embed_kernel_sizes=((4, 8, 16, 32), (2, 4), (2, 4), (2, 4)))
CROSSFORMER_SMALL = dict(pad_lat=None, pad_lon=None, dim=(4, 8, 16, 32), dim_head=4, local_window_size=2,
                         global_window_size=(4, 2, 2, 1), cross_embed_kernel_sizes=((4, 8), (2, 4), (2, 4), (2, 4)))


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("cnn", "crossformer", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per D (median); default 5")
    parser.add_argument("--grid", default=None, help="HxW; default 181x360 (1 degree)")
    parser.add_argument("--bytes", action="store_true",
                        help="print projected bytes per rank for CREDIT's CrossFormer at 1 and 0.25 degrees, D=2..64")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats takes a number of timed steps >= 1, got {args.repeats}")
    try:
        args.shape = tuple(int(n) for n in (args.grid or "181x360").lower().split("x"))
        assert len(args.shape) == 2 and min(args.shape) > 0
    except (ValueError, AssertionError):
        parser.error(f"--grid takes HxW (e.g. 181x360), got {args.grid!r}")
    return args


def cores():
    """The cores this process may run on (every rank of one node shares them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def crossformer_config(shape):
    """(config, label): CREDIT's 1-degree configuration on 181 x 360, else the small unpadded one."""
    if shape == ONE_DEGREE:
        return CROSSFORMER_1DEG, "1 degree, earth padding (37, 38) x (76, 76)"
    return CROSSFORMER_SMALL, "no padding"


def build(name, shape):
    """A fresh (seeded) float32 model and its whole-field input (1, C, H, W) (5-d for CREDIT's CrossFormer)."""
    torch.manual_seed(0)
    if name == "cnn":
        return UNet(channels=4, width=32), torch.randn(1, 4, *shape)
    config = dict(crossformer_config(shape)[0])
    pad_lat, pad_lon = config.pop("pad_lat"), config.pop("pad_lon")
    model = credit_crossformer_module().CrossFormer(
        image_height=shape[0], image_width=shape[1], frames=1, output_frames=1, channels=2, levels=2,
        surface_channels=2, input_only_channels=1, depth=(1, 1, 1, 1), cross_embed_strides=(2, 2, 2, 2),
        use_spectral_norm=True, upsample_with_ps=True, attention_type="scse",
        padding_conf=dict(activate=pad_lat is not None, mode="earth", pad_lat=list(pad_lat or ()),
                          pad_lon=list(pad_lon or ())), **config)
    return model, torch.randn(1, 7, 1, *shape)


class Run:
    """One converted model over one manager, ready to step."""

    def __init__(self, name, shape, manager):
        self.manager = manager
        model, field = build(name, shape)
        self.model = convert_model(model, manager)
        self.x = mpidomain.shard_tensor(field, dim=-2, manager=manager, allow_uneven=True)
        self.count = float(field[:, :4 if name == "cnn" else 6].numel())  # outputs of the whole field

    def step(self):
        self.model.zero_grad(set_to_none=True)
        y = self.model(self.x)
        (y.square().sum() / self.count).backward()
        allreduce_gradients(self.model, group="domain", op="sum", manager=self.manager)


def wait_sleeping(world):
    """Meet the other ranks without a busy poll (so a rank running alone keeps the cores)."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.0005)


def timed(run):
    """(seconds, seconds waiting for messages) of one step."""
    with comm_stats.WaitTimer() as timer:
        began = time.perf_counter()
        run.step()
        seconds = time.perf_counter() - began
    return seconds, timer.seconds


def bench(name, args, world):
    n, rank, threads = world.size, world.rank, cores()
    if name == "crossformer":
        missing = credit_missing()
        if missing is not None:
            if rank == 0:
                print(f"crossformer: skipped, CREDIT's CrossFormer does not import here ({missing}); "
                      "pip install einops && pip install --no-deps miles-credit==2026.2.0", flush=True)
            return
    shape = args.shape
    if name == "cnn":  # the U-Net needs even sizes: 181 x 360 runs on 180 x 360
        shape = tuple(s - s % 2 for s in shape)
    label = f"{shape[0]}x{shape[1]}"
    if name == "crossformer":
        label += f", {crossformer_config(shape)[1]}"
    single = Run(name, shape, mpidomain.DomainParallelManager(1, 1, comm=MPI.COMM_SELF)) if rank == 0 else None
    parallel = Run(name, shape, mpidomain.DomainParallelManager(n, n))
    ones, many = [], []
    for repeat in range(args.repeats + 1):  # the first of each: warm-up (plans, caches)
        if rank == 0:
            torch.set_num_threads(threads)
            result = timed(single)
            if repeat:
                ones.append(result)
        wait_sleeping(world)
        torch.set_num_threads(max(1, threads // n))
        result = timed(parallel)
        if repeat:
            many.append(result)
        wait_sleeping(world)
    with CommStats(parallel.manager) as stats:
        parallel.step()
    mine = (statistics.median(s for s, _ in many), statistics.median(w for _, w in many), stats.total)
    everyone = world.gather(mine, root=0)
    tables = world.gather(stats.table(), root=0)
    if rank == 0:
        one, one_wait = statistics.median(s for s, _ in ones), statistics.median(w for _, w in ones)
        slowest = max(s for s, _, _ in everyone)
        print(f"{name}: {label}, float32, batch 1; {n} ranks on {threads} cores; median of {args.repeats} steps, "
              f"D=1 and D={n} interleaved", flush=False)
        print(f"{'model':<12}{'D':>3}{'threads':>9}{'rank':>6}{'s/step':>10}{'wait s':>10}{'wait %':>8}"
              f"{'efficiency':>12}{'vs D=1':>9}{'bytes sent':>14}")
        print(f"{name:<12}{1:>3}{threads:>9}{0:>6}{one:>10.4f}{one_wait:>10.4f}{100 * one_wait / one:>7.1f}%"
              f"{1.0:>12.2f}{'x 1.00':>9}{0:>14,}")
        for r, (seconds, wait, sent) in enumerate(everyone):
            print(f"{name:<12}{n:>3}{max(1, threads // n):>9}{r:>6}{seconds:>10.4f}{wait:>10.4f}"
                  f"{100 * wait / seconds:>7.1f}%{one / seconds:>12.2f}{f'x {seconds / one:.2f}':>9}{sent:>14,}")
        print(f"{name}: step at D={n} (slowest rank) {slowest:.4f} s against {one:.4f} s at D=1: parallel efficiency "
              f"time(D=1)/time(D={n}) = {one / slowest:.2f}")
        for table in tables:
            print(table)
        print(flush=True)


# -- the projection ----------------------------------------------------------------------------------------
QUARTER_DEGREE = (721, 1440)
# CREDIT's 0.25-degree CrossFormer: the 1-degree layers on 721 x 1440 (padding to 768 rows, 1536 columns,
# a multiple of the 64-row alignment).
PROJECTIONS = {"1 degree": (ONE_DEGREE, (37, 38), (76, 76)), "0.25 degrees": (QUARTER_DEGREE, (23, 24), (48, 48))}


def layer_shapes(shape, pad_lat, pad_lon):
    """Run CREDIT's CrossFormer (1-degree layers) on the meta device; return [(module, input shape)] per layer."""
    config = dict(CROSSFORMER_1DEG, pad_lat=pad_lat, pad_lon=pad_lon)
    model, _ = build("crossformer", shape) if shape == ONE_DEGREE else (None, None)
    if model is None:
        config.pop("pad_lat"), config.pop("pad_lon")
        torch.manual_seed(0)
        model = credit_crossformer_module().CrossFormer(
            image_height=shape[0], image_width=shape[1], frames=1, output_frames=1, channels=2, levels=2,
            surface_channels=2, input_only_channels=1, depth=(1, 1, 1, 1), cross_embed_strides=(2, 2, 2, 2),
            use_spectral_norm=True, upsample_with_ps=True, attention_type="scse",
            padding_conf=dict(activate=True, mode="earth", pad_lat=list(pad_lat), pad_lon=list(pad_lon)), **config)
    model = model.to("meta")
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append((m, tuple(args[0].shape))))
             for m in model.modules()
             if isinstance(m, (torch.nn.Conv2d, torch.nn.GroupNorm)) or hasattr(m, "attn_type")]
    with torch.no_grad():
        model(torch.empty(1, 7, 1, *shape, device="meta"))
    for hook in hooks:
        hook.remove()
    return model, seen


def moved_rows(source, target):
    """Rows of a contiguous ``source`` split (extents) that another rank holds in the ``target`` split, per rank."""
    def bounds(extents):
        edges = [0]
        for e in extents:
            edges.append(edges[-1] + e)
        return edges
    s, t = bounds(source), bounds(target)
    out = []
    for r in range(len(source)):
        kept = max(0, min(s[r + 1], t[r + 1]) - max(s[r], t[r]))
        out.append(source[r] - kept)
    return out


def project(itemsize=4):
    """Print the projected bytes each rank sends per step (the busiest rank), by kind, for D = 2 .. 64.

    From the layer shapes of one meta-device pass (no MPI) and the library's row arithmetic
    (:mod:`mpidomain.nn.rows` for halos, :func:`mpidomain.redistribution_layout.window_move` for the
    long windows' all-to-all), with the padded rows cut into equal blocks (D dividing the blocks of
    the model's alignment; a D beyond those is projected as if the rows split evenly, and marked).
    """
    from mpidomain.nn import rows
    from mpidomain.redistribution_layout import window_move
    from mpidomain.tile_layout import balanced_split

    for label, (shape, pad_lat, pad_lon) in PROJECTIONS.items():
        model, seen = layer_shapes(shape, pad_lat, pad_lon)
        params = sum(p.numel() for p in model.parameters()) * itemsize
        hp = shape[0] + sum(pad_lat)
        print(f"CREDIT's CrossFormer at {label}: {shape[0]}x{shape[1]} padded to {hp}x{shape[1] + sum(pad_lon)}, "
              f"float32, batch 1; bytes the busiest rank sends per step (forward + backward + gradients), projected")
        print("(all-to-all: the long windows' and the padding's re-distributions; all-reduce: the gradients)")
        print(f"{'D':>4} {'halo':>12} {'all-to-all':>12} {'all-reduce':>12} {'norm':>10} {'total MiB':>10} "
              f"{'all-to-all %':>13}  layout")
        for d in (2, 4, 8, 16, 32, 64):
            halo, alltoall, norm = [0] * d, [0] * d, [0] * d
            runnable = d <= hp // 64  # latitude slabs: at most Hp / alignment (64) ranks
            for module, (b, c, h, w) in seen:
                extents = balanced_split(h, d)[0]
                row = b * c * w * itemsize
                if isinstance(module, torch.nn.GroupNorm):
                    for r in range(d):
                        norm[r] += 8 * b * (4 * module.num_groups + 1)
                elif isinstance(module, torch.nn.Conv2d):
                    k, s, dil = module.kernel_size[0], module.stride[0], module.dilation[0]
                    p = module.padding[0] if isinstance(module.padding, tuple) else 0
                    if k == 1 and s == 1 and p == 0:
                        continue  # local
                    if s == 1:
                        width = rows.unit_stride_halo(k, dil, p, p)
                    else:
                        before = max(p, (k - s) // 2)  # CrossEmbed: ZeroPad2d((k - s) // 2) moved into the conv
                        width = rows.halo_for(rows.conv_windows(extents, k, s, dil, before, before))
                    for r in range(d):
                        neighbours = (r > 0) + (r < d - 1)
                        halo[r] += 2 * neighbours * width * row  # forward, and the adjoint in backward
                elif module.attn_type == "long" and min(extents) > 0:
                    try:
                        move = window_move("long", tuple(extents), module.window_size)
                    except ValueError:
                        continue
                    for r in range(d):
                        leaving = sum(len(rows_) for peer, rows_ in enumerate(move.sends(r)) if peer != r)
                        back = sum(len(rows_) for peer, rows_ in enumerate(move.inverse.sends(r)) if peer != r)
                        alltoall[r] += 2 * (leaving + back) * row  # there and back, forward and backward
            # TensorPadding: the padded rows dealt into blocks (and back in unpad), forward and backward.
            field = 7 * (shape[1] + sum(pad_lon)) * itemsize
            moved = moved_rows([e + (pad_lat[0] if r == 0 else 0) + (pad_lat[1] if r == d - 1 else 0)
                                for r, e in enumerate(balanced_split(shape[0], d)[0])], balanced_split(hp, d)[0])
            other = [4 * m * field for m in moved]
            busiest = max(range(d), key=lambda r: halo[r] + alltoall[r] + other[r] + norm[r])
            total = halo[busiest] + alltoall[busiest] + other[busiest] + norm[busiest] + params
            note = "slabs" if runnable else f"more than Hp/64 = {hp // 64} slabs: needs tiles (projected as even rows)"
            print(f"{d:>4} {halo[busiest]:>12,} {alltoall[busiest] + other[busiest]:>12,} {params:>12,} "
                  f"{norm[busiest]:>10,} {total / 2**20:>10.2f} {100 * (alltoall[busiest] + other[busiest]) / total:>12.1f}%"
                  f"  {note}")
        print()


def main(argv=None):
    args = parse(argv)
    world = MPI.COMM_WORLD
    if args.bytes:
        if credit_missing() is not None:
            print(f"--bytes: skipped, CREDIT's CrossFormer does not import here ({credit_missing()})")
        elif world.rank == 0:
            project()
        return
    names = ("cnn", "crossformer") if args.model == "both" else (args.model,)
    for name in names:
        bench(name, args, world)


if __name__ == "__main__":
    main()
