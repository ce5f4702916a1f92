#!/usr/bin/env python
"""One training step of a converted model at D=1 and D=world size, in one run, on the same cores.

    mpiexec -n 2 python scripts/bench/bench_step.py [--model cnn|crossformer|both] [--repeats 5] [--grid 181x360]
    mpiexec -n 2 python scripts/bench/bench_step.py --compile [--backend inductor]   # compiled against eager, D=2
    python scripts/bench/bench_step.py --bytes            # projected bytes per rank, CrossFormer, D = 2 .. 64
    python scripts/bench/bench_step.py --project [--bandwidth 25] [--latency 2] [--compute-seconds S]
                                                    # projected step time at 0.25 degrees, D = 4 .. 64

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

``--compile`` runs the step at D = the world's size twice over, eagerly and compiled (``Module.compile``,
default backend Inductor; the custom operators of :mod:`mpidomain.nn.ops` in the graph), alternating within
each repeat on the same ranks: the table gives each rank's median seconds per step both ways and their ratio,
the first compiled step's seconds (tracing and compiling), the graph breaks ``torch._dynamo.explain`` finds,
and how far the compiled step's loss and parameter gradients are from eager's (relative to the largest;
first step of each, from the same weights). The CrossFormer runs without spectral norm there: in training
mode, PyTorch 2.13's Inductor gives ``torch.nn.utils.spectral_norm``'s weight gradients other values than
eager even on one process (docs/training-stack.md).

``--bytes`` projects, without MPI ranks, what CommStats would count (all but control) for CREDIT's
CrossFormer at 1 and 0.25 degrees, D = 2 .. 64 (:func:`project_traffic`: a meta-device training pass
of the unconverted model and the library's row arithmetic). ``--project`` turns it into a step time at
0.25 degrees: compute(D=1) / D plus, for the busiest rank, each point-to-point message's latency +
bytes / bandwidth (no overlap), all-reduces 2 log2(D) latencies + 2 (D-1)/D bytes / bandwidth, and the
control steps' latencies.
"""

import argparse
import math
import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mpidomain  # noqa: E402
from mpidomain import comm_stats  # noqa: E402
from mpidomain.models import UNet, convert_model, credit_crossformer_module, credit_missing  # noqa: E402
from mpidomain.nn import CommStats, allreduce_gradients  # noqa: E402
from mpidomain.nn.conv import conv_padding  # noqa: E402
from mpidomain.nn.stats import LABELS  # noqa: E402

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
    parser.add_argument("--compile", action="store_true",
                        help="time the step at D = world size eagerly and compiled, alternating, in one run")
    parser.add_argument("--backend", default="inductor", help="--compile: the torch.compile backend (default inductor)")
    parser.add_argument("--bytes", action="store_true",
                        help="print projected bytes per rank for CREDIT's CrossFormer at 1 and 0.25 degrees, D=2..64")
    parser.add_argument("--project", action="store_true",
                        help="print the projected step time of CREDIT's CrossFormer at 0.25 degrees, D=4..64")
    parser.add_argument("--bandwidth", type=float, default=25.0,
                        help="--project: GB/s per rank (default 25, a Slingshot-class 200 Gb/s link)")
    parser.add_argument("--latency", type=float, default=2.0, help="--project: microseconds per message (default 2)")
    parser.add_argument("--compute-seconds", type=float, default=None,
                        help="--project: seconds of one D=1 step at 0.25 degrees (default: measured here)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats takes a number of timed steps >= 1, got {args.repeats}")
    for name in ("bandwidth", "latency", "compute_seconds"):
        value = getattr(args, name)
        if value is not None and not (value > 0 if name != "latency" else value >= 0):
            parser.error(f"--{name.replace('_', '-')} takes a positive number, got {value}")
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


