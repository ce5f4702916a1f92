"""CREDIT's own models converted: TensorPadding, CrossFormer end to end, unet_diffusion's PeriodicConv2d.

Float64 against the unconverted model on one process (every rank runs it on the whole
field): the gathered output and the parameter gradients summed over the domain group.
Skipped alike on every rank where CREDIT (``miles-credit``) cannot be imported.
"""

import copy

import pytest

pytestmark = pytest.mark.credit
torch = pytest.importorskip("torch")

import credit_models  # noqa: E402
from mpidomain import DomainParallelManager, gather_tensor, shard_tensor  # noqa: E402
from mpidomain.nn import (DomainParallelPeriodicConv2d, DomainParallelTensorPadding, allreduce_gradients,  # noqa: E402
                          convert_to_domain_parallel)
from mpidomain.models import CREDIT_INSTALL  # noqa: E402

TOLERANCE = 1e-9


def _agreed_skip(world, loader):
    reasons = world.allgather(credit_models.why_missing(loader))
    if any(reasons):
        pytest.skip(f"CREDIT not importable here ({next(r for r in reasons if r)}): {CREDIT_INSTALL}")
    return loader()


@pytest.fixture
def crossformer(world):
    return _agreed_skip(world, credit_models.crossformer)


def layouts(world):
    """(domain shape, shard_dim) this world runs: slabs of all its ranks, and 2 x 2 tiles at 4."""
    found = [(world.size, -2)]
    if world.size == 4:
        found.append(((2, 2), (-2, -1)))
    return found


def relative(got, want):
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-300)


def run(world, model, x, shape, shard_dim):
    """Return (max relative output difference, max relative gradient difference) against one process."""
    reference = copy.deepcopy(model)
    want = reference(x)
    want.square().mean().backward()
    with DomainParallelManager(world.size, shape, shard_dim=shard_dim) as manager:
        converted = convert_to_domain_parallel(model, manager=manager)
        y = converted(shard_tensor(x, manager=manager, allow_uneven=True))
        (y.square().sum() / want.numel()).backward()  # this rank's share of the whole field's mean
        allreduce_gradients(converted, manager=manager, group="domain", op="sum")
        got = gather_tensor(y.detach(), manager=manager)
    output = relative(got, want.detach()) if got.shape == want.shape else float("inf")
    return output, gradient_difference(converted, reference)


def gradient_difference(converted, reference):
    """Max |gradient difference| over all parameters, relative to the largest |gradient| of the model
    (some gradients are zero up to round-off: the bias before a softmax or a GroupNorm)."""
    pairs = [(a.grad, b.grad) for a, b in zip(converted.parameters(), reference.parameters()) if b.grad is not None]
    return max((a - b).abs().max().item() for a, b in pairs) / max(b.abs().max().item() for _, b in pairs)


def small_crossformer(module, global_window_size=(4, 2, 2, 1), mode="earth"):
    """CREDIT's test configuration shrunk: 123 x 56, pads (2, 3) / (4, 4), windows 2 and (4, 2, 2, 1), two
    input frames (reshaped into channels)."""
    torch.manual_seed(0)
    model = module.CrossFormer(image_height=123, image_width=56, frames=2, channels=1, levels=2, surface_channels=1,
                               input_only_channels=0, dim=(4, 8, 16, 32), depth=(1, 1, 1, 1), dim_head=4,
                               local_window_size=2, global_window_size=global_window_size,
                               cross_embed_kernel_sizes=((4, 8), (2, 4), (2, 4), (2, 4)),
                               cross_embed_strides=(2, 2, 2, 2), use_spectral_norm=True,
                               padding_conf=dict(activate=True, mode=mode, pad_lat=[2, 3], pad_lon=[4, 4])).double()
    return model, torch.randn(1, 3, 2, 123, 56, dtype=torch.float64)


def test_crossformer_forward_and_gradients(world, crossformer):
    """Earth padding (2, 3), CrossEmbed 4/8 stride 2, short windows 2, long windows (4, 2, 2, 1), spectral norm,
    PixelShuffle decoder: slabs of every rank (123 rows: uneven shards) and 2 x 2 tiles."""
    for shape, shard_dim in layouts(world):
        model, x = small_crossformer(crossformer)
        output, grads = run(world, model, x, shape, shard_dim)
        assert output < TOLERANCE and grads < TOLERANCE, (shape, output, grads)


