"""torch.compile of converted models: the library's communication as custom operators (mpidomain.nn.ops).

Every compiled model is compared with the same converted model run eagerly from the same state, forward
and parameter (and input) gradients: float64 to 1e-12 and float32 to 1e-6 of the largest value, on every
layout of the world's ranks (latitude slabs of D = 1, 2, 4 with data-parallel groups for the rest, and
2 x 2 tiles). Most cases compile with ``backend="aot_eager"``: Dynamo, AOTAutograd, the operators' fake
implementations and autograd, the effect tokens that order them, all of what the library adds, without
generating kernels (seconds, not minutes, on the CI's two cores); the converted CNN also compiles with the
default Inductor backend, ``fullgraph=True`` and ``dynamic=False`` on uneven shards (721 rows; float32
gradients within INDUCTOR_FLOAT32_GRADIENTS). CREDIT's CrossFormer (slow, credit) compiles at one layout per
world.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # compiling takes seconds to minutes per case: the full suite's, not the quick loop's
nn = torch.nn

from mpidomain import DomainParallelManager, shard_tensor  # noqa: E402
from mpidomain.models import UNet, convert_model  # noqa: E402
from mpidomain.nn import (CommStats, DomainParallelPixelUnshuffle, DomainParallelTensorPadding,  # noqa: E402
                          DomainParallelWindowAttention, LatitudeWeightedMSE, convert_to_domain_parallel, ops)
from mpidomain.layout.moves import RowMove, contiguous_layout  # noqa: E402
from mpitest import divisors  # noqa: E402

TOLERANCES = {torch.float64: 1e-12, torch.float32: 1e-6}


def layouts(world):
    """(label, domain shape, shard_dim) of every layout this world runs: slabs of each D, 2 x 2 tiles at 4."""
    found = [(f"D={d}", d, -2) for d in divisors(world.size)]
    if world.size == 4:
        found.append(("2x2", (2, 2), (-2, -1)))
    return found


def cnn():
    """Conv / GroupNorm / SiLU / stride-2 conv / pools / interpolation / transposed conv / BatchNorm."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(),
                         nn.Conv2d(8, 8, 4, stride=2, padding=1), nn.BatchNorm2d(8), nn.MaxPool2d(3, 1, 1),
                         nn.Upsample(scale_factor=2, mode="bilinear"), nn.AvgPool2d(3, 1, 1),
                         nn.ConvTranspose2d(8, 4, 2, stride=2), nn.Conv2d(4, 3, 3, padding=1, padding_mode="reflect"))


def relative(got, want):
    """max |got - want| over max |want|, of tensors or lists of them (the largest value sets the scale)."""
    pairs = list(zip(got, want)) if isinstance(got, (list, tuple)) else [(got, want)]
    pairs = [(g.detach(), w.detach()) for g, w in pairs]
    scale = max(float(w.abs().max()) for _, w in pairs if w.numel()) if any(w.numel() for _, w in pairs) else 1.0
    return max((float((g - w).abs().max()) for g, w in pairs if w.numel()), default=0.0) / max(scale, 1e-300)


def step(model, x, weights):
    """Forward, a weighted sum as the loss, backward; (output, [parameter gradients..., input gradient])."""
    for p in model.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    out = model(x)
    (out * weights).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None] + [x.grad]


def compiled_against_eager(world, model, manager, field, *, backend="aot_eager", **options):
    """Return (output, gradient) differences of ``torch.compile(model)`` against ``model`` eager, the largest of
    every rank; both from the same state (spectral norms, BatchNorm statistics) and the same input shard."""
    torch._dynamo.reset()  # a fresh cache: the same forward compiled for another layout must not count as a hit
    x = shard_tensor(field, manager=manager, allow_uneven=True)
    out = model(x)
    weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(world.rank))
    state = copy.deepcopy(model.state_dict())
    eager_out, eager_grads = step(model, x, weights)
    model.load_state_dict(state)
    compiled = torch.compile(model, backend=backend, **options)
    out, grads = step(compiled, x, weights)
    torch._dynamo.reset()
    return world.allreduce(relative(out, eager_out), op=max_op()), world.allreduce(relative(grads, eager_grads),
                                                                                  op=max_op())


def max_op():
    from mpi4py import MPI

    return MPI.MAX


