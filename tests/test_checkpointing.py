"""Activation checkpointing of converted models: ``torch.utils.checkpoint`` (non-reentrant) around converted
blocks, CREDIT's ``activation_checkpoint``, and :func:`mpidomain.nn.prepare_training`'s.

The recomputation in backward runs each block's forward again, its halo exchanges and all-reduces with it:
every rank recomputes the same blocks in the same order, so the exchanges match (each opens with its
agreement step, which would raise on a mismatch). Gradients, summed over the domain group, equal one process
without checkpointing (float64, 1e-12), and equal the converted model without checkpointing bit for bit;
far fewer activation bytes stay saved for backward (:class:`mpidomain.nn.SavedActivations`).
"""

import copy

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from torch.utils.checkpoint import checkpoint  # noqa: E402

from mpidomain import DomainParallelManager, gather_tensor, shard_tensor  # noqa: E402
from mpidomain.nn import (CommStats, SavedActivations, TrainingOptions, allreduce_gradients,  # noqa: E402
                          convert_to_domain_parallel, prepare_training)
from test_compile import layouts, relative  # noqa: E402


class Checkpointed(nn.Module):
    """``block`` run under non-reentrant ``torch.utils.checkpoint``: its activations recomputed in backward."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def blocks(checkpointed=False):
    """Two convolution blocks (a halo exchange, GroupNorm's all-reduces, a stride-2 exchange) and a head."""
    torch.manual_seed(0)

    def block(channels_in, channels_out, stride):
        return nn.Sequential(nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.GroupNorm(2, channels_out),
                             nn.SiLU(), nn.Conv2d(channels_out, channels_out, 4 if stride == 2 else 3, stride=stride,
                                                  padding=1), nn.SiLU())

    first, second = block(3, 8, 1), block(8, 8, 2)
    if checkpointed:
        first, second = Checkpointed(first), Checkpointed(second)
    return nn.Sequential(first, second, nn.Conv2d(8, 3, 1)).double()


def train_step(model, x, manager=None):
    """One forward and backward of the mean square over the whole field (each rank its share); the parameter
    gradients, summed over the domain group when ``manager`` is given."""
    model.zero_grad()
    y = model(x)
    count = y.numel() if manager is None else manager.domain_comm.allreduce(y.numel())
    (y.square().sum() / count).backward()
    if manager is not None:
        allreduce_gradients(model, group="domain", op="sum", manager=manager)
    return y.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_checkpointed_blocks_equal_one_process(world):
    """Each converted block under torch.utils.checkpoint: output and parameter gradients equal one process, and
    the converted model without checkpointing bit for bit, on every layout."""
    field = torch.randn(2, 3, 30, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want_out, want_grads = train_step(blocks(), field)
    problems = []
    for label, shape, shard_dim in layouts(world):
        with DomainParallelManager(world.size, shape, shard_dim=shard_dim) as manager:
            x = shard_tensor(field, manager=manager, allow_uneven=True)
            plain = train_step(convert_to_domain_parallel(blocks(), manager=manager), x, manager)
            out, grads = train_step(convert_to_domain_parallel(blocks(True), manager=manager), x, manager)
            whole = gather_tensor(out, manager=manager)
        if relative(whole, want_out) > 1e-12 or relative(grads, want_grads) > 1e-12:
            problems.append(f"{label}: against one process, output {relative(whole, want_out):.3g}, gradients "
                            f"{relative(grads, want_grads):.3g}")
        if not (torch.equal(out, plain[0]) and all(torch.equal(a, b) for a, b in zip(grads, plain[1]))):
            problems.append(f"{label}: differs from the converted model without checkpointing")
    assert not problems, problems


def test_recomputation_exchanges_again_and_saves_activations(world):
    """With checkpointing, backward sends the forward's halos and all-reduces once more (the recomputation, on
    every rank alike), and the bytes saved for backward drop to the blocks' inputs."""
    with DomainParallelManager(world.size, world.size) as manager:
        x = shard_tensor(torch.randn(2, 3, 32, 16, dtype=torch.float64), manager=manager)
        counts = {}
        for checkpointed in (False, True):
            model = convert_to_domain_parallel(blocks(checkpointed), manager=manager)
            with SavedActivations(exclude=model.parameters()) as saved, CommStats(manager) as forward:
                y = model(x)
            with CommStats(manager) as backward:
                y.square().sum().backward()
            counts[checkpointed] = (saved.nbytes, forward.by_kind, backward.by_kind)
    (plain_saved, plain_forward, plain_backward), (saved, forward, backward) = counts[False], counts[True]
    moved = {k: v for k, v in forward.items() if not k.startswith("control")}  # plans built once: fewer steps
    assert moved == {k: v for k, v in plain_forward.items() if not k.startswith("control")}, (forward, plain_forward)
    if world.size > 1:  # by kind of message (CommStats names the recomputation's layers "other": it runs in backward)
        for kind in ("halo exchange", "all-reduce"):
            def total(counts):
                return sum(v for k, v in counts.items() if k.startswith(kind))
            assert total(backward) == total(plain_backward) + total(plain_forward), (kind, backward, plain_backward,
                                                                                     plain_forward)
    assert saved * 4 < plain_saved, (saved, plain_saved)


@pytest.mark.slow  # compiles
def test_prepare_training_checkpoints_the_whole_model_and_compiles_inside(world):
    """prepare_training(activation_checkpoint=True) on a model CREDIT marks nothing in: the whole model
    checkpointed; with compile, compiled inside the checkpoint. Both equal eager (float64); the state_dict
    keys stay the model's."""
    problems = []
    with DomainParallelManager(world.size, world.size) as manager:
        x = shard_tensor(torch.randn(2, 3, 30, 16, dtype=torch.float64), manager=manager, allow_uneven=True)
        eager = train_step(convert_to_domain_parallel(blocks(), manager=manager), x, manager)
        for options in (TrainingOptions(activation_checkpoint=True),
                        TrainingOptions(activation_checkpoint=True, compile=True, compile_backend="aot_eager")):
            torch._dynamo.reset()
            model = convert_to_domain_parallel(blocks(), manager=manager)
            keys = list(model.state_dict())
            setup = prepare_training(model, options)
            with SavedActivations(exclude=model.parameters()) as saved:
                setup.model(x)
            out, grads = train_step(setup.model, x, manager)
            torch._dynamo.reset()
            if setup.blocks != ("",) or list(setup.model.state_dict()) != keys:
                problems.append(f"{options.summary()}: blocks {setup.blocks}, keys {list(setup.model.state_dict())}")
            if relative(out, eager[0]) > 1e-12 or relative(grads, eager[1]) > 1e-12:
                problems.append(f"{options.summary()}: output {relative(out, eager[0]):.3g}, gradients "
                                f"{relative(grads, eager[1]):.3g}")
            if saved.nbytes > x.nbytes:
                problems.append(f"{options.summary()}: {saved.nbytes} bytes saved, more than the input's {x.nbytes}")
    assert not problems, problems


def buffered():
    """A block whose forward advances buffers: spectral norm's power iteration (``weight_u``, ``weight_v``)
    and batch norm's running statistics."""
    torch.manual_seed(0)
    return nn.Sequential(nn.utils.spectral_norm(nn.Conv2d(3, 8, 3, padding=1)), nn.BatchNorm2d(8), nn.SiLU(),
                         nn.utils.spectral_norm(nn.Conv2d(8, 3, 3, padding=1))).double()


def test_checkpointing_advances_buffers_once_per_step(world):
    """The recomputation starts from the buffers the forward started from and leaves them as it left them:
    over three steps the checkpointed model's outputs, gradients and buffers (spectral norm's u and v, batch
    norm's running statistics) equal the model without checkpointing, on one process and on every layout.
    (Recomputed as they are, the power iteration would run twice a step and the gradients depart.)"""
    field = torch.randn(2, 3, 30, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    problems = []
    for label, shape, shard_dim in [("one process", 1, -2)] + layouts(world):
        with DomainParallelManager(world.size, shape, shard_dim=shard_dim) as manager:
            x = shard_tensor(field, manager=manager, allow_uneven=True)
            plain = convert_to_domain_parallel(buffered(), manager=manager)
            model = convert_to_domain_parallel(buffered(), manager=manager)
            setup = prepare_training(model, TrainingOptions(activation_checkpoint=True))
            for step in range(3):
                want, got = train_step(plain, x, manager), train_step(setup.model, x, manager)
                buffers = [(name, b, dict(plain.named_buffers())[name]) for name, b in model.named_buffers()]
                different = [name for name, b, p in buffers if not torch.equal(b, p)]
                if not (torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))):
                    problems.append(f"{label}, step {step + 1}: output or gradients differ")
                if different:
                    problems.append(f"{label}, step {step + 1}: buffers differ: {different}")
    assert not problems, problems


def test_checkpoint_like_credit_checkpoints_nothing_when_nothing_is_marked(world):
    """TrainingOptions(checkpoint_like_credit=True), as CREDIT's trainer: a model with no ``_fsdp2_shard`` block
    (CREDIT's ``crossformer`` type) is not wrapped at all."""
    with DomainParallelManager(world.size, world.size) as manager:
        model = convert_to_domain_parallel(blocks(), manager=manager)
        setup = prepare_training(model, TrainingOptions(activation_checkpoint=True, checkpoint_like_credit=True))
    assert setup.blocks == () and setup.model is model, (setup.blocks, type(setup.model).__name__)
    assert not any(type(m).__name__ == "CheckpointWrapper" for m in setup.model.modules())


@pytest.mark.credit
def test_credit_activation_checkpoint_equals_one_process(world):
    """CREDIT's trainer.activation_checkpoint (credit.parallel.fsdp2._apply_activation_checkpointing: its marked
    blocks wrapped non-reentrant) on the converted CrossFormer: output and gradients equal one process with the
    same checkpointing; prepare_training wraps the same blocks."""
    import credit_models
    from test_credit_models import _agreed_skip, small_crossformer

    module = _agreed_skip(world, credit_models.crossformer)
    from credit.parallel.fsdp2 import _apply_activation_checkpointing

    model, x = small_crossformer(module)
    reference = copy.deepcopy(model)
    # The reference checkpoints too: in training, the recomputation runs the spectral norms' power iteration
    # again, so checkpointed gradients differ from plain ones (by 8% here) on one process as well.
    _apply_activation_checkpointing(reference)
    want_out, want_grads = train_step(reference, x)
    with DomainParallelManager(world.size, world.size) as manager:
        converted = convert_to_domain_parallel(model, manager=manager)
        marked = convert_to_domain_parallel(small_crossformer(module)[0], manager=manager)
        _apply_activation_checkpointing(converted)
        wrapped = [path for path, m in converted.named_modules() if type(m).__name__ == "CheckpointWrapper"]
        out, grads = train_step(converted, shard_tensor(x, manager=manager, allow_uneven=True), manager)
        whole = gather_tensor(out, manager=manager)
        setup = prepare_training(marked, TrainingOptions(activation_checkpoint=True))
    assert wrapped and list(setup.blocks) == [p.replace("._checkpoint_wrapped_module", "") for p in wrapped], \
        (wrapped, setup.blocks)
    assert relative(whole, want_out) < 1e-12 and relative(grads, want_grads) < 1e-12, \
        (relative(whole, want_out), relative(grads, want_grads))


@pytest.mark.credit
def test_credit_train_checkpoints_exactly_as_credit(world):
    """``credit train``'s checkpointing (TrainingOptions(checkpoint_like_credit=True)) on CREDIT's two
    CrossFormers, converted: the blocks CREDIT's own wrapper checkpoints and no others (none for the
    ``crossformer`` type, which marks none: the whole model was checkpointed, its spectral norms' power
    iteration run twice a step), and over two steps outputs, gradients and buffers equal CREDIT's own
    checkpointing on one process (float64, 1e-12)."""
    import importlib

    import credit_models
    from test_credit_models import _agreed_skip

    wxformer = _agreed_skip(world, credit_models.crossformer)  # its postblock stand-in where torchvision is absent
    from credit.parallel.fsdp2 import _apply_activation_checkpointing

    def build(module):
        torch.manual_seed(0)
        return module.CrossFormer(image_height=123, image_width=56, frames=2, channels=1, levels=2,
                                  surface_channels=1, input_only_channels=0, dim=(4, 8, 16, 32), depth=(1, 1, 1, 1),
                                  dim_head=4, local_window_size=2, global_window_size=(4, 2, 2, 1),
                                  cross_embed_kernel_sizes=((4, 8), (2, 4), (2, 4), (2, 4)),
                                  cross_embed_strides=(2, 2, 2, 2), use_spectral_norm=True, interp=False,
                                  padding_conf=dict(activate=True, mode="earth", pad_lat=[2, 3],
                                                    pad_lon=[4, 4])).double()

    x = torch.randn(1, 3, 2, 123, 56, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    problems = []
    for name, module in (("crossformer", importlib.import_module("credit.models.crossformer")),
                         ("wxformer", wxformer)):
        reference = build(module)
        _apply_activation_checkpointing(reference)
        theirs = [p.replace("._checkpoint_wrapped_module", "") for p, m in reference.named_modules()
                  if type(m).__name__ == "CheckpointWrapper"]
        with DomainParallelManager(world.size, world.size) as manager:
            model = convert_to_domain_parallel(build(module), manager=manager)
            setup = prepare_training(model, TrainingOptions(activation_checkpoint=True, checkpoint_like_credit=True))
            xs = shard_tensor(x, manager=manager, allow_uneven=True)
            for step in range(2):
                want_out, want_grads = train_step(reference, x)
                out, grads = train_step(setup.model, xs, manager)
                whole = gather_tensor(out, manager=manager)
                if relative(whole, want_out) > 1e-12 or relative(grads, want_grads) > 1e-12:
                    problems.append(f"{name}, step {step + 1}: output {relative(whole, want_out):.3g}, gradients "
                                    f"{relative(grads, want_grads):.3g}")
            mine, want = setup.model.state_dict(), reference.state_dict()  # the same keys, the wrappers' stripped
            for key in (k.replace("_checkpoint_wrapped_module.", "") for k, _ in reference.named_buffers()):
                if key in want and relative(mine[key], want[key]) > 1e-12:
                    problems.append(f"{name}: buffer {key} differs")
        if list(setup.blocks) != theirs:
            problems.append(f"{name}: checkpointed {list(setup.blocks)}, CREDIT {theirs}")
        if name == "crossformer" and theirs:
            problems.append(f"CREDIT's crossformer type now marks {theirs}")
    assert not problems, problems

