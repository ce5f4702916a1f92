"""``halo_exchange``: each call's agreement step, the plan cache, and the autograd Function.

Every call starts with one small agreement step over the domain group that
checks the ranks' arguments and settles the plan cache alike on every rank
(:func:`cached_plan`). A call that finds its plan (every call after the
first with the same arguments) starts the halos together with the step, and
one whose pad is a single copy runs a path prepared once per spelling of the
arguments (:func:`_pad_found`). The plans themselves, and how their bytes
move, are :mod:`mpidomain.halo.plan`'s.
"""

from typing import NamedTuple

from .. import devices
from . import cache as plan_cache
from .._agreement import AheadMessages, Agreement, agreement_code
from .._current import require_manager
from .plan import HaloPlan
from .spec import describe, group_mismatch

__all__ = ["adjoint_of", "cached_plan", "halo_exchange", "pad_for_grad"]


class HaloCall(NamedTuple):
    """One halo exchange call's arguments besides its arrays, as the caller spelled them.

    ``call`` names what the call does (``"pad"``, ``"pad+grad"``, ``"adjoint"``): the agreement step
    checks it with the rest. Immutable, and part of the quick key (:func:`_quick_key`). A NamedTuple,
    not a frozen dataclass: every call makes one, in a third of the time.
    """

    halo_width: object
    dim: object
    periodic: object
    boundary: object
    manager: object
    call: str


def cached_plan(x, halo_width, dim=None, *, periodic=False, boundary=None, manager=None, call="pad"):
    """Return the cached :class:`HaloPlan` for ``x``'s shard, building it on a miss.

    Collective over the domain group, on every call: one small agreement step
    checks that every rank passed the same arguments (all but the extent along
    ``dim``) for the same ``call`` (``"pad"``, ``"pad+grad"``, ``"adjoint"``)
    and settles hit or miss for all ranks at once: if any rank misses, all
    build a new plan together. A disagreement raises on every rank, listing
    what each rank had. Each manager keeps its own last
    :data:`~mpidomain.halo.cache.CACHE_SIZE` plans.
    """
    return _plan(x, HaloCall(halo_width, dim, periodic, boundary, manager, call))


class _Spelling:
    """One spelling of ``halo_exchange``'s arguments the cache has seen (its quick key's entry).

    ``signature`` and ``code`` are what its agreement compares, ``mine`` the
    :class:`~mpidomain.halo.spec.HaloSpec` they described. ``agreement`` is
    the pad's :class:`~mpidomain._agreement.Agreement` with the plan's halos to go
    ahead of it (``ahead``), prepared by the first pad that finds the plan this way and
    started again by each one after it.
    """

    __slots__ = ("signature", "code", "mine", "agreement", "ahead")

    def __init__(self, signature, code, mine):
        self.signature, self.code, self.mine = signature, code, mine
        self.agreement = self.ahead = None


class _Lookup(NamedTuple):
    """What :func:`_lookup` found for one call, locally."""

    manager: object  # the manager the call uses
    cache: object    # its plan_cache.PlanCache
    host: object     # x's devices.host_view, or None
    quick: object    # the _quick_key (None: x does not say, or an argument is unhashable)
    found: object    # the plan_cache.QuickEntry under it (info: the _Spelling), or None


class _Settled(NamedTuple):
    """What :func:`_settle` agreed on: the ``plan``, and the pad it started (None: pad with :meth:`HaloPlan.pad`)."""

    plan: HaloPlan
    pad: object  # a halo.plan.PadStart, for plan.finish_pad


def _lookup(x, arguments):
    """Return the :class:`_Lookup` of ``x`` with :class:`HaloCall` ``arguments``."""
    manager = require_manager(arguments.manager, "halo exchange")
    cache = plan_cache.cache_of(manager)
    host = devices.host_view(x)
    try:
        quick = _quick_key(x, host, arguments)
        return _Lookup(manager, cache, host, quick, cache.quick(quick))
    except Exception:  # not an array, or an unhashable argument: the full checks report it
        return _Lookup(manager, cache, host, None, None)


def _quick_key(x, host, arguments):
    """Return what ``x`` (``host``: its host view, or None) and :class:`HaloCall` ``arguments`` are, as spelled,
    cheaply (the types tell ``1`` from ``True``)."""
    types = (type(arguments.halo_width), type(arguments.dim), type(arguments.periodic))
    if host is not None:  # host memory: its NumPy view says what it is
        return (type(x), host.shape, host.dtype, types, arguments)
    return (type(x), tuple(x.shape), x.dtype, x.device, getattr(x, "layout", None), "not a host view", types,
            arguments)


