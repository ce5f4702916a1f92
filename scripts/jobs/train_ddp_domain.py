"""A minimal domain-parallel training loop: halo exchange over MPI, gradient sync with torch DDP.

    mpiexec -n 4 python scripts/jobs/train_ddp_domain.py [--domain-parallel-size 2] [--steps 5]

No torchrun: ``initialize_domain_parallel(..., torch_bridge=True)`` starts
torch.distributed from MPI. Each domain group holds one sample of a
(N, C, H, W) batch, split by latitude (H) across its D ranks. Before each
convolution the model pads its shard with its neighbours' rows through
``mpidomain.nn.HaloExchange`` (MPI, on ``manager.domain_comm``).
DistributedDataParallel averages gradients over ``manager.data_parallel_group``
(a torch group: the ranks holding the same latitude band of different
samples); a sum over ``manager.domain_group`` then adds the bands' parts of
each sample's gradient, so every rank takes the same step.

Rank 0 also trains the same model on the whole batch in one process and
prints both losses per step: they agree to rounding.
"""

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel

import mpidomain
from mpidomain.nn import HaloExchange


class ShardedConvNet(torch.nn.Module):
    """Two 3x3 convolutions; with ``halo`` the latitude padding comes from the neighbouring shards."""

    def __init__(self, channels, hidden, halo):
        super().__init__()
        self.halo = halo
        self.pad = HaloExchange(1, dim=-2) if halo else torch.nn.Identity()
        padding = (0, 1) if halo else 1
        self.first = torch.nn.Conv2d(channels, hidden, 3, padding=padding, dtype=torch.float64)
        self.second = torch.nn.Conv2d(hidden, channels, 3, padding=padding, dtype=torch.float64)

    def forward(self, x):
        return self.second(self.pad(torch.tanh(self.first(self.pad(x)))))


def batch(samples, channels, height, width):
    """Return the same (inputs, targets) on every rank."""
    inputs = torch.randn(samples, channels, height, width, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(0))
    return inputs, 0.5 * torch.roll(inputs, shifts=(1, 2), dims=(-2, -1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain-parallel-size", "-D", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows-per-rank", type=int, default=8)
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    manager = mpidomain.initialize_domain_parallel(world.size, args.domain_parallel_size, torch_bridge=True)
    d, samples = manager.domain_parallel_size, manager.data_parallel_size
    rows, channels, width = args.rows_per_rank, 2, 16
    inputs, targets = batch(samples, channels, rows * d, width)
    band = slice(manager.domain_rank * rows, (manager.domain_rank + 1) * rows)
    x = inputs[manager.dp_rank:manager.dp_rank + 1, :, band]
    y = targets[manager.dp_rank:manager.dp_rank + 1, :, band]

    torch.manual_seed(1)
    model = ShardedConvNet(channels, hidden=4, halo=True)
    reference = ShardedConvNet(channels, hidden=4, halo=False)
    reference.load_state_dict(copy.deepcopy(model.state_dict()))
    ddp = DistributedDataParallel(model, process_group=manager.data_parallel_group)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.2)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)

    for step in range(args.steps):
        optimizer.zero_grad()
        # This band's share of its sample's mean squared error. DDP averages the gradients
        # over the samples; the sum over the bands makes them the gradient of the batch's mean.
        local = ((ddp(x) - y) ** 2).sum() / (channels * rows * d * width)
        local.backward()
        for parameter in ddp.parameters():
            dist.all_reduce(parameter.grad, group=manager.domain_group)
        optimizer.step()
        loss = world.allreduce(local.item()) / samples
        if world.rank == 0:
            reference_optimizer.zero_grad()
            reference_loss = F.mse_loss(reference(inputs), targets)
            reference_loss.backward()
            reference_optimizer.step()
            print(f"step {step}: loss {loss:.12f} (single process {reference_loss.item():.12f})", flush=True)
    manager.close()


if __name__ == "__main__":
    main()
