"""CREDIT's CrossFormer domain-parallel: CREDIT's own converter against mpidomain's, and the memory per rank.

Run with every rank in one domain group (D = the number of ranks)::

    mpiexec -n 1 python scripts/credit/credit_parity.py
    mpiexec -n 2 python scripts/credit/credit_parity.py
    mpiexec -n 4 python scripts/credit/credit_parity.py

Two CrossFormers in float64, CREDIT's test configuration (earth padding, CrossEmbed kernels
[[4, 8, 16, 32], [2, 4], [2, 4], [2, 4]] with stride 2, spectral norm, PixelShuffle decoder,
short and long windows) with the widths and depths shrunk to fit a laptop:

- ``small``: 124 x 56, pad_lat (2, 2), pad_lon (4, 4), local window 2, global windows (4, 2, 2, 1);
- ``nopad`` and ``nopad-g1``: 128 x 64 without padding, long windows (4, 2, 2, 1), or all 1 (the
  long-range attention is local too). (CREDIT's converter of miles-credit 2026.2.0 crashes on each of
  them, as with CrossEmbed kernels (2, 4) at every stage: its CrossEmbed branches come out of
  different heights; with kernel 2 alone it adds tensors of different heights.)
- ``1deg``: 181 x 360, pad_lat (37, 38), pad_lon (76, 76), local window 4, global windows (8, 4, 2, 1).

For each, one training step (forward, loss = mean square, backward) of

- CREDIT's ``credit.domain_parallel.convert_to_domain_parallel`` over mpidomain's
  torch.distributed bridge (its manager, even shards; its errors are printed);
- mpidomain's ``convert_to_domain_parallel`` (input cut by ``shard_tensor``, balanced, uneven allowed);

against the unconverted model on one process (every rank runs it on the whole field):
max |output difference| and max |parameter-gradient difference| (gradients summed over
the domain group), each also relative to the largest |value|. Then per rank for
mpidomain's step: bytes of activations saved for backward (``SavedActivations``), peak
RSS, and the step time as a ratio to the one-process step timed in the same run.

``--device cuda`` runs both on the GPU (``cuda:<rank % devices>``) and adds each rank's peak
CUDA memory of the step above what it held before (``torch.cuda.max_memory_allocated``), against
the one-process step's; ``scripts/ci/gpu_check.sh`` runs it so at 1, 2 and 4 ranks.
"""

import argparse
import copy
import os
import resource
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))

import credit_models  # noqa: E402
import mpidomain  # noqa: E402
from mpidomain.nn import SavedActivations, allreduce_gradients, convert_to_domain_parallel  # noqa: E402

WORLD = MPI.COMM_WORLD

CONFIGS = {
    "small": dict(image_height=124, image_width=56, pad_lat=(2, 2), pad_lon=(4, 4), dim=(4, 8, 16, 32),
                  dim_head=4, local_window_size=2, global_window_size=(4, 2, 2, 1),
                  cross_embed_kernel_sizes=((4, 8), (2, 4), (2, 4), (2, 4))),
    "nopad": dict(image_height=128, image_width=64, pad_lat=None, pad_lon=None, dim=(4, 8, 16, 32),
                  dim_head=4, local_window_size=2, global_window_size=(4, 2, 2, 1),
                  cross_embed_kernel_sizes=((4, 8), (2, 4), (2, 4), (2, 4))),
    "nopad-g1": dict(image_height=128, image_width=64, pad_lat=None, pad_lon=None, dim=(4, 8, 16, 32),
                     dim_head=4, local_window_size=2, global_window_size=(1, 1, 1, 1),
                     cross_embed_kernel_sizes=((4, 8), (2, 4), (2, 4), (2, 4))),
    "1deg": dict(image_height=181, image_width=360, pad_lat=(37, 38), pad_lon=(76, 76), dim=(8, 16, 32, 64),
                 dim_head=8, local_window_size=4, global_window_size=(8, 4, 2, 1),
                 cross_embed_kernel_sizes=((4, 8, 16, 32), (2, 4), (2, 4), (2, 4))),
}


def build(config, device="cpu"):
    """CREDIT's CrossFormer for ``config`` (float64, seeded) and an input (1, 7, 1, H, W), on ``device``."""
    module = credit_models.crossformer()
    torch.manual_seed(0)
    c = dict(config)
    pad_lat, pad_lon = c.pop("pad_lat"), c.pop("pad_lon")
    model = module.CrossFormer(frames=1, output_frames=1, channels=2, levels=2, surface_channels=2,
                               input_only_channels=1, depth=(1, 1, 1, 1), cross_embed_strides=(2, 2, 2, 2),
                               use_spectral_norm=True, upsample_with_ps=True, attention_type="scse",
                               padding_conf=dict(activate=pad_lat is not None, mode="earth",
                                                 pad_lat=list(pad_lat or ()), pad_lon=list(pad_lon or ())),
                               **c).double()
    x = torch.randn(1, 7, 1, c["image_height"], c["image_width"], dtype=torch.float64)
    return model.to(device), x.to(device)


def output_size(model, x):
    """Elements of the whole field's output: (B, output channels, H, W)."""
    return x.shape[0] * model.output_channels * x.shape[-2] * x.shape[-1]


