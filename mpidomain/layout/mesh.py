"""The (dp, tp, domain) layout of a job's ranks: pure arithmetic, no MPI.

Ranks are laid out row-major over ``(dp, tp, domain)`` with the domain axis
innermost, as NCAR CREDIT's ``credit.parallel.mesh`` lays out its DeviceMesh.
For global rank ``g`` with ``T`` tensor-parallel and ``D`` domain-parallel
ranks::

    domain = g % D        tp = (g // D) % T        dp = g // (T * D)

An axis' group holds the ranks that differ only in that axis' coordinate.
With 8 ranks, ``T=2`` and ``D=2``::

    domain groups: [0,1] [2,3] [4,5] [6,7]
    tp groups:     [0,2] [1,3] [4,6] [5,7]
    dp groups:     [0,4] [1,5] [2,6] [3,7]

With ``T=1`` this is the manager's two-axis layout: consecutive domain groups,
data-parallel groups striding by ``D``.
"""

import math

from .._validate import is_int

__all__ = ["Mesh", "AXES"]

AXES = ("dp", "tp", "domain")


class Mesh:
    """The layout of ``dp * tp * domain`` ranks, and one rank's place in it.

    Local: building or querying it communicates nothing.

    :param shape: ``(dp, tp, domain)`` sizes, each >= 1.
    :param rank: This process' global rank, ``0 <= rank < dp * tp * domain``.
    """

    def __init__(self, shape, rank):
        shape = tuple(shape)
        if len(shape) != len(AXES) or not all(is_int(n) and n >= 1 for n in shape):
            raise ValueError(f"shape must be three positive ints (dp, tp, domain), got {shape!r}")
        self.shape = tuple(int(n) for n in shape)
        self.size = math.prod(self.shape)
        self.rank = self._checked_rank(rank)
        self.coords = self.coords_of(self.rank)

    def _checked_rank(self, rank):
        if not is_int(rank) or not 0 <= rank < self.size:
            raise ValueError(f"rank must be an int from 0 to {self.size - 1} in a mesh of shape "
                             f"{self.shape}, got {rank!r}")
        return int(rank)

    def axis(self, name):
        """Return the index of axis ``name`` (``"dp"``, ``"tp"`` or ``"domain"``)."""
        try:
            return AXES.index(name)
        except ValueError:
            raise ValueError(f"axis must be one of {AXES}, got {name!r}") from None

    def axis_size(self, name):
        """Return the number of ranks along axis ``name``."""
        return self.shape[self.axis(name)]

    def coordinate(self, name, rank=None):
        """Return the coordinate along axis ``name`` of ``rank`` (default: this rank)."""
        coords = self.coords if rank is None else self.coords_of(rank)
        return coords[self.axis(name)]

    def coords_of(self, rank):
        """Return ``(dp, tp, domain)`` of global rank ``rank``."""
        rank = self._checked_rank(rank)
        dp_size, tp, domain = self.shape
        return rank // (tp * domain), (rank // domain) % tp, rank % domain

    def rank_of(self, coords):
        """Return the global rank at ``coords = (dp, tp, domain)``."""
        coords = tuple(coords)
        if len(coords) != 3 or not all(is_int(c) and 0 <= c < n for c, n in zip(coords, self.shape)):
            raise ValueError(f"coords must be (dp, tp, domain) within {self.shape}, got {coords!r}")
        dp, tp, domain = coords
        return (dp * self.shape[1] + tp) * self.shape[2] + domain

    def group_index(self, name, rank=None):
        """Return which of :meth:`groups` ``(name)`` holds ``rank`` (default: this rank).

        Groups are numbered row-major over the other two coordinates, so every
        rank numbers them alike: an MPI ``Split`` colour.
        """
        coords = list(self.coords if rank is None else self.coords_of(rank))
        axis = self.axis(name)
        del coords[axis]
        others = [n for i, n in enumerate(self.shape) if i != axis]
        return coords[0] * others[1] + coords[1]

    def group_ranks(self, name, index=None):
        """Return the ascending global ranks of group ``index`` along axis ``name`` (default: this rank's)."""
        axis = self.axis(name)
        count = self.size // self.shape[axis]
        index = self.group_index(name) if index is None else index
        if not is_int(index) or not 0 <= index < count:
            raise ValueError(f"index must be an int from 0 to {count - 1} ({count} {name} groups in a mesh of "
                             f"shape {self.shape}), got {index!r}")
        others = [n for i, n in enumerate(self.shape) if i != axis]
        fixed = [index // others[1], index % others[1]]
        ranks = []
        for position in range(self.shape[axis]):
            coords = list(fixed)
            coords.insert(axis, position)
            ranks.append(self.rank_of(coords))
        return ranks

    def groups(self, name):
        """Return every group along axis ``name``, in :meth:`group_index` order."""
        return [self.group_ranks(name, i) for i in range(self.size // self.shape[self.axis(name)])]

    def neighbor(self, name, offset, rank=None, periodic=False):
        """Return the global rank ``offset`` steps along axis ``name`` from ``rank``, or None past an edge."""
        coords = list(self.coords if rank is None else self.coords_of(rank))
        axis = self.axis(name)
        position = coords[axis] + offset
        if periodic:
            position %= self.shape[axis]
        elif not 0 <= position < self.shape[axis]:
            return None
        coords[axis] = position
        return self.rank_of(coords)

    def layout(self):
        """Return the nested list ``mesh[dp][tp][domain] = global rank`` (DeviceMesh's ``mesh`` argument)."""
        dp_size, tp, domain = self.shape
        return [[[self.rank_of((i, j, k)) for k in range(domain)] for j in range(tp)] for i in range(dp_size)]

    def __repr__(self):
        return (f"Mesh(shape={self.shape}, names={AXES}, rank={self.rank}, "
                f"coords={dict(zip(AXES, self.coords))})")