def test_crossformer_layout_that_cannot_work_raises_on_every_rank(world, crossformer):
    """11 + 2 + 3 = 16 padded rows hold one group of 16 (the product of the strides): they fit one latitude
    rank only; the converted model raises the same ValueError on every rank, naming the rows and the limit."""
    if world.size == 1:
        pytest.skip("one rank holds every block")
    torch.manual_seed(0)
    model = crossformer.CrossFormer(image_height=11, image_width=56, frames=1, channels=1, levels=2,
                                    surface_channels=1, input_only_channels=0, dim=(4, 8, 16, 32),
                                    depth=(1, 1, 1, 1), dim_head=4, local_window_size=2,
                                    global_window_size=(1, 1, 1, 1), use_spectral_norm=False,
                                    cross_embed_kernel_sizes=((4, 8), (2, 4), (2, 4), (2, 4)),
                                    cross_embed_strides=(2, 2, 2, 2),
                                    padding_conf=dict(activate=True, mode="earth", pad_lat=[2, 3],
                                                      pad_lon=[4, 4])).double()
    x = torch.randn(1, 3, 1, 11, 56, dtype=torch.float64)
    with DomainParallelManager(world.size, world.size) as manager:
        converted = convert_to_domain_parallel(model, manager=manager)
        with pytest.raises(ValueError) as error:
            converted(shard_tensor(x, manager=manager, allow_uneven=True))
    messages = world.allgather(str(error.value))
    assert len(set(messages)) == 1 and "16 padded latitude rows hold 1 whole 16-row groups" in messages[0] \
        and "use at most 1 latitude ranks" in messages[0], messages


@pytest.mark.parametrize("pad_lat", [(3, 4), (9, 10), (20, 21)], ids=["narrow", "wider than a shard", "wider than the field"])
@pytest.mark.parametrize("mode", ["earth", "mirror"])
def test_tensor_padding_pad_unpad_and_adjoint(world, crossformer, mode, pad_lat):
    """pad and unpad equal CREDIT's TensorPadding on the whole field cut to the shard; the backward is the
    exact adjoint (dot-product test against autograd through CREDIT's pad on the whole field). Pads wider
    than a shard (9 of 29 rows at 4 slabs: 8, 7, 7, 7) take their rows from as many ranks as they span; pads
    wider than half the field (CREDIT reads rows twice) too; on longitude tiles they are refused alike on
    every rank."""
    from credit.boundary_padding import TensorPadding

    torch.manual_seed(1)
    x = torch.randn(2, 3, 1, 29, 24, dtype=torch.float64)
    credit = TensorPadding(mode, pad_lat, (4, 4))
    want = credit.pad(x)
    probe = torch.randn_like(want)
    whole = x.clone().requires_grad_()
    (credit.pad(whole) * probe).sum().backward()
    for shape, shard_dim in layouts(world):
        with DomainParallelManager(world.size, shape, shard_dim=shard_dim) as manager:
            padding = DomainParallelTensorPadding(mode, pad_lat, (4, 4), align=(4, 4), manager=manager)
            shard = shard_tensor(x, manager=manager, allow_uneven=True).requires_grad_()
            if shard_dim != -2 and pad_lat == (20, 21):
                with pytest.raises(ValueError, match="use fewer latitude ranks or D_lon = 1"):
                    padding.pad(shard)
                continue
            padded = padding.pad(shard)
            got = gather_tensor(padded.detach(), manager=manager)
            assert got.shape == want.shape and torch.equal(got, want), shape
            assert torch.equal(padding.unpad(padded).detach(), shard.detach()), shape
            sizes = world.allgather(tuple(padded.shape[-2:]))  # pad() re-cut the rows in blocks of 4
            if shard_dim == -2:
                start = sum(s[0] for s in sizes[:manager.domain_rank])
                mine = probe.narrow(-2, start, padded.shape[-2])
            else:
                lat, lon = manager.domain_coords
                top = sum(sizes[c * 2 + lon][0] for c in range(lat))
                left = sum(sizes[lat * 2 + c][1] for c in range(lon))
                mine = probe.narrow(-2, top, padded.shape[-2]).narrow(-1, left, padded.shape[-1])
            (padded * mine).sum().backward()
            grad = gather_tensor(shard.grad, manager=manager)
            assert relative(grad, whole.grad) < 1e-14, shape


def test_crossformer_interpolation_is_switched_off_where_it_is_the_identity(crossformer):
    """Bilinear (align_corners False) to the input's own size returns the input bit for bit, so the
    converter switches CrossFormer's F.interpolate off instead of running it on a shard."""
    x = torch.randn(1, 3, 123, 56, dtype=torch.float64)
    assert torch.equal(torch.nn.functional.interpolate(x, size=(123, 56), mode="bilinear"), x)
    model, _ = small_crossformer(crossformer)
    convert_to_domain_parallel(model, shard_dim=-2)  # local: no manager needed to convert
    assert model.use_interp is False and isinstance(model.padding_opt, DomainParallelTensorPadding)
    assert model.padding_opt.align == (16, 16) and model.padding_opt.prefer == (32,)  # strides; + short windows


