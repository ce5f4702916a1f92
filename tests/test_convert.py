"""convert_to_domain_parallel: what is wrapped, state_dict keys, hooks, and whole converted models."""

import copy

import pytest

torch = pytest.importorskip("torch")

from mpidomain import DomainParallelManager  # noqa: E402
from mpidomain.nn import (DomainParallelConv2d, DomainParallelConvTranspose2d, DomainParallelGroupNorm,  # noqa: E402
                          DomainParallelInterpolate, convert_to_domain_parallel)
from test_layers import compare, counts_for  # noqa: E402

nn = torch.nn


@pytest.fixture
def manager(world):
    with DomainParallelManager(world.size, world.size) as m:
        yield m


class Custom(nn.Module):
    """A block a user converts themselves."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        return self.inner(x)


def test_rules():
    model = nn.ModuleDict({
        "conv3x3": nn.Conv2d(2, 2, 3, padding=1),
        "pointwise": nn.Conv2d(2, 2, 1),
        "along_longitude": nn.Conv2d(2, 2, (1, 5), padding=(0, 2)),
        "pointwise_stride2": nn.Conv2d(2, 2, 1, stride=2),
        "up_k2s2": nn.ConvTranspose2d(2, 2, 2, stride=2),
        "up_k4s2": nn.ConvTranspose2d(2, 2, 4, stride=2, padding=1),
        "up_k1s2": nn.ConvTranspose2d(2, 2, 1, stride=2),
        "norm": nn.GroupNorm(1, 2),
        "layer_norm": nn.LayerNorm(2),
        "upsample": nn.Upsample(scale_factor=2, mode="bilinear"),
        "block": nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU()),
        "cross_embed": nn.Sequential(nn.ZeroPad2d((1, 2, 1, 2)), nn.Conv2d(2, 2, 4, stride=1)),
        "custom": Custom(),
    })
    marker = nn.Identity()
    converted = convert_to_domain_parallel(model, custom_converters={Custom: lambda m: marker})
    kinds = {name: type(module) for name, module in converted.items()}
    assert kinds["conv3x3"] is DomainParallelConv2d
    assert kinds["pointwise"] is nn.Conv2d and kinds["along_longitude"] is nn.Conv2d
    assert kinds["pointwise_stride2"] is DomainParallelConv2d  # odd first rows would pick other rows
    assert kinds["up_k2s2"] is nn.ConvTranspose2d
    assert kinds["up_k4s2"] is DomainParallelConvTranspose2d and kinds["up_k1s2"] is DomainParallelConvTranspose2d
    assert kinds["norm"] is DomainParallelGroupNorm and kinds["layer_norm"] is nn.LayerNorm
    assert kinds["upsample"] is DomainParallelInterpolate
    assert type(converted["block"][0]) is DomainParallelConv2d and type(converted["block"][1]) is nn.ReLU
    pad, conv = converted["cross_embed"]
    assert pad.padding == (1, 2, 0, 0) and conv.padding_override == (1, 2)
    assert converted["custom"] is marker
    again = convert_to_domain_parallel(converted)  # converting twice changes nothing
    assert type(again["conv3x3"].conv) is nn.Conv2d


def test_mistakes():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got list"):
        convert_to_domain_parallel([])
    with pytest.raises(ValueError, match="shard_dim must be a negative int"):
        convert_to_domain_parallel(nn.Conv2d(1, 1, 3), shard_dim=2)
    with pytest.raises(TypeError, match="DomainParallelConv2d wraps a torch.nn.Conv2d, got Linear"):
        DomainParallelConv2d(nn.Linear(2, 2))


class ChannelLayerNorm(nn.Module):
    """LayerNorm over the channels only: local, so conversion leaves it alone."""

    def __init__(self, channels):
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x):
        return self.norm(x.movedim(1, -1)).movedim(-1, 1)


def small_cnn():
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        ChannelLayerNorm(4),
        nn.SiLU(),
        nn.Conv2d(4, 8, 4, stride=2, padding=1),
        nn.GroupNorm(1, 8),
        nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1),
        nn.Conv2d(4, 4, 1),
        nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.Conv2d(4, 2, 3, stride=2, padding=1, padding_mode="circular"),
    ).double()


def test_state_dict_keys_survive_and_load_both_ways():
    single = small_cnn()
    converted = convert_to_domain_parallel(copy.deepcopy(single))
    assert list(converted.state_dict()) == list(single.state_dict())
    for p in single.parameters():
        p.data.add_(1.0)
    converted.load_state_dict(single.state_dict())
    back = small_cnn()
    back.load_state_dict(converted.state_dict())
    for key, value in single.state_dict().items():
        assert torch.equal(converted.state_dict()[key], value) and torch.equal(back.state_dict()[key], value)


def test_whole_model(manager):
    single = small_cnn()
    parallel = convert_to_domain_parallel(copy.deepcopy(single), manager=manager)
    assert type(parallel[2].norm) is nn.LayerNorm
    problems = []
    for uneven in (False, True):
        shape = (2, 2, 8 * manager.domain_parallel_size + 4 * uneven, 12)
        problems += compare(manager, single, parallel, shape, counts_for(shape[-2], manager.domain_parallel_size))
        single.zero_grad()
        parallel.zero_grad()
    assert not problems, "\n".join(problems)


def test_hooks_and_parametrizations(manager):
    torch.manual_seed(5)
    single = nn.Sequential(
        torch.nn.utils.spectral_norm(nn.Conv2d(2, 3, 3, padding=1)),
        torch.nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 2, 3, padding=1)),
    ).double()
    parallel = convert_to_domain_parallel(copy.deepcopy(single), manager=manager)
    assert list(parallel.state_dict()) == list(single.state_dict())
    shape = (1, 2, 8 * manager.domain_parallel_size, 6)
    problems = compare(manager, single, parallel, shape, counts_for(shape[-2], manager.domain_parallel_size))
    assert not problems, "\n".join(problems)


def test_layouts_a_layer_cannot_run_raise_on_every_rank(manager, world):
    if world.size == 1:
        pytest.skip("one rank holds the whole field")
    layer = DomainParallelConv2d(nn.Conv2d(1, 1, 7, padding=3), manager=manager)
    x = torch.zeros(1, 1, 2, 4)  # 2 rows per rank, the kernel needs 3 of each neighbour
    with pytest.raises(ValueError, match=r"DomainParallelConv2d\(kernel=7, stride=1, dilation=1, padding=\(3, 3\) "
                                         r"along dim 2\): halo_width=3 exceeds the extent along dim on some ranks "
                                         r"\(rank 0: 2, rank 1: 2.*use a smaller halo_width or fewer domain ranks"):
        layer(x)
    strided = DomainParallelConv2d(nn.Conv2d(1, 1, 7, stride=2, padding=3), manager=manager)
    with pytest.raises(ValueError, match=r"DomainParallelConv2d\(kernel=7, stride=2, dilation=1, padding=\(3, 3\) "
                                         r"along dim 2\) cannot run on shards of \[2, 2.*it needs 3 rows of each "
                                         r"neighbour, more than the smallest shard holds; use fewer domain ranks"):
        strided(x)
    valid = DomainParallelConv2d(nn.Conv2d(1, 1, 5), manager=manager)
    with pytest.raises(ValueError, match=r"the last domain rank holds 2 rows, too few for one output row"):
        valid(torch.zeros(1, 1, 2, 8))
