"""Where a halo exchange's rows come from and go to: pure arithmetic, no MPI, no arrays.

A :class:`HaloLayout` answers, for one rank of a group of ``size`` ranks that
shards ``dim`` of arrays of ``shape``: the padded shape, the neighbours, which
rows of the padded array each message sends or fills and under which tag,
which ghost rows are zeros, and which are copies of the rank's own rows (one
rank, periodic). :class:`mpidomain.HaloPlan` moves the data; this module can be
checked for every group size in one process (tests/test_halo_layout.py).
"""

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["HaloLayout", "Message"]


@dataclass(frozen=True)
class Message:
    """One halo message seen from this rank: the other rank, the tag, and the rows of the padded array.

    ``flip``: the dims along which a sent block is mirrored while packing (the Earth's pole fold).
    """

    peer: int
    tag: int
    rows: tuple  # an index: slice(None) for the dims before ``dim``, then the rows along ``dim``
    flip: tuple = ()


@dataclass(frozen=True)
class HaloLayout:
    """The rows of one rank's halo exchange along ``dim`` (normalised) of arrays of ``shape``.

    ``size`` and ``rank`` place this rank in its group (1 and 0 along a
    dimension the group does not shard: a local pad). ``tag`` is the first of
    two tags: rows travelling to the next rank carry ``tag`` and fill its
    leading ghost rows, rows travelling to the previous rank carry ``tag + 1``.
    """

    shape: Tuple[int, ...]
    dim: int
    halo_width: int
    periodic: bool
    size: int
    rank: int
    tag: int = 0

    def __post_init__(self):
        if not 0 <= self.dim < len(self.shape):
            raise ValueError(f"dim={self.dim} must index shape {self.shape}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank={self.rank} must be in [0, {self.size})")
        if self.halo_width < 0:
            raise ValueError(f"halo_width={self.halo_width} must be >= 0")

    # -- shapes ---------------------------------------------------------------
    @property
    def extent(self):
        """This rank's rows along ``dim``."""
        return self.shape[self.dim]

    @property
    def padded_shape(self):
        """``shape`` with ``2 * halo_width`` more rows along ``dim``."""
        d = self.dim
        return self.shape[:d] + (self.extent + 2 * self.halo_width,) + self.shape[d + 1:]

    @property
    def halo_shape(self):
        """The shape of one side's halo: ``halo_width`` rows."""
        d = self.dim
        return self.shape[:d] + (self.halo_width,) + self.shape[d + 1:]

    def rows(self, start, stop):
        """The index of rows ``start:stop`` along ``dim``."""
        return (slice(None),) * self.dim + (slice(start, stop),)

    @property
    def interior(self):
        """The index of the local rows inside a padded array."""
        return self.rows(self.halo_width, self.halo_width + self.extent)

    def shard_rows(self, rows):
        """Rows of the padded array (an index from this layout) as rows of the unpadded shard."""
        span = rows[self.dim]
        return self.rows(span.start - self.halo_width, span.stop - self.halo_width)

    # -- neighbours and messages ----------------------------------------------
    @property
    def neighbors(self) -> Tuple[Optional[int], Optional[int]]:
        """(previous rank, next rank) in the group; None at an edge that is not periodic."""
        rank, size = self.rank, self.size
        previous = rank - 1 if rank > 0 else (size - 1 if self.periodic else None)
        following = rank + 1 if rank < size - 1 else (0 if self.periodic else None)
        return previous, following

    @property
    def _moves(self):
        """True if there are rows to fill: a halo, and a padded array with elements."""
        return self.halo_width > 0 and all(self.padded_shape)

    @property
    def _ghosts(self):
        h, n = self.halo_width, self.extent
        return self.rows(0, h), self.rows(n + h, n + 2 * h)  # leading, trailing

    @property
    def _edges(self):
        h, n = self.halo_width, self.extent
        return self.rows(h, 2 * h), self.rows(n, n + h)  # first and last local rows

    @property
    def local_wrap(self):
        """True if the ghost rows are copies of this rank's own rows (one rank, periodic)."""
        return self._moves and self.size == 1 and self.periodic

    @property
    def sends(self):
        """The messages this rank sends: its first rows to the previous rank, its last to the next."""
        if not self._moves or self.local_wrap:
            return ()
        previous, following = self.neighbors
        first, last = self._edges
        messages = []
        if previous is not None:
            messages.append(Message(previous, self.tag + 1, first))
        if following is not None:
            messages.append(Message(following, self.tag, last))
        return tuple(messages)

    @property
    def receives(self):
        """The messages this rank receives: the previous rank's last rows, the next rank's first."""
        if not self._moves or self.local_wrap:
            return ()
        previous, following = self.neighbors
        leading, trailing = self._ghosts
        messages = []
        if previous is not None:
            messages.append(Message(previous, self.tag, leading))
        if following is not None:
            messages.append(Message(following, self.tag + 1, trailing))
        return tuple(messages)

    @property
    def zeros(self):
        """Ghost rows that hold zeros: those at an edge of the group that is not periodic."""
        if not self._moves or self.local_wrap:
            return ()
        previous, following = self.neighbors
        leading, trailing = self._ghosts
        return tuple(rows for rows, peer in ((leading, previous), (trailing, following)) if peer is None)

    @property
    def copies(self):
        """(source rows, ghost rows, mirrored dims) of the padded array copied locally (one rank, periodic).

        Never mirrored along a single dim: the third entry (as :class:`~mpidomain.tile_layout.TileLayout`'s) is ``()``.
        """
        if not self.local_wrap:
            return ()
        first, last = self._edges
        leading, trailing = self._ghosts
        return ((last, leading, ()), (first, trailing, ()))
