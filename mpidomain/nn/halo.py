"""``HaloExchange``: CREDIT's differentiable halo-exchange layer, over MPI.

Forward pads the local shard with its neighbours' rows (``halo_exchange``);
backward is the exact adjoint: each ghost row's gradient returns to the rank
that owns the row and is added onto it (``HaloPlan.adjoint``), periodic
wrap included.

Differences from CREDIT's ``credit.domain_parallel.halo_exchange``: the
output always has ``shape[dim] + 2 * halo_width`` rows, also with one rank
per domain group (CREDIT returns ``x`` unpadded when D=1 or without a
manager; here a missing manager is a RuntimeError), and ``periodic=True``
wraps around the domain group's ends.
"""

import torch

from ..halo.call import halo_exchange

__all__ = ["HaloExchange"]


class HaloExchange(torch.nn.Module):
    """Pad the input with ``halo_width`` neighbour rows on both sides along ``dim``; differentiable.

    Collective over the domain group, forward and backward: every rank of the
    group calls it on its shard. The output has ``x.shape[dim] + 2 * halo_width``
    rows whatever the domain-parallel size (CREDIT returns ``x`` unpadded when
    D=1); the ends of the domain group get zeros, or the wrapped rows when
    ``periodic=True``.

    With tiles or ``boundary="earth"``, along several dims at once, corners
    included (:func:`mpidomain.halo_exchange`); backward the exact adjoint,
    mirrored fold rows included.

    :param halo_width: Ghost rows on each side (or one per dim).
    :param dim: A dim (-2 is latitude in (B, C, H, W)), a tuple of dims, or None (default): the manager's
        ``shard_dims`` (-2 on a latitude manager, as CREDIT's layer; both on tiles; ``(-2, -1)`` with the Earth).
    :param periodic: Wrap around the ends of the domain group (e.g. longitude); or one per dim.
    :param boundary: ``None`` or ``"earth"``: longitude periodic and the fold across the poles.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    def __init__(self, halo_width, dim=None, periodic=False, *, boundary=None, manager=None):
        super().__init__()
        self.halo_width = halo_width
        self.dim = dim
        self.periodic = periodic
        self.boundary = boundary
        self.manager = manager

    def forward(self, x):
        """Return ``x`` padded with its neighbours' rows (see the class docstring)."""
        return halo_exchange(x, self.halo_width, self.dim, periodic=self.periodic, boundary=self.boundary,
                             manager=self.manager)

    @staticmethod
    def trim(x, halo_before, halo_after, dim=-2):
        """Drop ``halo_before`` rows at the start and ``halo_after`` at the end of ``dim`` (a view)."""
        dim = dim % x.ndim
        return x.narrow(dim, halo_before, x.shape[dim] - halo_before - halo_after)

    def extra_repr(self):
        return (f"halo_width={self.halo_width}, dim={self.dim}, periodic={self.periodic}"
                + (f", boundary={self.boundary!r}" if self.boundary else ""))