def step(model, x, count):
    """Forward, loss = sum of squares / ``count`` (the whole field's mean square: this rank's share), backward.

    Return the output and, on a GPU, the step's peak CUDA bytes above what was allocated before it (else 0).
    """
    model.zero_grad(set_to_none=True)
    cuda = x.is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    y = model(x)
    (y.square().sum() / count).backward()
    peak = torch.cuda.max_memory_allocated() - before if cuda else 0
    return y.detach(), peak


def differences(y, want, model, reference):
    """(max |dy|, relative, max |dgrad|, relative) against the one-process model."""
    dy = (y - want).abs().max().item() if y.shape == want.shape else float("inf")
    dg, gmax = 0.0, 0.0  # relative to the model's largest |gradient| (some are zero up to round-off)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        if theirs.grad is not None:
            dg = max(dg, (mine.grad - theirs.grad).abs().max().item() if mine.grad is not None else float("inf"))
            gmax = max(gmax, theirs.grad.abs().max().item())
    return dy, dy / want.abs().max().item(), dg, dg / max(gmax, 1e-300)


def credit_converter(model, x, want, reference, size):
    """CREDIT's converter over the torch.distributed bridge: its differences, or its error."""
    import torch.distributed as dist
    from credit.domain_parallel import convert as credit_convert
    from credit.domain_parallel.manager import DomainParallelManager as CreditManager
    from credit.domain_parallel.sharding import gather_tensor as credit_gather
    from credit.domain_parallel.sharding import shard_tensor as credit_shard

    try:
        manager = CreditManager(size, size)
        model = credit_convert.convert_to_domain_parallel(model, manager)
        y = step(model, credit_shard(x, manager=manager), want.numel())[0]
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=manager.domain_group)
        y = credit_gather(y, manager=manager) if size > 1 else y
        return differences(y, want, model, reference), None
    except Exception as error:  # noqa: BLE001  (its failure is a result here)
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:150]}"


def ours(model, x, size):
    """mpidomain's converter: (gathered output, model, saved bytes, peak RSS MiB, step seconds, peak CUDA bytes)."""
    with mpidomain.DomainParallelManager(size, size) as manager:
        model = convert_to_domain_parallel(model, manager=manager)
        shard = mpidomain.shard_tensor(x, manager=manager, allow_uneven=True)
        with SavedActivations(exclude=list(model.parameters())) as saved:
            model(shard)
        WORLD.Barrier()
        start = time.perf_counter()
        y, device_peak = step(model, shard, output_size(model, x))
        seconds = time.perf_counter() - start
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        allreduce_gradients(model, manager=manager, group="domain", op="sum")
        return mpidomain.gather_tensor(y, manager=manager), model, saved.nbytes, rss, seconds, device_peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--skip-credit", action="store_true", help="leave CREDIT's converter out")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    device = "cpu"
    if args.device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    if not args.skip_credit:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        mpidomain.init_torch_distributed(backend="gloo")
    for name in args.configs:
        model, x = build(CONFIGS[name], device)
        reference = copy.deepcopy(model)
        y, converted, saved_bytes, rss, seconds, device_peak = ours(copy.deepcopy(model), x, size)  # first: peak RSS
        with SavedActivations(exclude=list(reference.parameters())) as saved:
            reference(x)
        whole_bytes = saved.nbytes
        WORLD.Barrier()
        start = time.perf_counter()
        want, whole_device_peak = step(reference, x, output_size(reference, x))
        whole_seconds = time.perf_counter() - start
        ours_result = differences(y, want, converted, reference)
        credit_result = (None, "skipped") if args.skip_credit else credit_converter(copy.deepcopy(model), x, want,
                                                                                     reference, size)
        rows = WORLD.gather(((saved_bytes, rss, seconds, device_peak), whole_bytes, whole_seconds, whole_device_peak),
                            root=0)
        if rank:
            continue
        print(f"== {name}: CrossFormer {CONFIGS[name]['image_height']} x {CONFIGS[name]['image_width']}, "
              f"D={size} on {args.device} (float64; differences against one process: absolute, relative to max |value|)")
        for label, (result, error) in (("CREDIT's converter", credit_result), ("mpidomain", (ours_result, None))):
            if error:
                print(f"  {label:20s} error: {error}")
            else:
                dy, ry, dg, rg = result
                print(f"  {label:20s} max |output diff| {dy:.3g} ({ry:.2g})   max |grad diff| {dg:.3g} ({rg:.2g})")
        for r, ((saved_bytes, rss, seconds, peak), whole, whole_s, whole_peak) in enumerate(rows):
            on_device = (f", peak CUDA memory of the step {peak / 2**20:.1f} MiB ({peak / whole_peak:.3f} of one "
                         f"process's {whole_peak / 2**20:.1f} MiB)" if whole_peak else "")
            print(f"  rank {r}: saved activations {saved_bytes / 2**20:8.2f} MiB "
                  f"({saved_bytes / whole:.3f} of one process's {whole / 2**20:.2f} MiB; ideal {1 / size:.3f}), "
                  f"peak RSS {rss:7.0f} MiB, step time {seconds / whole_s:.2f}x one process's "
                  f"({whole_s:.2f} s){on_device}")


if __name__ == "__main__":
    main()
