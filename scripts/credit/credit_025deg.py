"""CREDIT's 0.25-degree example model at its real geometry, domain-parallel: exactness, rows and memory per rank.

Run with every rank in one domain group::

    mpiexec -n 1 python scripts/credit/credit_025deg.py
    mpiexec -n 2 python scripts/credit/credit_025deg.py
    mpiexec -n 4 python scripts/credit/credit_025deg.py            # D = 4, then 2 x 2 tiles
    mpiexec -n 8 python scripts/credit/credit_025deg.py

The model block of CREDIT's ``config/gen_2/examples/wxformer_era5_025deg_6hr.yml`` (type ``crossformer``,
721 x 1440, earth padding 40/80, CrossEmbed kernels [[4, 8, 16, 32], [2, 4], [2, 4], [2, 4]], strides 2,
global windows [10, 5, 2, 1], local window 10, depth [2, 2, 8, 2], spectral norm, ``interp: True``) with
narrow widths (``--dim``, default 8 16 32 64; 2 input and output channels), built by CREDIT's own class.
One forward and backward (loss: the whole field's mean square) of the converted model at D = the number of
ranks (and 2 x 2 tiles at 4) against the unconverted model on rank 0, in float64 (``--dtype float32``: the
two then differ by float32's reduction order over 1.3 million points, ~1e-5 of the largest gradient even at
D = 1). Printed: the largest
difference of the output and of the parameter gradients (summed over the domain group), relative to the
largest value; the latitude rows each rank holds at every stage; the bytes of activations each rank keeps
for backward (``SavedActivations``) against one process's, and what ``estimate_memory`` (``credit train
--estimate``) predicts for them; the seconds of the step against one process's.
"""

import argparse
import os
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mpidomain import DomainParallelManager, gather_tensor, shard_tensor  # noqa: E402
from mpidomain.models import credit_crossformer_module  # noqa: E402
from mpidomain.nn import SavedActivations, allreduce_gradients, convert_to_domain_parallel, estimate_memory  # noqa: E402

WORLD = MPI.COMM_WORLD


def build(dim, depth):
    """The 0.25-degree example's model, widths ``dim``, on the seed every rank shares."""
    import importlib

    credit_crossformer_module()  # CREDIT's postblock import needs torchvision; a stand-in where it is absent
    crossformer = importlib.import_module("credit.models.crossformer")
    torch.manual_seed(0)
    return crossformer.CrossFormer(
        image_height=721, image_width=1440, frames=1, channels=1, levels=1, surface_channels=1,
        input_only_channels=0, output_only_channels=0, dim=tuple(dim), depth=tuple(depth), dim_head=4,
        global_window_size=(10, 5, 2, 1), local_window_size=10,
        cross_embed_kernel_sizes=((4, 8, 16, 32), (2, 4), (2, 4), (2, 4)), cross_embed_strides=(2, 2, 2, 2),
        attn_dropout=0.0, ff_dropout=0.0, use_spectral_norm=True, interp=True,
        padding_conf=dict(activate=True, mode="earth", pad_lat=[40, 40], pad_lon=[80, 80]))


def step(model, x, comm=None):
    """Forward and backward of the whole field's mean square; (output, gradients, saved bytes, seconds)."""
    model.zero_grad()
    began = time.perf_counter()
    with SavedActivations(exclude=model.parameters()) as saved:
        y = model(x)
    count = y.numel() if comm is None else comm.allreduce(y.numel())
    (y.square().sum() / count).backward()
    seconds = time.perf_counter() - began
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    return y.detach(), grads, saved.nbytes, seconds


def stage_rows(model):
    """Forward hooks that record the latitude rows of each encoder stage's output (and the padded input)."""
    seen = {}
    for k, (_, transformer) in enumerate(model.layers):
        transformer.register_forward_hook(lambda m, i, out, k=k: seen.__setitem__(f"stage {k + 1}", out.shape[-2]))
    return seen


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, nargs=4, default=(8, 16, 32, 64), help="the stages' widths")
    parser.add_argument("--depth", type=int, nargs=4, default=(2, 2, 8, 2), help="the stages' depths")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    args = parser.parse_args()
    torch.set_default_dtype(getattr(torch, args.dtype))
    rank = WORLD.rank
    x = torch.randn(1, 2, 1, 721, 1440, generator=torch.Generator().manual_seed(1))
    reference = None
    if rank == 0:
        model = build(args.dim, args.depth)
        rows = stage_rows(model)
        out, grads, saved, seconds = step(model, x)
        reference = (out, grads, saved, seconds, dict(rows))
        del model
        print(f"one process: output {tuple(out.shape)}, activations kept for backward {saved / 2**20:.1f} MiB, "
              f"{seconds:.1f} s; stage rows {rows}", flush=True)
    waiting = WORLD.Ibarrier()  # the other ranks sleep while rank 0 runs the one process (no busy polling)
    while not waiting.Test():
        time.sleep(0.05)
    layouts = [WORLD.size] + ([(2, 2)] if WORLD.size == 4 else [])
    for shape in layouts:
        tiles = isinstance(shape, tuple)
        with DomainParallelManager(WORLD.size, shape, shard_dim=(-2, -1) if tiles else -2) as manager:
            model = convert_to_domain_parallel(build(args.dim, args.depth), manager=manager)
            rows = stage_rows(model)
            shard = shard_tensor(x, manager=manager, allow_uneven=True)
            out, _, saved, seconds = step(model, shard, manager.domain_comm)
            allreduce_gradients(model, group="domain", op="sum", manager=manager)
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
            whole = gather_tensor(out, manager=manager)
            every = WORLD.gather((shard.shape[-2], dict(rows), saved, seconds), root=0)
            label = "x".join(map(str, shape)) if tiles else str(shape)
            if rank == 0:
                estimate = estimate_memory(build(args.dim, args.depth), tuple(x.shape), shape)
                print(f"D={label}: --estimate's activations per rank {estimate.ratio:.3f} of one process "
                      f"({estimate.ratio * WORLD.size:.2f} / D)", flush=True)
                want, want_grads, one_saved, one_seconds, _ = reference
                d_out = float((whole - want).abs().max() / want.abs().max())
                scale = max(float(g.abs().max()) for g in want_grads)
                d_grad = max(float((a - b).abs().max()) for a, b in zip(grads, want_grads)) / scale
                largest = max(s for _, _, s, _ in every)
                print(f"D={label}: output {d_out:.1e}, gradients {d_grad:.1e} (relative, {args.dtype}); activations "
                      f"per rank {largest / 2**20:.1f} MiB at most = {largest / one_saved:.3f} of one process "
                      f"({largest / one_saved * WORLD.size:.2f} / D); step {max(t for *_, t in every):.1f} s "
                      f"({max(t for *_, t in every) / one_seconds:.2f} of one process)", flush=True)
                for r, (input_rows, stages, nbytes, _) in enumerate(every):
                    print(f"  rank {r}: input rows {input_rows}, {stages}, {nbytes / 2**20:.1f} MiB", flush=True)
            del model


if __name__ == "__main__":
    main()
