"""Re-distributing rows over MPI for window attention, against a global reference.

``redistribute`` on slabs (every D dividing the world) and on 2 x 2 tiles:
forward bitwise, the adjoint by the dot-product test, autograd's gradient equal
to the inverse move; CREDIT's CrossFormer ``Attention`` wrapped in
``DomainParallelWindowAttention`` equal to the module on the whole field in
float64 (output, input and parameter gradients); a layout that cannot work
raises the same error on every rank. Worlds of 3 and 5 ranks run in one fresh
job each, from a one-rank suite only.
"""


import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpidomain import DomainParallelManager, balanced_split, redistribute  # noqa: E402
from mpidomain.nn import (DomainParallelWindowAttention, Redistribute, allreduce_gradients,  # noqa: E402
                          window_attention_spec)
from mpidomain.layout.moves import window_move  # noqa: E402
from mpitest import REPO, divisors, run_mpi, share  # noqa: E402

TOLERANCE = 1e-12


def managers(world):
    """(label, manager) for every slab count dividing the world, and 2 x 2 tiles at 4 ranks."""
    for d in divisors(world.size):
        yield f"D={d}", DomainParallelManager(world.size, d)
    if world.size == 4:
        yield "2x2", DomainParallelManager(4, (2, 2), (-2, -1))


def place_of(manager, ndim=4):
    """[(dim, coordinate, parts)] along each dim the manager shards, normalised for ``ndim`` dims."""
    return [(d % ndim, c, p) for d, c, p in zip(manager.shard_dims, manager.domain_coords, manager.domain_shape)]


def shard_of(full, manager):
    """This rank's block of ``full``, cut as shard_tensor(allow_uneven=True) cuts it (slabs or tiles)."""
    for dim, c, parts in place_of(manager, full.ndim):
        counts, offsets = balanced_split(full.shape[dim], parts)
        index = [slice(None)] * full.ndim
        index[dim] = slice(offsets[c], offsets[c] + counts[c])
        full = full[tuple(index)]
    return full


def moves_for(manager, shape, kind, window):
    """[(dim, move)] of the window layout along each sharded dim of a field of ``shape`` (balanced shards)."""
    return [(dim, window_move(kind, balanced_split(shape[dim], parts)[0], window))
            for dim, _, parts in place_of(manager, len(shape))]


def target_of(full, manager, moves):
    """This rank's block of ``full`` in the moves' target layouts (what the re-distribution must give)."""
    for dim, move in moves:
        c = dict((d, c) for d, c, _ in place_of(manager, full.ndim))[dim]
        full = np.take(full, list(move.target.rows_of(c)), axis=dim) if isinstance(full, np.ndarray) \
            else full.index_select(dim, torch.tensor(move.target.rows_of(c)))
    return full


def domain_sum(manager, value):
    return manager.domain_comm.allreduce(float(value))


CASES = [("short", 3, (2, 3, 15, 12)), ("long", 3, (2, 3, 15, 12)), ("long", 2, (1, 2, 6, 4)),
         ("short", 4, (1, 2, 8, 8))]  # the last two: more ranks than windows or groups leaves some with none


@pytest.mark.parametrize("kind, window, shape", CASES)
def test_redistribute_equals_the_global_reference(world, kind, window, shape):
    """NumPy and Torch rows land bitwise; the inverse move brings them back; the adjoint passes the dot-product test."""
    problems = []
    rng = np.random.default_rng(7)
    full = rng.standard_normal(shape)
    probe = rng.standard_normal(shape)
    for label, manager in managers(world):
        with manager:
            moves = moves_for(manager, shape, kind, window)
            for make in (np.array, torch.from_numpy):
                x = make(np.ascontiguousarray(shard_of(full, manager)))
                y = x
                for dim, move in moves:
                    y = redistribute(y, move, dim, manager=manager)
                expected = make(np.ascontiguousarray(target_of(full, manager, moves)))
                if type(y) is not type(expected) or tuple(y.shape) != tuple(expected.shape) or not (y == expected).all():
                    problems.append(f"{label} {make.__name__}: forward differs")
                back = y
                for dim, move in reversed(moves):
                    back = redistribute(back, move.inverse, dim, manager=manager)
                if not (back == x).all():
                    problems.append(f"{label} {make.__name__}: the inverse move does not bring the rows back")
            # <y', R x> == <R^T y', x> summed over the domain, with R^T the inverse move.
            x = torch.from_numpy(np.ascontiguousarray(shard_of(full, manager))).requires_grad_()
            y_probe = torch.from_numpy(np.ascontiguousarray(target_of(probe, manager, moves)))
            y = x
            for dim, move in moves:
                y = Redistribute(move, dim, manager)(y)
            (y * y_probe).sum().backward()
            adjoint = y_probe
            for dim, move in reversed(moves):
                adjoint = redistribute(adjoint, move.inverse, dim, manager=manager)
            left = domain_sum(manager, (y.detach() * y_probe).sum())
            right = domain_sum(manager, (adjoint * x.detach()).sum())
            if abs(left - right) > TOLERANCE * max(1.0, abs(left)):
                problems.append(f"{label}: dot-product test {left} != {right}")
            if not torch.equal(x.grad, adjoint):
                problems.append(f"{label}: autograd's gradient is not the inverse move")
    assert not problems, problems


