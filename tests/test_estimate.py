"""estimate_memory: the activation bytes per rank predicted before launch against those measured at launch.

The prediction runs in one process on the meta device; the measurement converts the model and counts
``SavedActivations`` on every rank of this world's layouts (D = the world size in latitude slabs, and
2 x 2 tiles at 4). The promise is 10 %; every rank's prediction is held to 2 % of its measurement here (it
follows each converted layer's storages, halos included, so a layer it misreads shows). CrossFormer tests
skip alike on every rank where CREDIT cannot be imported.
"""

import pytest

torch = pytest.importorskip("torch")

from mpidomain import DomainParallelManager, shard_tensor  # noqa: E402
from mpidomain.models import (UNet, convert_model, credit_crossformer, credit_missing,  # noqa: E402
                              custom_converters)
from mpidomain.nn import MemoryEstimate, SavedActivations, estimate_memory  # noqa: E402

PROMISE = 0.10  # what estimate_memory promises
TOLERANCE = 0.02  # what it is held to here


def layouts(world):
    """(domain shape, shard_dim) this world runs: slabs of all its ranks, and 2 x 2 tiles at 4."""
    found = [(world.size, -2)]
    if world.size == 4:
        found.append(((2, 2), (-2, -1)))
    return found


def unet():
    torch.manual_seed(0)
    return UNet(channels=3, width=8)


def crossformer_unpadded():
    """CREDIT's CrossFormer, 128 x 64 without padding (its rows dealt out in aligned blocks of 32)."""
    torch.manual_seed(0)
    return credit_crossformer(2, 2, 2, 128, 64)


def crossformer_earth_padded():
    """155 x 56 with earth padding (2, 3) / (4, 4): 160 x 64 padded, dealt in 5 blocks of 32 rows (uneven: 3/2 at
    D = 2, 2/1/1/1 at D = 4), so the long windows (20 groups of 4 at the first stage) re-deal them evenly."""
    torch.manual_seed(0)
    return credit_crossformer(2, 2, 2, 155, 56, padding_conf=dict(activate=True, mode="earth", pad_lat=[2, 3],
                                                                  pad_lon=[4, 4]))


def measured(world, build, shape, domain, shard_dim):
    """Every domain rank's saved bytes of the converted model's forward, on this world's manager."""
    x = torch.randn(shape)
    with DomainParallelManager(world.size, domain, shard_dim=shard_dim) as manager:
        model = convert_model(build(), manager)
        with SavedActivations(exclude=list(model.parameters())) as saved:
            model(shard_tensor(x, manager=manager, allow_uneven=True))
        found = sorted(world.allgather((manager.domain_rank, saved.nbytes)))
    return [nbytes for _, nbytes in found]


def one_process(build, shape):
    model = build()
    with SavedActivations(exclude=list(model.parameters())) as saved:
        model(torch.randn(shape))
    return saved.nbytes


def check(world, build, shape):
    for domain, shard_dim in layouts(world):
        estimate = estimate_memory(build(), shape, domain, custom_converters=custom_converters)
        got = measured(world, build, shape, domain, shard_dim)
        errors = [predicted / actual - 1 for predicted, actual in zip(estimate.rank_bytes, got)]
        assert max(abs(e) for e in errors) <= TOLERANCE, (domain, estimate.rank_bytes, got)
        assert abs(estimate.bytes_per_rank / max(got) - 1) <= PROMISE, (domain, estimate, got)
        assert estimate.bytes_per_rank == max(estimate.rank_bytes) == estimate.rank_bytes[estimate.largest_rank]
    assert estimate.one_process_bytes == one_process(build, shape)  # the meta run counts what one process saves


@pytest.fixture
def credit(world):
    reasons = world.allgather(credit_missing())
    if any(reasons):
        pytest.skip(f"CREDIT not importable here: {next(r for r in reasons if r)}")


def test_unet(world):
    """The UNet on 32 x 64: periodic convolutions, GroupNorm, a stride-2 level down and a transposed one up."""
    check(world, unet, (1, 3, 32, 64))


