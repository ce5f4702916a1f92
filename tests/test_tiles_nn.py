"""Domain-parallel layers and a converted CNN on 2-D tiles (latitude x longitude), equal to one process."""

import pytest

torch = pytest.importorskip("torch")

from mpidomain import DomainParallelManager, balanced_split  # noqa: E402
from reference import tile_of  # noqa: E402
from mpidomain.nn import (DomainParallelConv2d, HaloExchange, DomainParallelConvTranspose2d, DomainParallelInterpolate,  # noqa: E402
                          DomainParallelPeriodicConv2d, allreduce_gradients, convert_to_domain_parallel)

nn = torch.nn
TOLERANCE = 1e-10


def layouts(size):
    """Every (D_lat, D_lon) of ``size`` ranks."""
    return [(a, size // a) for a in range(1, size + 1) if size % a == 0]


def assemble(tile, manager):
    """The whole field from every rank's ``tile``, placed by the tiles' coordinates (every rank gets it)."""
    tiles = manager.domain_comm.allgather((manager.domain_coords, tile.detach()))
    rows = {}
    for (i, j), t in tiles:
        rows.setdefault(i, {})[j] = t
    return torch.cat([torch.cat([rows[i][j] for j in sorted(rows[i])], -1) for i in sorted(rows)], -2)


def relative(a, b):
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-300))


def one_process(single, shape, seed=0):
    """Run ``single`` on a random whole field and back-propagate a random weighting of its output.

    Return (the field, its leaf with ``.grad``, the output, the weights).
    """
    generator = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, dtype=torch.float64, generator=generator)
    full_in = full.clone().requires_grad_()
    reference = single(full_in)
    weights = torch.randn(reference.shape, dtype=torch.float64, generator=generator)
    (reference * weights).sum().backward()
    return full, full_in, reference, weights


def compare(manager, single, parallel, shape, seed=0):
    """The problems of ``parallel`` on tiles against ``single`` on the whole field: output, input and weight grads."""
    full, full_in, reference, weights = one_process(single, shape, seed)
    local_in = tile_of(full, manager).clone().requires_grad_()
    out = parallel(local_in)
    whole = assemble(out, manager)
    problems = []
    if whole.shape != reference.shape:
        return [f"output shape {tuple(whole.shape)} != {tuple(reference.shape)}"]
    if relative(whole, reference.detach()) > TOLERANCE:
        problems.append(f"forward relative error {relative(whole, reference.detach()):.3g}")
    # This rank's output tile sits where assemble put it: cut the weights the same way, by output extents.
    extents = manager.domain_comm.allgather((manager.domain_coords, tuple(out.shape[-2:])))
    i, j = manager.domain_coords
    top = sum(e[0] for (a, b), e in extents if b == 0 and a < i)
    left = sum(e[1] for (a, b), e in extents if a == 0 and b < j)
    (out * weights[..., top:top + out.shape[-2], left:left + out.shape[-1]]).sum().backward()
    if relative(local_in.grad, tile_of(full_in.grad, manager)) > TOLERANCE:
        problems.append(f"input gradient relative error {relative(local_in.grad, tile_of(full_in.grad, manager)):.3g}")
    for p in parallel.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    allreduce_gradients(parallel, group="domain", op="sum", manager=manager)
    for (name, p), q in zip(parallel.named_parameters(), single.parameters()):
        if q.grad is None:  # frozen
            continue
        if relative(p.grad, q.grad) > TOLERANCE:
            problems.append(f"gradient of {name}: relative error {relative(p.grad, q.grad):.3g}")
    return problems


def twins(make):
    """The layer on one process and a copy for the tiles, with the same parameters."""
    torch.manual_seed(1)
    single = make().double()
    parallel = make().double()
    parallel.load_state_dict(single.state_dict())
    return single, parallel


