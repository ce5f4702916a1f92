"""Convolutions sharded along one spatial dimension, equal to the single-process layer.

Each rank computes the output rows whose first input row falls in its own
rows (:mod:`mpidomain.nn.rows`), from its rows plus its neighbours' (a
differentiable halo exchange): any kernel, stride, dilation, padding
(``"same"``, ``"valid"``, asymmetric) and padding mode, uneven shards
included. Forward and backward equal the wrapped layer's on the whole field
to round-off. Parameters stay the wrapped module's (same state_dict keys);
its forward pre-hooks run first (spectral_norm, weight_norm).
"""

import torch
import torch.nn.functional as F

from . import rows
from ._shard import Wrapper, fetch_rows, layer_agree, layer_extents, place, require_covered, shard_dims, spatial_axis
from .overlap import overlapped_rows, resolve
from .precision import conv_input

__all__ = [
    "DomainParallelConv2d",
    "DomainParallelConv3d",
    "DomainParallelConvTranspose2d",
    "DomainParallelConvTranspose3d",
    "DomainParallelPeriodicConv2d",
]

_CONV = {2: F.conv2d, 3: F.conv3d}
_TRANSPOSED = {2: F.conv_transpose2d, 3: F.conv_transpose3d}


def conv_padding(conv):
    """Return the conv's zero padding as (before, after) per spatial dim (``"same"``/``"valid"`` resolved)."""
    spatial = len(conv.kernel_size)
    if conv.padding == "valid":
        return [(0, 0)] * spatial
    if conv.padding == "same":
        totals = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        return [(t // 2, t - t // 2) for t in totals]
    return [(p, p) for p in conv.padding]


def _check_windows(name, windows, extents, halo, details):
    """Raise ValueError (alike on every rank: all compute the same windows) for a layout the layer cannot run."""
    empty = [r for r, w in enumerate(windows) if not w.outputs]
    problem = None
    if empty and sum(w.outputs for w in windows):
        problem = f"domain ranks {empty} would hold no output rows"
    elif halo > min(extents):
        problem = f"it needs {halo} rows of each neighbour, more than the smallest shard holds"
    if problem:
        raise ValueError(
            f"{name}({details}) cannot run on shards of {list(extents)} rows along the sharded dim: {problem}; "
            "use fewer domain ranks or a larger field"
        )


class _Conv(Wrapper):
    _child = "conv"
    _base = ()
    _spatial = 2

    def __init__(self, conv, shard_dim=-2, manager=None, *, padding=None):
        if not isinstance(conv, self._base):
            raise TypeError(f"{type(self).__name__} wraps a torch.nn.{self._base.__name__}, got {type(conv).__name__}")
        super().__init__(conv, shard_dim, manager)
        # (before, after) along the sharded dim in place of the conv's own: an explicit ZeroPad before it
        # (with tiles, one pair per sharded dim).
        self.padding_override = padding

    def _settings(self, axis):
        conv = self.conv
        return (type(conv).__name__, tuple(conv.kernel_size), tuple(conv.stride), tuple(conv.dilation),
                str(conv.padding), getattr(conv, "output_padding", None), conv.groups, conv.padding_mode, axis,
                self.padding_override)

    def extra_repr(self):
        return f"shard_dim={self.shard_dim}" + (f", padding={self.padding_override}" if self.padding_override else "")


class _ForwardConv(_Conv):
    def __init__(self, conv, shard_dim=-2, manager=None, *, padding=None, overlap=None):
        super().__init__(conv, shard_dim, manager, padding=padding)
        # True: start the halo exchange, compute the rows that need no halo, then the edge rows
        # (mpidomain.nn.overlap); False: exchange, then compute; None: mpidomain.nn.overlap_default().
        self.overlap = overlap

    def _settings(self, axis):
        return super()._settings(axis) + (("overlap", resolve(self.overlap)),)

    def forward(self, x):
        """Return this rank's rows of the convolution of the whole field; collective over the domain group.

        With tiles, the input rows along each sharded dim in turn (the second exchange carries the
        first one's halo rows, so the corners come along), then one convolution. With ``overlap``,
        the exchange along the last sharded dim (latitude on slabs, longitude on tiles) travels
        while the rows that need no halo along it are convolved (:mod:`mpidomain.nn.overlap`).
        """
        x = conv_input(self._pre_hooks(x))  # under autocast, the halos travel in its dtype
        conv, name, manager = self.conv, type(self).__name__, self._manager()
        dims = shard_dims(self.shard_dim)
        pads, axes = self._own_padding(), []
        require_covered(manager, x, self.shard_dim, self._spatial, name,
                        lambda a: conv.kernel_size[a] == 1 and conv.stride[a] == 1 and pads[a] == (0, 0))
        overrides = self.padding_override if len(dims) > 1 else (self.padding_override,)
        overlap = resolve(self.overlap)
        for i, (shard_dim, override) in enumerate(zip(dims, overrides or (None,) * len(dims))):
            dim, axis = spatial_axis(x, shard_dim, self._spatial, name)
            if override is not None:
                pads[axis] = tuple(override)
            window, halo, first, last = self._window_along(x, manager, name, dim, axis, pads)
            axes.append(axis)
            if overlap and i == len(dims) - 1 and halo and window.outputs:
                k, s, d = conv.kernel_size[axis], conv.stride[axis], conv.dilation[axis]
                return overlapped_rows(x, window, halo, dim, manager,
                                       lambda slab, sub: self._convolve(slab, pads, axes), s, d * (k - 1) + 1,
                                       edge=self._edge(axis), first=first, last=last)
            x = self._fetch(x, window, halo, dim, manager, name, axis, pads, first, last)
        return self._convolve(x, pads, axes)

    def _details(self, dim, axis, pads):
        conv = self.conv
        return (f"kernel={conv.kernel_size[axis]}, stride={conv.stride[axis]}, dilation={conv.dilation[axis]}, "
                f"padding={pads[axis]} along dim {dim}")

    def _fetch(self, x, window, halo, dim, manager, name, axis, pads, first, last):
        """Return ``window``'s input rows along ``dim`` (a halo exchange); collective."""
        try:
            return fetch_rows(x, window, halo, dim, manager, edge=self._edge(axis), first=first, last=last)
        except ValueError as error:  # raised on every rank alike: say which layer
            raise ValueError(f"{name}({self._details(dim, axis, pads)}): {error}") from error

    def _window_along(self, x, manager, name, dim, axis, pads):
        """Agree, and return (this rank's window, the halo, whether it holds the first/last rows) along ``dim``."""
        conv = self.conv
        k, s, d = conv.kernel_size[axis], conv.stride[axis], conv.dilation[axis]
        mode = self._edge(axis)
        details = self._details(dim, axis, pads)
        if s == 1:  # each rank's window follows from its own rows: no extents to gather
            return self._unit_stride(manager, name, x, dim, axis, pads, details)
        extents, index = layer_extents(manager, name, x, dim, self._settings(axis))
        windows = rows.conv_windows(extents, k, s, d, *pads[axis])
        halo = rows.halo_for(windows)
        _check_windows(name, windows, extents, halo, details)
        if mode == "reflect" and max(pads[axis]) >= min(extents[0], extents[-1]):
            raise ValueError(f"{name}({details}): reflect padding needs more rows than the padding on the edge "
                             f"ranks, got shards of {list(extents)}; use fewer domain ranks")
        return windows[index], halo, index == 0, index == len(windows) - 1

    def _unit_stride(self, manager, name, x, dim, axis, pads, details):
        """Agree, and return (window, halo, first, last) of a stride-1 layer from this rank's rows alone."""
        conv = self.conv
        k, d = conv.kernel_size[axis], conv.dilation[axis]
        before, after = pads[axis]
        n = x.shape[dim]
        coord, tiles = place(manager, x, dim)
        first, last = coord == 0, coord == tiles - 1
        window = rows.unit_stride_window(n, first, last, k, d, before, after)
        error = None
        if last and window.outputs < 1:
            error = ValueError(f"{name}({details}) cannot run: the last domain rank holds {n} rows, too few for "
                               "one output row; use fewer domain ranks or a larger field")
        elif self._edge(axis) == "reflect" and (first or last) and max(before, after) >= n:
            error = ValueError(f"{name}({details}): reflect padding needs more rows than the padding on the edge "
                               f"ranks, which hold {n}; use fewer domain ranks")
        halo = rows.unit_stride_halo(k, d, before, after)
        if error is None and resolve(self.overlap) and n < halo:  # the exchange reports it when not overlapping
            error = ValueError(f"{name}({details}): it needs {halo} rows of each neighbour, more than this rank's "
                               f"{n}; use fewer domain ranks or a larger field")
        layer_agree(manager, name, x, dim, self._settings(axis), error)
        return window, halo, first, last

    def _edge(self, axis):
        """How rows beyond the field's edges along spatial ``axis`` are made: the conv's padding mode."""
        return self.conv.padding_mode

    def _own_padding(self):
        """(before, after) per spatial dim before any override: the conv's."""
        return conv_padding(self.conv)

    def _convolve(self, slab, pads, axes):
        conv = self.conv
        others = [p for i, p in enumerate(pads) if i not in axes]
        padding = [0 if i in axes else p[0] for i, p in enumerate(pads)]
        if conv.padding_mode != "zeros" or any(b != a for b, a in others):
            widths = []
            for i in reversed(range(len(pads))):  # F.pad takes the last dim first
                widths += [0, 0] if i in axes else list(pads[i])
            mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
            slab = F.pad(slab, widths, mode=mode)
            padding = [0] * len(pads)
        return _CONV[self._spatial](slab, conv.weight, conv.bias, conv.stride, padding, conv.dilation, conv.groups)


class DomainParallelConv2d(_ForwardConv):
    """A ``torch.nn.Conv2d`` on a field sharded along ``shard_dim`` (default -2, latitude).

    Collective over the domain group, forward and backward. Each rank returns
    its rows of the single-process output (output rows are dealt out by where
    their first input row lies: a stride-2 layer over 181/180 rows gives
    91/90). Any kernel, stride, dilation, padding and padding mode (zeros,
    circular across the domain group, reflect and replicate at its edges).

    :param conv: The convolution; it stays the owner of the parameters (``.conv``).
    :param shard_dim: The sharded dim of the input (the manager's ``shard_dim``).
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    :param padding: (before, after) rows along ``shard_dim`` in place of the conv's own padding.
    :param overlap: True: start the halo exchange, convolve the rows that need no halo while it travels,
        then the edge rows (forward and backward; along the last sharded dim); False: exchange, then
        convolve; None (default): :func:`mpidomain.nn.overlap_default` (``set_overlap``,
        ``MPIDOMAIN_OVERLAP``). The results are the same either way.
    """

    _base = torch.nn.Conv2d
    _spatial = 2


class DomainParallelConv3d(_ForwardConv):
    """A ``torch.nn.Conv3d`` on (B, C, T, H, W) sharded along ``shard_dim`` (default -2, H); as :class:`DomainParallelConv2d`."""

    _base = torch.nn.Conv3d
    _spatial = 3


class _TransposedConv(_Conv):
    def forward(self, x, output_size=None):
        """Return this rank's rows of the transposed convolution of the whole field; collective.

        With tiles, the input rows along each sharded dim in turn, one transposed convolution, then
        this rank's output rows along each sharded dim.
        """
        x = conv_input(self._pre_hooks(x))  # under autocast, the halos travel in its dtype
        conv, name, manager = self.conv, type(self).__name__, self._manager()
        error = None
        if output_size is not None:
            error = TypeError(f"{name} takes no output_size; set output_padding on the wrapped layer instead")
        require_covered(manager, x, self.shard_dim, self._spatial, name,
                        lambda a: conv.dilation[a] * (conv.kernel_size[a] - 1) + 1 == conv.stride[a]
                        and conv.padding[a] == 0 and conv.output_padding[a] == 0)
        cuts = []  # (dim, window) per sharded dim
        for shard_dim in shard_dims(self.shard_dim):
            dim, axis = spatial_axis(x, shard_dim, self._spatial, name)
            k, s, d = conv.kernel_size[axis], conv.stride[axis], conv.dilation[axis]
            p, op = conv.padding[axis], conv.output_padding[axis]
            extents, index = layer_extents(manager, name, x, dim, self._settings(axis), error)
            windows = rows.transposed_windows(extents, k, s, d, p, op)
            halo = rows.halo_for(windows)
            details = f"kernel={k}, stride={s}, dilation={d}, padding={p}, output_padding={op} along dim {dim}"
            _check_windows(name, windows, extents, halo, details)
            window = windows[index]
            x = fetch_rows(x, window, halo, dim, manager)
            cuts.append((dim, axis, window))
        axes = [axis for _, axis, _ in cuts]
        padding = [0 if i in axes else q for i, q in enumerate(conv.padding)]
        output_padding = [0 if i in axes else q for i, q in enumerate(conv.output_padding)]
        empty = [dim for dim, _, _ in cuts if not x.shape[dim]]
        if not empty:
            full = _TRANSPOSED[self._spatial](x, conv.weight, None, conv.stride, padding, output_padding,
                                              conv.groups, conv.dilation)
        else:  # no input reaches these outputs (output_padding rows): bias only
            for dim in empty:
                x = F.pad(x, [0, 0] * (x.ndim - 1 - dim) + [0, 1])
            full = _TRANSPOSED[self._spatial](x, conv.weight, None, conv.stride, padding, output_padding,
                                              conv.groups, conv.dilation)
            for dim in empty:
                full = full.narrow(dim, 0, 0)
        for dim, _, window in cuts:
            short = window.skip + window.outputs - full.shape[dim]
            if short > 0:  # output_padding rows past the last input's reach
                full = F.pad(full, [0, 0] * (full.ndim - 1 - dim) + [0, short])
            full = full.narrow(dim, window.skip, window.outputs)
        if conv.bias is not None:
            full = full + conv.bias.view((1, -1) + (1,) * self._spatial).to(full.dtype)  # autocast: its dtype
        return full


class DomainParallelConvTranspose2d(_TransposedConv):
    """A ``torch.nn.ConvTranspose2d`` on a field sharded along ``shard_dim``; collective, as :class:`DomainParallelConv2d`.

    A rank computes output rows ``[a*stride, b*stride)`` for its input rows
    ``[a, b)``, from every input row that adds onto them: after a stride-2
    convolution over even shards, the rows of the skip connection.
    """

    _base = torch.nn.ConvTranspose2d
    _spatial = 2


class DomainParallelConvTranspose3d(_TransposedConv):
    """A ``torch.nn.ConvTranspose3d`` on (B, C, T, H, W) sharded along ``shard_dim``; as :class:`DomainParallelConvTranspose2d`."""

    _base = torch.nn.ConvTranspose3d
    _spatial = 3


class DomainParallelPeriodicConv2d(DomainParallelConv2d):
    """A ``torch.nn.Conv2d`` padded circularly in longitude and with zeros (or reflected) in latitude.

    Its single-process twin pads ``x`` circularly in longitude, then in latitude (zeros, or
    ``latitude="reflect"``), and convolves unpadded; the padding is the conv's own unless
    ``periodic_padding`` gives it. Along a sharded dim the rows come from the neighbours:
    beyond the poles zeros or the edge rank's rows reflected, and in longitude the rows of the
    other end of the domain group (with tiles) or this rank's own (latitude slabs hold every
    longitude). Collective over the domain group, forward and backward. Wraps a conv with
    ``padding_mode="zeros"``. :meth:`from_periodic` converts CREDIT's
    ``credit.models.unet_diffusion.PeriodicConv2d``.

    :param latitude: ``"zeros"`` or ``"reflect"``: the rows beyond the poles.
    :param periodic_padding: Rows and columns padded on each side in place of the conv's padding.
    """

    def __init__(self, conv, shard_dim=-2, manager=None, *, padding=None, latitude="zeros", periodic_padding=None,
                 overlap=None):
        if latitude not in ("zeros", "reflect"):
            raise ValueError(f"latitude must be 'zeros' or 'reflect', got {latitude!r}")
        super().__init__(conv, shard_dim, manager, padding=padding, overlap=overlap)
        self.latitude = latitude
        self.periodic_padding = periodic_padding

    @classmethod
    def from_periodic(cls, module, shard_dim=-2, manager=None):
        """Return the twin of a module that pads ``module.padding`` columns circularly, then rows reflected,
        and applies ``module.conv`` (unpadded): CREDIT's ``unet_diffusion.PeriodicConv2d``.

        The state_dict keys stay the module's (``<path>.conv.weight``).
        """
        conv, padding = getattr(module, "conv", None), getattr(module, "padding", None)
        if not isinstance(conv, torch.nn.Conv2d) or conv_padding(conv) != [(0, 0), (0, 0)] \
                or not isinstance(padding, int):
            raise TypeError(f"from_periodic expects a module with .conv (an unpadded Conv2d) and an int .padding, "
                            f"got {type(module).__name__}")
        layer = cls(conv, shard_dim, manager, latitude="reflect", periodic_padding=padding)
        layer.keeps_child_prefix = True
        return layer

    def _edge(self, axis):
        return "circular" if axis == 1 else self.latitude

    def _own_padding(self):
        if self.periodic_padding is None:
            return conv_padding(self.conv)
        return [(self.periodic_padding, self.periodic_padding)] * 2

    def _settings(self, axis):
        return super()._settings(axis) + (self.latitude, self.periodic_padding)

    def _convolve(self, slab, pads, axes):
        conv = self.conv
        widths = []
        for i in reversed(range(len(pads))):
            widths += [0, 0] if i in axes else list(pads[i])
        slab = F.pad(slab, widths, mode="circular")
        return F.conv2d(slab, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)

    def forward(self, x):
        """Return this rank's rows of the periodic convolution of the whole field; collective."""
        if self.conv.padding_mode != "zeros":
            raise ValueError("DomainParallelPeriodicConv2d pads longitude circularly itself: wrap a conv with "
                             f"padding_mode='zeros', got {self.conv.padding_mode!r}")
        return super().forward(x)

    def extra_repr(self):
        return super().extra_repr() + (f", latitude={self.latitude!r}" if self.latitude != "zeros" else "") + (
            f", periodic_padding={self.periodic_padding}" if self.periodic_padding is not None else "")