def _plan(x, arguments):
    """Return the cached plan for ``x`` with :class:`HaloCall` ``arguments`` (:func:`cached_plan`)."""
    return _settle(x, arguments, _lookup(x, arguments)).plan


def _settle(x, arguments, lookup, out=None, padding=False):
    """:func:`cached_plan`'s work after :func:`_lookup`; return a :class:`_Settled`.

    ``out`` is checked with the arguments (a bad one raises on every rank).
    With ``padding``, a rank that holds a plan for ``x`` starts the pad into
    ``out`` (a new padded array if None) with :meth:`HaloPlan.start_pad`, its
    halos with the agreement where it can: finish it with
    :meth:`HaloPlan.finish_pad`.
    """
    manager, cache, found = lookup.manager, lookup.cache, lookup.found
    comm = manager.library_comm()
    error = None
    if found is not None:  # arguments seen before: their checks passed then, and would again
        key, plan, spelling = found.key, found.plan, found.info
        signature, code, mine = spelling.signature, spelling.code, spelling.mine
        padded_shape = plan.padded_shape
    else:
        signature, key, code, padded_shape, mine = None, None, None, None, None
        try:
            mine = describe(x, arguments.halo_width, arguments.dim, arguments.periodic, manager, arguments.boundary)
            kind = devices.array_kind(x)
            device = str(x.device) if kind == "torch" else x.device.id if kind == "cupy" else None
            key = (mine, tuple(x.shape), device)  # this rank's plan; not the call kind
            signature = dict(mine.signature(), call=arguments.call)
            code = agreement_code("halo_exchange", signature)
            padded_shape = mine.padded_shape(tuple(x.shape))
        except (TypeError, ValueError) as exc:
            error = exc
        plan = None if key is None else cache.get(key)
    if out is not None and error is None:
        try:
            _check_out(out, x, padded_shape, arguments.call)
        except (TypeError, ValueError) as exc:
            error = exc
    # A hit counts only if every rank hit the same plan, the one built together with the same tags:
    # after uneven shards, one rank's key can find a plan its neighbour has since replaced.
    local = padding and plan is not None and error is None and (found is not None or plan.shape == tuple(x.shape))
    # On a hit, the halos leave with the agreement instead of after it; the agreement lets them finish
    # only if every rank did the same, and settles them on every rank otherwise.
    ahead = AheadMessages() if local else None
    agreement = Agreement(comm, "halo_exchange", signature, plan is None, error, group_mismatch,
                          -1 if plan is None else plan.tag, code, ahead)
    pad = plan.start_pad(x, lookup.host, out, agreement, ahead) if local else None
    # The agreement's wait polls the halos started ahead too, and usually completes them.
    if agreement.result():  # every rank described its arguments, and they agree: build on that
        plan, pad = _rebuilt(x, mine, manager, cache, key), None
    else:
        cache.touch(plan)
    if found is None and lookup.quick is not None:
        cache.remember(lookup.quick, key, _Spelling(signature, code, mine))
    return _Settled(plan, pad)


def _rebuilt(x, mine, manager, cache, key):
    """Build the plan for ``x`` from agreed ``mine`` on every rank, and cache it under ``key``; return it."""
    plan = HaloPlan.from_spec(x, mine, manager, "halo_exchange")
    cache.put(key, plan)
    return plan


def _pad_found(plan, spelling, host, out):
    """Pad host shard ``host`` (a NumPy view) into ``out`` (None: a new array) with ``plan``, found by ``spelling``,
    when a pad is one copy (:meth:`HaloPlan.pad_prepared`, the agreement prepared here on first use); return the
    result, or None if the agreement found that some rank missed (every rank's halos are settled: build anew)."""
    if spelling.agreement is None:
        spelling.ahead = AheadMessages()
        spelling.agreement = Agreement(plan.manager.library_comm(), "halo_exchange", spelling.signature, False, None,
                                       group_mismatch, plan.tag, spelling.code, spelling.ahead, start=False)
    return plan.pad_prepared(spelling.agreement, spelling.ahead, host, out)


def _fits(out, x, padded_shape, call):
    """Whether :func:`_check_out` accepts ``out``."""
    try:
        _check_out(out, x, padded_shape, call)
    except (TypeError, ValueError):
        return False
    return True


