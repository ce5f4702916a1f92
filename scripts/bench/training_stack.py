#!/usr/bin/env python
"""Activation checkpointing's memory and mixed precision's bound, on converted models, in one run.

    mpiexec -n 2 python scripts/bench/training_stack.py                 # both tables
    mpiexec -n 2 python scripts/bench/training_stack.py --memory        # checkpointing only
    mpiexec -n 4 python scripts/bench/training_stack.py --autocast      # autocast only

Models: ``cnn``, :class:`mpidomain.models.UNet` (width 32, 4 channels, 180 x 360: 1 degree, even), and
``crossformer``, CREDIT's CrossFormer as the forecast builds it (:func:`mpidomain.models.credit_crossformer`,
4 + 2 x 2 channels, 64 x 128; skipped with a reason line where CREDIT is missing); float32, batch 1, latitude
slabs of D = the world's size.

``--memory``: the bytes of activations each rank's autograd keeps for backward
(:class:`mpidomain.nn.SavedActivations`, parameters left out) in one forward, without and with activation
checkpointing (:func:`mpidomain.nn.prepare_training`: the blocks CREDIT marks, ``_fsdp2_shard``, for the
CrossFormer; the whole model for the U-Net), their ratio, and the training step's seconds both ways (median of
``--repeats``, alternating): what the recomputation costs; and whether the gradients are equal both ways, bit
for bit (not with spectral norm in training: the recomputation runs its power iteration again).

``--autocast``: the converted model under ``torch.autocast("cpu", bfloat16)`` against the unconverted model on
one process under the same autocast: the largest difference of the gathered output and of the parameter
gradients (summed over the domain group), each relative to the largest value, against the bound
``tests/test_autocast.py`` asserts (two bfloat16 machine epsilons, 2 x 2**-7); and the convolutions' halo bytes
per rank and step in bfloat16 against float32 (CommStats).
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mpidomain  # noqa: E402
from mpidomain.models import UNet, convert_model, credit_crossformer, credit_missing  # noqa: E402
from mpidomain.nn import (CommStats, SavedActivations, TrainingOptions, allreduce_gradients,  # noqa: E402
                          prepare_training)

WORLD = MPI.COMM_WORLD
BOUND = 2 * 2.0 ** -7
HALO = "halo exchange: convolutions"


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", action="store_true", help="the checkpointing table only")
    parser.add_argument("--autocast", action="store_true", help="the autocast table only")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps each way (median; default 3)")
    args = parser.parse_args()
    if not (args.memory or args.autocast):
        args.memory = args.autocast = True
    return args


def build(name):
    """A seeded float32 model and its whole-field input, or None where CREDIT is missing."""
    torch.manual_seed(0)
    if name == "cnn":
        return UNet(channels=4, width=32), torch.randn(1, 4, 180, 360)
    if credit_missing() is not None:
        return None
    return credit_crossformer(2, 2, 4, 64, 128, local_window_size=1, global_window_size=(2, 2, 1, 1)), \
        torch.randn(1, 8, 64, 128)


def step(model, x, manager):
    """Forward, this rank's share of the mean square, backward, domain sum of the gradients; (seconds, grads)."""
    model.zero_grad(set_to_none=True)
    began = time.perf_counter()
    y = model(x)
    (y.float().square().sum() / manager.domain_comm.allreduce(y.numel())).backward()
    allreduce_gradients(model, group="domain", op="sum", manager=manager)
    return time.perf_counter() - began, [p.grad for p in model.parameters()]


