"""Check a cluster end to end: ``python -m mpidomain check`` under the job's launcher.

Steps, each agreed across ranks: the layout (as ``info``); halo exchange against
a reference cut from the global array (zeros at the domain edges, periodic, then
the Earth's boundary: longitude periodic, latitude folded across the poles);
a shard/gather round trip; the bandwidth of every neighbour pair's halo messages,
naming the slowest link; the CUDA-aware decision and each rank's device. Rank 0
prints progress and, last, one verdict line.
"""

import math
import socket
import statistics

import numpy as np

from .. import devices, transport
from . import info
from .._errors import rank_ranges
from .._mpi import mpi
from ..halo.call import halo_exchange
from ..sharding import gather_tensor, shard_tensor
from ..manager import library_comm
from ..layout.tiles import balanced_split

__all__ = ["run_check"]

STEPS = 5


class _Report:
    """Rank 0's printer and every rank's record of what failed, agreed step by step."""

    def __init__(self, manager):
        self.manager = manager
        self.comm = library_comm(manager, "world")
        self.failures = []  # (step, message, ranks)
        self.notes = []

    def say(self, text=""):
        if self.comm.Get_rank() == 0:
            print(text, flush=True)

    def agree(self, step, error):
        """Gather each rank's error (None if fine) for ``step``; print and record the failures."""
        errors = self.comm.allgather(error)
        by_message = {}
        for rank, message in enumerate(errors):
            if message is not None:
                by_message.setdefault(message, []).append(rank)
        for message, ranks in by_message.items():
            self.failures.append((step, message, ranks))
            self.say(f"  FAILED on rank{'s' * (len(ranks) > 1)} {rank_ranges(ranks)}: {message}")
        return not by_message


def _to_numpy(x):
    kind = devices.array_kind(x)
    if kind == "torch":
        return x.detach().cpu().numpy()
    if kind == "cupy":
        return x.get()
    return x


def _on_device(array, device):
    """Return host ``array`` as an array on ``device``: NumPy for cpu, torch (else cupy) for cuda."""
    if device == "cpu":
        return array
    try:
        import torch

        if torch.cuda.is_available():
            return torch.from_numpy(array).to(torch.device("cuda", torch.cuda.current_device()))
    except ImportError:
        pass
    import cupy

    return cupy.asarray(array)


def _global_array(shape, group):
    """The global field every rank of domain group ``group`` builds alike: exact in float32."""
    values = np.arange(math.prod(shape), dtype=np.int64).reshape(shape) % 1009
    return (values + 0.5 * group).astype(np.float32)


