"""The row arithmetic of domain-parallel layers alone (mpidomain.nn.rows): no torch, no MPI."""

import itertools
import random

import pytest

from mpidomain.nn import rows

pytestmark = pytest.mark.one_world  # no MPI: the same in every world


def random_extents(rng, parts):
    return [rng.randint(3, 9) for _ in range(parts)]


def test_conv_windows_partition_the_output():
    rng = random.Random(0)
    for _ in range(400):
        extents = random_extents(rng, rng.randint(1, 5))
        k, s, d = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 2)
        before, after = rng.randint(0, 3), rng.randint(0, 3)
        windows = rows.conv_windows(extents, k, s, d, before, after)
        m = rows.conv_output_length(sum(extents), k, s, d, before, after)
        assert windows[0].out_start == 0 and windows[-1].out_stop == m
        for w, nxt in zip(windows, windows[1:]):
            assert w.out_stop == nxt.out_start
        for w in windows:
            if w.outputs:  # the inputs an output reads, and nothing beyond the padding
                assert w.in_start == w.out_start * s - before
                assert w.in_stop == (w.out_stop - 1) * s - before + d * (k - 1) + 1
                assert -before <= w.in_start and w.in_stop <= sum(extents) + after


def test_transposed_windows_partition_the_output_and_read_every_contribution():
    rng = random.Random(1)
    for _ in range(400):
        extents = random_extents(rng, rng.randint(1, 5))
        k, s, d = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 2)
        p = rng.randint(0, d * (k - 1))
        op = rng.randint(0, max(s, d) - 1)
        n = sum(extents)
        windows = rows.transposed_windows(extents, k, s, d, p, op)
        m = rows.transposed_output_length(n, k, s, d, p, op)
        assert windows[0].out_start == 0 and windows[-1].out_stop == m
        for w, nxt in zip(windows, windows[1:]):
            assert w.out_stop == nxt.out_start
        for w in windows:
            for q in range(w.out_start, w.out_stop):
                sources = {i for i, j in itertools.product(range(n), range(k)) if i * s + j * d - p == q}
                assert all(w.in_start <= i < w.in_stop for i in sources), (extents, k, s, d, p, op, q)
                assert w.skip + (q - w.out_start) == q + p - w.in_start * s


def test_unet_levels_line_up_on_even_shards():
    """A stride-2 convolution's output rows, upsampled by the matching transposed one, are the input's rows."""
    for extents in ([8, 8], [6, 10, 4], [16, 8, 8, 2]):
        down = rows.conv_windows(extents, 4, 2, 1, 1, 1)
        up = rows.transposed_windows([w.outputs for w in down], 4, 2, 1, 1, 0)
        assert [w.outputs for w in up] == extents


def test_halo_for():
    windows = rows.conv_windows([5, 5], 3, 1, 1, 1, 1)
    assert rows.halo_for(windows) == 1
    assert rows.halo_for(rows.conv_windows([5, 5], 1, 1, 1, 0, 0)) == 0
    assert rows.ceil_div(-3, 2) == -1 and rows.ceil_div(3, 2) == 2


def test_unit_stride_windows_need_no_other_extents():
    rng = random.Random(2)
    for _ in range(300):
        extents = random_extents(rng, rng.randint(1, 5))
        k, d, before, after = rng.randint(1, 5), rng.randint(1, 2), rng.randint(0, 3), rng.randint(0, 3)
        windows = rows.conv_windows(extents, k, 1, d, before, after)
        if not windows[-1].outputs:
            continue  # the layer refuses this layout
        for r, (w, n) in enumerate(zip(windows, extents)):
            local = rows.unit_stride_window(n, r == 0, r == len(extents) - 1, k, d, before, after)
            shift = w.own_start
            assert (local.outputs, local.in_start + shift, local.in_stop + shift) == (w.outputs, w.in_start, w.in_stop)
        assert rows.halo_for(windows) <= rows.unit_stride_halo(k, d, before, after)


def test_pool_windows_partition_the_output_ceil_mode_included():
    rng = random.Random(2)
    for _ in range(400):
        extents = random_extents(rng, rng.randint(1, 5))
        k, s, d = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 2)
        p, ceil = rng.randint(0, k // 2), rng.random() < 0.5
        windows = rows.pool_windows(extents, k, s, d, p, ceil)
        m = rows.pool_output_length(sum(extents), k, s, d, p, ceil)
        assert windows[0].out_start == 0 and windows[-1].out_stop == m
        assert all(w.out_stop == nxt.out_start for w, nxt in zip(windows, windows[1:]))
        for w in windows:
            if w.outputs:  # each window starts in the input or its left padding (PyTorch's ceil_mode rule)
                assert w.in_start == w.out_start * s - p and (w.out_stop - 1) * s - p < sum(extents) + p


def test_pool_output_length_is_pytorchs():
    # (n, kernel, stride, dilation, padding, ceil_mode) -> torch.nn.MaxPool1d's output length
    cases = {(7, 3, 2, 1, 1, False): 4, (7, 3, 2, 1, 0, True): 3, (8, 2, 3, 1, 0, True): 3, (8, 2, 3, 1, 0, False): 3,
             (9, 3, 2, 2, 1, True): 4, (6, 3, 2, 1, 1, True): 4, (5, 2, 2, 1, 1, True): 3}
    for args, length in cases.items():
        assert rows.pool_output_length(*args) == length, args


def test_adaptive_windows_deal_bins_by_their_first_row():
    rng = random.Random(3)
    for _ in range(300):
        extents = random_extents(rng, rng.randint(1, 5))
        n, m = sum(extents), rng.randint(1, 20)
        bins = rows.adaptive_bins(n, m)
        assert bins[0][0] == 0 and bins[-1][1] == n and all(a < b for a, b in bins)
        windows = rows.adaptive_windows(extents, m)
        if m == 1:  # a global pool: every rank holds the one output
            assert windows == [(0, 1)] * len(extents)
            continue
        assert windows[0][0] == 0 and windows[-1][1] == m
        assert all(w[1] == nxt[0] for w, nxt in zip(windows, windows[1:]))
        starts = [sum(extents[:r]) for r in range(len(extents))]
        for r, (lo, hi) in enumerate(windows):
            for i in range(lo, hi):  # bin i's first row lies in rank r's rows (the first and last take the ends)
                assert (r == 0 or bins[i][0] >= starts[r]) and (r == len(extents) - 1
                                                               or bins[i][0] < starts[r] + extents[r])
