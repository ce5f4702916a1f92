"""The row arithmetic of domain-parallel layers alone (mpidomain.nn.rows): no torch, no MPI."""

import itertools
import random

from mpidomain.nn import rows


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
