"""Benchmark the halo exchange against its floors and baselines, all measured in one run.

Run under MPI with every rank in one domain group (latitude, dim -2, sharded)::

    mpiexec -n 2 python scripts/bench/bench_halo.py
    mpiexec -n 4 python scripts/bench/bench_halo.py

Each rank holds one shard of the given shape (float32). Rows, per shape and halo width:

- floor (numpy / torch): copy the shard into a preallocated padded array, the least any
  pad-and-exchange must do; and, for information, a fresh allocation plus that copy (a large
  fresh array page-faults on every call);
- mpidomain pad-and-exchange, NumPy and Torch: ``halo_exchange(x, h)`` (a new result each call,
  against the fresh-allocation floor) and ``halo_exchange(x, h, out=padded)`` (against the
  preallocated floor);
- the same through a held plan, ``plan.pad(x)`` (no per-call agreement step, no cache lookup),
  and the agreement step alone (one Allreduce of seven integers, what every ``halo_exchange``
  call adds to check the ranks' arguments and settle the plan cache alike; on a call with
  a plan found in the cache the halos travel while it does, so "pad+exchange / held plan pad" is
  what the step still costs);
- the same into a freshly allocated output each call;
- hand-written mpi4py: pack contiguous halos, Isend/Irecv, then concatenate; and the same with a
  non-blocking Allreduce of seven integers started first and completed with the halos ("+ agreement"):
  the least a design that keeps a group-wide step on every call can cost, so the ratio of it to the
  hand-written row bounds from below what "Torch call / hand-written" can reach; the hand-written
  exchange of a Torch tensor (``x.numpy()``, the same exchange, ``torch.from_numpy``): what the two
  calls into torch that any Torch call makes cost on top of the NumPy one; and both together ("+
  agreement, torch"): the least a Torch call that keeps a group-wide step on every call can cost;
- CREDIT's exchange on torch.distributed gloo: P2POps, batch_isend_irecv, then torch.cat. It runs in
  a second phase, after every MPI row, next to ``halo_exchange`` of Torch tensors again: once a
  gloo group exists, its threads share the cores with MPI's polling, which on a 2-core machine
  slows every synchronising MPI call (the "gloo alive" row shows by how much);
- raw transfer: persistent requests moving contiguous buffers holding the same halo bytes;
  and, the alternative to packing, the same rows of padded arrays described by MPI subarray
  datatypes, on the receiving side only or on both sides;
- in-place plan: ``plan.exchange(padded)`` (packs the edge rows, sends, copies the received rows
  into the ghost rows).

Times are medians (and minima) over repetitions, each call started after a barrier, of the
slowest rank; the rows take turns, in an order shuffled each round (the same on every rank), so
that neither the machine's load nor what the row before left in the caches favours one row;
ratios compare medians. Targets (at 2 and 4 ranks) are printed as pass/miss:
small field, the Torch call <= 1.25x hand-written mpi4py and <= 1.15x the NumPy call; large
field, ``out=`` <= 1.10x the copy floor and a new result <= 1.10x hand-written mpi4py.
"""

import argparse
import os
import random
import statistics
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mpidomain  # noqa: E402
from mpidomain._agreement import agree, agreement_code  # noqa: E402

WORLD = MPI.COMM_WORLD


def timed(functions, repetitions, warmup=3):
    """(median, min) seconds of each ``functions[name]()`` on the slowest rank, in a dict.

    The functions take turns, one call each per round (every call after a barrier), so a
    change in the machine's load hits them all alike rather than whichever ran then; in an
    order shuffled each round, the same on every rank, so that no function always runs after
    the same one (a call after one that allocated or touched a megabyte of other memory finds
    colder caches: a fixed order would favour whichever follows a light one).
    """
    for function in functions.values():
        for _ in range(warmup):
            function()
    times = {name: [] for name in functions}
    order = random.Random(12345)  # the same sequence of orders on every rank
    names = list(functions)
    for _ in range(repetitions):
        order.shuffle(names)
        for name in names:
            function = functions[name]
            WORLD.Barrier()
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    return {name: (WORLD.allreduce(statistics.median(t), op=MPI.MAX), WORLD.allreduce(min(t), op=MPI.MAX))
            for name, t in times.items()}


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