def _padded_global(full, widths, boundary):
    """The global array padded by ``widths`` (latitude, longitude): ``"zeros"``, ``"periodic"`` or ``"earth"``.

    Earth: the rows beyond a pole are the near-pole rows mirrored, half a turn of longitude
    away (``roll(x, W // 2)``), then longitude wraps around (the corners too).
    """
    h, w = widths
    edge = [(0, 0)] * (full.ndim - 2)
    if boundary == "earth":
        turned = np.roll(full, full.shape[-1] // 2, axis=-1)
        rows = np.concatenate([turned[..., :h, :][..., ::-1, :], full, turned[..., full.shape[-2] - h:, :][..., ::-1, :]],
                              axis=-2)
        return np.pad(rows, edge + [(0, 0), (w, w)], mode="wrap")
    return np.pad(full, edge + [(h, h), (w, w)], mode="wrap" if boundary == "periodic" else "constant")


def _tile_window(manager, full):
    """This rank's (start, count) along latitude and along longitude (count = all of it for slabs)."""
    shape = manager.domain_shape if manager.tiled else (manager.domain_parallel_size, 1)
    coords = manager.domain_coords if manager.tiled else (manager.domain_rank, 0)
    window = []
    for n, parts, c in zip(full.shape[-2:], shape, coords):
        counts, offsets = balanced_split(n, parts)
        window.append((offsets[c], counts[c]))
    return window


def _mismatch(got, expected, what):
    got = _to_numpy(got)
    if got.shape != expected.shape:
        return f"{what}: shape {got.shape}, expected {expected.shape}"
    wrong = np.argwhere(got != expected)
    if len(wrong):
        return f"{what}: {len(wrong)} of {expected.size} values differ from the global reference, first at {tuple(wrong[0])}"
    return None


def _check_halo(manager, full, device, width):
    (lat, rows), (lon, cols) = _tile_window(manager, full)
    shard = shard_tensor(_on_device(full, device), dim=manager.shard_dim, manager=manager, allow_uneven=True)
    tiles = manager.tiled
    errors = []
    for boundary in ("zeros", "periodic", "earth"):  # every exchange on every rank, whatever the first found
        if boundary == "earth":
            widths = (width, width)
            padded = halo_exchange(shard, widths, boundary="earth", manager=manager)
        else:  # slabs: along latitude only
            widths = (width, width if tiles else 0)
            padded = halo_exchange(shard, width, periodic=boundary == "periodic", manager=manager)
        expected = _padded_global(full, widths, boundary)[..., lat:lat + rows + 2 * widths[0],
                                                          lon:lon + cols + 2 * widths[1]]
        errors.append(_mismatch(padded, expected, f"halo_exchange({boundary})"))
    return next((error for error in errors if error), None)


def _check_round_trip(manager, full, device):
    dim = manager.shard_dim
    shard = shard_tensor(_on_device(full, device), dim=dim, manager=manager, allow_uneven=True)
    return _mismatch(gather_tensor(shard, dim=dim, manager=manager), full, "gather_tensor(shard_tensor(x))")


def _exchange_times(comm, partner, send, recv, repeats):
    """Seconds for ``repeats`` round trips of ``send``/``recv`` with ``partner`` (after one warm-up)."""
    MPI = mpi()
    way = transport.transport_for(send)
    host_send, host_recv = way.staging(send), way.staging(recv)  # None unless staged

    def once():
        with way.writable(recv, host_recv) as received:
            comm.Sendrecv(way.readable(send, host_send), partner, 0, received, partner, 0)

    once()
    start = MPI.Wtime()
    for _ in range(repeats):
        once()
    return MPI.Wtime() - start


def _measure_links(manager, message_shape, device, repeats):
    """Return [(global rank a, global rank b, GB/s)] for this domain group's neighbour pairs.

    Link k joins domain ranks k and k+1; even links run together, then odd ones, so
    no rank is in two measurements at once. GB/s counts both directions' bytes.
    """
    comm = library_comm(manager)
    rank, size = comm.Get_rank(), comm.Get_size()
    first = manager.domain_group_ranks()[0]
    send = _on_device(np.ones(message_shape, dtype=np.float32), device)
    recv = _on_device(np.zeros(message_shape, dtype=np.float32), device)
    nbytes = math.prod(message_shape) * 4
    measured = []
    for parity in (0, 1):
        partner = rank + 1 if rank % 2 == parity else rank - 1
        comm.Barrier()
        if 0 <= partner < size:
            seconds = _exchange_times(comm, partner, send, recv, repeats)
            if rank < partner:
                measured.append((first + rank, first + partner, 2 * nbytes * repeats / seconds / 1e9))
    return measured


def run_check(manager, device, shape, width, repeats):
    """Run every step; print on rank 0; return the exit status (0: passed, 1: failed).

    Collective over ``manager.comm``: call on all ranks with the same arguments.
    """
    report = _Report(manager)
    world = manager.world_size
    binding = manager.device_binding
    along = "dims (-2, -1), tiles" if manager.tiled else "dim -2"
    report.say(f"mpidomain check: {world} ranks, {_axes(manager)}, device {device}, "
               f"global shape {tuple(shape)} float32 (sharded along {along}), halo width {width}")

    report.say(f"[1/{STEPS}] layout")
    rows = info.gather_layout(manager)
    if manager.rank == 0:
        print(info.format_layout(manager, rows), flush=True)

    report.say(f"[2/{STEPS}] halo exchange against the global reference (zero edges, periodic, then the Earth's "
               "boundary)")
    full = _global_array(tuple(shape), manager.mesh.group_index("domain"))
    if report.agree("halo exchange", _guarded(_check_halo, manager, full, device, width)):
        report.say("  ok: every rank's padded shard equals the global array's rows")

    report.say(f"[3/{STEPS}] shard/gather round trip")
    if report.agree("shard/gather round trip", _guarded(_check_round_trip, manager, full, device)):
        report.say("  ok: gather_tensor(shard_tensor(x)) == x on every rank")

    decision = devices.cuda_aware_decision()
    staged = transport.transport_for(_on_device(np.zeros(1, np.float32), device)).stages
    message_shape = tuple(shape[:-2]) + (width, shape[-1])
    kib = math.prod(message_shape) * 4 / 1024
    report.say(f"[4/{STEPS}] halo bandwidth per neighbour pair ({kib:.1f} KiB messages, {repeats} round trips"
               f"{', staged through host' if staged else ''})")
    links = [link for part in library_comm(manager, "world").allgather(
        _measure_links(manager, message_shape, device, repeats) if manager.domain_parallel_size > 1 else [])
        for link in part]
    hosts = library_comm(manager, "world").allgather(socket.gethostname())
    slowest = None
    if not links:
        report.say("  no neighbour pairs (D=1): nothing to measure")
    else:
        links.sort()
        fastest = max(bw for *_, bw in links)
        for a, b, bw in links:
            report.say(f"  rank {a} <-> rank {b} ({hosts[a]} <-> {hosts[b]}): {bw:.3f} GB/s")
        a, b, bw = slowest = min(links, key=lambda link: link[2])
        median = statistics.median(l[2] for l in links)
        report.say(f"  slowest link: rank {a} <-> rank {b} ({hosts[a]} <-> {hosts[b]}), {bw:.3f} GB/s, "
                   f"{bw / fastest:.2f} of the fastest, {bw / median:.2f} of the median")

    report.say(f"[5/{STEPS}] CUDA-aware decision and devices")
    decisions = library_comm(manager, "world").allgather(str(decision))
    if len(set(decisions)) == 1:
        report.say(f"  device buffers: {decisions[0]}")
    else:
        report.agree("CUDA-aware decision", f"ranks decide differently; this one: {decision}")
    bound = library_comm(manager, "world").allgather(binding.describe() if binding is not None else "not bound (bind_device='none')")
    for rank, text in enumerate(bound):
        report.say(f"  rank {rank} ({hosts[rank]}): {text}")
    shared = sorted({r for r, b in enumerate(library_comm(manager, "world").allgather(binding.shared_with if binding else ())) if b})
    if shared:
        report.notes.append(f"ranks {rank_ranges(shared)} share a GPU")

    summary = f"{world} ranks on {manager.num_nodes} node(s), {_axes(manager)}, {device}"
    if slowest is not None:
        summary += f"; slowest link rank {slowest[0]} <-> {slowest[1]} {slowest[2]:.3f} GB/s"
    if report.notes:
        summary += f" (warning: {'; '.join(report.notes)})"
    if not report.failures:
        report.say(f"check passed: halo exchange and shard/gather exact; {summary}")
        return 0
    failed = "; ".join(f"{step} on rank{'s' * (len(r) > 1)} {rank_ranges(r)}: {m}" for step, m, r in report.failures)
    report.say(f"check FAILED: {failed}; {summary}")
    return 1


def _axes(manager):
    """The three axes' sizes, as the header and the verdict print them."""
    d = manager.domain_parallel_size
    if manager.tiled:
        d = f"{d} ({manager.domain_shape[0]}x{manager.domain_shape[1]} tiles)"
    return f"D={d}, T={manager.tensor_parallel_size}, dp={manager.data_parallel_size}"


def _guarded(step, *args):
    """Run a step; return its error text (mpidomain's errors, raised on every rank alike) or None."""
    try:
        return step(*args)
    except (ValueError, TypeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
