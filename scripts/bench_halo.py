"""Benchmark the halo exchange against its floors and baselines, all measured in one run.

Run under MPI with every rank in one domain group (latitude, dim -2, sharded)::

    mpiexec -n 2 python scripts/bench_halo.py
    mpiexec -n 4 python scripts/bench_halo.py

Each rank holds one shard of the given shape (float32). Rows, per shape and halo width:

- floor (numpy / torch): allocate the padded array and copy the shard into it, the least any
  pad-and-exchange must do;
- mpidomain pad-and-exchange, NumPy and Torch: ``halo_exchange(x, h)``;
- pad-and-exchange through persistent requests bound to each new array (the alternative the
  plan's ``pad`` does not take);
- hand-written mpi4py: pack contiguous halos, Isend/Irecv, then concatenate;
- CREDIT's exchange on torch.distributed gloo: P2POps, batch_isend_irecv, then torch.cat;
- raw transfer: persistent Isend/Irecv of contiguous buffers holding the same halo bytes;
- in-place plan: ``plan.exchange(padded)`` (subarray datatypes), and the same with packed halos.

Times are medians over repetitions (each started after a barrier) of the slowest rank.
Targets (2 ranks) are printed as pass/miss.
"""

import argparse
import os
import socket
import statistics
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mpidomain  # noqa: E402
from mpidomain import halo  # noqa: E402

WORLD = MPI.COMM_WORLD


def timed(function, repetitions, warmup=3):
    """Median seconds of ``function()`` on the slowest rank."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repetitions):
        WORLD.Barrier()
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return WORLD.allreduce(statistics.median(times), op=MPI.MAX)


def init_gloo():
    """Start torch.distributed on gloo over this MPI world (address and port agreed over MPI)."""
    port = None
    if WORLD.rank == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(WORLD.bcast(port))
    torch.distributed.init_process_group("gloo", rank=WORLD.rank, world_size=WORLD.size)


def credit_gloo_exchange(x, h, dim, prev_rank, next_rank):
    """CREDIT's forward halo exchange (credit.domain_parallel.halo_exchange), reproduced."""
    dist = torch.distributed
    send_to_prev = x.narrow(dim, 0, h).contiguous()
    send_to_next = x.narrow(dim, x.shape[dim] - h, h).contiguous()
    recv_from_prev = torch.zeros_like(send_to_next)
    recv_from_next = torch.zeros_like(send_to_prev)
    ops = []
    if prev_rank is not None:
        ops.append(dist.P2POp(dist.isend, send_to_prev, prev_rank))
        ops.append(dist.P2POp(dist.irecv, recv_from_prev, prev_rank))
    if next_rank is not None:
        ops.append(dist.P2POp(dist.isend, send_to_next, next_rank))
        ops.append(dist.P2POp(dist.irecv, recv_from_next, next_rank))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return torch.cat([recv_from_prev, x, recv_from_next], dim=dim)


def mpi4py_exchange(comm, x, h, prev_rank, next_rank):
    """Hand-written exchange along axis -2: contiguous halos, Isend/Irecv, concatenate."""
    edge = x.shape[:-2] + (h, x.shape[-1])
    top = np.zeros(edge, x.dtype)
    bottom = np.zeros(edge, x.dtype)
    requests = []
    if prev_rank is not None:
        requests += [comm.Irecv(top, source=prev_rank, tag=1),
                     comm.Isend(np.ascontiguousarray(x[..., :h, :]), dest=prev_rank, tag=2)]
    if next_rank is not None:
        requests += [comm.Irecv(bottom, source=next_rank, tag=2),
                     comm.Isend(np.ascontiguousarray(x[..., -h:, :]), dest=next_rank, tag=1)]
    MPI.Request.Waitall(requests)
    return np.concatenate([top, x, bottom], axis=-2)


def raw_transfer_requests(comm, plan):
    """Persistent requests moving the plan's halo bytes between contiguous buffers."""
    nbytes = plan.shape[-1] * plan.halo_width * int(np.prod(plan.shape[:-2])) * 4
    requests, buffers = [], []
    prev_rank, next_rank = plan.neighbors
    for peer, send_tag, recv_tag in ((prev_rank, 2, 1), (next_rank, 1, 2)):
        if peer is None:
            continue
        send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        buffers += [send, recv]
        requests += [comm.Recv_init(recv, source=peer, tag=recv_tag), comm.Send_init(send, dest=peer, tag=send_tag)]
    return requests, buffers


