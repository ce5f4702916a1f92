"""Random layers in a converted model: rng="one-process" draws one process's masks bitwise, at every layout;
rng="tile" draws each rank's own, reproducibly; torch's default generator stays alike on every rank."""

import copy

import pytest

torch = pytest.importorskip("torch")

import credit_models  # noqa: E402
from mpidomain import DomainParallelManager, gather_tensor, shard_tensor  # noqa: E402
from mpidomain.nn import allreduce_gradients, convert_to_domain_parallel  # noqa: E402
from mpidomain.models import CREDIT_INSTALL  # noqa: E402

nn = torch.nn
TOLERANCE = 1e-12


class DropPath(nn.Module):
    """timm's DropPath (timm.layers.drop.drop_path), as written there: one value per sample."""

    def __init__(self, drop_prob=0.0, scale_by_keep=True):
        super().__init__()
        self.drop_prob, self.scale_by_keep = drop_prob, scale_by_keep

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep_prob = 1 - self.drop_prob
        random_tensor = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep_prob)
        if keep_prob > 0.0 and self.scale_by_keep:
            random_tensor.div_(keep_prob)
        return x * random_tensor


class Residual(nn.Module):
    def __init__(self, body, drop_path):
        super().__init__()
        self.body, self.drop_path = body, drop_path

    def forward(self, x):
        return x + self.drop_path(self.body(x))


class ChannelsOuter(nn.Module):
    """The same values laid out channel-major in memory (dense, not contiguous): dropout draws its mask in that
    order (torch's empty_like keeps the strides)."""

    def forward(self, x):
        return x.transpose(0, 1).contiguous().transpose(0, 1)


class RowsInner(nn.Module):
    """The same values with the columns outer of the rows in memory (dense, not contiguous)."""

    def forward(self, x):
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def random_cnn():
    """Convolutions between Dropout (one of them on a channel-major layout), AlphaDropout and a residual
    DropPath, float64."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.Dropout(0.3), nn.SiLU(), ChannelsOuter(), nn.Dropout(0.2),
        Residual(nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.AlphaDropout(0.2)), DropPath(0.5)),
        nn.Dropout(0.1, inplace=True), nn.Conv2d(6, 2, 3, padding=1)).double()


def layouts(world):
    """(label, domain shape, shard_dim): slabs of the world's ranks, and 2 x 2 tiles at four."""
    found = [(f"D={world.size}", world.size, -2)]
    if world.size == 4:
        found.append(("2x2", (2, 2), (-2, -1)))
    return found


def relative(got, want):
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-300)


def one_process_and_converted(world, model, x, shape, shard_dim, rng, seed=11, steps=2):
    """Train-mode forwards and backwards of ``model`` on one process (whole ``x``) and converted (shards), each
    from ``seed``; return what differs as a dict (empty: nothing). Output and gradients (summed over the domain,
    relative to the largest) within 1e-12 and the generator where one process leaves it ("one-process"), or other
    masks than one process's ("tile"); either way the generators alike on every rank."""
    reference = copy.deepcopy(model).train()
    torch.manual_seed(seed)
    for _ in range(steps):
        want = reference(x)
        want.square().mean().backward()
    state = torch.get_rng_state()
    problems = {}
    with DomainParallelManager(world.size, shape, shard_dim=shard_dim) as manager:
        converted = convert_to_domain_parallel(model, manager=manager, rng=rng,
                                               allow_local=(ChannelsOuter, RowsInner)).train()
        torch.manual_seed(seed)
        for _ in range(steps):
            y = converted(shard_tensor(x, manager=manager, allow_uneven=True))
            (y.square().sum() / want.numel()).backward()
        allreduce_gradients(converted, manager=manager, group="domain", op="sum")
        got = gather_tensor(y.detach(), manager=manager)
        states = world.allgather(torch.get_rng_state())
    output = relative(got, want.detach()) if got.shape == want.shape else float("inf")
    pairs = [(a.grad, b.grad) for a, b in zip(converted.parameters(), reference.parameters()) if b.grad is not None]
    grads = max((a - b).abs().max().item() for a, b in pairs) / max(b.abs().max().item() for _, b in pairs)
    if rng == "one-process":
        if output > TOLERANCE or grads > TOLERANCE:
            problems["differs"] = (output, grads)
        if not torch.equal(states[world.rank], state):
            problems["generator"] = "not where one process leaves it"
    elif output < 1e-6:
        problems["tile"] = "the tile draws equal one process's"
    if not all(torch.equal(s, states[0]) for s in states):
        problems["lockstep"] = "the ranks' default generators differ"
    return problems


