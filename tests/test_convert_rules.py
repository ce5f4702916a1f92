"""convert_to_domain_parallel's rules: the report, refusals on every rank, allow_local, and converted models
with pools, a pooled head, PixelShuffle, BatchNorm and CREDIT's attention blocks equal to one process."""

import copy

import pytest

torch = pytest.importorskip("torch")

from mpidomain import DomainParallelManager  # noqa: E402
from mpidomain.nn import (ConversionReport, DomainParallelAdaptiveAvgPool2d, DomainParallelBatchNorm,  # noqa: E402
                          DomainParallelConv2d, DomainParallelCoordinateAttention, DomainParallelMaxPool2d,
                          allreduce_gradients, convert_to_domain_parallel)
from mpitest import divisors, import_credit  # noqa: E402
from test_layers import compare, counts_for  # noqa: E402
from test_tiles_nn import compare as compare_tiles  # noqa: E402
from test_tiles_nn import layouts  # noqa: E402

nn = torch.nn


class ChannelNorm(nn.Module):
    """LayerNorm over channels, applied channels-last."""

    def __init__(self, channels):
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x):
        return self.norm(x.movedim(1, -1)).movedim(-1, 1)


class MyConv(nn.Conv2d):
    """A Conv2d subclass with its own forward: the Conv2d rule does not apply to it."""

    def forward(self, x):
        return super().forward(x.flip(-2))


class Shift(nn.Module):
    """A user layer with no children whose forward mixes rows: the converter cannot see it."""

    def forward(self, x):
        return x.roll(1, -2)


def test_report_lists_what_was_converted_and_what_stayed_local_and_why():
    model = nn.Sequential(
        nn.Conv2d(2, 8, 3, padding=1), ChannelNorm(8), nn.SiLU(), nn.Dropout(0.1),
        nn.Conv2d(8, 8, 1), nn.MaxPool2d(3, stride=2, padding=1), nn.GroupNorm(2, 8),
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.PixelShuffle(2)), nn.AdaptiveAvgPool2d(1),
    )
    converted, report = convert_to_domain_parallel(model, report=True)
    assert converted is model and isinstance(report, ConversionReport)
    done = dict(report.converted)
    assert done == {"0": "Conv2d -> DomainParallelConv2d", "3": "Dropout -> DomainParallelDropout (rng='tile')",
                    "5": "MaxPool2d -> DomainParallelMaxPool2d", "6": "GroupNorm -> DomainParallelGroupNorm",
                    "7.0": "Conv2d -> DomainParallelConv2d",
                    "8": "AdaptiveAvgPool2d -> DomainParallelAdaptiveAvgPool2d"}
    local = dict(report.local)
    assert local["1"].startswith("ChannelNorm: its children are decided; its own forward is not seen")
    assert local["1.norm"].startswith("LayerNorm: acts on the last dim only")
    assert local["2"] == "SiLU: pointwise activation"
    assert local["4"].startswith("Conv2d: pointwise along the sharded dims")
    assert local["7.1"].startswith("PixelShuffle: each input row makes r output rows")
    assert "7.1: PixelShuffle" in str(report) and "converted (6):" in str(report)
    assert type(model[5]) is DomainParallelMaxPool2d and type(model[8]) is DomainParallelAdaptiveAvgPool2d


def refused_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.Sequential(nn.SiLU(), nn.Dropout2d(0.2)),
        Shift(),
        nn.LayerNorm((6, 6)),
        nn.Softmax(dim=-2),
        nn.MaxPool3d(2),
        nn.ReflectionPad2d(1),
        MyConv(4, 4, 3),
    )


def test_refusal_names_every_path_and_is_the_same_on_every_rank(world):
    model = refused_model()
    with pytest.raises(ValueError) as caught:
        convert_to_domain_parallel(model)
    message = str(caught.value)
    for expected in ("1.1 (Dropout2d: drops whole channels", "2 (Shift: not known to be local",
                     "3 (LayerNorm: normalises over its last 2 dims", "4 (Softmax: works along dim=-2",
                     "5 (MaxPool3d: not known to be local", "6 (ReflectionPad2d: pads a sharded dim",
                     "7 (MyConv: a subclass of torch.nn.Conv2d with its own forward",
                     "cannot make 7 module(s) exact", "allow_local=(...)"):
        assert expected in message, message
    assert type(model[0]) is nn.Conv2d  # refused before anything changed
    messages = world.allgather(message)
    assert len(set(messages)) == 1