def bench(shape, h, repetitions, manager, rows):
    dim = -2
    rng = np.random.default_rng(WORLD.rank)
    x = rng.standard_normal(shape, dtype=np.float32)
    xt = torch.from_numpy(x.copy())
    padded_shape = shape[:-2] + (shape[-2] + 2 * h, shape[-1])
    comm = manager.domain_comm.Dup()
    prev_rank, next_rank = manager.neighbor_ranks()

    def floor_numpy():
        out = np.empty(padded_shape, np.float32)
        out[..., h:-h, :] = x
        return out

    def floor_torch():
        out = torch.empty(padded_shape, dtype=torch.float32)
        out[..., h:-h, :].copy_(xt)
        return out

    plan = mpidomain.HaloPlan(x, h, dim, manager=manager)

    def rebinding():
        out = plan.empty()
        plan.interior(out)[...] = x
        return plan.exchange(out)

    padded = plan.pad(x)
    halo._TRANSPORT_OVERRIDE = "packed"
    packed_plan = mpidomain.HaloPlan(x, h, dim, manager=manager)
    halo._TRANSPORT_OVERRIDE = None
    packed_padded = packed_plan.pad(x)
    raw_requests, _buffers = raw_transfer_requests(comm, plan)

    def raw():
        MPI.Prequest.Startall(raw_requests)
        MPI.Request.Waitall(raw_requests)

    # Same results before timing anything.
    ours = mpidomain.halo_exchange(x, h, dim)
    assert np.array_equal(ours, mpi4py_exchange(comm, x, h, prev_rank, next_rank))
    assert np.array_equal(mpidomain.halo_exchange(xt, h, dim).numpy(), ours)
    assert np.array_equal(credit_gloo_exchange(xt, h, dim, prev_rank, next_rank).numpy(), ours)
    assert np.array_equal(plan.exchange(padded), ours) and np.array_equal(packed_plan.exchange(packed_padded), ours)

    measured = {
        "floor numpy": timed(floor_numpy, repetitions),
        "floor torch": timed(floor_torch, repetitions),
        "mpidomain pad+exchange numpy": timed(lambda: mpidomain.halo_exchange(x, h, dim), repetitions),
        "mpidomain pad+exchange torch": timed(lambda: mpidomain.halo_exchange(xt, h, dim), repetitions),
        "pad+exchange, persistent rebound": timed(rebinding, repetitions),
        "hand-written mpi4py": timed(lambda: mpi4py_exchange(comm, x, h, prev_rank, next_rank), repetitions),
        "CREDIT gloo": timed(lambda: credit_gloo_exchange(xt, h, dim, prev_rank, next_rank), repetitions),
        "raw transfer": timed(raw, repetitions * 4),
        "in-place plan (datatypes)": timed(lambda: plan.exchange(padded), repetitions * 4),
        "in-place plan (packed)": timed(lambda: packed_plan.exchange(packed_padded), repetitions * 4),
    }
    for request in raw_requests:
        request.Free()
    plan.free()
    packed_plan.free()
    comm.Free()
    large = shape[-2] * shape[-1] >= 100_000
    two = WORLD.size == 2
    m = measured
    checks = [
        ("mpidomain pad+exchange numpy", "floor numpy", 1.15 if two and large else None, "<="),
        ("mpidomain pad+exchange torch", "floor torch", 1.15 if two and large else None, "<="),
        ("pad+exchange, persistent rebound", "mpidomain pad+exchange numpy", None, "<="),
        ("hand-written mpi4py", "mpidomain pad+exchange numpy", None, "<="),
        ("mpidomain pad+exchange numpy", "hand-written mpi4py", 1.5 if two and not large else None, "<="),
        ("CREDIT gloo", "mpidomain pad+exchange torch", (3 if large else 8) if two else None, ">="),
        ("in-place plan (datatypes)", "raw transfer", 1.2 if two else None, "<="),
        ("in-place plan (packed)", "in-place plan (datatypes)", None, "<="),
    ]
    label = f"{shape} h={h}"
    for name, time_s in measured.items():
        rows.append((label, name, f"{time_s * 1e3:9.3f}", "", ""))
    for name, baseline, target, sense in checks:
        ratio = m[name] / m[baseline]
        verdict = ""
        if target is not None:
            ok = ratio <= target if sense == "<=" else ratio >= target
            verdict = f"{'pass' if ok else 'MISS'} (target {sense} {target})"
        rows.append((label, f"{name} / {baseline}", "", f"{ratio:6.2f}x", verdict))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=None, help="repetitions per row (default: by size)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank
    manager = mpidomain.initialize_domain_parallel(WORLD.size, WORLD.size)
    init_gloo()
    rows = []
    for shape, h in (((1, 64, 180, 1440), 1), ((1, 64, 180, 1440), 3), ((2, 16, 64, 128), 1)):
        large = shape[-2] * shape[-1] >= 100_000
        bench(shape, h, args.repetitions or (20 if large else 200), manager, rows)
    if WORLD.rank == 0:
        print(f"ranks: {WORLD.size} (one domain group), float32, latitude (dim -2) sharded, torch threads 1")
        print(f"MPI: {MPI.Get_library_version().splitlines()[0]}; mpi4py {__import__('mpi4py').__version__}; "
              f"torch {torch.__version__}; numpy {np.__version__}; {os.cpu_count()} cores")
        print(f"{'case':26} {'measurement':60} {'median ms':>9} {'ratio':>7}  verdict")
        for label, name, ms, ratio, verdict in rows:
            print(f"{label:26} {name:60} {ms:>9} {ratio:>7}  {verdict}")
    torch.distributed.destroy_process_group()
    manager.close()


if __name__ == "__main__":
    main()