@pytest.mark.parametrize("kind, window, shape", CASES)
def test_both_dims_of_tiles_at_once(world, kind, window, shape):
    """With tiles, a pair of moves equals the two moves in turn (NumPy and Torch), its inverse brings the rows back,
    autograd's gradient is the inverse pair, and it sends no more bytes than the two moves (fewer when both move)."""
    from mpidomain.nn import CommStats

    if world.size != 4:
        pytest.skip("2 x 2 tiles need 4 ranks")
    problems = []
    rng = np.random.default_rng(11)
    full = rng.standard_normal(shape)
    with DomainParallelManager(4, (2, 2), (-2, -1)) as manager:
        moves = moves_for(manager, shape, kind, window)
        pair, dims = tuple(move for _, move in moves), (-2, -1)
        inverse = tuple(move.inverse for move in pair)
        for make in (np.array, torch.from_numpy):
            x = make(np.ascontiguousarray(shard_of(full, manager)))
            with CommStats(manager) as once:
                y = redistribute(x, pair, dims, manager=manager)
            with CommStats(manager) as twice:
                z = x
                for dim, move in moves:
                    z = redistribute(z, move, dim, manager=manager)
            if type(y) is not type(z) or tuple(y.shape) != tuple(z.shape) or not (y == z).all():
                problems.append(f"{make.__name__}: the pair differs from the two moves")
            if not (redistribute(y, inverse, dims, manager=manager) == x).all():
                problems.append(f"{make.__name__}: the inverse pair does not bring the rows back")
            sent = tuple(sum(v for k, v in stats.by_kind.items() if k.startswith("all-to-all"))
                         for stats in (once, twice))
            if sent[0] > sent[1]:
                problems.append(f"{make.__name__}: the pair sent {sent[0]} bytes, the two moves {sent[1]}")
        x = torch.from_numpy(np.ascontiguousarray(shard_of(full, manager))).requires_grad_()
        y = Redistribute(pair, dims, manager)(x)
        probe = torch.from_numpy(rng.standard_normal(tuple(y.shape)))
        (y * probe).sum().backward()
        if not torch.equal(x.grad, redistribute(probe, inverse, dims, manager=manager)):
            problems.append("autograd's gradient is not the inverse pair")
        totals = world.allgather(sent)
        if kind == "long" and shape[-2] >= 4 * window and sum(a for a, _ in totals) >= sum(b for _, b in totals):
            problems.append(f"the pair saved no bytes where both dims move: {totals}")
    everyone = world.allgather(problems)
    assert not any(everyone), everyone


def test_a_pair_of_moves_needs_tiles(world):
    """A pair of moves on slabs, or with one dim, raises the same ValueError on every rank."""
    messages = []
    with DomainParallelManager(world.size, world.size) as manager:
        move = window_move("long", balanced_split(8, world.size)[0], 2)
        for dim in ((-2, -1), -2):
            try:
                redistribute(np.zeros((2, balanced_split(8, world.size)[0][manager.domain_rank], 4)), (move, move),
                             dim, manager=manager)
                messages.append(None)
            except ValueError as error:
                messages.append(str(error))
    everyone = world.allgather(messages)
    assert all(m is not None and "call it once per dim" in m for m in messages), messages
    assert all(theirs == everyone[0] for theirs in everyone), everyone


