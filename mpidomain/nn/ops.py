"""The library's communication inside a model as PyTorch custom operators, so ``torch.compile`` can trace it.

Eager code calls the engine directly (:func:`mpidomain.halo_exchange`, :func:`mpidomain.allreduce`,
:func:`mpidomain.redistribution.redistribute`). While Dynamo traces (``torch.compiler.is_compiling()``), the
functions here put one custom operator in the graph instead (``torch.ops.mpidomain.*``, made with
``torch.library.custom_op``):

- ``halo_pad`` / ``halo_adjoint``: the halo exchange of every layout (slabs, tiles, the Earth) and its adjoint,
  each the other's backward;
- ``allreduce``: a sum, mean, max or min over one of the manager's groups (GroupNorm, BatchNorm, adaptive pools,
  the losses), its backward the reduction of the gradient (or the identity, for partial sums every rank turns
  into the same loss);
- ``redistribute``: a :class:`~mpidomain.layout.moves.RowMove` as one all-to-all (window attention, the Earth
  padding), its backward the inverse move.

Each operator's eager implementation runs the engine with its agreement step at run time, so a compiled
graph's collectives stay checked like eager ones. Its fake (meta) implementation communicates nothing: the
output shape follows from the arguments (halo widths, the move's target extents). Every operator is an ordered
effect (``torch.library.EffectType.ORDERED``): the compiled graph keeps the collectives in program order on
every rank.

What a layer decides from the other ranks' extents (its windows) is a constant of the graph
(:mod:`mpidomain.nn.plans`). Managers and moves travel in the graph as integers (:func:`handle`,
:func:`move_handle`): names in this process only, never reused.
"""

import itertools

import torch

from .._agreement import agree
from .._current import closed_error, require_manager
from ..halo.call import adjoint_of, pad_for_grad
from ..halo.call import halo_exchange as _eager_halo_exchange
from ..manager import sharded_dims
from ..reduce import allreduce as _eager_allreduce
from ..reduce import checked_reduce, reduce_array
from ..redistribution import redistribute as _redistribute
from ._compile_marks import compile_disabled, constant_result, substitute

__all__ = ["allreduce", "compiling", "halo_exchange", "handle", "move_handle", "moves_of", "raise_on_every_rank",
           "redistribute", "register", "sum_partials"]

_MANAGERS = {}  # handle -> manager
_HANDLES = {}  # id(manager) -> handle
_NUMBERS = itertools.count(1)  # handles are never reused: a graph of a closed manager finds none
_MOVES = {}  # handle -> a RowMove or a pair of them
_MOVE_HANDLES = {}  # moves -> handle


def compiling():
    """True while Dynamo traces (``torch.compiler.is_compiling()``); False in eager code. Local."""
    return torch.compiler.is_compiling()


def register(manager):
    """Return ``manager``'s handle, giving it one on first use (forgotten when it closes). Local."""
    key = id(manager)
    number = _HANDLES.get(key)
    if number is None:
        number = next(_NUMBERS)
        _MANAGERS[number], _HANDLES[key] = manager, number
        manager.on_close(_forget)
    return number


def _forget(manager):
    number = _HANDLES.pop(id(manager), None)
    _MANAGERS.pop(number, None)


@constant_result
def handle(manager):
    """Return the integer that names ``manager`` in a compiled graph (a constant of the graph). Local."""
    return register(manager)


def _manager(number, call):
    manager = _MANAGERS.get(number)
    if manager is None:
        raise RuntimeError(f"mpidomain::{call}: the compiled graph names manager {number}, which has closed; "
                           "compile the model again after initialize_domain_parallel")
    if manager.closed:
        raise closed_error(manager)
    return manager


def _move_register(moves):
    number = _MOVE_HANDLES.get(moves)
    if number is None:
        number = _MOVE_HANDLES[moves] = next(_NUMBERS)
        _MOVES[number] = moves
    return number


def move_handle(moves):
    """Return the integer that names ``moves`` (a RowMove, or a pair of them) in a compiled graph. Local.

    A function Dynamo calls at trace time returns this (not the move), so the graph holds an integer.
    """
    return _move_register(moves)


# -- the operators ----------------------------------------------------------------------------

def _halo_arguments(dims, widths, periodic):
    """One value per dim, or the value itself for one dim: as ``halo_exchange`` takes them."""
    if len(dims) == 1:
        return dims[0], widths[0], periodic[0]
    return tuple(dims), tuple(widths), tuple(periodic)


@torch.library.custom_op("mpidomain::halo_pad", mutates_args=())
def _halo_pad(x: torch.Tensor, manager: int, dims: list[int], widths: list[int], periodic: list[bool],
              boundary: str, grad: bool) -> torch.Tensor:
    """Collective over the domain group: ``x`` with its neighbours' rows (``mpidomain.halo_exchange``)."""
    dim, width, wraps = _halo_arguments(dims, widths, periodic)
    return pad_for_grad(x.detach(), width, dim, wraps, boundary or None, _manager(manager, "halo_pad"), grad)