def _check_out(out, x, padded_shape, call):
    """Raise TypeError/ValueError unless ``out`` can hold ``x``'s padded result of ``padded_shape``."""
    if call == "pad+grad":
        raise TypeError("out= cannot take the result of a tensor that requires grad (autograd needs a result of "
                        "its own); drop out=, or pass x.detach()")
    kind, expected = devices.array_kind(out), devices.array_kind(x)
    if (kind != expected or out.dtype != x.dtype or tuple(out.shape) != padded_shape
            or devices.is_device_array(out) != devices.is_device_array(x)):
        where = "device" if devices.is_device_array(x) else "host"
        raise ValueError(
            f"out must be a {expected} array on the {where} of shape {padded_shape} and dtype {x.dtype} (x with "
            f"the halos), got a {kind} array of shape {tuple(out.shape)} and dtype {out.dtype}"
            f"{' on the device' if devices.is_device_array(out) else ''}; allocate it like x with the padded shape"
        )
    if kind == "torch" and (out.is_conj() or out.is_neg() or out.requires_grad):
        raise ValueError("out must be a plain tensor that does not require grad (not a lazily conjugated or negated "
                         "view); allocate a new one, e.g. torch.empty_like")
    if not (out.is_contiguous() if kind == "torch" else out.flags.c_contiguous):
        raise ValueError(f"out must be C-contiguous, got strides {tuple(out.stride() if kind == 'torch' else out.strides)}; "
                         "allocate a new one, e.g. numpy.empty or torch.empty")


def halo_exchange(x, halo_width, dim=None, *, periodic=False, boundary=None, manager=None, out=None):
    """Return ``x`` padded with ``halo_width`` of its neighbours' rows on both sides along ``dim``.

    Collective over the domain group: call on every rank of the group, each
    with its own shard (same dtype, device kind and extents except along
    ``dim``), the same ``halo_width``, ``dim`` and ``periodic``. Each rank
    gets a new array of ``x``'s kind, dtype and device with
    ``x.shape[dim] + 2 * halo_width`` rows along ``dim``: the previous rank's
    last rows, ``x``, the next rank's first rows; zeros at the ends of the
    domain group, or the rows from the other end when ``periodic=True``. The
    result has that shape for any D, one rank included (CREDIT returns ``x``
    unpadded when D=1). Along a dimension the manager does not shard (e.g.
    longitude, ``dim=-1``, of a latitude-sharded field) each rank holds the
    whole extent, so the result is a local pad of ``x``: its own wrapped rows
    with ``periodic=True``, zeros otherwise. Every call starts with one small
    agreement step (a non-blocking Allreduce, which the halos of a plan found
    in the cache travel with) that checks the ranks' arguments and settles the plan
    cache alike on every rank; a mismatch raises on every rank. A Torch
    tensor that requires grad is differentiable: backward is the exact adjoint
    (:meth:`HaloPlan.adjoint`).
    ``out``, a C-contiguous array of the result's kind, dtype, device and
    shape, receives the result instead of a new array (reusing it saves the
    allocation, which for a large result costs as much as the copy).

    With tiles (a manager of ``(D_lat, D_lon)``), several dims or
    ``boundary="earth"``, ``x`` is padded along each dim (default: the
    manager's ``shard_dims``; ``(-2, -1)`` with the Earth) with the blocks the
    neighbours hold, the diagonal ones' corners included; see :class:`HaloPlan`.
    For example, on 2 x 2 tiles of a 4 x 6 field, ``halo_exchange(x, 1)``
    gives each rank its 2 x 3 tile inside a 4 x 5 array: its own values, one
    row of the tile north or south of it, one column of the tile east or west,
    one corner of the diagonal tile, zeros beyond the field's edges.

    :param x: This rank's shard: NumPy array, CuPy array or Torch tensor.
    :param halo_width: Ghost rows on each side (<= every rank's extent along ``dim``); or one per dim.
    :param dim: Sharded dimension, or a tuple of dims; default ``manager.shard_dim``.
    :param periodic: Wrap around the ends of the domain group (or one per dim).
    :param boundary: ``None`` or ``"earth"`` (see :class:`HaloPlan`; ``periodic`` must stay False).
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    :param out: Where to write the result (not with a tensor that requires grad).
    """
    if getattr(x, "requires_grad", False) is True:  # a Torch tensor in an autograd graph
        import torch

        # Every rank must agree whether a backward will follow: the agreement step checks it.
        arguments = HaloCall(halo_width, dim, periodic, boundary, manager,
                             "pad+grad" if torch.is_grad_enabled() else "pad")
        if out is not None:  # the same agreement as the autograd path's, raising on every rank
            checked = arguments._replace(call="pad+grad")
            _settle(x, checked, _lookup(x, checked), out)
        return _autograd_function().apply(x, arguments)
    _, padded = _padded(x, HaloCall(halo_width, dim, periodic, boundary, manager, "pad"), out)
    return padded


