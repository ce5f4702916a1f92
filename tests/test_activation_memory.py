"""Bytes saved for backward per rank: each converted layer keeps its shard's share (issue 19, part 3)."""

import pytest

torch = pytest.importorskip("torch")

from mpidomain import DomainParallelManager, shard_tensor  # noqa: E402
from mpidomain.nn import SavedActivations, convert_to_domain_parallel  # noqa: E402

nn = torch.nn


def saved_bytes(model, x):
    with SavedActivations(exclude=list(model.parameters())) as saved:
        model(x)
    return saved.nbytes


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ConvTranspose2d(8, 8, 2, stride=2),
                         nn.Conv2d(8, 8, 3, padding=1)).double()


@pytest.mark.parametrize("build", [cnn, lambda: nn.GroupNorm(2, 8).double()], ids=["cnn", "groupnorm"])
def test_saved_bytes_per_rank_are_the_shard_share(world, build):
    """(1, 8, 180, 360) float64: per rank at most 1/D of the one-process model's bytes plus 10 %."""
    x = torch.randn(1, 8, 180, 360, dtype=torch.float64, requires_grad=True)
    whole = saved_bytes(build(), x)  # every rank measures the unconverted model on the whole field
    with DomainParallelManager(world.size, world.size) as manager:
        model = convert_to_domain_parallel(build(), manager=manager)
        mine = saved_bytes(model, shard_tensor(x.detach(), manager=manager).requires_grad_())
    worst = max(world.allgather(mine))
    assert worst <= 1.1 * whole / world.size, (worst, whole, world.size)
