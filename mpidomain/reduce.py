"""All-reduce of arrays and tensors over a domain group, a data-parallel group or any communicator.

Host memory goes to MPI as it is; device memory goes directly to a CUDA-aware
MPI, or is staged through pinned host buffers. Half-precision values
(float16, bfloat16) are reduced in float32, which every MPI supports. For
Torch the reduction is differentiable.
"""

import numpy as np

from . import comm_stats, devices, transport
from ._agreement import agree
from ._mpi import mpi
from ._waits import wait_collective
from ._current import require_manager

__all__ = ["allreduce", "checked_reduce", "group_communicator"]

GROUPS = ("domain", "tensor_parallel", "data_parallel")
_PRIVATE = {"domain": "domain", "tensor_parallel": "tp", "data_parallel": "data"}
_MPI_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN", "prod": "PROD"}
_HALF = ("float16", "bfloat16")


def group_communicator(group, manager=None):
    """Return the mpi4py communicator ``group`` names, or None for a one-process job with no manager.

    ``group`` is ``"domain"``, ``"tensor_parallel"``, ``"data_parallel"`` (the library's private
    duplicates of the manager's groups, so its messages never meet the
    user's; ``manager`` defaults to the initialised one) or an mpi4py
    intracommunicator, returned as it is. Local: no communication. A group
    name with no manager in a job of several processes is a RuntimeError:
    silently skipping a gradient average would train each replica apart.
    """
    if isinstance(group, str):
        if group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS} or an mpi4py communicator, got {group!r}")
        manager = require_manager(manager, f"group={group!r}", alone_ok=True,
                                  fix="call mpidomain.initialize_domain_parallel(...) first, or pass manager= or an "
                                      "mpi4py communicator as group")
        return None if manager is None else manager.library_comm(_PRIVATE[group])
    if not isinstance(group, mpi().Intracomm):
        raise TypeError(
            f"group must be one of {GROUPS} or an mpi4py intracommunicator, got {type(group).__name__}"
        )
    return group


def _op_error(op, spec, needs_grad):
    """Return the TypeError/ValueError/NotImplementedError for reducing ``spec`` with ``op`` (a backward
    reduction to follow where ``needs_grad``), or None."""
    if op not in _MPI_OPS:
        return ValueError(f"op must be one of {tuple(_MPI_OPS)}, got {op!r}")
    kind = np.dtype("float32" if spec.dtype in _HALF else spec.dtype).kind
    if kind == "b" or (op == "mean" and kind not in "fc") or (op in ("max", "min") and kind == "c"):
        return TypeError(
            f"op={op!r} cannot reduce {spec.dtype} values; cast first (e.g. to float32 for a mean or a bool count)"
        )
    if needs_grad and op == "prod":
        return NotImplementedError("allreduce(op='prod') is not differentiable; detach the tensor or use another op")
    return None


def reduce_array(x, op, comm):
    """Return a new array: ``x`` reduced with ``op`` over every rank of ``comm``.

    Collective over ``comm``, with no checks and no autograd: the engine under
    :func:`allreduce`. Every rank must pass the same shape, dtype and ``op``.
    """
    dtype = devices.array_spec(x).dtype
    work = devices.contiguous(_as_native(x, dtype))
    out = devices.empty(tuple(work.shape), like=work)
    datatype = devices.mpi_datatype(work)
    MPI = mpi()
    operation = getattr(MPI, _MPI_OPS[op])
    way = transport.transport_for(work)
    source = way.readable(work)  # alive until the reduction completes
    with way.writable(out) as result:
        if comm_stats.recorder is not None and comm.Get_size() > 1:
            comm_stats.sent("allreduce", out.nbytes)
        request = comm.Iallreduce([source, datatype], [result, datatype], op=operation)
        wait_collective(request, comm, "allreduce", out.nbytes)
    if op == "mean":
        out /= comm.Get_size()
    return out if out.dtype == x.dtype else _cast(out, x)


def _as_native(x, dtype):
    """Return ``x`` in a type MPI reduces natively: float32 for half precision, native byte order."""
    if dtype in _HALF:
        return x.float() if devices.array_kind(x) == "torch" else x.astype("float32")
    if devices.array_kind(x) != "torch" and not x.dtype.isnative:
        return x.astype(x.dtype.newbyteorder("="))
    return x