def memory(name, manager, repeats):
    built = build(name)
    if built is None:
        if WORLD.rank == 0:
            print(f"{name}: skipped, CREDIT's CrossFormer does not import here ({credit_missing()})")
        return
    single, field = built
    x = mpidomain.shard_tensor(field, manager=manager, allow_uneven=True)
    plain = convert_model(copy.deepcopy(single), manager)
    checkpointed = convert_model(copy.deepcopy(single), manager)
    setup = prepare_training(checkpointed, TrainingOptions(activation_checkpoint=True))
    saved, seconds, grads = {}, {"plain": [], "checkpointed": []}, {}
    for label, model, params in (("plain", plain, plain), ("checkpointed", setup.model, checkpointed)):
        with SavedActivations(exclude=params.parameters()) as counter:
            model(x)
        saved[label] = counter.nbytes
    for _ in range(repeats + 1):
        for label, model in (("plain", plain), ("checkpointed", setup.model)):
            WORLD.Barrier()
            elapsed, grads[label] = step(model, x, manager)
            seconds[label].append(elapsed)
    same = all(torch.equal(a, b) for a, b in zip(grads["plain"], grads["checkpointed"]))
    same = WORLD.allreduce(same, op=MPI.LAND)
    rows = WORLD.gather((saved["plain"], saved["checkpointed"], statistics.median(seconds["plain"][1:]),
                         statistics.median(seconds["checkpointed"][1:])), root=0)
    if WORLD.rank == 0:
        blocks = ", ".join(setup.blocks) if setup.blocks != ("",) else "the whole model"
        print(f"{name}: {tuple(field.shape)} float32, D={WORLD.size}; checkpointed: {blocks}")
        print(f"{'model':<12}{'rank':>5}{'saved MiB':>11}{'checkpointed MiB':>18}{'ratio':>8}{'s/step':>9}"
              f"{'checkpointed s':>16}{'ratio':>8}")
        for rank, (a, b, s, t) in enumerate(rows):
            print(f"{name:<12}{rank:>5}{a / 2**20:>11.2f}{b / 2**20:>18.2f}{b / a:>8.3f}{s:>9.3f}{t:>16.3f}"
                  f"{t / s:>8.2f}")
        note = ""
        if not same and any(hasattr(m, "weight_u") for m in single.modules()):
            note = (" (spectral norm: in training, the recomputation runs the power iteration again, so the "
                    "recomputed weights differ; on one process as well)")
        print(f"{name}: gradients with and without checkpointing equal bit for bit: {'yes' if same else 'no'}{note}")
        print(flush=True)


def relative(got, want):
    """max |got - want| over max |want|, over lists of tensors (pairs with a None left out)."""
    pairs = [(g.float(), w.float()) for g, w in zip(got, want) if g is not None and w is not None]
    scale = max(float(w.abs().max()) for _, w in pairs)
    return max(float((g - w).abs().max()) for g, w in pairs) / scale


def autocast(name, manager):
    built = build(name)
    if built is None:
        if WORLD.rank == 0:
            print(f"{name}: skipped, CREDIT's CrossFormer does not import here ({credit_missing()})")
        return
    single, field = built
    model = convert_model(copy.deepcopy(single), manager)
    x = mpidomain.shard_tensor(field, manager=manager, allow_uneven=True)

    def bf16_step(m, inputs, mgr):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(inputs)
        count = y.numel() if mgr is None else mgr.domain_comm.allreduce(y.numel())
        (y.float().square().sum() / count).backward()
        if mgr is not None:
            allreduce_gradients(m, group="domain", op="sum", manager=mgr)
        return y.detach(), [p.grad for p in m.parameters()]

    want, want_grads = bf16_step(single, field, None)
    got, grads = bf16_step(model, x, manager)
    whole = mpidomain.gather_tensor(got, manager=manager)
    errors = (relative([whole], [want]), relative(grads, want_grads))
    sent = []
    for enabled in (False, True):
        with CommStats(manager) as stats, torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            model(x)
        sent.append(stats.by_kind.get(HALO, 0))
    sent = WORLD.allreduce(max(sent[0], 1), op=MPI.MAX), WORLD.allreduce(sent[1], op=MPI.MAX)
    if WORLD.rank == 0:
        print(f"{name}: {tuple(field.shape)}, D={WORLD.size}, bfloat16 autocast against one process under it: output "
              f"{errors[0]:.3g}, gradients {errors[1]:.3g} of the largest value (bound {BOUND:.3g}: "
              f"{'within' if max(errors) <= BOUND else 'OUTSIDE'}); output dtype {whole.dtype} (one process "
              f"{want.dtype}); convolution halos {sent[1]:,} bytes per rank in bfloat16 against {sent[0]:,} in "
              f"float32: x {sent[1] / sent[0]:.2f}", flush=True)


def main():
    args = parse()
    manager = mpidomain.DomainParallelManager(WORLD.size, WORLD.size)
    for name in ("cnn", "crossformer"):
        if args.memory:
            memory(name, manager, args.repeats)
        if args.autocast:
            autocast(name, manager)
    manager.close()


if __name__ == "__main__":
    main()
