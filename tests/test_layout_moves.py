"""The re-distribution arithmetic alone: every layout of 1-5 ranks simulated in one process, no MPI.

Delivering every rank's :meth:`RowMove.sends` to the peers' :meth:`RowMove.receives`
must give each rank exactly its target rows; a window operation applied on
each rank's whole windows (as CREDIT's attention rearranges them) and moved
back must equal it applied on the whole field.
"""

import itertools

import numpy as np
import pytest

from mpidomain.layout.moves import (Layout, RowMove, contiguous_layout, long_window_layout,
                                             short_window_layout, window_move)
from mpidomain.sharding import balanced_split

pytestmark = pytest.mark.one_world  # no MPI: the same in every world


def compositions(total, parts, most=24):
    """Ways of giving ``parts`` ranks ``total`` rows (zeros allowed), in rank order: all, or ``most`` spread over all."""
    every = []
    for cuts in itertools.combinations_with_replacement(range(total + 1), parts - 1):
        bounds = (0,) + cuts + (total,)
        every.append(tuple(b - a for a, b in zip(bounds, bounds[1:])))
    step = max(1, len(every) // most)
    return every[::step]


def deliver(move, field):
    """Each rank's rows after the simulated all-to-all of ``move`` over the 1-D ``field`` (rows = values)."""
    local = [field[list(move.source.rows_of(r))] for r in range(move.size)]
    received = [np.full(move.target.extents[r], np.nan) for r in range(move.size)]
    for sender in range(move.size):
        for peer, rows in enumerate(move.sends(sender)):
            landing = move.receives(peer)[sender]
            assert len(rows) == len(landing)
            received[peer][list(landing)] = local[sender][list(rows)]
    return received


def window_op(rows, kind, window):
    """A window-local, order-sensitive operation (a cumulative sum within each window), as the attention groups rows."""
    if kind == "short":
        return np.cumsum(rows.reshape(-1, window), axis=1).reshape(-1)
    return np.cumsum(rows.reshape(window, -1), axis=0).reshape(-1)  # "(l1 h)": windows are the columns


def cases():
    for parts in range(1, 6):
        for window in (1, 2, 3):
            for groups in range(1, parts + 3):
                yield parts, window, groups


@pytest.mark.parametrize("kind", ["short", "long"])
def test_every_layout_of_one_to_five_ranks(kind):
    """Every extent split (uneven, empty ranks, windows straddling shard edges): rows land, windows are whole."""
    problems, checked = [], 0
    for parts, window, groups in cases():
        total = window * groups
        field = np.arange(total, dtype=np.float64) * 1.5 + 1
        reference = window_op(field, kind, window)
        for extents in compositions(total, parts) + [balanced_split(total, parts)[0]]:
            move = window_move(kind, extents, window)
            received = deliver(move, field)
            for rank in range(parts):
                if not np.array_equal(received[rank], field[list(move.target.rows_of(rank))]):
                    problems.append(f"{kind} {extents} w={window}: rank {rank} got {received[rank]}")
            # The window operation on each rank's rows, then the inverse move, equals it on the whole field.
            computed = np.concatenate([window_op(rows, kind, window) for rows in received])
            computed_field = np.empty(total)
            computed_field[list(move.target.order)] = computed
            back = deliver(move.inverse, computed_field)
            for rank in range(parts):
                start = sum(extents[:rank])
                if not np.array_equal(back[rank], reference[start:start + extents[rank]]):
                    problems.append(f"{kind} {extents} w={window}: rank {rank} result {back[rank]}")
            checked += 1
    assert checked > 500 and not problems, problems[:5]


def test_target_layouts_are_balanced_in_whole_windows():
    """Short: aligned blocks of whole windows, first ranks one more; long: runs of groups, l1-major."""
    assert short_window_layout(20, 4, 3) == Layout(tuple(range(20)), (8, 8, 4))
    assert short_window_layout(8, 4, 4).extents == (4, 4, 0, 0)
    layout = long_window_layout(12, 3, 2)  # G = 4 groups: rank 0 groups 0-1, rank 1 groups 2-3
    assert layout.rows_of(0) == (0, 1, 4, 5, 8, 9) and layout.rows_of(1) == (2, 3, 6, 7, 10, 11)
    assert long_window_layout(10, 2, 3).extents == (4, 4, 2)
    move = window_move("long", [4, 4], 2)
    assert move.target.rows_of(0) == (0, 1, 4, 5) and move.inverse.inverse == move
    assert move.sends(0) == ((0, 1), (2, 3)) and move.receives(0) == ((0, 1), (2, 3))


@pytest.mark.parametrize("call, match", [
    (lambda: window_move("short", (5, 5), 4), r"10 rows, not a multiple of window_size=4; pad the field"),
    (lambda: window_move("long", (3, 3, 3), 2), r"long-range \(global\) window attention needs whole windows"),
    (lambda: window_move("diagonal", (4,), 2), r"kind must be 'short' or 'long', got 'diagonal'"),
    (lambda: window_move("short", (4,), 0), r"window_size must be >= 1"),
    (lambda: Layout((0, 2, 2), (3,)), r"order must be a permutation"),
    (lambda: Layout((0, 1, 2), (1, 1)), r"add up to 2 rows, but order has 3"),
    (lambda: RowMove(contiguous_layout((2, 2)), contiguous_layout((4,))), r"the same rows to the same ranks"),
])
def test_a_layout_that_cannot_work_says_why(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def attention_windows(field, kind, window):
    """A window-local operation on a 2-D field, with the rearranges of CREDIT's attention (cumsum in each window)."""
    einops = pytest.importorskip("einops")
    if not field.size:
        return field
    h, w = field.shape[0] // window, field.shape[1] // window
    if kind == "short":
        pattern, sizes = "(h s1) (w s2) -> (h w) (s1 s2)", {"s1": window, "s2": window}
        back = "(h w) (s1 s2) -> (h s1) (w s2)"
    else:
        pattern, sizes = "(l1 h) (l2 w) -> (h w) (l1 l2)", {"l1": window, "l2": window}
        back = "(h w) (l1 l2) -> (l1 h) (l2 w)"
    windows = np.cumsum(einops.rearrange(field, pattern, **sizes), axis=1)
    return einops.rearrange(windows, back, h=h, w=w, **sizes)


@pytest.mark.parametrize("kind", ["short", "long"])
def test_tiles_hold_whole_windows_of_credits_rearrange(kind):
    """On tiles (lat moved within each column, lon within each band), every tile's windows are the whole field's."""
    problems = []
    for grid in [(2, 2), (1, 3), (3, 2), (2, 1)]:
        for window, (rows, cols) in [(2, (10, 8)), (3, (9, 12)), (4, (8, 16))]:
            field = np.arange(rows * cols, dtype=np.float64).reshape(rows, cols) % 7 + 1
            reference = attention_windows(field, kind, window)
            for lat in compositions(rows, grid[0], most=4) + [balanced_split(rows, grid[0])[0]]:
                for lon in compositions(cols, grid[1], most=4) + [balanced_split(cols, grid[1])[0]]:
                    lat_move, lon_move = window_move(kind, lat, window), window_move(kind, lon, window)
                    result = np.full_like(field, np.nan)
                    for i, j in itertools.product(range(grid[0]), range(grid[1])):
                        mine = np.ix_(lat_move.target.rows_of(i), lon_move.target.rows_of(j))
                        result[mine] = attention_windows(field[mine], kind, window)
                    if not np.array_equal(result, reference):
                        problems.append(f"{kind} {grid} w={window} lat {lat} lon {lon}")
    assert not problems, problems[:5]