def test_compiled_cnn_equals_eager_on_every_layout(world):
    """Conv/GroupNorm/SiLU/pools/interpolation/transposed conv/BatchNorm, uneven shards (30 rows), float64 on every
    layout and float32 at the world's slabs, aot_eager."""
    problems = []
    for label, shape, shard_dim in layouts(world):
        dtypes = (torch.float64, torch.float32) if shape == world.size else (torch.float64,)
        for dtype in dtypes:
            with DomainParallelManager(world.size, shape, shard_dim=shard_dim) as manager:
                torch.manual_seed(0)
                model = convert_to_domain_parallel(cnn().to(dtype), manager=manager)
                field = torch.randn(2, 3, 30, 16, dtype=dtype, generator=torch.Generator().manual_seed(1))
                forward, backward = compiled_against_eager(world, model, manager, field, fullgraph=True)
            if forward > TOLERANCES[dtype] or backward > TOLERANCES[dtype]:
                problems.append(f"{label} {dtype}: output {forward:.3g}, gradients {backward:.3g}")
    assert not problems, problems


def test_explain_finds_no_graph_break(world):
    """torch._dynamo.explain over a converted Conv / GroupNorm / pool / interpolation stack: one graph, 0 breaks."""
    with DomainParallelManager(world.size, world.size) as manager:
        torch.manual_seed(0)
        model = convert_to_domain_parallel(nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1),
            nn.AvgPool2d(3, 1, 1), nn.Upsample(scale_factor=2, mode="bilinear"), nn.AdaptiveAvgPool2d((4, 4))),
            manager=manager)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(shard_tensor(torch.randn(1, 2, 16, 16), manager=manager))
        torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


# Inductor reorders float32 reductions: the same model unconverted, compiled on one process, gives parameter
# gradients up to 1.5e-6 (relative) from eager (docs/training-stack.md); outputs stay within 1e-6.
INDUCTOR_FLOAT32_GRADIENTS = 4e-6


def test_inductor_fullgraph_on_721_rows(world):
    """The default backend, fullgraph=True, dynamic=False: 721 rows (181/180/180/180 on four ranks), float64 and
    float32, against eager (float32 gradients: :data:`INDUCTOR_FLOAT32_GRADIENTS`)."""
    problems = []
    with DomainParallelManager(world.size, world.size) as manager:
        for dtype in (torch.float64, torch.float32):
            torch.manual_seed(0)
            model = convert_to_domain_parallel(nn.Sequential(
                nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv2d(4, 2, 3, padding=1)).to(dtype),
                manager=manager)
            field = torch.randn(1, 2, 721, 8, dtype=dtype, generator=torch.Generator().manual_seed(2))
            forward, backward = compiled_against_eager(world, model, manager, field, backend="inductor",
                                                       fullgraph=True, dynamic=False)
            bound = INDUCTOR_FLOAT32_GRADIENTS if dtype == torch.float32 else TOLERANCES[dtype]
            if forward > TOLERANCES[dtype] or backward > bound:
                problems.append(f"{dtype}: output {forward:.3g}, gradients {backward:.3g}")
    assert not problems, problems


