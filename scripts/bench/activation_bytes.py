"""Bytes of activations each rank keeps for backward: converted layers against the one-process model.

Run with every rank in one domain group::

    python scripts/bench/activation_bytes.py
    mpiexec -n 2 python scripts/bench/activation_bytes.py
    mpiexec -n 4 python scripts/bench/activation_bytes.py

Issue 19's CNN (Conv-GroupNorm-SiLU-Conv(stride 2)-ConvTranspose-Conv, 8 channels) and a GroupNorm
alone, on (1, 8, 180, 360), float32 and float64; the input requires grad. Counted with
``mpidomain.nn.SavedActivations`` (each storage once, whole; parameters left out). Prints per rank
the bytes and their ratio to the one-process model's, with the goal (1/D plus 10 %).
"""

import os
import sys

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mpidomain  # noqa: E402
from mpidomain.nn import SavedActivations, convert_to_domain_parallel  # noqa: E402

WORLD = MPI.COMM_WORLD
nn = torch.nn


def models(dtype):
    """name -> a builder of the model in ``dtype`` (seeded)."""
    def cnn():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(),
                             nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ConvTranspose2d(8, 8, 2, stride=2),
                             nn.Conv2d(8, 8, 3, padding=1)).to(dtype)

    return {"CNN": cnn, "GroupNorm": lambda: nn.GroupNorm(2, 8).to(dtype)}


def saved(model, x):
    with SavedActivations(exclude=list(model.parameters())) as counter:
        model(x)
    return counter.nbytes


def main():
    size = WORLD.Get_size()
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(1, 8, 180, 360, dtype=dtype, requires_grad=True)
        for name, build in models(dtype).items():
            whole = saved(build(), x)
            with mpidomain.DomainParallelManager(size, size) as manager:
                model = convert_to_domain_parallel(build(), manager=manager)
                mine = saved(model, mpidomain.shard_tensor(x.detach(), manager=manager).requires_grad_())
            rows = WORLD.gather(mine, root=0)
            if WORLD.Get_rank() == 0:
                for rank, count in enumerate(rows):
                    ratio = count / whole
                    print(f"{name:9s} {str(dtype)[6:]:7s} D={size} rank {rank}: {count / 2**20:6.2f} MiB saved for "
                          f"backward, {ratio:.3f} of one process's {whole / 2**20:.2f} MiB (goal <= "
                          f"{1.1 / size:.3f}) {'ok' if ratio <= 1.1 / size else 'OVER'}")


if __name__ == "__main__":
    main()