def test_allow_local_by_path_and_type_and_typos():
    allowed = ("1.1", Shift, "3", "4", nn.MaxPool3d, "6", MyConv)
    model, report = convert_to_domain_parallel(refused_model(), allow_local=allowed, report=True)
    assert type(model[0]) is DomainParallelConv2d and type(model[2]) is Shift
    assert dict(report.local)["1.1"] == "allow_local" and dict(report.local)["2"] == "allow_local"
    with pytest.raises(ValueError, match=r"allow_local names \['1.7'\], which are not module paths of the model"):
        convert_to_domain_parallel(refused_model(), allow_local=allowed + ("1.7",))
    with pytest.raises(TypeError, match="allow_local entries must be module paths"):
        convert_to_domain_parallel(refused_model(), allow_local=(3,))
    # the slab rule: a longitude-only pad is local on latitude slabs, refused on tiles
    pad = nn.Sequential(nn.ZeroPad2d((1, 1, 0, 0)))
    assert convert_to_domain_parallel(copy.deepcopy(pad), shard_dim=-2)[0].padding == (1, 1, 0, 0)
    with pytest.raises(ValueError, match=r"0 \(ZeroPad2d: pads a sharded dim"):
        convert_to_domain_parallel(pad, shard_dim=(-2, -1))


class PooledHead(nn.Module):
    """Issue 19's model: a convolution, a global mean (module form), a Linear on the pooled vector."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.flatten(self.pool(torch.tanh(self.conv(x)))))


def test_pooled_head_is_the_same_on_every_rank_and_equals_one_process(world):
    """The global mean is replicated: every rank's output is the whole output; loss counted once."""
    problems = []
    for D in divisors(world.size):
        with DomainParallelManager(world.size, D) as manager:
            torch.manual_seed(2)
            single = PooledHead().double()
            parallel = convert_to_domain_parallel(copy.deepcopy(single), manager)
            full = torch.randn(2, 3, 7 * D + 3, 10, dtype=torch.float64)
            counts = counts_for(full.shape[-2], D)
            start = sum(counts[:manager.domain_rank])
            reference = single(full)
            reference.pow(2).sum().backward()
            out = parallel(full[..., start:start + counts[manager.domain_rank], :])
            if float((out - reference).detach().abs().max()) > 1e-12 * float(reference.detach().abs().max()):
                problems.append(f"D={D}: output differs")
            (out.pow(2).sum() * (1.0 if manager.domain_rank == 0 else 0.0)).backward()
            allreduce_gradients(parallel, group="domain", op="sum", manager=manager)
            for (name, p), q in zip(parallel.named_parameters(), single.parameters()):
                if float((p.grad - q.grad).abs().max()) > 1e-10 * float(q.grad.abs().max()):
                    problems.append(f"D={D}: gradient of {name} differs")
    assert not problems, problems


def pools_and_shuffle():
    """Issue 22's pools and a PixelShuffle between converted convolutions."""
    torch.manual_seed(4)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.MaxPool2d(3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(4, 8, 3, padding=1), nn.PixelShuffle(2), nn.Conv2d(2, 4, 3, padding=1),
        nn.AvgPool2d(2), nn.Conv2d(4, 2, 3, padding=1),
    ).double()


def test_pools_and_pixel_shuffle_in_a_converted_model_equal_one_process(world):
    """Slabs of every D (shards of odd rows, odd starts) and every tiling: output, input and weight gradients."""
    problems = []
    for D in divisors(world.size):
        with DomainParallelManager(world.size, D) as manager:
            single = pools_and_shuffle()
            parallel = convert_to_domain_parallel(copy.deepcopy(single), manager)
            for rows in (8 * D, 8 * D + 4, 10 * D + 2):  # shards of 10/11/... rows: odd starts
                shape = (2, 2, rows, 12)
                problems += [f"D={D} rows={rows}: {p}" for p in
                             compare(manager, single, parallel, shape, counts_for(rows, D))]
                single.zero_grad()
                parallel.zero_grad()
    for tiling in layouts(world.size):
        with DomainParallelManager(world.size, tiling, (-2, -1)) as manager:
            single = pools_and_shuffle()
            parallel = convert_to_domain_parallel(copy.deepcopy(single), manager)
            problems += [f"{tiling}: {p}" for p in compare_tiles(manager, single, parallel, (2, 2, 18, 22))]
    assert not problems, "\n".join(problems)


def test_batch_norm_trains_on_the_whole_field(world):
    """BatchNorm2d in training: output, gradients and running statistics equal one process; eval is local."""
    problems = []
    for D in divisors(world.size):
        with DomainParallelManager(world.size, D) as manager:
            torch.manual_seed(6)
            single = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)).double()
            parallel = convert_to_domain_parallel(copy.deepcopy(single), manager)
            assert type(parallel[1]) is DomainParallelBatchNorm
            shape = (3, 2, 6 * D + 1, 8)
            problems += compare(manager, single, parallel, shape, counts_for(shape[-2], D))
            for key in ("running_mean", "running_var", "num_batches_tracked"):
                a, b = single[1].state_dict()[key], parallel[1].state_dict()[key]
                if float((a.double() - b.double()).abs().max()) > 1e-12:
                    problems.append(f"D={D}: {key} differs")
            single.eval()
            parallel.eval()
            single.zero_grad()
            parallel.zero_grad()
            problems += [f"eval: {p}" for p in compare(manager, single, parallel, shape, counts_for(shape[-2], D))]
    for tiling in layouts(world.size):
        with DomainParallelManager(world.size, tiling, (-2, -1)) as manager:
            torch.manual_seed(6)
            single = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4, momentum=None))
            single = single.double()
            parallel = convert_to_domain_parallel(copy.deepcopy(single), manager)
            problems += [f"{tiling}: {p}" for p in compare_tiles(manager, single, parallel, (2, 2, 11, 14))]
            if float((single[1].running_var - parallel[1].norm.running_var).abs().max()) > 1e-12:
                problems.append(f"{tiling}: running_var differs")
    assert not problems, problems