def agreed(world, problems):
    """Every rank's problems (so every rank asserts alike)."""
    return [p for p in world.allgather(problems) if p]


def test_one_process_draws_equal_one_process_on_every_layout(world):
    """Dropout (on a channel-major layout too), AlphaDropout (inplace too) and DropPath on a batch of 2 and 30 rows
    (uneven shards at 4), float64, two steps:
    output and summed gradients within 1e-12 of one process, torch's generator where one process leaves it,
    at D = the world and 2 x 2; rng="tile" draws other masks, with the generators alike on every rank."""
    x = torch.randn(2, 3, 30, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    found = {}
    for label, shape, shard_dim in layouts(world):
        for rng in ("one-process",) + (("tile",) if world.size > 1 else ()):
            problems = one_process_and_converted(world, random_cnn(), x, shape, shard_dim, rng)
            if problems:
                found[f"{label} {rng}"] = problems
    assert not agreed(world, found)


def test_one_process_draws_where_a_rank_holds_one_row_and_after_a_global_pool(world):
    """world + 1 rows (a rank holds one row) laid out columns-outer: one process's mask, in its memory order; a
    dropout of the pooled feature vector (the same on every rank) draws one process's mask on every rank; the
    generators end alike, in both modes."""
    rows = world.size + 1
    x = torch.randn(2, 3, rows, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    found = {}
    torch.manual_seed(0)
    layered = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), RowsInner(), nn.Dropout(0.5)).double()
    problems = one_process_and_converted(world, layered, x, world.size, -2, "one-process", steps=1)
    if problems:
        found["columns outer"] = problems
    torch.manual_seed(0)
    pooled = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5),
                           nn.Linear(4, 2)).double()
    for rng in ("one-process", "tile"):
        with DomainParallelManager(world.size, world.size) as manager:
            model = convert_to_domain_parallel(copy.deepcopy(pooled), manager=manager, rng=rng).train()
            torch.manual_seed(4)
            got = model(shard_tensor(x, manager=manager, allow_uneven=True)).detach()
        torch.manual_seed(4)
        want = copy.deepcopy(pooled).train()(x).detach()
        if relative(got, want) > TOLERANCE or not all(torch.equal(g, got) for g in world.allgather(got)):
            found[f"pooled {rng}"] = relative(got, want)
    assert not agreed(world, found)


def test_tile_draws_are_each_ranks_own_and_reproducible(world):
    """rng="tile" at a fixed layout: the same seed gives the same output; equal shards get other masks; an RReLU
    on uneven shards (each rank its own slopes) leaves the default generators alike on every rank."""
    with DomainParallelManager(world.size, world.size) as manager:
        model = convert_to_domain_parallel(nn.Dropout(0.5), manager=manager)
        x = torch.ones(1, 1, 4 * world.size, 8, dtype=torch.float64)
        runs = []
        for _ in range(2):
            torch.manual_seed(5)
            runs.append(model(shard_tensor(x, manager=manager)))
        masks = world.allgather(runs[0])
        rrelu = convert_to_domain_parallel(nn.Sequential(nn.RReLU(), nn.Dropout(0.5)), manager=manager).train()
        rrelu(shard_tensor(-torch.ones(1, 1, 4 * world.size + 1, 8), manager=manager, allow_uneven=True))
        states = world.allgather(torch.get_rng_state())
    same = torch.equal(runs[0], runs[1])
    distinct = len({tuple(m.flatten().tolist()) for m in masks}) == world.size
    lockstep = all(torch.equal(s, states[0]) for s in states)
    assert all(world.allgather((same, distinct, lockstep))), (same, distinct, lockstep)


class WindowAttention(nn.Module):
    """What the converter takes for a window attention (CREDIT's Attention's attributes), holding ``extra``."""

    def __init__(self, extra):
        super().__init__()
        self.attn_type, self.window_size = "short", 2
        self.to_qkv, self.to_out, self.extra = nn.Conv2d(4, 12, 1), nn.Conv2d(4, 4, 1), extra
        self.dropout = nn.Dropout(0.1)
        self.register_buffer("rel_pos_indices", torch.zeros(4, 4, dtype=torch.long))


