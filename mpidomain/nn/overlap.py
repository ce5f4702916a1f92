"""Overlap a layer's halo exchange with the computation of the rows that need no halo.

A convolution's (or window pool's) output row depends only on its window of
input rows, so a rank's outputs split three ways along the sharded dim: the
**interior** rows, whose windows lie inside the rank's own rows, and the **top**
and **bottom** edge rows, whose windows reach into a neighbour's rows (or the
padding beyond the field). :func:`overlapped_rows` starts the halo exchange
(non-blocking), computes the interior rows from the rank's own rows while the
halos travel, then finishes the exchange and computes the edge rows from two
thin strips (ghost rows plus the rank's edge rows), and concatenates the three.
Each output row is computed from the same input values as by exchange-then-
compute (:func:`mpidomain.nn._shard.fetch_rows`); only the shapes the kernels
see differ.

The halos travel as the exchange of a **thin** tensor: the rank's first and last
``halo`` rows, ``2 * halo`` rows on every rank (uneven shards included), whose
exchanged ghost rows are exactly those of the whole shard (the previous rank's
last rows and the next rank's first rows, zeros or the other end's rows at the
domain's ends). It uses :func:`mpidomain.halo.call.cached_plan` and the plan's
public ``start``/``wait``, so the agreement step, plan cache and tags are the
ones every halo exchange uses. Backward is overlapped as well: the gradients of
the ghost rows (``2 * halo`` rows) go back to their owners through the same
exchange, started as soon as the edge rows' backward produced them and finished
after the interior rows' backward (autograd runs a later-created node first:
:class:`_Ghosts` is created after the interior rows, :class:`_Enter` before
them), where they are added onto the owners' edge rows.

The switch: a layer's ``overlap`` attribute (constructor argument), ``None``
meaning the global default: :func:`set_overlap`, else the environment variable
``MPIDOMAIN_OVERLAP`` (``1``/``0``), else :data:`DEFAULT`. Layers put the
resolved value into their agreement step, so ranks that disagree raise on
every rank instead of taking different paths.
"""

import os

import torch

from ..halo.call import cached_plan
from .rows import Window, ceil_div

__all__ = ["DEFAULT", "ENVIRONMENT", "overlap_default", "overlapped_rows", "resolve", "set_overlap"]

#: The built-in default when neither :func:`set_overlap` nor ``MPIDOMAIN_OVERLAP`` says
#: (``scripts/bench/bench_overlap.py``: the converted UNet's training step, with and without).
DEFAULT = False
#: The environment variable that sets the default: ``1`` (on) or ``0`` (off).
ENVIRONMENT = "MPIDOMAIN_OVERLAP"

_chosen = None  # set_overlap's value


def set_overlap(enabled):
    """Set the default of every layer whose ``overlap`` is None: True, False, or None (back to
    ``MPIDOMAIN_OVERLAP``, else :data:`DEFAULT`). Local: set it alike on every rank (the layers' agreement
    step raises on every rank if the ranks differ)."""
    global _chosen
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_overlap takes True, False or None, got {enabled!r}")
    _chosen = enabled


def overlap_default():
    """Return the default: :func:`set_overlap`'s value, else ``MPIDOMAIN_OVERLAP``'s, else :data:`DEFAULT`."""
    if _chosen is not None:
        return _chosen
    value = os.environ.get(ENVIRONMENT, "").strip().lower()
    if not value:
        return DEFAULT
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{ENVIRONMENT}={value!r}: set it to 1 (overlap) or 0 (exchange, then compute)")


def resolve(setting):
    """A layer's ``overlap`` setting (True, False or None: the default) as a bool; False while Dynamo traces.

    A compiled graph exchanges, then computes: its halo exchange is one operator
    (:mod:`mpidomain.nn.ops`), not a start and a wait with work between them.
    """
    if torch.compiler.is_compiling():
        return False
    return overlap_default() if setting is None else bool(setting)


