"""Train with data x tensor x domain parallelism on one mesh, and check it against one process.

    mpiexec -n 8 python scripts/jobs/train_mesh.py -T 2 -D 2      # dp 2 x tp 2 x domain 2
    srun -n 8 --mpi=pmi2 python scripts/jobs/train_mesh.py -T 2 -D 2
    mpiexec -n 4 python scripts/jobs/train_mesh.py -T 1 -D 2      # FSDP2 over 2 replicas, no tensor parallelism

One MPI job, any launcher, no torchrun: ``initialize_domain_parallel(...,
tensor_parallel_size=T, torch_bridge=True)`` builds the (dp, tp, domain) mesh
over MPI and starts torch.distributed from it; ``manager.device_mesh`` is the
torch DeviceMesh of the same groups. The model is a convolution, a channel MLP
at every grid point (a transformer block's feed-forward half) and a second
convolution:

- the convolutions become domain-parallel (``convert_to_domain_parallel``:
  halo exchange through MPI along the latitude rows);
- the MLP is tensor-parallel on ``device_mesh["tp"]`` (``parallelize_module``,
  first layer column-wise, second row-wise);
- the whole model is sharded by FSDP2 on ``device_mesh["dp"]`` (``fully_shard``).

Each data-parallel replica reads its own batches (a DistributedSampler with
``manager.data_parallel_coords()``, so ranks differing only in tp or domain
read the same samples), and each domain rank its rows of them. After the
backward pass FSDP2 has averaged the gradient shards over ``dp``; one
``allreduce_gradients(..., group="domain", op="sum")`` adds the domain ranks'
parts. Every rank also trains the same model on one process (the whole batch,
unsharded) and the script compares the losses and, after the last step, every
parameter; it exits 0 when they agree to ``--tolerance`` (relative, float64).
"""

import argparse
import logging
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpidomain
from mpidomain.nn import allreduce_gradients, convert_to_domain_parallel


class PixelMLP(nn.Module):
    """A residual two-layer MLP over the channels at every grid point of (B, C, H, W)."""

    def __init__(self, channels, hidden):
        super().__init__()
        self.fc1 = nn.Linear(channels, hidden)
        self.fc2 = nn.Linear(hidden, channels)

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x.permute(0, 2, 3, 1))))
        return x + y.permute(0, 3, 1, 2)


def build_model(channels, width=8, hidden=32):
    """The same float64 model on every rank (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1),
        PixelMLP(width, hidden),
        nn.Conv2d(width, channels, 3, padding=1),
    ).double()


def synthetic_data(samples, channels, height, width):
    """Inputs and targets, the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, channels, height, width, dtype=torch.float64, generator=generator)
    return TensorDataset(x, torch.roll(x, 1, dims=-1).tanh())


def parallelize(model, manager):
    """Domain-parallel convolutions, a tensor-parallel MLP, FSDP2 over dp: in CREDIT's order."""
    mesh = manager.device_mesh
    model = convert_to_domain_parallel(model, manager)
    parallelize_module(model[1], mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def train(manager, steps=3, batch=4, channels=2, size=(16, 12), lr=0.05):
    """Train both ways; return (parallel losses, one-process losses, max relative parameter difference).

    Collective over the manager's ranks: call on all of them with the same arguments.
    """
    dp_rank, dp_size = manager.data_parallel_coords()
    if batch % dp_size:
        raise ValueError(f"--batch {batch} must be a multiple of the {dp_size} data-parallel replicas")
    data = synthetic_data(steps * batch, channels, *size)
    reference = build_model(channels)
    model = parallelize(build_model(channels), manager)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)

    sampler = DistributedSampler(data, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    replica_batches = DataLoader(data, batch_size=batch // dp_size, sampler=sampler)
    whole_batches = DataLoader(data, batch_size=batch)
    losses, reference_losses = [], []
    for (x, target), (x_all, target_all) in zip(replica_batches, whole_batches):
        # This rank's rows; the loss is its part of the replica's mean.
        rows = mpidomain.shard_tensor(x, manager=manager)
        error = model(rows) - mpidomain.shard_tensor(target, manager=manager)
        loss = error.square().sum() / target.numel()
        optimizer.zero_grad()
        loss.backward()                                   # FSDP2 averages over dp
        allreduce_gradients(model, group="domain", op="sum", manager=manager)
        optimizer.step()
        replica_loss = mpidomain.allreduce(loss.detach(), "sum", "domain", manager)
        losses.append(float(mpidomain.allreduce(replica_loss, "mean", "data_parallel", manager)))

        reference_loss = F.mse_loss(reference(x_all), target_all, reduction="mean")
        reference_optimizer.zero_grad()
        reference_loss.backward()
        reference_optimizer.step()
        reference_losses.append(float(reference_loss.detach()))

    expected = reference.state_dict()
    # full_tensor() of an FSDP2 x tensor-parallel parameter gathers twice; torch logs a warning saying so.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    worst = 0.0
    for name, value in model.state_dict().items():       # the same keys as the unconverted model's
        full = value.full_tensor() if hasattr(value, "full_tensor") else value   # collective
        worst = max(worst, float((full - expected[name]).abs().max() / expected[name].abs().max()))
    return losses, reference_losses, worst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-parallel-size", "-T", type=int, default=2)
    parser.add_argument("--domain-parallel-size", "-D", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="global batch: samples per step over all replicas")
    parser.add_argument("--tolerance", type=float, default=1e-10)
    args = parser.parse_args(argv)

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    manager = mpidomain.initialize_domain_parallel(
        world.size, args.domain_parallel_size, tensor_parallel_size=args.tensor_parallel_size, torch_bridge=True)
    dp, tp, domain = manager.mesh.shape
    losses, reference_losses, worst = train(manager, args.steps, args.batch)
    loss_gap = max(abs(a - b) / abs(b) for a, b in zip(losses, reference_losses))
    ok = world.allreduce(loss_gap <= args.tolerance and worst <= args.tolerance, op=MPI.LAND)
    print(f"rank {world.rank}: mesh (dp, tp, domain) = ({dp}, {tp}, {domain}) at {manager.mesh.coords}, "
          f"losses {' '.join(f'{v:.6f}' for v in losses)}, one process {' '.join(f'{v:.6f}' for v in reference_losses)}, "
          f"max relative loss gap {loss_gap:.1e}, parameter gap {worst:.1e}", flush=True)
    world.Barrier()
    if world.rank == 0:
        verdict = "equal to one process" if ok else f"DIFFERENT from one process (tolerance {args.tolerance:g})"
        print(f"train_mesh: dp {dp} x tp {tp} x domain {domain} on {world.size} ranks, {args.steps} steps: {verdict}",
              flush=True)
    manager.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