def test_bad_rng_and_layers_one_process_cannot_draw_are_refused(world):
    """rng="foo": ValueError naming rng; rng="one-process" with an RReLU, or with a random layer inside a window
    attention other than its attention weights' nn.Dropout named dropout: the converter's refusal names it."""
    with pytest.raises(ValueError, match="rng must be 'tile'.*got 'foo'"):
        convert_to_domain_parallel(nn.Conv2d(1, 1, 3), rng="foo")
    with pytest.raises(ValueError, match=r"1 \(RReLU: rng='one-process' cannot draw RReLU's slopes"):
        convert_to_domain_parallel(nn.Sequential(nn.Conv2d(1, 1, 3), nn.RReLU()), rng="one-process")
    convert_to_domain_parallel(nn.Sequential(nn.Conv2d(1, 1, 3), nn.RReLU()), rng="tile")
    window = WindowAttention(nn.Dropout2d(0.1))
    with pytest.raises(ValueError, match=r"rng='one-process' reproduces only the dropout of the attention weights "
                                         r".*it holds Dropout2d extra"):
        convert_to_domain_parallel(window, rng="one-process")
    convert_to_domain_parallel(WindowAttention(nn.Identity()), rng="one-process")


@pytest.mark.credit
def test_crossformer_with_dropout_equals_one_process(world):
    """CREDIT's CrossFormer with attn_dropout and ff_dropout 0.1 (tests/test_credit_models.py's geometry: 123
    uneven rows, short and long windows, Earth padding), rng="one-process": output and gradients within 1e-12
    of one process, the generator where one process leaves it, at D = the world and 2 x 2."""
    reasons = world.allgather(credit_models.why_missing(credit_models.crossformer))
    if any(reasons):
        pytest.skip(f"CREDIT not importable here ({next(r for r in reasons if r)}): {CREDIT_INSTALL}")
    module = credit_models.crossformer()
    found = {}
    for label, shape, shard_dim in layouts(world):
        torch.manual_seed(0)
        model = module.CrossFormer(image_height=123, image_width=56, frames=2, channels=1, levels=2,
                                   surface_channels=1, input_only_channels=0, dim=(4, 8, 16, 32), depth=(1, 1, 1, 1),
                                   dim_head=4, local_window_size=2, global_window_size=(4, 2, 2, 1),
                                   cross_embed_kernel_sizes=((4, 8), (2, 4), (2, 4), (2, 4)),
                                   cross_embed_strides=(2, 2, 2, 2), use_spectral_norm=True, attn_dropout=0.1,
                                   ff_dropout=0.1, padding_conf=dict(activate=True, mode="earth", pad_lat=[2, 3],
                                                                     pad_lon=[4, 4])).double()
        x = torch.randn(1, 3, 2, 123, 56, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        problems = one_process_and_converted(world, model, x, shape, shard_dim, "one-process", steps=1)
        if problems:
            found[label] = problems
    assert not agreed(world, found)


@pytest.mark.credit
def test_credit_model_with_a_layer_one_process_cannot_draw_is_one_usage_line(world, monkeypatch):
    """credit train/rollout --rng one-process on a model holding an RReLU: one UsageError line (exit 2 on the
    command line) naming --rng, the path and the layer, when the model is built (before any step)."""
    pytest.importorskip("credit")
    import credit.models

    from mpidomain.command import UsageError
    from mpidomain.credit.model import build_model

    if world.size == 1:
        pytest.skip("a world of one runs CREDIT's model unconverted")
    monkeypatch.setattr(credit.models, "load_model", lambda conf: nn.Sequential(nn.Conv2d(1, 1, 3), nn.RReLU()))
    with DomainParallelManager(world.size, world.size) as manager:
        build_model({"model": {"type": "toy"}}, manager, torch.device("cpu"), "tile")
        with pytest.raises(UsageError) as raised:
            build_model({"model": {"type": "toy"}}, manager, torch.device("cpu"), "one-process")
    line = str(raised.value)
    assert "\n" not in line and f"at D={world.size} with --rng one-process" in line, line
    assert "1 (RReLU: rng='one-process' cannot draw RReLU's slopes" in line, line


@pytest.mark.one_world
def test_estimate_draws_counts_one_process_masks():
    """estimate_draws on the meta device: each Dropout and AlphaDropout with p > 0 draws its input's whole mask."""
    from mpidomain.nn import estimate_draws

    draws = estimate_draws(random_cnn(), (2, 3, 30, 16))
    field = 2 * 6 * 30 * 16 * 8  # float64 bytes of each dropout's (B, 6, 30, 16) input
    assert (draws.calls, draws.largest_bytes, draws.total_bytes) == (4, field, 4 * field), draws