class _Ticket:
    """One overlapped exchange: the thin tensor's halos forward, the ghost rows' gradients backward."""

    def __init__(self, halo, dim, periodic, manager):
        self.halo, self.dim, self.periodic, self.manager = halo, dim, periodic, manager
        self.plan = self.padded = self.back = None

    def _start(self, thin):
        """Start exchanging ``thin``'s halos (collective: the plan cache's agreement step); return (plan, padded)."""
        plan = cached_plan(thin, self.halo, self.dim, periodic=self.periodic, manager=self.manager, call="overlap")
        padded = plan.empty()
        plan.interior(padded)[...] = thin
        plan.start(padded)
        return plan, padded

    def begin(self, x):
        """Start the exchange of ``x``'s first and last ``halo`` rows."""
        h, dim, n = self.halo, self.dim, x.shape[self.dim]
        thin = torch.cat([x.narrow(dim, 0, h), x.narrow(dim, n - h, h)], dim).detach()
        self.plan, self.padded = self._start(thin)

    def end(self):
        """Finish the exchange; return the padded thin tensor (4 * halo rows: ghosts, thin, ghosts)."""
        plan, padded = self.plan, self.padded
        self.plan = self.padded = None
        plan.wait()
        return padded

    def adjoint_begin(self, grad):
        """Start sending the ghost rows' gradients (of the padded thin tensor, ``grad``) back to their owners."""
        h, dim = self.halo, self.dim
        ghosts = torch.cat([grad.narrow(dim, 0, h), grad.narrow(dim, 3 * h, h)], dim).detach()
        # Exchanging them as a thin tensor: the previous rank's last rows (its next ghosts' gradients) belong
        # to this rank's first rows, the next rank's first rows (its previous ghosts') to this rank's last.
        self.back = self._start(ghosts)

    def adjoint_end(self, grad):
        """Add the gradients the neighbours sent back onto ``grad``'s edge rows (a new tensor); ``grad`` if none."""
        if self.back is None:
            return grad
        (plan, padded), self.back = self.back, None
        plan.wait()
        h, dim = self.halo, self.dim
        n = grad.shape[dim]
        grad = grad.clone()
        grad.narrow(dim, 0, h).add_(padded.narrow(dim, 0, h))
        grad.narrow(dim, n - h, h).add_(padded.narrow(dim, 3 * h, h))
        return grad