def attention_twins(kind, window, dim=16):
    """CREDIT's CrossFormer Attention on one process and a copy to wrap, with the same parameters, float64."""
    crossformer = pytest.importorskip("credit_crossformer").crossformer()
    torch.manual_seed(3)
    single = crossformer.Attention(dim, kind, window, dim_head=8).double()
    copy = crossformer.Attention(dim, kind, window, dim_head=8).double()
    copy.load_state_dict(single.state_dict())
    return single, copy


def relative(a, b):
    """max |a - b| / max |b| (0 for empty shards: a rank of more ranks than rows holds none)."""
    a, b = a.detach(), b.detach()
    if not b.numel():
        return 0.0
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-300))


ATTENTION_CASES = [("short", 4, (2, 16, 20, 12)), ("long", 4, (2, 16, 20, 12)), ("long", 2, (1, 16, 4, 6)),
                   ("short", 4, (1, 16, 8, 8))]


@pytest.mark.credit
@pytest.mark.parametrize("kind, window, shape", ATTENTION_CASES)
def test_credit_window_attention_equals_one_process(world, kind, window, shape):
    """The wrapped CREDIT Attention on shards (windows straddling the edges, ranks with none): output and gradients."""
    problems = []
    for label, manager in managers(world):
        with manager:
            single, copy = attention_twins(kind, window)
            parallel = DomainParallelWindowAttention(copy, manager=manager)
            assert parallel.state_dict().keys() == single.state_dict().keys()
            generator = torch.Generator().manual_seed(5)
            full = torch.randn(shape, dtype=torch.float64, generator=generator)
            weights = torch.randn(shape, dtype=torch.float64, generator=generator)
            full_in = full.clone().requires_grad_()
            reference = single(full_in)
            (reference * weights).sum().backward()
            local_in = shard_of(full, manager).clone().requires_grad_()
            out = parallel(local_in)
            (out * shard_of(weights, manager)).sum().backward()
            if out.shape != shard_of(reference, manager).shape:
                problems.append(f"{label}: output shape {tuple(out.shape)}")
                continue
            error = manager.domain_comm.allreduce(relative(out, shard_of(reference.detach(), manager)), op=max_op())
            if error > TOLERANCE:
                problems.append(f"{label}: output relative error {error:.3g}")
            if relative(local_in.grad, shard_of(full_in.grad, manager)) > TOLERANCE:
                problems.append(f"{label}: input gradient differs")
            allreduce_gradients(parallel, group="domain", op="sum", manager=manager)
            # Relative to the largest gradient: the last bias of the position-bias MLP shifts all of a softmax's
            # logits alike, so its exact gradient is 0 and both sides hold round-off (~1e-17) there.
            scale = max(float(q.grad.abs().max()) for q in single.parameters())
            for (name, p), q in zip(parallel.named_parameters(), single.parameters()):
                error = float((p.grad - q.grad).abs().max()) / scale
                if error > TOLERANCE:
                    problems.append(f"{label}: gradient of {name}: error {error:.3g} of the largest gradient")
    assert not problems, problems


def max_op():
    from mpi4py import MPI

    return MPI.MAX


def test_the_spec_is_read_from_what_the_module_has():
    """CREDIT's Attention is recognised by its attributes; a module without them is not."""
    single, _ = attention_twins("long", 4)
    spec = window_attention_spec(single)
    assert (spec.kind, spec.window_size) == ("long", 4)
    assert window_attention_spec(torch.nn.Conv2d(2, 2, 1)) is None
    single.attn_type = "diagonal"
    assert window_attention_spec(single) is None
    with pytest.raises(TypeError, match="does not say its window"):
        DomainParallelWindowAttention(torch.nn.Identity())