LAYERS = {
    "conv3x3": (lambda: nn.Conv2d(2, 3, 3, padding=1), DomainParallelConv2d),
    "conv5x3_circular": (lambda: nn.Conv2d(2, 2, (5, 3), padding=(2, 1), padding_mode="circular"), DomainParallelConv2d),
    "conv_stride2": (lambda: nn.Conv2d(2, 2, 3, stride=2, padding=1), DomainParallelConv2d),
    "conv_dilated_reflect": (lambda: nn.Conv2d(2, 2, 3, dilation=2, padding=2, padding_mode="reflect"),
                             DomainParallelConv2d),
    "transposed_k4s2": (lambda: nn.ConvTranspose2d(2, 2, 4, stride=2, padding=1), DomainParallelConvTranspose2d),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_on_every_tile_layout_equals_one_process(world, name):
    """Each layer on every (D_lat, D_lon) of the world, uneven tiles: forward, input and parameter gradients."""
    make, wrapper = LAYERS[name]
    problems = []
    for shape in layouts(world.size):
        with DomainParallelManager(world.size, shape, (-2, -1)) as manager:
            single, inner = twins(make)
            problems += [f"{shape}: {p}" for p in compare(manager, single, wrapper(inner, (-2, -1), manager),
                                                          (2, 2, 13, 18))]
    assert not problems, problems


def test_upsample_on_tiles_equals_one_process(world):
    """Bilinear upsampling on tiles equals F.interpolate on the whole field."""
    problems = []
    for shape in layouts(world.size):
        with DomainParallelManager(world.size, shape, (-2, -1)) as manager:
            single = nn.Upsample(scale_factor=2, mode="bilinear")
            parallel = DomainParallelInterpolate(scale_factor=2, mode="bilinear", shard_dim=(-2, -1), manager=manager)
            problems += [f"{shape}: {p}" for p in compare(manager, single, parallel, (1, 2, 9, 14))]
    assert not problems, problems


class PeriodicTwin(nn.Module):
    """One process' periodic convolution: longitude padded circularly, latitude with zeros."""

    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x):
        x = torch.nn.functional.pad(x, (1, 1, 0, 0), mode="circular")
        return torch.nn.functional.conv2d(x, self.conv.weight, self.conv.bias, padding=(1, 0))


def test_periodic_conv_wraps_longitude_across_the_tiles(world):
    """DomainParallelPeriodicConv2d on tiles: the longitude wrap comes from the other end of the group."""
    problems = []
    for shape in layouts(world.size):
        with DomainParallelManager(world.size, shape, (-2, -1)) as manager:
            single, inner = twins(lambda: nn.Conv2d(2, 2, 3, padding=1))
            parallel = DomainParallelPeriodicConv2d(inner, (-2, -1), manager)
            problems += [f"{shape}: {p}" for p in compare(manager, PeriodicTwin(single), parallel, (1, 2, 10, 12))]
    assert not problems, problems


