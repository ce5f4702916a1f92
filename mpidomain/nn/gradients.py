"""Average (or sum) gradients across a group in a few large Allreduce calls.

Gradients are copied into flat buckets of about ``bucket_bytes`` each (one
per dtype and device, in parameter order), each bucket is reduced in place
with one ``MPI_Allreduce(MPI_IN_PLACE, ...)``, and the results are copied
back. Device buckets go to a CUDA-aware MPI directly, or are staged through a
pinned host buffer; half-precision gradients are reduced in float32.
"""

import torch

from .. import comm_stats, devices, transport
from .._agreement import agree
from .._errors import rank_ranges
from .._mpi import mpi
from ..reduce import group_communicator

__all__ = ["allreduce_gradients", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 * 2**20
_HALF = (torch.float16, torch.bfloat16)


def _parameters(module_or_params):
    """Return the distinct tensors of a module or an iterable of parameters, in order."""
    params = module_or_params.parameters() if hasattr(module_or_params, "parameters") else module_or_params
    if isinstance(params, torch.Tensor):
        params = [params]
    distinct, seen = [], set()
    for param in params:
        if not isinstance(param, torch.Tensor):
            raise TypeError(
                f"module_or_params must be a torch.nn.Module or an iterable of tensors, found a {type(param).__name__}"
            )
        if id(param) not in seen:
            seen.add(id(param))
            distinct.append(param)
    return distinct


def _local_error(op, bucket_bytes, params):
    if op not in ("mean", "sum"):
        return ValueError(f"op must be 'mean' or 'sum', got {op!r}")
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
        return ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    for index, param in enumerate(params):
        if param.grad is not None and (param.grad.is_sparse or param.grad.layout != torch.strided):
            return TypeError(f"parameter {index} has a {param.grad.layout} gradient; only dense gradients are reduced")
    return None


def _mismatch(signatures):
    """Return a ValueError describing how the ranks' gradient signatures differ."""
    lines = []
    for rank, (op, bucket_bytes, count, entries) in enumerate(signatures):
        with_grad = [index for index, *_ in entries]
        listed = rank_ranges(with_grad) if with_grad else "none"
        lines.append(f"rank {rank}: op={op!r} bucket_bytes={bucket_bytes}, {len(with_grad)} of {count} "
                     f"parameters with a gradient ({listed})")
    shapes = {}
    for rank, (*_, entries) in enumerate(signatures):
        for index, *described in entries:
            shapes.setdefault(index, {}).setdefault(tuple(described), []).append(rank)
    for index, variants in sorted(shapes.items()):
        if len(variants) > 1:
            lines.append(f"parameter {index}: " + "; ".join(
                f"shape {shape} {dtype} on {device} on rank(s) {rank_ranges(ranks)}"
                for (shape, dtype, device), ranks in variants.items()))
            break
    return ValueError(
        "allreduce_gradients needs the same op, bucket_bytes, parameters and gradients (which ones, shapes, "
        "dtypes, device types) on every rank of the group, got:\n  " + "\n  ".join(lines)
        + "\nrun the same model and the same backward on every rank (zero unused gradients with "
          "torch.zeros_like instead of leaving them None)"
    )


def allreduce_gradients(module_or_params, group="data_parallel", op="mean", manager=None, *,
                        bucket_bytes=DEFAULT_BUCKET_BYTES):
    """Replace every parameter's ``.grad`` by its mean (or sum) over ``group``; return the bucket count.

    Collective over ``group`` (``"data_parallel"``, ``"domain"``,
    ``"tensor_parallel"`` or an mpi4py communicator): call on all its ranks with the same arguments, after the
    backward pass, with the same model. Each rank's gradients become the
    element-wise mean (``op="mean"``) or sum (``op="sum"``) of all ranks'
    gradients, in place. A DTensor gradient (FSDP2, tensor parallelism)
    contributes its local shard, which every rank of the group must hold
    alike, as the ranks of a domain group on a mesh do (``group="domain"``
    after an FSDP2 backward sums the domain shards' parts of each gradient
    shard). Parameters whose ``.grad`` is None are skipped; which
    ones have gradients, and their shapes and dtypes, must agree across ranks,
    or every rank raises ValueError listing what each had (one small Allreduce
    checks it). Gradients travel in flat buckets of about ``bucket_bytes``
    (one Allreduce each). Does nothing when ``group`` is a name and there is
    no manager in a one-process job; with several processes that is a
    RuntimeError (a skipped average would let the replicas drift apart).
    """
    params = _parameters(module_or_params)
    comm = group_communicator(group, manager)
    error = _local_error(op, bucket_bytes, params)
    with torch.no_grad():
        local = {index: _local(p.grad) for index, p in enumerate(params) if p.grad is not None}
    entries = [(index, tuple(g.shape), str(g.dtype), g.device.type) for index, g in local.items()]
    if comm is None or comm.Get_size() == 1:
        if error is not None:
            raise error
        return 0
    agree(comm, "allreduce_gradients", (op, bucket_bytes, len(params), entries), error=error, mismatch=_mismatch)
    grads = [local[index] for index, *_ in entries]
    buckets = _buckets(grads, bucket_bytes)
    staging = None
    with torch.no_grad():
        for bucket in buckets:
            staging = _reduce_bucket(bucket, op, comm, staging)
    return len(buckets)


def _local(grad):
    """Return the tensor this rank holds of ``grad``: a DTensor's local shard (FSDP2, tensor parallelism), else itself.

    Reducing the local shards over a group whose ranks hold the same shard (a
    domain group of a mesh) reduces the whole gradient.
    """
    to_local = getattr(grad, "to_local", None)
    return grad if to_local is None else to_local()


def _reduce_dtype(dtype):
    return torch.float32 if dtype in _HALF else dtype


def _buckets(grads, bucket_bytes):
    """Group gradients into lists of about ``bucket_bytes`` each, per dtype and device, in order."""
    open_buckets, closed = {}, []
    for grad in grads:
        key = (grad.dtype, grad.device)
        bucket = open_buckets.setdefault(key, [[], 0])
        bucket[0].append(grad)
        bucket[1] += grad.numel() * _reduce_dtype(grad.dtype).itemsize
        if bucket[1] >= bucket_bytes:
            closed.append(bucket[0])
            del open_buckets[key]
    return closed + [grads for grads, _ in open_buckets.values()]


def _reduce_bucket(grads, op, comm, staging):
    """Flatten ``grads``, all-reduce them in place, copy the result back; return the staging buffer."""
    dtype = _reduce_dtype(grads[0].dtype)
    numels = [g.numel() for g in grads]
    flat = torch.empty(sum(numels), dtype=dtype, device=grads[0].device)
    for piece, grad in zip(flat.split(numels), grads):
        piece.copy_(grad.reshape(-1))
    MPI = mpi()
    datatype = devices.mpi_datatype(flat)
    way = transport.transport_for(flat)
    if way.stages and (staging is None or staging.size < flat.numel()
                                 or staging.dtype != devices.numpy_dtype(flat)):
        staging = way.staging(flat)  # kept for the next bucket: pinned memory is slow to allocate
    with way.in_place(flat, None if staging is None else staging[:flat.numel()]) as memory:
        if comm_stats.recorder is not None and comm.Get_size() > 1:
            comm_stats.sent("allreduce", flat.numel() * flat.element_size(), layer="gradients")
        if comm_stats.timer is None:
            comm.Allreduce(MPI.IN_PLACE, [memory, datatype], op=MPI.SUM)
        else:
            began = comm_stats.clock()
            comm.Allreduce(MPI.IN_PLACE, [memory, datatype], op=MPI.SUM)
            comm_stats.waited(comm_stats.clock() - began)
    if op == "mean":
        flat /= comm.Get_size()
    for piece, grad in zip(flat.split(numels), grads):
        grad.copy_(piece.view_as(grad))
    devices.synchronize(flat)
    return staging