def build(name, shape, config=None, spectral_norm=True):
    """A fresh (seeded) float32 model and its whole-field input (1, C, H, W) (5-d for CREDIT's CrossFormer);
    ``config``: the CrossFormer's (default :func:`crossformer_config`'s)."""
    torch.manual_seed(0)
    if name == "cnn":
        return UNet(channels=4, width=32), torch.randn(1, 4, *shape)
    config = dict(config or crossformer_config(shape)[0])
    pad_lat, pad_lon = config.pop("pad_lat"), config.pop("pad_lon")
    model = credit_crossformer_module().CrossFormer(
        image_height=shape[0], image_width=shape[1], frames=1, output_frames=1, channels=2, levels=2,
        surface_channels=2, input_only_channels=1, depth=(1, 1, 1, 1), cross_embed_strides=(2, 2, 2, 2),
        use_spectral_norm=spectral_norm, upsample_with_ps=True, attention_type="scse",
        padding_conf=dict(activate=pad_lat is not None, mode="earth", pad_lat=list(pad_lat or ()),
                          pad_lon=list(pad_lon or ())), **config)
    return model, torch.randn(1, 7, 1, *shape)


class Run:
    """One converted model over one manager, ready to step."""

    def __init__(self, name, shape, manager, config=None, spectral_norm=True):
        self.manager = manager
        model, field = build(name, shape, config, spectral_norm)
        self.model = convert_model(model, manager)
        self.x = mpidomain.shard_tensor(field, dim=-2, manager=manager, allow_uneven=True)
        self.count = float(field[:, :4 if name == "cnn" else 6].numel())  # outputs of the whole field

    def step(self):
        """One step; return its loss (this rank's share)."""
        self.model.zero_grad(set_to_none=True)
        y = self.model(self.x)
        loss = y.square().sum() / self.count
        loss.backward()
        allreduce_gradients(self.model, group="domain", op="sum", manager=self.manager)
        return loss.detach()


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
                print(f"crossformer: skipped, CREDIT's CrossFormer does not import here ({missing})", flush=True)
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


def relative_difference(got, want):
    """max |got - want| over max |want|, over lists of tensors (pairs with a None left out)."""
    pairs = [(g, w) for g, w in zip(got, want) if g is not None and w is not None]
    scale = max(float(w.abs().max()) for _, w in pairs)
    return max(float((g - w).abs().max()) for g, w in pairs) / scale