class SmallCNN(nn.Module):
    """A U-Net-like CNN: convolutions, a strided one, GroupNorm, upsampling back, a skip, a longitude-circular conv."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU())
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.embed = nn.Sequential(nn.ZeroPad2d((1, 2, 1, 2)), nn.Conv2d(4, 4, 4))
        self.wrap = nn.Conv2d(8, 3, 3, padding=1, padding_mode="circular")

    def forward(self, x):
        skip = self.encode(x)
        y = self.embed(self.up(torch.tanh(self.down(skip))))
        return self.wrap(torch.cat([y, skip], 1))


def test_converted_cnn_on_tiles_equals_one_process(world):
    """convert_to_domain_parallel on a 2-D manager, unchanged call: the whole CNN equals one process."""
    problems = []
    for shape in layouts(world.size):
        with DomainParallelManager(world.size, shape, (-2, -1)) as manager:
            single, copy = twins(SmallCNN)
            parallel = convert_to_domain_parallel(copy, manager)
            assert parallel.encode[0].shard_dim == (-2, -1)
            # 24 x 24: every layout of 1 to 4 ranks cuts tiles of even extent, so the strided convolution's rows
            # come back from the upsampling aligned with the skip's (16 rows over 3 ranks, 6/5/5, would not: torch.cat
            # would then fail on some ranks only, inside the model, where no mpidomain call can see it).
            problems += [f"{shape}: {p}" for p in compare(manager, single, parallel, (2, 3, 24, 24))]
    assert not problems, problems


def test_tiles_need_a_neighbour_per_halo_everywhere(world):
    """A kernel wider than a tile raises the same ValueError on every rank."""
    if world.size < 2:
        pytest.skip("needs several tiles")
    with DomainParallelManager(world.size, (1, world.size), (-2, -1)) as manager:
        conv = DomainParallelConv2d(nn.Conv2d(1, 1, 9, padding=4).double(), (-2, -1), manager)
        x = torch.zeros(1, 1, 8, 2, dtype=torch.float64)
        try:
            conv(x)
            message = None
        except ValueError as error:
            message = str(error)
    messages = world.allgather(message)
    assert messages[0] is not None and len(set(messages)) == 1, messages


def test_a_layer_that_leaves_a_sharded_dim_out_raises(world):
    """A conv wrapped for latitude only, on tiles split in longitude too, raises instead of padding alone."""
    if world.size < 2:
        pytest.skip("needs tiles split in longitude")
    with DomainParallelManager(world.size, (1, world.size), (-2, -1)) as manager:
        x = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
        along_lat = DomainParallelConv2d(nn.Conv2d(1, 1, 3, padding=1).double(), -2, manager)
        with pytest.raises(ValueError, match=r"the manager shards dim -1 too .* pass shard_dim=\(-2, -1\)"):
            along_lat(x)
        pointwise_in_lon = DomainParallelConv2d(nn.Conv2d(1, 1, (3, 1), padding=(1, 0)).double(), -2, manager)
        assert pointwise_in_lon(x).shape == (1, 1, 4, 4)


def padded_tile_of(full, manager, halo):
    """This rank's tile of ``full`` zero-padded by ``halo`` along both dims, with its halos: what an exchange gives."""
    return tile_of(torch.nn.functional.pad(full, (halo, halo, halo, halo)), manager, halo)


def test_halo_exchange_layer_defaults_to_the_managers_dims(world):
    """HaloExchange with no dim pads along the manager's shard_dims: both on tiles (2 x 2 among them), -2 on latitude."""
    full = torch.arange(2 * 6 * 8, dtype=torch.float64).reshape(1, 2, 6, 8) + 1
    problems = []
    for shape in layouts(world.size):
        with DomainParallelManager(world.size, shape, (-2, -1)) as manager:
            x = tile_of(full, manager).clone().requires_grad_()
            out = HaloExchange((1, 1), manager=manager)(x)
            if not torch.equal(out.detach(), padded_tile_of(full, manager, 1)):
                problems.append(f"{shape}: the padded tile differs from the zero-padded field's")
            out.sum().backward()  # each ghost cell's gradient returns to its owner: none lost, none made up
            given = manager.domain_comm.allreduce(float(x.grad.sum()))
            wanted = manager.domain_comm.allreduce(float(padded_tile_of(torch.ones_like(full), manager, 1).sum()))
            if given != wanted:
                problems.append(f"{shape}: the input gradients sum to {given}, not {wanted}")
    with DomainParallelManager(world.size, world.size, -2) as manager:  # a latitude manager, CREDIT's default
        lat = balanced_split(6, world.size)
        rank = manager.domain_rank
        out = HaloExchange(1, manager=manager)(full[..., lat[1][rank]:lat[1][rank] + lat[0][rank], :])
        expected = torch.nn.functional.pad(full, (0, 0, 1, 1))[..., lat[1][rank]:lat[1][rank] + lat[0][rank] + 2, :]
        if not torch.equal(out, expected):
            problems.append(f"latitude manager: HaloExchange(1) gave shape {tuple(out.shape)}, not the rows along -2")
    assert not problems, problems