def test_unet_diffusion_periodic_conv2d(world):
    """CREDIT's PeriodicConv2d (longitude circular, latitude reflected) through the custom converter
    DomainParallelPeriodicConv2d.from_periodic; the state_dict keys stay CREDIT's."""
    unet_diffusion = _agreed_skip(world, credit_models.unet_diffusion)
    torch.manual_seed(0)
    model = torch.nn.Sequential(unet_diffusion.PeriodicConv2d(3, 4, 3, padding=1), torch.nn.SiLU(),
                                unet_diffusion.PeriodicConv2d(4, 2, 5, padding=2)).double()
    keys = list(model.state_dict())
    x = torch.randn(2, 3, 17, 24, dtype=torch.float64)
    for shape, shard_dim in layouts(world):
        converters = {unet_diffusion.PeriodicConv2d:
                      lambda m, d=shard_dim: DomainParallelPeriodicConv2d.from_periodic(m, d)}
        reference = copy.deepcopy(model)
        want = reference(x)
        want.square().sum().backward()
        with DomainParallelManager(world.size, shape, shard_dim=shard_dim) as manager:
            converted = convert_to_domain_parallel(copy.deepcopy(model), manager=manager,
                                                   custom_converters=converters)
            for layer in converted.modules():
                if isinstance(layer, DomainParallelPeriodicConv2d):
                    layer.manager = manager
            assert list(converted.state_dict()) == keys
            y = converted(shard_tensor(x, manager=manager, allow_uneven=True))
            y.square().sum().backward()
            allreduce_gradients(converted, manager=manager, group="domain", op="sum")
            got = gather_tensor(y.detach(), manager=manager)
        assert relative(got, want.detach()) < TOLERANCE, shape
        assert gradient_difference(converted, reference) < TOLERANCE, shape


def test_crossformer_with_patches_is_refused(crossformer):
    """CubeEmbedding's reshape to the whole patch grid and the real interpolation after it are functional
    calls the converter cannot reach: a ValueError (alike on every rank: conversion is local)."""
    model = crossformer.CrossFormer(image_height=64, image_width=64, patch_height=2, patch_width=2, frames=1,
                                    channels=1, levels=2, surface_channels=1, input_only_channels=0,
                                    dim=(4, 8, 16, 32), depth=(1, 1, 1, 1), dim_head=4, local_window_size=1,
                                    global_window_size=(1, 1, 1, 1))
    with pytest.raises(ValueError, match="CrossFormer with patches"):
        convert_to_domain_parallel(model, shard_dim=-2)


def test_choosing_d_as_the_docs_say(world, crossformer):
    """docs/credit.md "Choosing D", against the converted models of CREDIT's 0.25-degree example (crossformer
    721 x 1440, pads 40/80, strides 2, short window 10) and its 1-degree configuration (181 x 360, pads
    37-38/76, short window 4): the groups, the blocks at D = 2, 4, 8, the most latitude ranks and the
    longitude tiles the text states are the ones the code deals and allows. Local (no data, no forward)."""
    import importlib
    import os

    from mpidomain.nn.earth_padding import BALANCE, padded_extents

    credit_crossformer = importlib.import_module("credit.models.crossformer")

    def padding(height, width, pad_lat, pad_lon, window):
        model = credit_crossformer.CrossFormer(
            image_height=height, image_width=width, frames=1, channels=1, levels=1, surface_channels=1,
            input_only_channels=0, output_only_channels=0, dim=(8, 16, 32, 64), depth=(1, 1, 1, 1), dim_head=4,
            global_window_size=(1, 1, 1, 1), local_window_size=window,
            cross_embed_kernel_sizes=((4, 8, 16, 32), (2, 4), (2, 4), (2, 4)), cross_embed_strides=(2, 2, 2, 2),
            use_spectral_norm=False, interp=True,
            padding_conf=dict(activate=True, mode="earth", pad_lat=pad_lat, pad_lon=pad_lon))
        convert_to_domain_parallel(model, shard_dim=-2)
        return model.padding_opt

    assert BALANCE == 1.15
    quarter = padding(721, 1440, [40, 40], [80, 80], 10)
    assert quarter.align == (16, 16) and quarter.prefer == (80, 160), (quarter.align, quarter.prefer)
    blocks = {d: padded_extents(801, d, 16, quarter.prefer)[0] for d in (2, 4, 8)}
    assert blocks[2] == [400, 401] and blocks[4] == [208, 208, 192, 193] and max(blocks[8]) == 112, blocks
    assert quarter.check_layout(721, 1440, (50,)) is None
    assert "use at most 50 latitude ranks (latitude ranks that work: 1-50)" in quarter.check_layout(721, 1440, (51,))
    assert quarter.check_layout(721, 1440, (2, 2)) is None
    assert "start at [80, 440, 800, 1160]" in quarter.check_layout(721, 1440, (2, 4))
    one = padding(181, 360, [37, 38], [76, 76], 4)
    assert one.align == (16, 16) and one.check_layout(181, 360, (16,)) is None
    assert "use at most 16 latitude ranks" in one.check_layout(181, 360, (17,))
    with open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "credit.md")) as file:
        text = " ".join(file.read().split())
    for said in ("has `a = 16`: 50 groups, up to 50 latitude ranks", "blocks of 80 rows at D = 2 (400 and 401 rows)",
                 "(208, 208, 192 and 193 rows, 0.26 of the padded rows on the largest)", "D = 8 (112 rows, 0.14)",
                 "4 tiles would start at 440", "has `a = 16` too: up to 16 latitude ranks", "at most 1.15 times"):
        assert said in text, said