def mpi4py_exchange(comm, x, h, prev_rank, next_rank, agreement=None):
    """Hand-written exchange along axis -2: contiguous halos, Isend/Irecv, concatenate; with ``agreement``
    (an int64 array), a non-blocking Allreduce (MAX) of it travels with the halos."""
    edge = x.shape[:-2] + (h, x.shape[-1])
    top = np.zeros(edge, x.dtype)
    bottom = np.zeros(edge, x.dtype)
    requests = [] if agreement is None else [comm.Iallreduce(MPI.IN_PLACE, agreement, op=MPI.MAX)]
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


def subarray_transfer_requests(comm, x, h, prev_rank, next_rank, both_sides):
    """Persistent requests moving the halo rows into a padded array through a subarray datatype.

    The rows leave a padded array through a datatype too (``both_sides``) or a contiguous buffer.
    """
    padded = np.zeros(x.shape[:-2] + (x.shape[-2] + 2 * h, x.shape[-1]), x.dtype)
    sizes = [int(np.prod(x.shape[:-2])), padded.shape[-2], x.shape[-1] * x.itemsize]

    def rows(start):
        return MPI.BYTE.Create_subarray(sizes, [sizes[0], h, sizes[2]], [0, start, 0]).Commit()

    n = x.shape[-2]
    types, requests = [], []
    contiguous = np.ones(sizes[0] * h * sizes[2], np.uint8)
    for peer, send_start, recv_start, send_tag, recv_tag in ((prev_rank, h, 0, 2, 1), (next_rank, n, n + h, 1, 2)):
        if peer is None:
            continue
        recv = rows(recv_start)
        types.append(recv)
        requests.append(comm.Recv_init([padded, 1, recv], source=peer, tag=recv_tag))
        if both_sides:
            send = rows(send_start)
            types.append(send)
            requests.append(comm.Send_init([padded, 1, send], dest=peer, tag=send_tag))
        else:
            requests.append(comm.Send_init(contiguous, dest=peer, tag=send_tag))
    return requests, types