BLOCKS = {  # CREDIT's credit/models/unet_attention_modules.py (it imports torch only)
    "scse_optimized": lambda a: a.SCSEAttention(16, 4, use_depthwise=True),
    "scse_standard": lambda a: a.SCSEAttention(16, 4, use_depthwise=False),
    "eca": lambda a: a.ECABlock(16),
    "coordinate": lambda a: a.CoordinateAttention(16, 4),
    "spatial": lambda a: a.LightSpatialAttention(5),
    "mixed": lambda a: a.EfficientMixedAttention(16, 4, 5),
}
# What the report must say about each block (at path "1" in the test model).
EXPECTED = {
    "scse_optimized": ("1.cse.0", "AdaptiveAvgPool2d -> DomainParallelAdaptiveAvgPool2d"),
    "scse_standard": ("1.cse.0", "AdaptiveAvgPool2d -> DomainParallelAdaptiveAvgPool2d"),
    "eca": ("1.avg_pool", "AdaptiveAvgPool2d -> DomainParallelAdaptiveAvgPool2d"),
    "coordinate": ("1", "CoordinateAttention -> DomainParallelCoordinateAttention (matched by "
                        "coordinate_attention_like)"),
    "spatial": ("1.conv", "Conv2d -> DomainParallelConv2d"),
    "mixed": ("1.channel_attention.avg_pool", "AdaptiveAvgPool2d -> DomainParallelAdaptiveAvgPool2d"),
}


def credit_block(name):
    attention = import_credit("credit.models.unet_attention_modules")
    torch.manual_seed(8)
    block = BLOCKS[name](attention)
    if name == "coordinate":  # conv1's bias goes into a BatchNorm: its gradient is round-off, left out
        block.conv1.bias.requires_grad_(False)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), block, nn.Conv2d(16, 2, 3, padding=1)).double()


@pytest.mark.credit
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_credit_attention_blocks_equal_one_process(world, name):
    """CREDIT's UNet attention blocks (global means inside) on slabs of every D and on every tiling."""
    problems = []
    for D in divisors(world.size):
        with DomainParallelManager(world.size, D) as manager:
            single = credit_block(name)
            parallel, report = convert_to_domain_parallel(copy.deepcopy(single), manager, report=True)
            path, what = EXPECTED[name]
            assert dict(report.converted)[path] == what, report
            if name in ("eca", "mixed"):
                assert "an ECA block's Conv1d" in dict(report.local)[path.replace("avg_pool", "conv")]
            if name == "coordinate":
                assert type(parallel[1]) is DomainParallelCoordinateAttention
            shape = (2, 3, 7 * D + 3, 12)
            problems += [f"D={D}: {p}" for p in compare(manager, single, parallel, shape, counts_for(shape[-2], D))]
            if name == "coordinate":
                for key in ("running_mean", "running_var"):
                    a, b = single[1].bn1.state_dict()[key], parallel[1].block.bn1.state_dict()[key]
                    if float((a - b).abs().max()) > 1e-12:
                        problems.append(f"D={D}: bn1.{key} differs")
    for tiling in layouts(world.size):
        with DomainParallelManager(world.size, tiling, (-2, -1)) as manager:
            single = credit_block(name)
            parallel = convert_to_domain_parallel(copy.deepcopy(single), manager)
            problems += [f"{tiling}: {p}" for p in compare_tiles(manager, single, parallel, (2, 3, 13, 18))]
    assert not problems, "\n".join(problems)


def test_pixel_unshuffle_needs_whole_blocks_on_every_rank(world):
    """PixelUnshuffle(2) is exact on shards of even rows; an odd shard raises the same error on every rank."""
    problems, messages = [], []
    for D in divisors(world.size):
        with DomainParallelManager(world.size, D) as manager:
            torch.manual_seed(9)
            single = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.PixelUnshuffle(2),
                                   nn.Conv2d(8, 2, 3, padding=1)).double()
            parallel = convert_to_domain_parallel(copy.deepcopy(single), manager)
            shape = (1, 2, 6 * D, 8)
            problems += [f"D={D}: {p}" for p in compare(manager, single, parallel, shape, counts_for(6 * D, D))]
            if D > 1:
                try:
                    parallel(torch.zeros(1, 2, 7 if manager.domain_rank == 0 else 6, 8, dtype=torch.float64))
                    messages.append(None)
                except ValueError as error:
                    messages.append(str(error))
    assert not problems, problems
    assert all(m is not None and "a shard holds 7 rows along dim 2, not a multiple of 2" in m for m in messages)
    assert len({tuple(m) for m in world.allgather(messages)}) == 1