def test_crossformer_unpadded(world, credit):
    check(world, crossformer_unpadded, (1, 6, 128, 64))


def test_crossformer_earth_padded(world, credit):
    """Earth padding re-deals the rows in aligned blocks; CrossEmbed's kernels up to 32 exchange wide halos."""
    check(world, crossformer_earth_padded, (1, 6, 155, 56))


def test_estimate_reads_like_a_result_and_leaves_the_model_alone():
    model = unet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    estimate = estimate_memory(model, (2, 3, 32, 64), (2, 2), custom_converters=custom_converters)
    assert isinstance(estimate, MemoryEstimate) and estimate.domain_shape == (2, 2)
    assert estimate.tile_shape == (2, 3, 16, 32) and estimate.input_shape == (2, 3, 32, 64)
    assert 0.25 < estimate.ratio < 0.3 and len(estimate.rank_bytes) == 4
    assert "D=2x2 (tiles)" in str(estimate) and "MiB" in str(estimate)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(AttributeError):
        estimate.bytes_per_rank = 0  # frozen


def test_batch_scales_the_fields_only():
    """Twice the batch: twice the field bytes; the estimate at B=2 is twice the one at B=1 (no weights saved)."""
    one = estimate_memory(unet(), (1, 3, 32, 64), 2, custom_converters=custom_converters)
    two = estimate_memory(unet(), (2, 3, 32, 64), 2, custom_converters=custom_converters)
    assert two.bytes_per_rank == 2 * one.bytes_per_rank


class ReadsValues(torch.nn.Module):
    """A forward that reads a value (the meta device has none)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return self.conv(x) * float(x.mean())


@pytest.mark.parametrize("model, shape, layout, error, words", [
    ("not a module", (1, 3, 32, 64), 2, TypeError, "model must be a torch.nn.Module"),
    (unet, [1, 3, 32.0, 64], 2, TypeError, "input_shape must be a tuple of ints"),
    (unet, (3, 32), 2, ValueError, "(B, C, ..., H, W)"),
    (unet, (1, 3, 32, 64), 0, ValueError, "manager_or_D must be >= 1"),
    (unet, (1, 3, 32, 64), "4", TypeError, "manager_or_D must be an int D"),
    (unet, (1, 3, 32, 64), (2, 2, 2), TypeError, "manager_or_D must be an int D"),
    (unet, (1, 3, 32, 64), 64, ValueError, "fewer than its 64 ranks"),
    (lambda: ReadsValues(), (1, 3, 32, 64), 2, RuntimeError, "meta"),
])
def test_bad_arguments_raise_clear_errors(model, shape, layout, error, words):
    with pytest.raises(error) as raised:
        estimate_memory(model() if callable(model) else model, shape, layout, custom_converters=custom_converters)
    assert words in str(raised.value)


def test_converters_built_for_other_dims_are_refused():
    """Converters made for slabs, used for a tile layout: the estimate would be of another model; it says so."""
    with pytest.raises(ValueError, match="custom_converters made"):
        estimate_memory(unet(), (1, 3, 32, 64), (2, 2), custom_converters=custom_converters(-2))


def test_padded_rows_that_cannot_be_dealt_raise(credit):
    """160 padded rows hold 10 groups of 16 (the product of the strides): 10 latitude ranks at most, as the
    converted model would say at 16."""
    with pytest.raises(ValueError, match="use at most 10 latitude ranks"):
        estimate_memory(crossformer_earth_padded(), (1, 6, 155, 56), 16)


def test_a_converted_model_is_refused():
    """Its forward would communicate; the estimate is of the model before conversion."""
    from mpidomain.nn import convert_to_domain_parallel

    converted = convert_to_domain_parallel(torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1)), shard_dim=-2)
    with pytest.raises(ValueError, match="takes the unconverted model"):
        estimate_memory(converted, (1, 3, 32, 64), 2)