def _cast(out, like):
    return out.to(like.dtype) if devices.array_kind(like) == "torch" else out.astype(like.dtype)


def allreduce(x, op="sum", group="domain", manager=None):
    """Return ``x`` reduced over ``group``: every rank gets the same new array.

    Collective over ``group``: call on all its ranks with the same ``op`` and
    arrays of the same shape and dtype. ``op`` is ``"sum"``, ``"mean"``,
    ``"max"``, ``"min"`` or ``"prod"``; ``group`` is ``"domain"``,
    ``"tensor_parallel"``, ``"data_parallel"`` or an mpi4py communicator. The result has ``x``'s
    kind, dtype and device. Returns ``x`` itself when ``group`` is a name and
    there is no manager in a one-process job (a group of one rank); with
    several processes and no manager, a group name is a RuntimeError.

    Torch tensors are differentiable: the backward of a sum all-reduces the
    gradient (a mean divides it by the group size; max and min send it to the
    ranks holding the extreme, split evenly on ties), so every rank must run
    backward through the result. ``prod`` is not differentiable. Ranks that
    disagree on op, shape, dtype or whether a gradient is needed raise
    ValueError on every rank (checked with one small Allreduce).
    """
    comm = group_communicator(group, manager)
    spec = signature = error = None
    try:
        spec = devices.array_spec(x)
        needs_grad = spec.kind == "torch" and x.requires_grad and _grad_enabled()
        signature = (op, tuple(x.shape), spec.dtype, needs_grad)
        error = _op_error(op, spec, needs_grad)
    except TypeError as exc:  # not an array, or a dtype MPI cannot move
        error = exc
    if comm is None:
        if error is not None:
            raise error
        return x
    agree(comm, "allreduce", signature, error=error, mismatch=_mismatch)
    if spec.kind == "torch":
        return _autograd_function().apply(x, op, comm)
    return reduce_array(x, op, comm)


def checked_reduce(x, op, comm, needs_grad, call="allreduce"):
    """Return a new tensor: ``x`` reduced with ``op`` over ``comm``, after :func:`allreduce`'s agreement step.

    Collective over ``comm``: every rank passes the same op, shape, dtype and ``needs_grad`` (whether a
    backward reduction will follow), or every rank raises. No autograd: for a caller that does its own
    (the custom operator ``mpidomain::allreduce``). ``call`` names it in the errors.
    """
    spec = signature = error = None
    try:
        spec = devices.array_spec(x)
        signature = (op, tuple(x.shape), spec.dtype, bool(needs_grad))
        error = _op_error(op, spec, needs_grad)
    except TypeError as exc:
        error = exc
    agree(comm, call, signature, error=error, mismatch=_mismatch)
    return reduce_array(x, op, comm)


def _mismatch(signatures):
    listing = ", ".join(
        f"rank {r}: op={o!r} shape {s} {t}{' requiring grad' * g}" for r, (o, s, t, g) in enumerate(signatures))
    return ValueError(f"allreduce needs the same op, shape, dtype and requires_grad on every rank, got {listing}")


def _grad_enabled():
    import torch

    return torch.is_grad_enabled()


_FUNCTION = None


def _autograd_function():
    """Return the torch.autograd.Function behind :func:`allreduce` (built on first use: torch is lazy)."""
    global _FUNCTION
    if _FUNCTION is not None:
        return _FUNCTION
    import torch

    class AllReduce(torch.autograd.Function):
        """Differentiable all-reduce: sum and mean all-reduce the gradient; max and min route it."""

        @staticmethod
        def forward(ctx, x, op, comm):
            y = reduce_array(x.detach(), op, comm)
            ctx.op, ctx.comm = op, comm
            if op in ("max", "min"):
                ctx.save_for_backward(x.detach(), y)
            return y

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad):
            total = reduce_array(grad, "sum", ctx.comm)
            if ctx.op == "mean":
                total /= ctx.comm.Get_size()
            elif ctx.op in ("max", "min"):
                x, y = ctx.saved_tensors
                holds = (x == y).to(grad.dtype)
                total = total * holds / reduce_array(holds, "sum", ctx.comm)
            return total, None, None

    _FUNCTION = AllReduce
    return _FUNCTION
