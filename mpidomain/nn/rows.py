"""Which output rows of a sharded layer each rank computes, and which input rows it needs.

Pure arithmetic along the sharded dimension, no torch and no MPI: given every
rank's extent, each rank gets a :class:`Window`. Outputs are dealt out so that
the ranks' outputs, in rank order, are exactly the single-process output rows,
whatever the extents (uneven ones included), strides, paddings and dilations;
input rows outside ``[0, N)`` are the layer's own padding.
"""

from dataclasses import dataclass

__all__ = ["Window", "adaptive_bins", "adaptive_windows", "conv_windows", "pool_output_length", "pool_windows",
           "transposed_windows", "halo_for", "ceil_div"]


def ceil_div(a, b):
    """Return ceil(a / b) for ints, b > 0 (negative a included)."""
    return -(-a // b)


@dataclass(frozen=True)
class Window:
    """One rank's share: output rows ``[out_start, out_stop)``, computed from input rows
    ``[in_start, in_stop)`` (global indices; beyond ``[0, N)`` they are padding), whose
    own rows are ``[own_start, own_stop)``. ``skip`` is how many leading rows of the local
    result on ``[in_start, in_stop)`` come before ``out_start`` (transposed convolutions)."""

    out_start: int
    out_stop: int
    in_start: int
    in_stop: int
    own_start: int
    own_stop: int
    skip: int = 0

    @property
    def before(self):
        """Rows needed before this rank's own rows (negative: own rows left unused)."""
        return self.own_start - self.in_start

    @property
    def after(self):
        """Rows needed after this rank's own rows."""
        return self.in_stop - self.own_stop

    @property
    def outputs(self):
        """The number of output rows."""
        return self.out_stop - self.out_start


def _offsets(extents):
    starts, total = [], 0
    for n in extents:
        starts.append(total)
        total += n
    return starts, total


def conv_output_length(n, kernel, stride, dilation, before, after):
    """Output rows of a convolution over ``n`` rows padded by ``before``/``after``."""
    return max(0, (n + before + after - dilation * (kernel - 1) - 1) // stride + 1)


def conv_windows(extents, kernel, stride, dilation, before, after, length=None):
    """Return each rank's :class:`Window` of a convolution along the sharded dimension.

    Output ``o`` reads padded rows ``[o*stride, o*stride + span)`` (``span = dilation*(kernel-1)+1``),
    that is input rows from ``o*stride - before``. A rank computes the outputs whose first
    padded row ``o*stride`` falls in its own rows (the first rank from 0, the last up to the end).
    ``length``: the number of output rows, if not the convolution's (a pool's ``ceil_mode``).
    """
    starts, total = _offsets(extents)
    span = dilation * (kernel - 1) + 1
    m = conv_output_length(total, kernel, stride, dilation, before, after) if length is None else length
    windows = []
    for rank, (a, n) in enumerate(zip(starts, extents)):
        b = a + n
        lo = 0 if rank == 0 else min(ceil_div(a, stride), m)
        hi = m if rank == len(extents) - 1 else min(ceil_div(b, stride), m)
        hi = max(hi, lo)
        in_start = lo * stride - before
        in_stop = (hi - 1) * stride - before + span if hi > lo else in_start
        windows.append(Window(lo, hi, in_start, in_stop, a, b))
    return windows


def pool_output_length(n, kernel, stride, dilation, padding, ceil_mode):
    """Output rows of a max or average pool over ``n`` rows (PyTorch's rule, ``ceil_mode`` included).

    With ``ceil_mode`` a last, partial window counts if it starts inside the input or its left padding.
    """
    span = dilation * (kernel - 1) + 1
    m = (n + 2 * padding - span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (m - 1) * stride >= n + padding:
        m -= 1
    return max(0, m)


def pool_windows(extents, kernel, stride, dilation, padding, ceil_mode):
    """Return each rank's :class:`Window` of a pool: a convolution's windows, with the pool's output rows.

    With ``ceil_mode`` the last window may reach past the padding; its rows there are padding too.
    """
    m = pool_output_length(sum(extents), kernel, stride, dilation, padding, ceil_mode)
    return conv_windows(extents, kernel, stride, dilation, padding, padding, length=m)


def adaptive_bins(n, m):
    """Return the input rows ``[(start, stop)]`` of each of an adaptive pool's ``m`` outputs over ``n`` rows.

    PyTorch's bins: output ``i`` pools rows ``[floor(i*n/m), ceil((i+1)*n/m))``; they may overlap.
    """
    return [((i * n) // m, ceil_div((i + 1) * n, m)) for i in range(m)]


def adaptive_windows(extents, m):
    """Return each rank's output rows ``(lo, hi)`` of an adaptive pool to ``m`` rows.

    A rank holds the outputs whose bin's first row lies in its own rows (the first rank from 0, the
    last up to the end); with ``m == 1`` (a global pool) every rank holds the one output row.
    """
    if m == 1:
        return [(0, 1)] * len(extents)
    starts, total = _offsets(extents)
    firsts = [start for start, _ in adaptive_bins(total, m)]
    windows = []
    for rank, (a, n) in enumerate(zip(starts, extents)):
        lo = 0 if rank == 0 else sum(1 for f in firsts if f < a)
        hi = m if rank == len(extents) - 1 else sum(1 for f in firsts if f < a + n)
        windows.append((lo, max(lo, hi)))
    return windows


def unit_stride_window(n, first, last, kernel, dilation, before, after):
    """Return this rank's :class:`Window` of a stride-1 convolution, from its own ``n`` rows alone.

    In this rank's coordinates (its rows are ``[0, n)``): the same window as
    :func:`conv_windows` gives, which for stride 1 needs no other rank's extent
    as long as the last rank keeps at least one output row (``last_rank_outputs``).
    """
    span = dilation * (kernel - 1) + 1
    hi = n + before + after - span + 1 if last else n
    in_stop = hi - 1 - before + span if hi > 0 else -before
    return Window(0, max(hi, 0), -before, in_stop, 0, n)


def unit_stride_halo(kernel, dilation, before, after):
    """The halo of a stride-1 convolution, the same for every layout: the rows any rank needs on either side."""
    return max(0, before, after, dilation * (kernel - 1) - before)


def transposed_output_length(n, kernel, stride, dilation, padding, output_padding):
    """Output rows of a transposed convolution over ``n`` rows."""
    return max(0, (n - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1)


def transposed_windows(extents, kernel, stride, dilation, padding, output_padding):
    """Return each rank's :class:`Window` of a transposed convolution along the sharded dimension.

    Input ``i`` adds onto full-output rows ``i*stride + j*dilation`` (``j < kernel``); output
    ``q`` is full row ``q + padding``. A rank computes outputs ``[a*stride, b*stride)`` for its
    own rows ``[a, b)`` (the first from 0, the last up to the end), from every input that adds
    onto them: the rows a stride-``s`` convolution's outputs ``[a/s, b/s)`` came from, so a
    U-Net's skip connections line up.
    """
    starts, total = _offsets(extents)
    reach = dilation * (kernel - 1)
    m = transposed_output_length(total, kernel, stride, dilation, padding, output_padding)
    windows = []
    for rank, (a, n) in enumerate(zip(starts, extents)):
        b = a + n
        lo = 0 if rank == 0 else min(a * stride, m)
        hi = m if rank == len(extents) - 1 else min(b * stride, m)
        hi = max(hi, lo)
        if hi > lo:
            in_start = ceil_div(lo + padding - reach, stride)
            in_stop = (hi - 1 + padding) // stride + 1
        else:
            in_start = in_stop = a
        windows.append(Window(lo, hi, in_start, in_stop, a, b, skip=lo + padding - in_start * stride))
    return windows


def halo_for(windows):
    """Return the halo width every rank exchanges: the most rows any rank needs on either side."""
    return max([0] + [max(w.before, w.after) for w in windows if w.outputs])