class _Enter(torch.autograd.Function):
    """Identity on the shard; backward adds the ghost rows' gradients the neighbours sent back."""

    @staticmethod
    def forward(ctx, x, ticket):
        ctx.ticket = ticket
        return x.view_as(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        if grad is None:  # pragma: no cover - autograd materialises the gradient
            return None, None
        return ctx.ticket.adjoint_end(grad), None


class _Ghosts(torch.autograd.Function):
    """Finish the exchange and return the padded thin tensor; backward starts sending the ghosts' gradients back.

    Takes the shard (the output of :class:`_Enter`) only so that autograd runs :class:`_Enter`'s backward
    after this one's.
    """

    @staticmethod
    def forward(ctx, x, ticket):
        ctx.ticket = ticket
        return ticket.end()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        ctx.ticket.adjoint_begin(grad)
        return None, None


class _Join(torch.autograd.Function):
    """Identity on the layer's output that also takes the padded thin tensor: backward reaches
    :class:`_Ghosts` (with zeros) on every rank, also where no output row reads a ghost row (a rank at the
    field's edge of a ``"valid"`` convolution), so that every rank makes the same exchanges."""

    @staticmethod
    def forward(ctx, out, padded):
        ctx.padded = (padded.shape, padded.dtype, padded.device)
        return out.view_as(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        shape, dtype, device = ctx.padded
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _rows(x, before, after, lo, hi, dim, halo, edge, first, last):
    """Rows ``[lo, hi)`` of the rank's rows ``x`` extended by its ghost rows (local indices; ``before``:
    rows ``[-halo, 0)``, ``after``: ``[n, n + halo)``); reflect or replicate beyond the field's edges, as
    :func:`~mpidomain.nn._shard.fetch_rows` makes them."""
    n = x.shape[dim]
    own_edges = edge in ("reflect", "replicate")
    pieces = []
    if lo < 0:
        stop = min(hi, 0)
        if own_edges and first:
            index = [(-g if edge == "reflect" else 0) for g in range(lo, stop)]
            pieces.append(x.index_select(dim, torch.tensor(index, device=x.device)))
        else:
            pieces.append(before.narrow(dim, halo + lo, stop - lo))
    if hi > 0 and lo < n:
        a, b = max(lo, 0), min(hi, n)
        pieces.append(x.narrow(dim, a, b - a))
    if hi > n:
        a = max(lo, n)
        if own_edges and last:
            index = [(2 * (n - 1) - g if edge == "reflect" else n - 1) for g in range(a, hi)]
            pieces.append(x.index_select(dim, torch.tensor(index, device=x.device)))
        else:
            pieces.append(after.narrow(dim, a - n, hi - a))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def overlapped_rows(x, window, halo, dim, manager, compute, stride, span, *, edge="zeros", first=True, last=True):
    """Return ``compute`` of this rank's ``window`` along ``dim``, the halo exchange overlapped; differentiable.

    Collective over the domain group (one halo exchange of ``halo`` rows, started before the interior rows are
    computed and finished after; backward the same, reversed). ``window`` is a
    :class:`~mpidomain.nn.rows.Window` (output ``j`` reads input rows ``in_start + j*stride + [0, span)``),
    ``halo`` > 0 the exchange's width, ``edge``/``first``/``last`` as for
    :func:`~mpidomain.nn._shard.fetch_rows`. ``compute(slab, sub)`` returns the outputs of the
    :class:`~mpidomain.nn.rows.Window` ``sub`` (a part of ``window``: output rows ``[sub.out_start,
    sub.out_stop)`` from input rows ``[sub.in_start, sub.in_stop)``, which ``slab`` holds along ``dim``);
    the parts are concatenated along ``dim``.
    """
    n = x.shape[dim]
    offset = window.own_start  # window rows are global, or local with own_start 0
    start = window.in_start - offset
    m = window.outputs
    # Outputs [j0, j1) read own rows only: start + j*stride >= 0 and start + j*stride + span <= n.
    j0 = min(m, max(0, ceil_div(-start, stride)))
    j1 = max(j0, min(m, (n - span - start) // stride + 1))

    def part(j_lo, j_hi):
        lo, hi = start + j_lo * stride, start + (j_hi - 1) * stride + span
        return lo, hi, Window(window.out_start + j_lo, window.out_start + j_hi, lo + offset, hi + offset,
                              window.own_start, window.own_stop)

    differentiable = torch.is_grad_enabled() and x.requires_grad
    ticket = _Ticket(halo, dim, edge == "circular", manager)
    ticket.begin(x)
    source = _Enter.apply(x, ticket) if differentiable else x
    interior = None
    if j1 > j0:  # while the halos travel
        lo, hi, sub = part(j0, j1)
        interior = compute(source.narrow(dim, lo, hi - lo), sub)
    padded = _Ghosts.apply(source, ticket) if differentiable else ticket.end()
    before, after = padded.narrow(dim, 0, halo), padded.narrow(dim, 3 * halo, halo)
    pieces = []
    for j_lo, j_hi in ((0, j0), (j1, m)):
        if j_hi > j_lo:
            lo, hi, sub = part(j_lo, j_hi)
            pieces.append(compute(_rows(source, before, after, lo, hi, dim, halo, edge, first, last), sub))
    if interior is not None:
        pieces.insert(1 if j0 > 0 else 0, interior)
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
    return _Join.apply(out, padded) if differentiable else out