@_halo_pad.register_fake
def _(x, manager, dims, widths, periodic, boundary, grad):
    shape = list(x.shape)
    for d, w in zip(dims, widths):
        shape[d] += 2 * w
    return x.new_empty(shape)


@torch.library.custom_op("mpidomain::halo_adjoint", mutates_args=())
def _halo_adjoint(grad: torch.Tensor, manager: int, dims: list[int], widths: list[int], periodic: list[bool],
                  boundary: str) -> torch.Tensor:
    """Collective over the domain group: the adjoint of ``halo_pad`` (ghost rows' gradients back to their owners)."""
    dim, width, wraps = _halo_arguments(dims, widths, periodic)
    return adjoint_of(grad.detach(), width, dim, wraps, boundary or None, _manager(manager, "halo_adjoint"))


@_halo_adjoint.register_fake
def _(grad, manager, dims, widths, periodic, boundary):
    shape = list(grad.shape)
    for d, w in zip(dims, widths):
        shape[d] -= 2 * w
    return grad.new_empty(shape)


def _halo_setup(ctx, inputs, output):
    ctx.arguments = inputs[1:6]


def _halo_pad_backward(ctx, grad):
    return (_halo_adjoint(grad, *ctx.arguments),) + (None,) * 6


def _halo_adjoint_backward(ctx, grad):
    return (_halo_pad(grad, *ctx.arguments, False),) + (None,) * 5


_halo_pad.register_autograd(_halo_pad_backward, setup_context=_halo_setup)
_halo_adjoint.register_autograd(_halo_adjoint_backward, setup_context=_halo_setup)


@torch.library.custom_op("mpidomain::allreduce", mutates_args=())
def _allreduce(x: torch.Tensor, manager: int, group: str, op: str, backward: str, grad: bool) -> torch.Tensor:
    """Collective over the manager's library communicator ``group``: ``x`` reduced with ``op``, a new tensor."""
    comm = _manager(manager, "allreduce").library_comm(group)
    call = "allreduce" if backward == "reduce" else "allreduce (partial sums)"
    return checked_reduce(x.detach(), op, comm, grad, call)


@_allreduce.register_fake
def _(x, manager, group, op, backward, grad):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _allreduce_setup(ctx, inputs, output):
    x, manager, group, op, backward, _ = inputs
    ctx.arguments = (manager, group, op, backward)
    if op in ("max", "min"):
        ctx.save_for_backward(x, output)


def _allreduce_backward(ctx, grad):
    manager, group, op, backward = ctx.arguments
    if backward == "identity":
        return grad, None, None, None, None, None
    total = _allreduce(grad, manager, group, "sum", "reduce", False)
    if op == "mean":
        total = total / _group_size(manager, group)
    elif op in ("max", "min"):
        x, y = ctx.saved_tensors
        holds = (x == y).to(grad.dtype)
        total = total * holds / _allreduce(holds, manager, group, "sum", "reduce", False)
    return total, None, None, None, None, None


_allreduce.register_autograd(_allreduce_backward, setup_context=_allreduce_setup)


@torch.library.custom_op("mpidomain::redistribute", mutates_args=())
def _redistribute_op(x: torch.Tensor, manager: int, move: int, dims: list[int]) -> torch.Tensor:
    """Collective over the domain group: ``x``'s rows dealt out as move ``move`` says (one all-to-all)."""
    moves = _MOVES[move]
    dim = tuple(dims) if len(dims) > 1 else dims[0]
    return _redistribute(x.detach().contiguous(), moves, dim, manager=_manager(manager, "redistribute"))


@_redistribute_op.register_fake
def _(x, manager, move, dims):
    return x.new_empty(_moved_shape(tuple(x.shape), _MOVES[move], dims, _MANAGERS[manager]))


def _redistribute_setup(ctx, inputs, output):
    ctx.arguments = (inputs[1], inputs[2], inputs[3])


def _redistribute_backward(ctx, grad):
    manager, move, dims = ctx.arguments
    return _redistribute_op(grad, manager, _inverse(move), dims), None, None, None


_redistribute_op.register_autograd(_redistribute_backward, setup_context=_redistribute_setup)

for _op in (_halo_pad, _halo_adjoint, _allreduce, _redistribute_op):
    _op.register_effect(torch.library.EffectType.ORDERED)


def _inverse(number):
    moves = _MOVES[number]
    inverse = tuple(m.inverse for m in moves) if isinstance(moves, tuple) else moves.inverse
    return _move_register(inverse)


def _moved_shape(shape, moves, dims, manager):
    """``shape`` with each of ``dims`` holding this rank's rows of the move's target layout (pure arithmetic)."""
    along = {s.dim: s for s in sharded_dims(manager, len(shape))}
    shape = list(shape)
    for d, move in zip(dims, moves if isinstance(moves, tuple) else (moves,)):
        shape[d] = move.target.extents[along[d].coord]
    return shape