def bench(shape, h, repetitions, manager, gloo):
    """Return the measured rows of one case: MPI's alone (``gloo=False``, before torch.distributed
    starts), or CREDIT's gloo exchange next to ours with a gloo group alive (``gloo=True``)."""
    dim = -2
    rng = np.random.default_rng(WORLD.rank)
    x = rng.standard_normal(shape, dtype=np.float32)
    xt = torch.from_numpy(x.copy())
    padded_shape = shape[:-2] + (shape[-2] + 2 * h, shape[-1])
    comm = manager.domain_comm.Dup()
    prev_rank, next_rank = manager.neighbor_ranks()

    preallocated = np.zeros(padded_shape, np.float32)
    preallocated_torch = torch.zeros(padded_shape, dtype=torch.float32)

    def floor_numpy():
        np.copyto(preallocated[..., h:-h, :], x)

    def floor_torch():
        preallocated_torch[..., h:-h, :].copy_(xt)

    def fresh_numpy():
        out = np.empty(padded_shape, np.float32)
        out[..., h:-h, :] = x
        return out

    def fresh_torch():
        out = torch.empty(padded_shape, dtype=torch.float32)
        out[..., h:-h, :].copy_(xt)
        return out

    plan = mpidomain.HaloPlan(x, h, dim, manager=manager)
    padded = plan.pad(x)
    raw_requests, _buffers = raw_transfer_requests(comm, plan)
    subarray_requests, subarray_types = subarray_transfer_requests(comm, x, h, prev_rank, next_rank, True)
    receive_only_requests, receive_only_types = subarray_transfer_requests(comm, x, h, prev_rank, next_rank, False)

    def run(requests):
        MPI.Prequest.Startall(requests)
        MPI.Request.Waitall(requests)

    signature = {"array": "numpy on host", "dtype": x.dtype, "ndim": x.ndim, "dim": 2, "halo_width": h}
    code = agreement_code("halo_exchange", signature)  # kept from an earlier call, as halo_exchange keeps it
    seven = np.zeros(7, np.int64)
    # Same results before timing anything.
    ours = mpidomain.halo_exchange(x, h, dim)
    assert np.array_equal(ours, mpi4py_exchange(comm, x, h, prev_rank, next_rank))
    assert np.array_equal(mpidomain.halo_exchange(xt, h, dim).numpy(), ours)
    assert np.array_equal(plan.exchange(padded), ours)
    if gloo:
        assert np.array_equal(credit_gloo_exchange(xt, h, dim, prev_rank, next_rank).numpy(), ours)
        measured = timed({
            "CREDIT gloo": lambda: credit_gloo_exchange(xt, h, dim, prev_rank, next_rank),
            "mpidomain pad+exchange torch, gloo alive": lambda: mpidomain.halo_exchange(xt, h, dim),
        }, repetitions)
        _free(raw_requests, subarray_requests, subarray_types, receive_only_requests, receive_only_types, plan, comm)
        return measured

    measured = timed({
        "floor numpy": floor_numpy,
        "floor torch": floor_torch,
        "fresh allocation + copy numpy": fresh_numpy,
        "fresh allocation + copy torch": fresh_torch,
        "mpidomain pad+exchange numpy": lambda: mpidomain.halo_exchange(x, h, dim),
        "mpidomain pad+exchange torch": lambda: mpidomain.halo_exchange(xt, h, dim),
        "mpidomain pad+exchange numpy, out=": lambda: mpidomain.halo_exchange(x, h, dim, out=preallocated),
        "mpidomain pad+exchange torch, out=": lambda: mpidomain.halo_exchange(xt, h, dim, out=preallocated_torch),
        "pad+exchange, fresh output": lambda: plan.pad(x, np.empty(padded_shape, np.float32)),
        "held plan pad": lambda: plan.pad(x),
        "agreement step": lambda: agree(comm, "halo_exchange", signature, False, None, None, 16, code),
        "hand-written mpi4py": lambda: mpi4py_exchange(comm, x, h, prev_rank, next_rank),
        "hand-written mpi4py + agreement": lambda: mpi4py_exchange(comm, x, h, prev_rank, next_rank, seven),
        "hand-written mpi4py, torch": lambda: torch.from_numpy(mpi4py_exchange(comm, xt.numpy(), h, prev_rank, next_rank)),
        "hand-written mpi4py + agreement, torch": lambda: torch.from_numpy(
            mpi4py_exchange(comm, xt.numpy(), h, prev_rank, next_rank, seven)),
    }, repetitions)
    measured.update(timed({
        "raw transfer": lambda: run(raw_requests),
        "raw transfer, subarray receives": lambda: run(receive_only_requests),
        "raw transfer, subarray both sides": lambda: run(subarray_requests),
        "in-place plan": lambda: plan.exchange(padded),
    }, repetitions * 4))
    _free(raw_requests, subarray_requests, subarray_types, receive_only_requests, receive_only_types, plan, comm)
    return measured


def _free(*handles):
    for handle in handles:
        for one in handle if isinstance(handle, list) else [handle]:
            one.free() if isinstance(one, mpidomain.HaloPlan) else one.Free()


