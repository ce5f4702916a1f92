"""Mixed precision through converted models: ``torch.autocast`` (bfloat16 on CPU) and the agreed GradScaler.

What is guaranteed (mpidomain.nn.precision): a convolution's halos travel in the autocast dtype, and the
convolution sees the values autocast gives it on one process; normalisations, pools and interpolation of a
bfloat16/float16 field compute in float32 and round once, as PyTorch's kernels do. A converted model under
autocast then differs from one process under the same autocast only by the rounding of sums that cross
ranks or that the kernels order differently on a shard: at most :data:`BOUND` (two bfloat16 machine
epsilons, 2 * 2**-7) of the largest value, forward and parameter gradients (measured: 0 forward for the
CNN, 2.7e-4 for the U-Net, 4e-3 for gradients; docs/training-stack.md).
"""

import copy

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from mpidomain import DomainParallelManager, gather_tensor, shard_tensor  # noqa: E402
from mpidomain.models import UNet, convert_model  # noqa: E402
from mpidomain.nn import (AgreedGradScaler, CommStats, DomainParallelBatchNorm, DomainParallelGroupNorm,  # noqa: E402
                          TrainingOptions, allreduce_gradients, convert_to_domain_parallel, prepare_training)
from test_compile import layouts, relative  # noqa: E402

BOUND = 2 * 2.0 ** -7  # two bfloat16 machine epsilons, of the largest value


def cnn():
    """The issue's Conv/GroupNorm/SiLU/Conv, with a stride-2 conv, BatchNorm, interpolation and pools."""
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                         nn.Conv2d(16, 16, 4, stride=2, padding=1), nn.BatchNorm2d(16), nn.SiLU(),
                         nn.Upsample(scale_factor=2, mode="bilinear"), nn.AvgPool2d(3, 1, 1), nn.MaxPool2d(3, 1, 1),
                         nn.Conv2d(16, 3, 3, padding=1))


def autocast_step(model, x, manager=None):
    """Forward under bfloat16 autocast, mean square backward; (output, parameter gradients summed over the domain)."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    count = y.numel() if manager is None else manager.domain_comm.allreduce(y.numel())
    (y.float().square().sum() / count).backward()
    if manager is not None:
        allreduce_gradients(model, group="domain", op="sum", manager=manager)
    return y.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["cnn", "unet"])
def test_bf16_autocast_is_within_the_bound_of_one_process(world, name):
    """Under the same bfloat16 autocast, the gathered output and the parameter gradients stay within BOUND of one
    process's, on every layout (30 rows for the CNN: uneven shards; the U-Net needs even ones: 32)."""
    torch.manual_seed(0)
    single = cnn() if name == "cnn" else UNet(3, width=16)
    field = 3 * torch.randn(2, 3, 30 if name == "cnn" else 32, 32, generator=torch.Generator().manual_seed(1))
    want_out, want_grads = autocast_step(single, field)
    problems = []
    for label, shape, shard_dim in layouts(world):
        with DomainParallelManager(world.size, shape, shard_dim=shard_dim) as manager:
            model = convert_model(copy.deepcopy(single), manager)
            out, grads = autocast_step(model, shard_tensor(field, manager=manager, allow_uneven=True), manager)
            whole = gather_tensor(out, manager=manager)
        if whole.dtype != want_out.dtype:
            problems.append(f"{label}: output dtype {whole.dtype}, one process {want_out.dtype}")
        errors = relative(whole.float(), want_out.float()), relative(grads, want_grads)
        if max(errors) > BOUND:
            problems.append(f"{label}: output {errors[0]:.3g}, gradients {errors[1]:.3g} of the largest value")
    assert not problems, problems


def test_halos_travel_in_the_autocast_dtype(world):
    """A convolution's halo exchange under bfloat16 autocast sends half the bytes of float32."""
    if world.size < 2:
        pytest.skip("one rank sends no halo")
    with DomainParallelManager(world.size, world.size) as manager:
        model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)),
                                           manager=manager)
        x = shard_tensor(torch.randn(1, 4, 16, 16), manager=manager)
        sent = []
        for enabled in (False, True):
            with CommStats(manager) as stats, torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                model(x)
            sent.append(stats.by_kind["halo exchange: convolutions"])
    assert sent[1] * 2 == sent[0], sent