def _group_size(number, group):
    return _MANAGERS[number].library_comm(group).Get_size()


# -- what Dynamo traces in place of the engine's entry points ---------------------------------

def _normalised(values, count):
    return list(values) if isinstance(values, (tuple, list)) else [values] * count


@substitute(_eager_halo_exchange)
def halo_exchange(x, halo_width, dim=None, *, periodic=False, boundary=None, manager=None, out=None):
    """:func:`mpidomain.halo_exchange` as Dynamo traces it: the ``mpidomain::halo_pad`` operator.

    Eager code never calls this: Dynamo calls it in place of :func:`mpidomain.halo_exchange`
    (``torch.compiler.substitute_in_graph``), so a compiled model that pads with the library (a converted
    layer, ``HaloExchange``, or the function itself) holds the operator; its backward is
    ``mpidomain::halo_adjoint``. Collective over the domain group when the graph runs, as the function.
    """
    if out is not None:
        raise TypeError("halo_exchange(out=...) cannot be compiled: a compiled graph allocates its results; drop out=")
    manager = require_manager(manager, "halo exchange")
    if dim is None:
        dim = (-2, -1) if boundary == "earth" else manager.shard_dims
    dims = [d % x.ndim for d in (dim if isinstance(dim, (tuple, list)) else (dim,))]
    widths, wraps = _normalised(halo_width, len(dims)), _normalised(periodic, len(dims))
    grad = x.requires_grad and torch.is_grad_enabled()
    return _halo_pad(x, handle(manager), dims, [int(w) for w in widths], [bool(w) for w in wraps],
                     boundary or "", grad)


_GROUPS = {"domain": "domain", "tensor_parallel": "tp", "data_parallel": "data"}


@substitute(_eager_allreduce)
def allreduce(x, op="sum", group="domain", manager=None):
    """:func:`mpidomain.allreduce` as Dynamo traces it: the ``mpidomain::allreduce`` operator.

    Eager code never calls this (see :func:`halo_exchange`). Collective over ``group`` (a group name: a
    compiled graph names communicators by the manager's groups) when the graph runs; backward as eager:
    the gradient summed over the group (a mean divides it, max and min route it).
    """
    if group not in _GROUPS:
        raise TypeError(f"allreduce(group={group!r}) cannot be compiled: pass one of {tuple(_GROUPS)}")
    manager = require_manager(manager, f"group={group!r}")
    grad = x.requires_grad and torch.is_grad_enabled()
    return _allreduce(x, handle(manager), _GROUPS[group], op, "reduce", grad)


def sum_partials(x, manager, group="domain"):
    """Return ``x`` summed over the manager's library communicator ``group``; the gradient passes as it is.

    Collective over the group: every rank passes a tensor of the same shape and dtype and gets the same sum.
    For partial sums that every rank turns into the same loss: the objective is that one loss, not D copies
    of it, so the gradient of a rank's partial sum is the upstream gradient itself
    (:func:`mpidomain.allreduce`'s backward sums the ranks' upstream gradients, right when each rank's output
    feeds a different loss, which here would multiply every gradient by D). While Dynamo traces, the
    ``mpidomain::allreduce`` operator with an identity backward.
    """
    if not compiling():
        return _PartialSums.apply(x, manager.library_comm(group))
    grad = x.requires_grad and torch.is_grad_enabled()
    return _allreduce(x, handle(manager), group, "sum", "identity", grad)


class _PartialSums(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward (:func:`sum_partials`)."""

    @staticmethod
    def forward(ctx, partial, comm):
        return reduce_array(partial.detach(), "sum", comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def redistribute(x, move, dim, manager):
    """Return this rank's rows of ``x`` in ``move``'s target layout: the ``mpidomain::redistribute`` operator.

    Collective over the domain group (see :func:`mpidomain.redistribution.redistribute`); differentiable
    (backward: the inverse move). ``move``: a RowMove, a pair of them (tiles), or the :func:`move_handle` of
    one (what a function Dynamo calls at trace time returns).
    """
    if not isinstance(move, int):
        move = move_handle(tuple(move) if isinstance(move, (tuple, list)) else move)
    dims = [d % x.ndim for d in (dim if isinstance(dim, (tuple, list)) else (dim,))]
    return _redistribute_op(x, handle(manager), move, dims)


def moves_of(number):
    """Return the RowMove (or pair) that :func:`move_handle` named ``number``. Local."""
    return _MOVES[number]


@compile_disabled
def raise_on_every_rank(comm, call, error):
    """Raise this rank's ``error`` on every rank of ``comm``: the agreement step of ``call`` with it.

    Collective over ``comm``: the other ranks meet it in their own agreement step of ``call`` (or, in a
    compiled model, of their next operator) and raise too. Never traced: Dynamo calls it at run time.
    """
    agree(comm, call, None, error=error)
    raise error  # not reached: the agreement raises it
