"""Layout arithmetic: which rows, tiles and ranks go where. Pure: no MPI, no arrays.

- :mod:`~mpidomain.layout.tiles`: :func:`balanced_split` and :class:`TileLayout`, the rows and
  neighbours of every tile of a 1-D or 2-D decomposition (what the halo engine moves);
- :mod:`~mpidomain.layout.moves`: :class:`Layout` and :class:`RowMove`, rows dealt out anew among
  the ranks of a dim (the window layouts of CREDIT's CrossFormer attention);
- :mod:`~mpidomain.layout.mesh`: :class:`Mesh`, the dp x tp x domain mesh of a manager's ranks.

The code that moves bytes (:mod:`mpidomain.halo`, :mod:`mpidomain.redistribution`,
:mod:`mpidomain.manager`) imports these; nothing here imports it back (``tests/test_imports.py``).
"""

from .mesh import Mesh
from .moves import Layout, RowMove, contiguous_layout, long_window_layout, short_window_layout, window_move
from .tiles import TileLayout, balanced_split

__all__ = ["Mesh", "Layout", "RowMove", "contiguous_layout", "short_window_layout", "long_window_layout",
           "window_move", "TileLayout", "balanced_split"]