def test_a_pair_on_odd_inputs(world):
    """On 2 x 2 tiles: channels-last and an empty batch give the two moves' result; a wrong element of the pair
    names itself; a dtype that differs on one rank names the differing field; a tile one column short on one rank in
    a latitude move raises; every rank raises alike."""
    if world.size != 4:
        pytest.skip("2 x 2 tiles need 4 ranks")
    problems, messages = [], []
    rng = np.random.default_rng(5)
    for shard_dim, shape in (((-3, -2), (2, 12, 8, 3)), ((-2, -1), (0, 3, 12, 8))):
        with DomainParallelManager(4, (2, 2), shard_dim) as manager:
            full = rng.standard_normal(shape)
            moves = moves_for(manager, shape, "long", 2)
            x = np.ascontiguousarray(shard_of(full, manager))
            y = redistribute(x, tuple(m for _, m in moves), shard_dim, manager=manager)
            z = x
            for dim, move in moves:
                z = redistribute(z, move, dim, manager=manager)
            if y.shape != z.shape or not (y == z).all():
                problems.append(f"shard_dim={shard_dim}, shape {shape}: the pair differs from the two moves")
    with DomainParallelManager(4, (2, 2), (-2, -1)) as manager:
        shape = (1, 2, 8, 8)
        pair = tuple(m for _, m in moves_for(manager, shape, "short", 2))
        x = np.zeros(shard_of(np.zeros(shape), manager).shape, dtype=np.float32 if manager.domain_rank else np.float64)
        for error, move, array in ((TypeError, (pair[0], 3), x.astype(np.float64)), (ValueError, pair, x)):
            try:
                redistribute(array, move, (-2, -1), manager=manager)
                messages.append(None)
            except error as caught:
                messages.append(str(caught))
        # One latitude move: a rank whose tile is one column short must not leave its column's Alltoallv unmatched.
        tile = shard_of(np.zeros(shape), manager)
        lat_move = moves_for(manager, shape, "short", 2)[0][1]
        try:
            redistribute(tile[..., :tile.shape[-1] - (manager.domain_rank == 2)], lat_move, -2, manager=manager)
            messages.append(None)
        except ValueError as caught:
            messages.append(str(caught))
    everyone = world.allgather((problems, messages))
    assert all(theirs == everyone[0] for theirs in everyone), everyone
    assert not problems, problems
    assert messages[0] is not None and "move[1] has type int" in messages[0], messages
    assert messages[1] is not None and "a different array kind, dtype and device" in messages[1], messages
    assert messages[2] is not None and "must hold the same extents of x apart from dim 2" in messages[2], messages


def test_a_layout_that_cannot_work_raises_alike_on_every_rank(world):
    """A latitude extent the window does not divide, and a shard the move was not made for, raise alike everywhere."""
    messages = []
    with DomainParallelManager(world.size, world.size) as manager:
        parallel = DomainParallelWindowAttention(torch.nn.Identity(), 4, "short", manager=manager)
        calls = [lambda: redistribute(np.zeros((2 + (manager.domain_rank == 0), 3)),
                                      window_move("short", (2,) * world.size, 1), 0, manager=manager)]
        if world.size > 1:  # one rank holds the whole field: nothing to re-distribute, the module itself decides
            calls.append(lambda: parallel(shard_of(torch.zeros(1, 16, 10, 8, dtype=torch.float64), manager)))
        for call in calls:
            try:
                call()
                messages.append(None)
            except ValueError as error:
                messages.append(str(error))
    everyone = world.allgather(messages)
    assert all(m is not None for m in messages), messages
    assert all(theirs == everyone[0] for theirs in everyone), everyone
    assert "x has 3 rows along dim 0, but the move's source layout gives this rank" in messages[0]
    if world.size > 1:
        assert "10 rows, not a multiple of window_size=4" in messages[1]


@pytest.mark.parametrize("size", [3, 5])
@pytest.mark.mpi_job
def test_worlds_of_three_and_five_ranks(world, size):
    """The re-distribution and error tests above in a fresh job of ``size`` ranks (from a one-rank suite only)."""
    if world.size != 1:
        pytest.skip("run from the one-rank suite; the others have their own world")
    result = None
    if world.rank == 0:
        job = run_mpi(size, ["-m", "pytest", "-q", "-p", "no:cacheprovider", f"{REPO}/tests/test_window_redistribution.py",
                             "-k", "redistribute_equals or cannot_work", "-W", "ignore"], timeout=280)
        result = (job.returncode, job.stdout[-2000:] + job.stderr[-2000:])
    returncode, output = share(world, result)
    assert returncode == 0, output


def test_device_paths_move_the_same_rows(world, fake_device_path):
    """The staged and direct (CUDA-aware) transports, driven with host tensors, give the reference rows."""
    shape = (2, 3, 14, 6)
    full = torch.from_numpy(np.random.default_rng(2).standard_normal(shape))
    problems = []
    with DomainParallelManager(world.size, world.size) as manager:
        moves = moves_for(manager, shape, "long", 2)
        y = shard_of(full, manager).contiguous()
        for dim, move in moves:
            y = redistribute(y, move, dim, manager=manager)
        if not torch.equal(y, target_of(full, manager, moves)):
            problems.append(f"{fake_device_path}: rows differ")
    assert not problems, problems
