"""``python -m mpidomain demo``: train a small U-Net domain-parallel, and the same steps on one process.

Under ``mpiexec -n 4`` (D=2: two data-parallel replicas of two latitude
shards each; ``-D 2x2``: one replica of 2 x 2 latitude x longitude tiles)
every rank trains the converted model on its shard of its replica's samples, while rank 0 also trains the unconverted model on the
whole batch. Both start from the same weights and see the same data; the
demo prints both losses per step and, at the end, the largest difference
between the two models' parameters, and exits 0 if it is within float32
round-off (1e-5).
"""

import copy
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from .._mpi import mpi
from ..manager import initialize_domain_parallel, library_comm
from ..command import UsageError
from ..models import UNet, convert_model, unet_grid_problem
from ..nn import allreduce_gradients
from ..reduce import allreduce
from ..sharding import shard_tensor

__all__ = ["synthetic_batch", "run_demo"]

TOLERANCE = 1e-5
SAMPLES_PER_REPLICA = 2


def synthetic_batch(step, samples, channels, height, width):
    """Return (inputs, targets) of ``samples`` smooth random latitude-longitude fields for ``step``.

    Inputs are sums of a few low zonal and meridional waves (fixed seeds);
    targets are the inputs carried eastward by a latitude-dependent wind.
    """
    rng = np.random.default_rng(1000 + step)
    lat = np.linspace(-math.pi / 2, math.pi / 2, height)[:, None]
    lon = np.linspace(0, 2 * math.pi, width, endpoint=False)[None, :]
    fields = np.zeros((samples, channels, height, width))
    for s in range(samples):
        for c in range(channels):
            for _ in range(4):
                m, n = rng.integers(1, 5), rng.integers(1, 4)
                amplitude, phase = rng.normal(), rng.uniform(0, 2 * math.pi)
                fields[s, c] += amplitude * np.cos(m * lon + phase) * np.cos(n * lat) ** 2
    targets = np.empty_like(fields)
    for row in range(height):
        shift = int(round(3 * math.cos(float(lat[row, 0]))))
        targets[..., row, :] = np.roll(fields[..., row, :], shift, axis=-1)
    return torch.from_numpy(fields).float(), torch.from_numpy(targets).float()


def _parameters_difference(a, b):
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def run_demo(steps=5, domain_parallel_size=2, size=(128, 256), channels=2, out=print):
    """Train both ways for ``steps`` steps; print one line per step; return the exit status (0: models agree).

    ``domain_parallel_size``: latitude slabs (an int) or ``(D_lat, D_lon)`` tiles.
    Collective over ``MPI.COMM_WORLD``: call on every rank with the same arguments.
    """
    world = mpi().COMM_WORLD
    height, width = size
    tiles = isinstance(domain_parallel_size, tuple)
    manager = initialize_domain_parallel(world.Get_size(), domain_parallel_size, (-2, -1) if tiles else -2)
    try:
        d = manager.domain_parallel_size
        d_lat, d_lon = manager.domain_shape if tiles else (d, 1)
        problem = unet_grid_problem(height, width, (d_lat, d_lon))
        if problem:
            layout = f"{d_lat} x {d_lon} tiles" if tiles else f"D={d}"
            raise UsageError(f"--size {height}x{width} with {layout}: {problem}")
        torch.manual_seed(0)
        single = UNet(channels)
        parallel = convert_model(copy.deepcopy(single), manager)
        optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (single, parallel)]
        replicas = manager.data_parallel_size
        batch = SAMPLES_PER_REPLICA * replicas
        elements = batch * channels * height * width
        if world.Get_rank() == 0:
            layout = f"{d_lat} x {d_lon} latitude x longitude tiles" if tiles else f"D={d} latitude shards"
            out(f"mpidomain demo: {world.Get_size()} ranks = {replicas} data-parallel replicas x {layout}; U-Net on {batch} fields of {channels}x{height}x{width} per step (float32), and the "
                "same steps on one process on rank 0")
        status = 0
        for step in range(1, steps + 1):
            inputs, targets = synthetic_batch(step, batch, channels, height, width)
            mine = slice(manager.dp_rank * SAMPLES_PER_REPLICA, (manager.dp_rank + 1) * SAMPLES_PER_REPLICA)
            x = shard_tensor(inputs[mine], dim=manager.shard_dim, manager=manager)
            y = shard_tensor(targets[mine], dim=manager.shard_dim, manager=manager)
            library_comm(manager, "world").Barrier()
            started = time.perf_counter()
            optimizers[1].zero_grad()
            loss = ((parallel(x) - y) ** 2).sum() / elements
            loss.backward()
            allreduce_gradients(parallel, group="domain", op="sum", manager=manager)
            allreduce_gradients(parallel, group="data_parallel", op="sum", manager=manager)
            optimizers[1].step()
            total = allreduce(allreduce(loss.detach(), "sum", "domain", manager), "sum", "data_parallel", manager)
            seconds = library_comm(manager, "world").allreduce(time.perf_counter() - started, op=mpi().MAX)
            if world.Get_rank() == 0:
                started = time.perf_counter()
                optimizers[0].zero_grad()
                reference = F.mse_loss(single(inputs), targets)
                reference.backward()
                reference = reference.detach()
                optimizers[0].step()
                alone = time.perf_counter() - started
                out(f"step {step}/{steps}: loss {float(total):.7f} domain-parallel, {float(reference):.7f} one "
                    f"process (difference {abs(float(total) - float(reference)):.1e}); {seconds * 1e3:.1f} ms vs "
                    f"{alone * 1e3:.1f} ms per step")
        checksums = library_comm(manager, "world").allgather(sum(float(p.detach().double().sum()) for p in parallel.parameters()))
        identical = len(set(checksums)) == 1
        if world.Get_rank() == 0:
            difference = _parameters_difference(single, parallel)
            status = 0 if difference <= TOLERANCE and identical else 1
            out(f"largest parameter difference after {steps} steps: {difference:.2e} (float32; "
                f"{'within' if difference <= TOLERANCE else 'OUTSIDE'} {TOLERANCE:g}); every rank's copy of the "
                f"domain-parallel model {'is identical' if identical else 'DIFFERS'}")
        return library_comm(manager, "world").bcast(status)
    finally:
        manager.close()