def test_compiled_unet_and_loss_equal_eager(world):
    """The built-in U-Net (periodic convolutions, GroupNorm, stride 2, transposed conv, skip) with the
    latitude-weighted loss (an identity-backward all-reduce), float64, every layout."""
    problems = []
    for label, shape, shard_dim in layouts(world):
        with DomainParallelManager(world.size, shape, shard_dim=shard_dim) as manager:
            torch.manual_seed(0)
            model = convert_model(UNet(3, width=8).double(), manager)
            grid = torch.linspace(-80, 80, 32, dtype=torch.float64).view(1, 1, 32, 1).expand(1, 1, 32, 16)
            loss = LatitudeWeightedMSE(shard_tensor(grid, manager=manager)[0, 0, :, 0], manager)
            field = torch.randn(1, 3, 32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
            x = shard_tensor(field, manager=manager)
            target = x.flip(-1)
            state = copy.deepcopy(model.state_dict())

            def run(m):
                model.zero_grad()
                value = loss(m(x), target)
                value.backward()
                return value.detach(), [p.grad.clone() for p in model.parameters()]

            torch._dynamo.reset()
            eager = run(model)
            model.load_state_dict(state)
            compiled = run(torch.compile(model, backend="aot_eager", fullgraph=True))
            torch._dynamo.reset()
            errors = (relative(compiled[0], eager[0]), relative(compiled[1], eager[1]))
            if max(errors) > 1e-12:
                problems.append(f"{label}: loss {errors[0]:.3g}, gradients {errors[1]:.3g}")
    assert not problems, problems


class WindowMixer(nn.Module):
    """Self-attention within windows as CREDIT's CrossFormer ``Attention`` deals them (``short``: w x w
    neighbouring pixels; ``long``: pixels H/w and W/w apart), what window_attention_spec recognises."""

    def __init__(self, dim, attn_type, window_size):
        super().__init__()
        self.attn_type, self.window_size = attn_type, window_size
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.to_out = nn.Conv2d(dim, dim, 1)
        self.register_buffer("rel_pos_indices", torch.zeros(1, dtype=torch.long))

    def forward(self, x):
        b, d, height, width = x.shape
        w = self.window_size
        q, k, v = self.to_qkv(x).chunk(3, dim=1)

        def windows(t):  # (b * windows, w * w, d)
            if self.attn_type == "short":  # b d (h s1) (w s2) -> (b h w) (s1 s2) d
                t = t.reshape(b, d, height // w, w, width // w, w).permute(0, 2, 4, 3, 5, 1)
            else:  # b d (l1 h) (l2 w) -> (b h w) (l1 l2) d
                t = t.reshape(b, d, w, height // w, w, width // w).permute(0, 3, 5, 2, 4, 1)
            return t.reshape(-1, w * w, d)

        attention = torch.softmax(windows(q) @ windows(k).transpose(1, 2) / d ** 0.5, dim=-1)
        out = (attention @ windows(v)).reshape(b, height // w, width // w, w, w, d)
        if self.attn_type == "short":
            out = out.permute(0, 5, 1, 3, 2, 4)
        else:
            out = out.permute(0, 5, 3, 1, 4, 2)
        return self.to_out(out.reshape(b, d, height, width))


class PaddedMixer(nn.Module):
    """Earth padding, a convolution, short and long window attention, unpadding: CrossFormer's moves in small."""

    def __init__(self, manager):
        super().__init__()
        self.padding = DomainParallelTensorPadding("earth", (2, 2), (4, 4), align=(4, 4), manager=manager)
        self.conv = convert_to_domain_parallel(nn.Conv2d(4, 4, 3, padding=1), manager=manager)
        self.short = DomainParallelWindowAttention(WindowMixer(4, "short", 2), manager=manager)
        self.long = DomainParallelWindowAttention(WindowMixer(4, "long", 2), manager=manager)

    def forward(self, x):
        return self.padding.unpad(self.long(self.short(self.conv(self.padding.pad(x)))))


def test_compiled_padding_and_window_attention_equal_eager(world):
    """The Earth padding's all-to-all and halo exchange, window attention's all-to-alls (slabs and tiles at once),
    float64, every layout; 28 rows padded to 32 (uneven shards before, whole windows after)."""
    problems = []
    for label, shape, shard_dim in layouts(world):
        with DomainParallelManager(world.size, shape, shard_dim=shard_dim) as manager:
            torch.manual_seed(0)
            model = PaddedMixer(manager).double()
            field = torch.randn(1, 4, 28, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
            forward, backward = compiled_against_eager(world, model, manager, field, fullgraph=True)
            if forward > 1e-12 or backward > 1e-12:
                problems.append(f"{label}: output {forward:.3g}, gradients {backward:.3g}")
    assert not problems, problems


def test_fake_implementations_give_the_eager_shapes_without_communicating(world):
    """Each operator's fake implementation, on uneven shards (721 rows; a move to whole windows), gives the shape
    its eager implementation gives, and sends nothing (CommStats counts no byte)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with DomainParallelManager(world.size, world.size) as manager:
        x = shard_tensor(torch.randn(1, 2, 721, 8, dtype=torch.float64), manager=manager, allow_uneven=True)
        number = ops.handle(manager)
        extents = tuple(int(n) for n in manager.domain_comm.allgather(x.shape[-2]))  # 181, 180, 180, 180
        move = ops.move_handle(RowMove(contiguous_layout(extents), contiguous_layout(extents[1:] + extents[:1])))
        calls = [(torch.ops.mpidomain.halo_pad, (number, [2, 3], [2, 1], [False, True], "", False)),
                 (lambda t, *a: torch.ops.mpidomain.allreduce(t[:, :, :180], *a),
                  (number, "domain", "sum", "reduce", False)),
                 (torch.ops.mpidomain.redistribute, (number, move, [2]))]
        eager = [tuple(op(x, *arguments).shape) for op, arguments in calls]
        eager.append(tuple(torch.ops.mpidomain.halo_adjoint(torch.ops.mpidomain.halo_pad(
            x, number, [2], [2], [False], "", True), number, [2], [2], [False], "").shape))
        with FakeTensorMode() as mode, CommStats(manager) as stats:
            fake = mode.from_tensor(x)
            shapes = [tuple(op(fake, *arguments).shape) for op, arguments in calls]
            shapes.append(tuple(torch.ops.mpidomain.halo_adjoint(torch.ops.mpidomain.halo_pad(
                fake, number, [2], [2], [False], "", True), number, [2], [2], [False], "").shape))
    assert shapes == eager and stats.total == 0, (shapes, eager, stats.total)
    assert eager[0] == (1, 2, x.shape[2] + 4, 10) and eager[3] == tuple(x.shape), eager


def test_a_compilation_after_eager_calls_on_another_field_size_equals_eager(world):
    """Eager calls on 4 * ranks - 1 rows (rank 0: 4 rows, the last: 3), then a compilation on 4 * ranks rows
    (every rank 4): rank 0's own extent is the same both times, the layout is not. The trace gathers the extents
    again (nothing kept from the eager calls), so the compiled adaptive pool and interpolation equal eager."""
    with DomainParallelManager(world.size, world.size) as manager:
        torch.manual_seed(0)
        model = convert_to_domain_parallel(nn.Sequential(
            nn.Conv2d(2, 2, 3, padding=1), nn.Upsample(size=(10, 8), mode="bilinear", align_corners=True),
            nn.AdaptiveAvgPool2d((3, 3))).double(), manager=manager)
        model(shard_tensor(torch.randn(1, 2, 4 * world.size - 1, 8, dtype=torch.float64), manager=manager,
                           allow_uneven=True))
        field = torch.randn(1, 2, 4 * world.size, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        forward, backward = compiled_against_eager(world, model, manager, field, fullgraph=True)
    assert forward < 1e-12 and backward < 1e-12, (forward, backward)


def test_a_rank_recompiling_alone_raises_on_every_rank(world):
    """If rank 0 recompiles alone (its compiled code forgotten), its trace gathers the other ranks' extents: it
    meets their run-time operators' agreement step, and every rank raises (no rank waits, nothing baked in from
    what rank 0 alone saw)."""
    if world.size < 2:
        pytest.skip("needs two ranks")
    errors = []
    with DomainParallelManager(world.size, world.size) as manager:
        torch.manual_seed(0)
        model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 4, stride=2, padding=1)).double(),
                                           manager=manager)
        x = shard_tensor(torch.randn(1, 2, 16, 8, dtype=torch.float64), manager=manager)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        compiled(x)
        if world.rank == 0:
            torch._dynamo.reset()
        try:
            compiled(x)
        except Exception as error:  # Dynamo wraps the trace's error on rank 0
            errors.append(str(error))
        torch._dynamo.reset()
    assert len(errors) == 1 and "different mpidomain calls" in errors[0], errors


def test_a_layer_error_in_a_compiled_model_raises_on_every_rank(world):
    """PixelUnshuffle(2) over 9 rows on four ranks (3, 2, 2, 2): the rank whose rows straddle blocks finds it at
    trace time, and raises it when its graph runs; the others meet it in the layer's agreement step at their
    trace time, and every rank raises the ValueError."""
    if world.size < 2:
        pytest.skip("needs two ranks")
    rows = 2 * world.size + 1  # the first rank holds 3
    messages = []
    with DomainParallelManager(world.size, world.size) as manager:
        model = DomainParallelPixelUnshuffle(nn.PixelUnshuffle(2), manager=manager)
        x = shard_tensor(torch.randn(1, 1, rows, 4), manager=manager, allow_uneven=True)
        torch._dynamo.reset()
        try:
            torch.compile(model, backend="aot_eager")(x)
        except Exception as error:  # Dynamo may wrap it where the trace raised
            messages.append(f"{type(error).__name__}: {error}")
        torch._dynamo.reset()
    assert len(messages) == 1 and "not a multiple of 2" in messages[0], messages


@pytest.mark.credit
@pytest.mark.slow
def test_compiled_crossformer_equals_eager(world):
    """CREDIT's CrossFormer (tests/test_credit_models.py's: Earth padding, 123 uneven rows, short and long windows,
    spectral norm), float64, aot_eager, fullgraph: slabs of D = 1 and 2 on one and two ranks (a compilation costs
    95 s at four ranks on two cores; the moves of D = 4 slabs and 2 x 2 tiles, Earth padding and window attention,
    compile in test_compiled_padding_and_window_attention_equal_eager at every layout)."""
    import credit_models
    from test_credit_models import _agreed_skip, small_crossformer

    if world.size > 2:
        pytest.skip("compiled at D = 1 and 2; four ranks compile the same operators with other extents")
    module = _agreed_skip(world, credit_models.crossformer)
    problems = []
    for label, shape, shard_dim in [(f"D={world.size}", world.size, -2)]:
        with DomainParallelManager(world.size, shape, shard_dim=shard_dim) as manager:
            model, x = small_crossformer(module)
            model = convert_to_domain_parallel(model, manager=manager)
            forward, backward = compiled_against_eager(world, model, manager, x, fullgraph=True)
            if forward > 1e-12 or backward > 1e-12:
                problems.append(f"{label}: output {forward:.3g}, gradients {backward:.3g}")
    assert not problems, problems