@pytest.mark.parametrize("norm", ["group", "batch"])
def test_norm_statistics_in_float32_round_once(world, norm):
    """GroupNorm and BatchNorm of a bfloat16 field (and under autocast): bfloat16 out, as torch's own on one
    process, within one bfloat16 rounding of it (statistics in float32 or better, the result rounded once)."""
    torch.manual_seed(0)
    layer = nn.GroupNorm(2, 4) if norm == "group" else nn.BatchNorm2d(4)
    field = (3 * torch.randn(2, 4, 16, 8) + 1).bfloat16()
    want = layer(field)
    with DomainParallelManager(world.size, world.size) as manager:
        wrapper = DomainParallelGroupNorm if norm == "group" else DomainParallelBatchNorm
        converted = wrapper(copy.deepcopy(layer), manager=manager)
        x = shard_tensor(field, manager=manager)
        got = gather_tensor(converted(x), manager=manager)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under = gather_tensor(converted(x), manager=manager)
    assert got.dtype == under.dtype == want.dtype == torch.bfloat16
    ulp = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp(min=2 ** -100))) - 7)
    assert bool(((got.float() - want.float()).abs() <= ulp).all()), relative(got.float(), want.float())
    assert torch.equal(got, under)


@pytest.mark.slow  # compiles
def test_compiled_under_autocast_equals_eager_under_autocast(world):
    """prepare_training(compile=True, amp="bf16") (aot_eager) gives eager autocast's output and gradients."""
    with DomainParallelManager(world.size, world.size) as manager:
        torch.manual_seed(0)
        base = cnn()
        x = shard_tensor(torch.randn(2, 3, 30, 32), manager=manager, allow_uneven=True)
        eager = autocast_step(convert_to_domain_parallel(copy.deepcopy(base), manager=manager), x, manager)
        torch._dynamo.reset()
        model = convert_to_domain_parallel(copy.deepcopy(base), manager=manager)
        setup = prepare_training(model, TrainingOptions(compile=True, amp="bf16", compile_backend="aot_eager"))
        model.zero_grad()
        with setup.autocast():
            y = setup.model(x)
        (y.float().square().sum() / manager.domain_comm.allreduce(y.numel())).backward()
        allreduce_gradients(model, group="domain", op="sum", manager=manager)
        torch._dynamo.reset()
    assert setup.scaler is None and y.dtype == torch.bfloat16
    assert relative(y, eager[0]) == 0 and relative([p.grad for p in model.parameters()], eager[1]) < 1e-6


def _step_with_inf_on_rank_0(world, manager, scaler_class, fused=False):
    """One fp16 step whose gradient is infinite on rank 0 only; (parameters changed?, the scale after). ``fused``:
    an optimizer whose step checks the gradients itself (GradScaler does not call unscale_ for it)."""
    torch.manual_seed(0)
    model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1)), manager=manager)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, **({"fused": True} if fused else {}))
    scaler = scaler_class("cpu", init_scale=1024.0, **({"manager": manager} if scaler_class is AgreedGradScaler
                                                         else {}))
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.float16):
        y = model(shard_tensor(torch.randn(1, 2, 8, 8), manager=manager))
    scaler.scale(y.float().square().mean()).backward()
    if world.rank == 0:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return changed, scaler.get_scale()


def test_agreed_grad_scaler_skips_the_same_steps_on_every_rank(world):
    """An inf gradient on rank 0 only: AgreedGradScaler skips the step and backs off its scale on every rank
    (torch's GradScaler skips on rank 0 alone and steps elsewhere); prepare_training(amp="fp16") uses it."""
    with DomainParallelManager(world.size, world.size) as manager:
        agreed = world.allgather(_step_with_inf_on_rank_0(world, manager, AgreedGradScaler))
        fused = world.allgather(_step_with_inf_on_rank_0(world, manager, AgreedGradScaler, fused=True))
        plain = world.allgather(_step_with_inf_on_rank_0(world, manager, torch.amp.GradScaler))
        setup = prepare_training(convert_to_domain_parallel(nn.Conv2d(2, 2, 1), manager=manager),
                                 TrainingOptions(amp="fp16"), manager=manager)
    assert agreed == [(False, 512.0)] * world.size, agreed
    assert fused == [(False, 512.0)] * world.size, fused
    assert plain == [(False, 512.0)] + [(True, 1024.0)] * (world.size - 1), plain
    assert isinstance(setup.scaler, AgreedGradScaler) and setup.options.summary() == "amp fp16"