def _padded(x, arguments, out=None):
    """Pad ``x`` with :class:`HaloCall` ``arguments`` into ``out`` (None: a new array); return (the plan, the result).

    On a hit of a pad in one copy, :func:`_pad_found`; else :func:`_settle` with ``padding``, then the pad
    finished (or done). The hot path: :func:`_lookup`'s work inline, and a pair rather than a record returned.
    """
    manager = require_manager(arguments.manager, "halo exchange")
    cache = plan_cache.cache_of(manager)
    host = devices.host_view(x)
    try:
        quick = _quick_key(x, host, arguments)
        found = cache.quick(quick)
    except Exception:  # as in _lookup
        quick = found = None
    if found is not None and host is not None and found.plan.pads_in_one_copy:
        plan = found.plan
        if out is None or _fits(out, x, plan.padded_shape, arguments.call):  # else _settle reports it on every rank
            padded = _pad_found(plan, found.info, host, out)
            if padded is not None:
                cache.touch(plan)
                return plan, padded
            plan = _rebuilt(x, found.info.mine, manager, cache, found.key)
            # pad()'s local checks cannot fail on one rank alone here: the plan was just built from x, out fits it.
            return plan, plan.pad(x, out)
    settled = _settle(x, arguments, _Lookup(manager, cache, host, quick, found), out, padding=True)
    plan = settled.plan
    return plan, plan.pad(x, out) if settled.pad is None else plan.finish_pad(x, settled.pad)


def pad_for_grad(x, halo_width, dim, periodic, boundary, manager, grad):
    """Return ``x`` padded as :func:`halo_exchange` pads it, for a caller that does its own autograd.

    Collective over the domain group, with :func:`halo_exchange`'s agreement step; ``grad`` says whether
    a backward (:func:`adjoint_of`) will follow, which every rank must agree on (the step checks it, as for
    a tensor that requires grad). The custom operator ``mpidomain::halo_pad`` runs this.
    """
    _, padded = _padded(x, HaloCall(halo_width, dim, periodic, boundary, manager, "pad+grad" if grad else "pad"))
    return padded


def adjoint_of(grad, halo_width, dim, periodic, boundary, manager):
    """Return the gradient of the unpadded shard from ``grad`` of the padded one: :meth:`HaloPlan.adjoint`.

    Collective over the domain group, with the agreement step of :func:`halo_exchange`'s backward: every
    rank passes the gradient of the array its :func:`pad_for_grad` (same arguments) returned.
    """
    arguments = HaloCall(halo_width, dim, periodic, boundary, manager, "adjoint")
    return _plan(grad[_interior_of(grad, halo_width, dim)], arguments).adjoint(grad)


def _interior_of(padded, halo_width, dim):
    """The index of ``padded``'s rows without the ``halo_width`` ghost rows on each side of ``dim`` (normalised)."""
    dims = dim if isinstance(dim, tuple) else (dim,)
    widths = halo_width if isinstance(halo_width, tuple) else (halo_width,) * len(dims)
    index = [slice(None)] * padded.ndim
    for d, w in zip(dims, widths):
        index[d] = slice(w, padded.shape[d] - w)
    return tuple(index)


_FUNCTION = None


def _autograd_function():
    """Return the torch.autograd.Function behind :func:`halo_exchange` on a tensor that requires grad.

    Built on first use (torch is imported lazily). Forward pads with the
    neighbours' rows; backward is the exact adjoint: each ghost row's gradient
    returns to the rank that owns the row and is added onto it
    (:meth:`HaloPlan.adjoint`), periodic wrap and mirrored fold rows included.
    """
    global _FUNCTION
    if _FUNCTION is not None:
        return _FUNCTION
    import torch

    class HaloExchangeFunction(torch.autograd.Function):
        """Pad with the neighbours' rows; backward sends ghost-row gradients back to their owners."""

        @staticmethod
        def forward(ctx, x, arguments):
            plan, padded = _padded(x, arguments)
            ctx.adjoint = arguments._replace(manager=plan.manager, call="adjoint")
            ctx.interior = plan.layout.interior
            return padded

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad):
            # The plan is found again (it may have left halo_exchange's cache since the forward)
            # from a view with the unpadded shard's shape, dtype and device.
            plan = _plan(grad[ctx.interior], ctx.adjoint)
            return plan.adjoint(grad), None

    _FUNCTION = HaloExchangeFunction
    return _FUNCTION
