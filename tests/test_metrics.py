"""Latitude-weighted loss, RMSE and ACC from slabs and tiles equal one process's on the whole field.

Every rank computes the one-process reference on the whole field (written from CREDIT's
definitions, and checked against CREDIT's own LatWeightedMetrics) and compares its part.
"""

import numpy as np
import pytest

from mpidomain import DomainParallelManager, shard_tensor
from mpidomain.nn import (LatitudeWeightedMSE, allreduce_gradients, latitude_weighted_acc, latitude_weighted_rmse,
                          latitude_weights)

torch = pytest.importorskip("torch")

H, W = 13, 24  # 13 rows: uneven on 2 and 4 ranks
LATITUDES = np.linspace(-80.0, 85.0, H)  # not symmetric: a local mean of cos differs from the global one
SHAPES = [(2, 3, H, W), (2, 3, 2, H, W)]
TOLERANCE = dict(rtol=1e-12, atol=1e-15)


def layouts(size):
    """(domain_parallel_size, shard_dim) of every decomposition the test runs on ``size`` ranks, data-parallel too."""
    found = []
    for d in (d for d in range(1, size + 1) if size % d == 0):
        found += [(d, -2), (d, -1)]
        found += [((a, d // a), (-2, -1)) for a in range(1, d + 1) if d % a == 0]
    return found


def reference_weights(latitude=LATITUDES):
    weights = np.cos(np.deg2rad(latitude))
    return weights / weights.mean()


def reference_mse(pred, target):
    """CREDIT's VariableTotalLoss2D with MSE: each channel's mean of weight * error**2, then their mean."""
    weights = torch.from_numpy(reference_weights()).view(H, 1)
    squared = (pred - target) ** 2
    return torch.stack([(squared[:, c] * weights).mean() for c in range(pred.shape[1])]).mean()


def reference_rmse(pred, target):
    """CREDIT's LatWeightedMetrics: sqrt of each sample's weighted spatial mean, then the mean over samples."""
    weights = torch.from_numpy(reference_weights()).view(H, 1)
    squared = (pred - target) ** 2
    return torch.stack([torch.sqrt((squared[:, c] * weights).mean(dim=(-2, -1))).mean() for c in range(pred.shape[1])])


def reference_acc(pred, target, climatology):
    """CREDIT's LatWeightedMetrics with a climatology: plain mean anomaly removed, one correlation per channel."""
    weights = torch.from_numpy(reference_weights()).view(H, 1)
    forecast, truth = pred - climatology, target - climatology
    scores = []
    for c in range(pred.shape[1]):
        f, t = forecast[:, c] - forecast[:, c].mean(), truth[:, c] - truth[:, c].mean()
        scores.append((weights * f * t).sum() / (torch.sqrt((weights * f**2).sum() * (weights * t**2).sum()) + 1e-7))
    return torch.stack(scores)


def fields(shape, seed):
    """Prediction, target and climatology of one domain group (``seed``: its data-parallel index)."""
    generator = torch.Generator().manual_seed(1000 + seed)
    pred, target = (torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(2))
    climatology = 0.3 * torch.randn(shape[1:], generator=generator, dtype=torch.float64) + 0.2
    return pred, target + 0.5 * pred, climatology


def rows(manager, latitude=LATITUDES):
    """This rank's latitudes: the first column of its part of a (H, W) grid of latitudes."""
    grid = np.repeat(np.asarray(latitude)[:, None], W, axis=1)
    return shard_tensor(grid, manager=manager, allow_uneven=True)[:, 0]


def part(x, manager):
    return shard_tensor(x, manager=manager, allow_uneven=True)


def test_references_are_credits():
    """The references equal CREDIT's own LatWeightedMetrics (RMSE, MSE, ACC with a climatology). Local."""
    metrics_module = pytest.importorskip("credit.metrics.gen_1.metrics")
    for shape in SHAPES:
        pred, target, climatology = fields(shape, 0)
        metrics = object.__new__(metrics_module.LatWeightedMetrics)  # its __init__ reads files; set what it uses
        metrics.w_lat = torch.from_numpy(reference_weights()).view(1, H, 1)
        metrics.w_var, metrics.ensemble_size = None, 1
        metrics.vars = [f"v{c}" for c in range(shape[1])]
        scores = metrics(pred, target, clim=climatology)
        for name, ours in (("rmse", reference_rmse(pred, target)), ("acc", reference_acc(pred, target, climatology))):
            theirs = torch.stack([scores[f"{name}_v{c}"] for c in range(shape[1])])
            torch.testing.assert_close(ours, theirs, **TOLERANCE)
        mse = torch.stack([scores[f"mse_v{c}"] for c in range(shape[1])]).mean()
        torch.testing.assert_close(reference_mse(pred, target), mse, **TOLERANCE)


def test_latitude_weights_are_the_global_rows(world):
    """Each rank gets its rows of cos(lat) / mean over the global grid, on slabs, tiles and longitude slabs."""
    expected = reference_weights()
    for layout in layouts(world.size):
        with DomainParallelManager(world.size, *layout) as manager:
            mine = rows(manager)
            start = int(np.searchsorted(LATITUDES, mine[0])) if len(mine) else 0
            np.testing.assert_allclose(latitude_weights(mine, manager), expected[start:start + len(mine)],
                                       rtol=1e-12, atol=0, err_msg=str(layout))
            from_tensor = latitude_weights(torch.from_numpy(mine), manager)
            assert from_tensor.dtype == torch.float64
            np.testing.assert_allclose(from_tensor.numpy(), expected[start:start + len(mine)], rtol=1e-12, atol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_mse_value_and_input_gradient_are_one_process(world, shape):
    """The loss is the whole field's on every rank; its gradient is this rank's part of the whole gradient."""
    for layout in layouts(world.size):
        with DomainParallelManager(world.size, *layout) as manager:
            pred, target, _ = fields(shape, manager.dp_rank)
            whole = pred.clone().requires_grad_()
            expected = reference_mse(whole, target)
            expected.backward()
            mine = part(pred, manager).requires_grad_()
            loss = LatitudeWeightedMSE(rows(manager), manager)(mine, part(target, manager))
            loss.backward()
            assert loss.dtype == torch.float64
            torch.testing.assert_close(loss, expected.detach(), **TOLERANCE, msg=f"{layout}: loss")
            torch.testing.assert_close(mine.grad, part(whole.grad, manager), **TOLERANCE, msg=f"{layout}: gradient")


def test_mse_parameter_gradients_after_domain_sum_are_one_process(world):
    """backward on every rank, then allreduce_gradients(group="domain", op="sum"): one process's gradients."""
    for layout in layouts(world.size):
        with DomainParallelManager(world.size, *layout) as manager:
            pred, target, _ = fields((2, 3, H, W), manager.dp_rank)
            torch.manual_seed(7)
            model = torch.nn.Conv2d(3, 3, 1, dtype=torch.float64)  # pointwise: the same on a part as on the whole
            reference_mse(model(pred), target).backward()
            expected = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            LatitudeWeightedMSE(rows(manager), manager)(model(part(pred, manager)), part(target, manager)).backward()
            allreduce_gradients(model, group="domain", op="sum", manager=manager)
            for got, want in zip((p.grad for p in model.parameters()), expected):
                torch.testing.assert_close(got, want, **TOLERANCE, msg=str(layout))


@pytest.mark.parametrize("shape", SHAPES)
def test_rmse_and_acc_are_one_process(world, shape):
    """Per-channel RMSE and ACC equal one process's on every rank (pred requiring grad is detached)."""
    for layout in layouts(world.size):
        with DomainParallelManager(world.size, *layout) as manager:
            pred, target, climatology = fields(shape, manager.dp_rank)
            mine, truth = part(pred, manager).requires_grad_(), part(target, manager)
            rmse = latitude_weighted_rmse(mine, truth, rows(manager), manager)
            assert rmse.shape == (shape[1],) and rmse.dtype == torch.float64 and not rmse.requires_grad
            torch.testing.assert_close(rmse, reference_rmse(pred, target), **TOLERANCE, msg=f"{layout}: rmse")
            expected = reference_acc(pred, target, climatology)
            for local_climatology in (part(climatology, manager), part(climatology[None], manager).numpy()):
                acc = latitude_weighted_acc(mine, truth, local_climatology, rows(manager), manager)
                torch.testing.assert_close(acc, expected, **TOLERANCE, msg=f"{layout}: acc")
            constant = climatology.mean(dim=(-2, -1), keepdim=True)  # (C, 1, 1): broadcasts to any part
            torch.testing.assert_close(latitude_weighted_acc(mine, truth, constant, rows(manager), manager),
                                       reference_acc(pred, target, constant), **TOLERANCE, msg=f"{layout}: acc")


def test_one_process_without_manager(world):
    """No manager in a one-process job: the whole field is this rank's."""
    if world.size != 1:
        pytest.skip("a job of several processes needs a manager")
    pred, target, climatology = fields((2, 3, H, W), 0)
    whole = pred.clone().requires_grad_()
    loss = LatitudeWeightedMSE(LATITUDES)(whole, target)
    loss.backward()
    reference = pred.clone().requires_grad_()
    reference_mse(reference, target).backward()
    torch.testing.assert_close(loss, reference_mse(pred, target), **TOLERANCE)
    torch.testing.assert_close(whole.grad, reference.grad, **TOLERANCE)
    torch.testing.assert_close(latitude_weighted_rmse(pred, target, LATITUDES), reference_rmse(pred, target),
                               **TOLERANCE)
    torch.testing.assert_close(latitude_weighted_acc(pred, target, climatology, LATITUDES),
                               reference_acc(pred, target, climatology), **TOLERANCE)
    np.testing.assert_allclose(latitude_weights(LATITUDES), reference_weights(), rtol=1e-12)


def _messages(world, call):
    """Every rank's error message from ``call`` (None where it did not raise)."""
    try:
        call()
        return world.allgather(None)
    except (ValueError, TypeError) as error:
        return world.allgather(f"{type(error).__name__}: {error}")


def test_mistakes_raise_the_same_error_on_every_rank(world):
    """A mistake on the last rank alone: every rank raises the same error (no hang)."""
    if world.size < 2:
        pytest.skip("a domain of one rank has no other rank to disagree with")
    last = world.rank == world.size - 1
    for layout in ((world.size, -2), ((1, world.size), (-2, -1))):
        with DomainParallelManager(world.size, *layout) as manager:
            pred, target, climatology = (part(x, manager) for x in fields((2, 3, H, W), 0))
            lat = rows(manager)
            loss = LatitudeWeightedMSE(lat, manager)
            cases = {
                "latitude length": lambda: latitude_weighted_rmse(pred, target, lat[:-1] if last else lat, manager),
                "2-D latitude": lambda: latitude_weights(lat[:, None] if last else lat, manager),
                "shapes differ": lambda: latitude_weighted_rmse(pred, target[:1] if last else target, lat, manager),
                "channels differ": lambda: latitude_weighted_acc(pred[:, :2] if last else pred,
                                                                 target[:, :2] if last else target,
                                                                 climatology[:2] if last else climatology, lat,
                                                                 manager),
                "loss channels": lambda: loss(pred[:, :2] if last else pred, target[:, :2] if last else target),
                "loss rows": lambda: loss(pred[..., 1:, :] if last else pred, target[..., 1:, :] if last else target),
                "climatology": lambda: latitude_weighted_acc(pred, target, climatology[:, :1, :1, None] if last
                                                             else climatology, lat, manager),
            }
            if len(manager.domain_shape) == 2:  # one tile row: every rank holds the same latitudes
                cases["tile row latitudes"] = lambda: latitude_weights(lat + 1.0 if last else lat, manager)
            for name, case in cases.items():
                messages = _messages(world, case)
                assert messages[0] is not None and len(set(messages)) == 1, (layout, name, messages)