def report(shape, h, measured, rows):
    """Append the case's rows, ratios and verdicts (targets at 2 ranks) to ``rows``."""
    large = shape[-2] * shape[-1] >= 100_000
    two = WORLD.size == 2
    targeted = WORLD.size in (2, 4)
    m = measured

    def at(target, when=True):
        return target if targeted and when else None

    checks = [
        ("mpidomain pad+exchange numpy, out=", "floor numpy", at(1.10, large), "<="),
        ("mpidomain pad+exchange torch, out=", "floor torch", at(1.10, large), "<="),
        ("mpidomain pad+exchange numpy", "fresh allocation + copy numpy", None, "<="),
        ("mpidomain pad+exchange torch", "fresh allocation + copy torch", None, "<="),
        ("mpidomain pad+exchange numpy", "hand-written mpi4py", at(1.10, large), "<="),
        ("mpidomain pad+exchange torch", "hand-written mpi4py", at(1.10 if large else 1.25), "<="),
        ("mpidomain pad+exchange torch", "mpidomain pad+exchange numpy", at(1.15, not large), "<="),
        ("pad+exchange, fresh output", "mpidomain pad+exchange numpy", None, "<="),
        ("held plan pad", "mpidomain pad+exchange numpy", None, "<="),
        ("mpidomain pad+exchange numpy", "held plan pad", None, "<="),
        ("agreement step", "mpidomain pad+exchange numpy", None, "<="),
        ("agreement step", "hand-written mpi4py", None, "<="),
        ("hand-written mpi4py + agreement", "hand-written mpi4py", None, "<="),
        ("mpidomain pad+exchange torch", "hand-written mpi4py + agreement", None, "<="),
        ("hand-written mpi4py, torch", "hand-written mpi4py", None, "<="),
        ("mpidomain pad+exchange torch", "hand-written mpi4py, torch", None, "<="),
        ("hand-written mpi4py + agreement, torch", "hand-written mpi4py", None, "<="),
        ("mpidomain pad+exchange torch", "hand-written mpi4py + agreement, torch", None, "<="),
        ("CREDIT gloo", "mpidomain pad+exchange torch", (3 if large else 8) if two else None, ">="),
        ("CREDIT gloo", "mpidomain pad+exchange torch, gloo alive", None, ">="),
        ("in-place plan", "raw transfer", 1.2 if two else None, "<="),
        ("raw transfer, subarray receives", "in-place plan", None, "<="),
        ("raw transfer, subarray both sides", "in-place plan", None, "<="),
    ]
    label = f"{shape} h={h}"
    for name, (median, fastest) in measured.items():
        rows.append((label, name, f"{median * 1e3:9.3f}", f"{fastest * 1e3:9.3f}", "", ""))
    for name, baseline, target, sense in checks:
        ratio = m[name][0] / m[baseline][0]
        verdict = ""
        if target is not None:
            ok = ratio <= target if sense == "<=" else ratio >= target
            verdict = f"{'pass' if ok else 'MISS'} (target {sense} {target})"
        rows.append((label, f"{name} / {baseline}", "", "", f"{ratio:6.2f}x", verdict))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=None, help="repetitions per row (default: by size)")
    parser.add_argument("--shapes", choices=("all", "small", "large"), default="all",
                        help="which cases to run (small: (2, 16, 64, 128) h=1, e.g. at 8 ranks)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank
    manager = mpidomain.initialize_domain_parallel(WORLD.size, WORLD.size)
    rows = []
    cases = [((1, 64, 180, 1440), 1), ((1, 64, 180, 1440), 3), ((2, 16, 64, 128), 1)]
    if args.shapes != "all":
        cases = [case for case in cases if (case[0][-2] * case[0][-1] >= 100_000) == (args.shapes == "large")]
    repetitions = [args.repetitions or (60 if shape[-2] * shape[-1] >= 100_000 else 1000) for shape, _ in cases]
    measured = [bench(shape, h, n, manager, gloo=False) for (shape, h), n in zip(cases, repetitions)]
    mpidomain.init_torch_distributed(backend="gloo")  # after MPI's rows: gloo's threads share the cores
    for (shape, h), n, rows_of_case in zip(cases, repetitions, measured):
        rows_of_case.update(bench(shape, h, n, manager, gloo=True))
        report(shape, h, rows_of_case, rows)
    if WORLD.rank == 0:
        print(f"ranks: {WORLD.size} (one domain group), float32, latitude (dim -2) sharded, torch threads 1")
        print(f"MPI: {MPI.Get_library_version().splitlines()[0]}; mpi4py {__import__('mpi4py').__version__}; "
              f"torch {torch.__version__}; numpy {np.__version__}; {os.cpu_count()} cores")
        print(f"{'case':24} {'measurement (ratios of medians)':58} {'median ms':>9} {'min ms':>9} {'ratio':>7}  verdict")
        for label, name, median, fastest, ratio, verdict in rows:
            print(f"{label:24} {name:58} {median:>9} {fastest:>9} {ratio:>7}  {verdict}")
    torch.distributed.destroy_process_group()
    manager.close()


if __name__ == "__main__":
    main()