def bench_compile(name, args, world):
    """Eager and compiled steps at D = the world's size, alternating; one table (see the module docstring)."""
    n, rank = world.size, world.rank
    if name == "crossformer" and credit_missing() is not None:
        if rank == 0:
            print(f"crossformer: skipped, CREDIT's CrossFormer does not import here ({credit_missing()})", flush=True)
        return
    shape = args.shape if name == "crossformer" else tuple(s - s % 2 for s in args.shape)
    torch.set_num_threads(max(1, cores() // n))
    manager = mpidomain.DomainParallelManager(n, n)
    eager, compiled = (Run(name, shape, manager, spectral_norm=False) for _ in range(2))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(compiled.model)(compiled.x)
    breaks, graphs = explained.graph_break_count, explained.graph_count
    torch._dynamo.reset()
    compiled.model.compile(backend=args.backend)
    began = time.perf_counter()
    compiled_loss = compiled.step()  # the first call traces and compiles
    first = time.perf_counter() - began
    eager_loss = eager.step()
    differences = (relative_difference([compiled_loss], [eager_loss]),
                   relative_difference([p.grad for p in compiled.model.parameters()],
                                       [p.grad for p in eager.model.parameters()]))
    differences = tuple(world.allreduce(d, op=MPI.MAX) for d in differences)
    times = {"eager": [], "compiled": []}
    for _ in range(args.repeats):
        for label, run in (("eager", eager), ("compiled", compiled)):
            wait_sleeping(world)
            times[label].append(timed(run)[0])
    mine = tuple(statistics.median(times[label]) for label in ("eager", "compiled"))
    everyone = world.gather(mine + (first,), root=0)
    if rank == 0:
        label = f"{shape[0]}x{shape[1]}" + (f", {crossformer_config(shape)[1]}, no spectral norm"
                                            if name == "crossformer" else "")
        print(f"{name}: {label}, float32, batch 1; D={n} on {cores()} cores; backend {args.backend}; median of "
              f"{args.repeats} steps, eager and compiled alternating", flush=False)
        print(f"{'model':<12}{'D':>3}{'rank':>6}{'eager s':>10}{'compiled s':>12}{'compiled/eager':>16}"
              f"{'first step s':>14}")
        for r, (slow, fast, compile_seconds) in enumerate(everyone):
            print(f"{name:<12}{n:>3}{r:>6}{slow:>10.4f}{fast:>12.4f}{fast / slow:>16.2f}{compile_seconds:>14.1f}")
        slowest = [max(e[i] for e in everyone) for i in range(2)]
        print(f"{name}: compiled step {slowest[1]:.4f} s against {slowest[0]:.4f} s eager at D={n} (slowest rank): "
              f"x {slowest[1] / slowest[0]:.2f}; {graphs} graph(s), {breaks} graph break(s); compiled against eager: "
              f"loss {differences[0]:.2g}, gradients {differences[1]:.2g} (relative)")
        print(flush=True)
    manager.close()


# -- the projection ----------------------------------------------------------------------------------------
QUARTER_DEGREE = (721, 1440)
# CREDIT's CrossFormer at 1 and 0.25 degrees: the 1-degree layers; at 0.25 degrees padded to 768 rows and
# 1536 columns (a multiple of the 64-row alignment).
PROJECTIONS = {"1 degree": (ONE_DEGREE, (37, 38), (76, 76)), "0.25 degrees": (QUARTER_DEGREE, (23, 24), (48, 48))}
DS = (2, 4, 8, 16, 32, 64)
#: The kinds the projection counts (CommStats' labels); control (agreement steps, extents) is not projected.
HALO_CONV, HALO_POOL, HALO_OTHER = (LABELS[("halo", k)] for k in ("conv", "pool", "other"))
A2A_ATTENTION, A2A_OTHER = LABELS[("alltoall", "attention")], LABELS[("alltoall", "other")]
NORM, GRADIENTS = LABELS[("allreduce", "norm")], LABELS[("allreduce", "gradients")]
PROJECTED = (HALO_CONV, HALO_POOL, HALO_OTHER, A2A_ATTENTION, A2A_OTHER, NORM, GRADIENTS)
REDUCES = (NORM, GRADIENTS)
# Agreement steps and extents (control) per step: CommStats' count for CREDIT's CrossFormer at 1 degree, D=2
# (124 sends of 16-56 bytes); its layers are the same at 0.25 degrees. Latency only, in the time projection.
CONTROL_CALLS = 124


class Traffic:
    """What each of ``d`` ranks sends in one training step, by CommStats label: ``[bytes, calls, messages]``.

    ``calls`` as CommStats counts them (a halo exchange, an all-to-all, an all-reduce: one each);
    ``messages``: the point-to-point messages (a halo exchange: one per neighbour; an all-to-all: one
    per peer that gets rows; an all-reduce: one call, its messages are the algorithm's).
    """

    def __init__(self, d):
        self.d = d
        self.ranks = [{} for _ in range(d)]
        self.smallest = [{} for _ in range(d)]  # label -> the smallest point-to-point message (bytes)
        self.notes = set()

    def add(self, rank, label, nbytes, messages=1):
        entry = self.ranks[rank].setdefault(label, [0, 0, 0])
        entry[0] += int(nbytes)
        entry[1] += 1
        entry[2] += int(messages)
        if messages:
            size = int(nbytes) // int(messages)
            self.smallest[rank][label] = min(self.smallest[rank].get(label, size), size)

    def by_kind(self, rank):
        """{label: bytes} of ``rank``, CommStats' labels, kinds with none left out."""
        return {label: v[0] for label, v in self.ranks[rank].items() if v[0]}

    def total(self, rank):
        return sum(v[0] for v in self.ranks[rank].values())

    def busiest(self):
        return max(range(self.d), key=self.total)

    def seconds(self, rank, bandwidth, latency, control_calls=0):
        """(seconds, {part: seconds}) of ``rank``'s messages in one step on a network of ``bandwidth`` bytes/s
        and ``latency`` s: point to point, each message latency + bytes / bandwidth, one after the other
        (no overlap); an all-reduce of n bytes 2 log2(D) latencies + 2 (D-1)/D n / bandwidth (reduce-scatter
        and all-gather); a control step log2(D) latencies."""
        d, hops = self.d, math.ceil(math.log2(self.d)) if self.d > 1 else 0
        parts = {"latency": 0.0, "bandwidth": 0.0}
        kinds = {}
        for label, (nbytes, calls, messages) in self.ranks[rank].items():
            if label in REDUCES:
                lat, bw = calls * 2 * hops * latency, 2 * (d - 1) / d * nbytes / bandwidth
            else:
                lat, bw = messages * latency, nbytes / bandwidth
            parts["latency"] += lat
            parts["bandwidth"] += bw
            kinds[label] = lat + bw
        kinds["control"] = control_calls * hops * latency if d > 1 else 0.0
        parts["latency"] += kinds["control"]
        return sum(kinds.values()), parts, kinds


class _PaddingProbe:
    """Stands in for CREDIT's ``TensorPadding`` in the meta pass: pads with zeros and records what it was given."""

    def __init__(self, padding, seen):
        self.mode, self.pad_lat, self.pad_lon, self.align = padding.mode, padding.pad_lat, padding.pad_lon, \
            padding.align[0]
        self.prefer = padding.prefer
        self.seen = seen

    def pad(self, x):
        self.seen.append((self, tuple(x.shape), x.requires_grad, "pad"))
        (top, bottom), (left, right) = self.pad_lat, self.pad_lon
        return torch.nn.functional.pad(x, (left, right, top, bottom))

    def unpad(self, y):
        self.seen.append((self, tuple(y.shape), y.requires_grad, "unpad"))
        (top, bottom), (left, right) = self.pad_lat, self.pad_lon
        return y[..., top:y.shape[-2] - bottom, left:y.shape[-1] - right]


def _layers(model, field_shape):
    """One meta-device training pass of a copy of ``model`` (unconverted): ([(module, input shape, requires grad,
    output rows)], gradient bytes, {conv: (top, bottom)} of a ZeroPad2d folded into it, PeriodicConvs)."""
    import copy

    from mpidomain.models import PeriodicConv
    from mpidomain.nn.padded_models import plan_padded_models

    model = copy.deepcopy(model).to("meta")
    seen = []
    for module, name, value, _, _ in plan_padded_models(model):  # as convert_model: padding, interpolation
        setattr(module, name, _PaddingProbe(value, seen) if name == "padding_opt" else value)
    folded, periodic = {}, {m: m.conv for m in model.modules() if isinstance(m, PeriodicConv)}
    for seq in model.modules():
        if isinstance(seq, torch.nn.Sequential):
            for pad, conv in zip(list(seq)[:-1], list(seq)[1:]):  # the converter's ZeroPad2d-before-Conv2d pair
                if type(pad) is torch.nn.ZeroPad2d and isinstance(conv, torch.nn.Conv2d) and \
                        conv_padding(conv) == [(0, 0), (0, 0)]:
                    folded[conv] = pad.padding[2:]
    inner = set(periodic.values())
    kinds = (torch.nn.Conv2d, torch.nn.ConvTranspose2d, torch.nn.MaxPool2d, torch.nn.AvgPool2d,
             torch.nn.GroupNorm, PeriodicConv)

    def record(module, args, output):
        x = args[0]
        seen.append((module, tuple(x.shape), x.requires_grad, tuple(output.shape)))

    hooks = [m.register_forward_hook(record) for m in model.modules()
             if (isinstance(m, kinds) and m not in inner) or getattr(m, "attn_type", None) in ("short", "long")]
    try:
        with torch.enable_grad():
            y = model(torch.empty(field_shape, device="meta"))
            y.sum().backward()
    finally:
        for hook in hooks:
            hook.remove()
    gradients = sum(p.numel() * p.element_size() for p in model.parameters() if p.grad is not None)
    return seen, gradients, folded, periodic


def project_traffic(model, field_shape, d):
    """Project the bytes each of ``d`` latitude slabs sends in one training step of ``model``, as CommStats
    counts them (all but control); a :class:`Traffic`. No MPI: a meta-device pass of the unconverted model.

    The step is :class:`Run`'s: forward (the field needs no gradient), backward, ``allreduce_gradients``.
    Each layer as the converted one runs it: halos of :mod:`mpidomain.nn.rows` (to each neighbour, and
    back in backward where the layer's input needs a gradient), window attention's moves of
    :func:`~mpidomain.layout.moves.window_move`, GroupNorm's float64 sums, CREDIT's padding
    (the earth halo, then the deal into ``align``-row blocks; ``unpad`` the move back). A layout
    the library refuses (more slabs than aligned blocks) is projected on balanced rows and noted.
    """
    from mpidomain.nn import rows
    from mpidomain.nn.earth_padding import padded_extents
    from mpidomain.layout.moves import window_move
    from mpidomain.layout.tiles import balanced_split

    traffic = Traffic(d)
    if d == 1:
        return traffic  # a group of one rank sends nothing
    seen, gradients, folded, periodic = _layers(model, field_shape)
    known = {}  # rows -> extents

    def extents(h):
        if h not in known:
            base = max((n for n in known if n % h == 0 and all(e % (n // h) == 0 for e in known[n])), default=None)
            known[h] = [e * h // base for e in known[base]] if base else list(balanced_split(h, d)[0])
        return known[h]

    def neighbours(r, circular=False):
        return 2 if circular else (r > 0) + (r < d - 1)

    def halo(label, width, row, backward, circular=False):
        for r in range(d):
            n = neighbours(r, circular)
            for _ in range(2 if backward else 1):
                if n and width:
                    traffic.add(r, label, n * width * row, n)

    def move(label, source, target, row, times):
        from mpidomain.layout.moves import RowMove, contiguous_layout
        there = RowMove(contiguous_layout(source), contiguous_layout(target))
        for way in (there, there.inverse)[:times]:  # forward; backward the move back
            for r in range(d):
                sends = [len(s) for peer, s in enumerate(way.sends(r)) if peer != r]
                traffic.add(r, label, sum(sends) * row, sum(1 for s in sends if s))

    known[field_shape[-2]] = list(balanced_split(field_shape[-2], d)[0])
    for module, shape, grad, out in seen:
        row = math.prod(shape) // shape[-2] * 4  # float32 bytes of one row (latitude is dim -2)
        if isinstance(module, _PaddingProbe):
            (top, bottom), (left, right) = module.pad_lat, module.pad_lon
            if out == "pad":
                local = [e + (top if r == 0 else 0) + (bottom if r == d - 1 else 0)
                         for r, e in enumerate(extents(shape[-2]))]
                target = padded_extents(sum(local), d, module.align, module.prefer)[0]
                if target is None:
                    traffic.notes.add(f"more slabs than {sum(local) // module.align} blocks of {module.align} rows: "
                                      "projected on balanced rows (the library needs tiles)")
                    target = list(balanced_split(sum(local), d)[0])
                known.clear()
                known[sum(local)] = target
                module.local = local
                if module.mode == "earth" and max(top, bottom):  # HaloExchange((hlat, hlon), boundary="earth")
                    wide = row // shape[-1] * (shape[-1] + 2 * max(left, right))
                    halo(HALO_OTHER, max(top, bottom), wide, grad)
                if local != target:
                    move(A2A_OTHER, local, target, row + row // shape[-1] * (left + right), 2 if grad else 1)
            else:
                target = extents(shape[-2])
                if module.local != target:
                    move(A2A_OTHER, target, module.local, row, 2 if grad else 1)
            continue
        h = shape[-2]
        if isinstance(module, torch.nn.GroupNorm):
            b, g = shape[0], module.num_groups
            for r in range(d):
                traffic.add(r, NORM, 8 * b * (g + 1))
                traffic.add(r, NORM, 8 * b * g)
                if grad or any(p.requires_grad for p in module.parameters()):
                    traffic.add(r, NORM, 8 * b * 2 * g)
        elif getattr(module, "attn_type", None) in ("short", "long"):
            try:
                moves = window_move(module.attn_type, tuple(extents(h)), module.window_size)
            except ValueError:
                traffic.notes.add(f"a {module.attn_type} window of {module.window_size} does not fit the slabs of "
                                  f"{h} rows: not counted")
                continue
            if moves.source != moves.target:
                for _ in range(2 if grad else 1):  # forward there and back; backward the same moves
                    for way in (moves, moves.inverse):
                        for r in range(d):
                            sends = [len(s) for peer, s in enumerate(way.sends(r)) if peer != r]
                            traffic.add(r, A2A_ATTENTION, sum(sends) * row, sum(1 for s in sends if s))
        elif isinstance(module, torch.nn.ConvTranspose2d):
            k, s, dil = module.kernel_size[0], module.stride[0], module.dilation[0]
            windows = rows.transposed_windows(extents(h), k, s, dil, module.padding[0], module.output_padding[0])
            known.setdefault(out[-2], [w.outputs for w in windows])
            halo(HALO_CONV, rows.halo_for(windows), row, grad)
        elif isinstance(module, (torch.nn.MaxPool2d, torch.nn.AvgPool2d)):
            pair = lambda v: v if isinstance(v, tuple) else (v, v)  # noqa: E731
            k, s, p = pair(module.kernel_size)[0], pair(module.stride or module.kernel_size)[0], pair(module.padding)[0]
            dil = pair(getattr(module, "dilation", 1))[0]
            windows = rows.pool_windows(extents(h), k, s, dil, p, module.ceil_mode)
            known.setdefault(out[-2], [w.outputs for w in windows])
            halo(HALO_POOL, rows.halo_for(windows), row, grad)
        else:  # Conv2d, PeriodicConv, or a Conv2d with the ZeroPad2d before it folded in
            conv = periodic.get(module, module)
            before, after = (1, 1) if module in periodic else conv_padding(conv)[0]
            if conv in folded:
                before, after = folded[conv]
                h -= before + after
            k, s, dil = conv.kernel_size[0], conv.stride[0], conv.dilation[0]
            if k == 1 and s == 1 and before == after == 0:
                continue  # local
            if s == 1:
                width = rows.unit_stride_halo(k, dil, before, after)
            else:
                windows = rows.conv_windows(extents(h), k, s, dil, before, after)
                known.setdefault(out[-2], [w.outputs for w in windows])
                width = rows.halo_for(windows)
            halo(HALO_CONV, width, row, grad, circular=module not in periodic and conv.padding_mode == "circular")
    for r in range(d):
        traffic.add(r, GRADIENTS, gradients)
    return traffic


def _crossformer(shape, pad_lat, pad_lon):
    """CREDIT's CrossFormer with the 1-degree layers on ``shape``, earth padding ``pad_lat`` x ``pad_lon``."""
    config = dict(CROSSFORMER_1DEG, pad_lat=pad_lat, pad_lon=pad_lon)
    return build("crossformer", shape, config)[0]


def project(itemsize=4):
    """Print the projected bytes the busiest rank sends per step, by kind, for D = 2 .. 64, at 1 and 0.25 degrees."""
    for label, (shape, pad_lat, pad_lon) in PROJECTIONS.items():
        model = _crossformer(shape, pad_lat, pad_lon)
        hp = shape[0] + sum(pad_lat)
        print(f"CREDIT's CrossFormer at {label}: {shape[0]}x{shape[1]} padded to {hp}x{shape[1] + sum(pad_lon)}, "
              f"float32, batch 1; bytes the busiest rank sends per step (forward, backward, gradients), projected")
        print("(halo: convolutions, and the earth padding's; all-to-all: window attention, and the padding's deal "
              "into blocks; control not projected)")
        print(f"{'D':>4} {'halo conv':>11} {'halo pad':>10} {'a2a attn':>11} {'a2a pad':>10} {'norm':>7} "
              f"{'gradients':>11} {'total MiB':>10} {'all-to-all %':>13}  {'sends':>6} {'messages':>9}  layout")
        for d in DS:
            traffic = project_traffic(model, (1, 7, 1) + shape, d)
            r = traffic.busiest()
            k = traffic.by_kind(r)
            total = traffic.total(r)
            a2a = k.get(A2A_ATTENTION, 0) + k.get(A2A_OTHER, 0)
            calls = sum(v[1] for v in traffic.ranks[r].values())
            messages = sum(v[2] for lab, v in traffic.ranks[r].items() if lab not in REDUCES)
            note = "; ".join(sorted(traffic.notes)) or "slabs"
            print(f"{d:>4} {k.get(HALO_CONV, 0):>11,} {k.get(HALO_OTHER, 0):>10,} {k.get(A2A_ATTENTION, 0):>11,} "
                  f"{k.get(A2A_OTHER, 0):>10,} {k.get(NORM, 0):>7,} {k.get(GRADIENTS, 0):>11,} "
                  f"{total / 2**20:>10.2f} {100 * a2a / total:>12.1f}%  {calls:>6} {messages:>9}  {note}")
        print()


def quarter_degree_compute(repeats):
    """Seconds of one D=1 training step of the 0.25-degree CrossFormer on this process (median of ``repeats``)."""
    shape, pad_lat, pad_lon = PROJECTIONS["0.25 degrees"]
    torch.set_num_threads(cores())
    run = Run("crossformer", shape, mpidomain.DomainParallelManager(1, 1, comm=MPI.COMM_SELF),
              config=dict(CROSSFORMER_1DEG, pad_lat=pad_lat, pad_lon=pad_lon))
    run.step()  # warm-up
    return statistics.median(timed(run)[0] for _ in range(repeats))


def project_time(args):
    """Print the projected step time of the 0.25-degree CrossFormer for D = 4 .. 64 on a stated network."""
    shape, pad_lat, pad_lon = PROJECTIONS["0.25 degrees"]
    compute, source = args.compute_seconds, "given (--compute-seconds)"
    if compute is None:
        compute = quarter_degree_compute(args.repeats)
        source = f"measured here: D=1 on {cores()} cores, median of {args.repeats} steps"
    bandwidth, latency = args.bandwidth * 1e9, args.latency * 1e-6
    model = _crossformer(shape, pad_lat, pad_lon)
    print(f"CREDIT's CrossFormer at 0.25 degrees ({shape[0]}x{shape[1]}), float32, batch 1: projected step time")
    print(f"compute at D=1 {compute:.3f} s ({source}), divided by D (perfect scaling); network "
          f"{args.bandwidth:g} GB/s per rank, {args.latency:g} us per message; no overlap of messages with "
          f"compute or with each other; the busiest rank")
    print(f"{'D':>4} {'compute s':>10} {'comm s':>9} {'step s':>9} {'efficiency':>11} {'speed-up':>9} "
          f"{'comm %':>7} {'a2a % comm':>11} {'latency % comm':>15} {'messages':>9} {'smallest halo':>14}  layout")
    for d in DS[1:]:
        traffic = project_traffic(model, (1, 7, 1) + shape, d)
        r = traffic.busiest()
        comm, parts, kinds = traffic.seconds(r, bandwidth, latency, CONTROL_CALLS)
        step = compute / d + comm
        a2a = kinds.get(A2A_ATTENTION, 0) + kinds.get(A2A_OTHER, 0)
        messages = sum(v[2] for lab, v in traffic.ranks[r].items() if lab not in REDUCES)
        smallest = traffic.smallest[r].get(HALO_CONV, 0)
        note = "; ".join(sorted(traffic.notes)) or "slabs"
        print(f"{d:>4} {compute / d:>10.4f} {comm:>9.4f} {step:>9.4f} {compute / d / step:>11.2f} "
              f"{compute / step:>9.1f} {100 * comm / step:>6.1f}% {100 * a2a / comm:>10.1f}% "
              f"{100 * parts['latency'] / comm:>14.1f}% {messages:>9} {smallest:>12,.0f} B  {note}")
    print("efficiency: (compute / D) / step; a2a: the window attention's and the padding's all-to-alls; latency: "
          "the message count times the latency, all-reduces 2 log2(D) latencies each, control steps "
          f"({CONTROL_CALLS} per step) log2(D) each; smallest halo: the smallest convolution halo message")


def main(argv=None):
    args = parse(argv)
    world = MPI.COMM_WORLD
    if args.bytes or args.project:
        flag = "--bytes" if args.bytes else "--project"
        if credit_missing() is not None:
            print(f"{flag}: skipped, CREDIT's CrossFormer does not import here ({credit_missing()})")
        elif world.rank == 0:
            if args.bytes:
                project()
            if args.project:
                project_time(args)
        return
    names = ("cnn", "crossformer") if args.model == "both" else (args.model,)
    for name in names:
        (bench_compile if args.compile else bench)(name, args, world)


if __name__ == "__main__":
    main()
