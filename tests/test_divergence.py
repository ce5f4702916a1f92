"""Randomised divergence test: random legal call sequences against a global reference, and random
illegal deviations that must end with an error on every rank within seconds.

Legal sequences run in the suite's own world (serially, ``mpiexec -n 1/2/4``). One RNG seeded alike
on every rank says what to do; each rank also makes choices that may legally differ (its extent
along the sharded dim, changed on some ranks only, and its spelling of ``dim``). Mismatches are
collected and asserted once at the end, so no rank leaves the sequence while the others are still
in a collective.

Deviations run this file as a script in fresh 2- and 3-rank jobs (``python test_divergence.py
--seed S``), each under a timeout: every trial is a short legal sequence in which one random rank
passes a random wrong argument (or makes another call) at one random step; every rank catches what
it raises, prints one line, and goes on with the next trial, whose answers must still be right.
MPIDOMAIN_TEST_DIVERGENCE_SEED=k shifts the jobs' seeds, to explore others.
"""

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
import traceback

import numpy as np
import pytest
from mpi4py import MPI

import mpidomain
from mpidomain import DomainParallelManager, HaloPlan, allreduce, gather_tensor, halo_exchange
from mpitest import run_mpi
from reference import pad_along

CACHE_SIZE = 16  # plans halo_exchange keeps per manager (docs/halo.md)
NUMPY_DTYPES = ("float32", "float64", "int32", "complex64")
TORCH_DTYPES = NUMPY_DTYPES + ("bfloat16", "float16")
FLOATS = ("float32", "float64", "bfloat16", "float16")
MAX_EXTENT = 7  # along the sharded dim, per rank
BIG_ROW = 256 * 1024  # bytes a row of the big layouts holds: halos from 256 KiB arrive straight in place
VIEWS = ("contiguous",) * 6 + ("strided", "transposed", "reversed", "conjugate")  # how inputs lie in memory
DETECTION_SECONDS = 10  # a generous bound: a deviating step takes milliseconds
WATCHDOG_SECONDS = 20  # a job step running longer is a hang: the job prints HUNG and ends
JOB_TIMEOUT = 90
LINE = re.compile(r"^RANK (\d+) TRIAL (\d+) STEP (\d+) (OK|WRONG|RAISED|SKIPPED|HUNG) ([\d.]+)s ?(.*)$")
PLAN = re.compile(r"^TRIAL (\d+) DEVIATES AT STEP (\w+) ON RANK (\d+): (.*)$")
WHAT = re.compile(r"^TRIAL (\d+) STEP (\d+) IS (.*)$")


def _torch():
    import torch

    return torch


# -- arrays and the global reference ------------------------------------------------------------


def take(a, axis, start, stop):
    """Rows ``start:stop`` of ``a`` along ``axis``."""
    return a[(slice(None),) * axis + (slice(start, stop),)]


def random_values(rng, shape, dtype):
    """Values exact in ``dtype`` (quarters up to 64, integers for int32), as float64/complex128/int64."""
    values = rng.integers(-64, 64, size=shape)
    if dtype == "int32":
        return values
    if dtype == "complex64":
        return (values + 1j * rng.integers(-64, 64, size=shape)) / 4
    return values / 4


def stored(values, dtype):
    """``values`` as the NumPy array of ``dtype``'s bytes (int16 bit patterns for bfloat16)."""
    if dtype == "bfloat16":
        torch = _torch()
        return torch.from_numpy(np.asarray(values, np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
    return np.ascontiguousarray(np.asarray(values).astype(dtype))


def as_array(storage, kind, dtype, view="contiguous"):
    """A fresh array of ``kind`` and ``dtype`` holding ``storage``, laid out as ``view`` says.

    ``"strided"``: every other element of a wider array; ``"transposed"``: Fortran order;
    ``"reversed"``: negative strides (NumPy only); ``"conjugate"``: Torch's lazy conjugate of
    the conjugate values (complex only). Where a view does not apply, a contiguous copy.
    """
    if view == "strided":
        base = np.repeat(storage, 2, axis=-1)
    elif view == "transposed":
        base = np.ascontiguousarray(storage.T)
    elif view == "reversed" and kind == "numpy":
        base = storage[::-1].copy()
    elif view == "conjugate" and kind == "torch" and dtype == "complex64":
        base = np.conj(storage)
    else:
        view, base = "contiguous", storage.copy()
    if kind == "numpy":
        return {"strided": base[..., ::2], "transposed": base.T, "reversed": base[::-1]}.get(view, base)
    torch = _torch()
    tensor = torch.from_numpy(base)
    if dtype == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    if view == "strided":
        return tensor[..., ::2]
    if view == "transposed":
        return tensor.permute(*reversed(range(tensor.ndim)))
    return tensor.conj() if view == "conjugate" else tensor


def empty_result(shape, kind, dtype, contiguous=True):
    """An uninitialised array for ``out=``: C-contiguous, or the transpose of one."""
    shape = tuple(shape) if contiguous else tuple(reversed(shape))
    if kind == "numpy":
        out = np.empty(shape, dtype)
    else:
        out = _torch().empty(shape, dtype=getattr(_torch(), dtype))
    return out if contiguous else out.T if kind == "numpy" else out.permute(*reversed(range(out.ndim)))


def storage_of(result, kind, dtype):
    """``result``'s values as stored() writes them, or None if it is not an array of ``kind`` and ``dtype``."""
    if kind == "numpy":
        return result if isinstance(result, np.ndarray) and result.dtype == np.dtype(dtype) else None
    torch = _torch()
    if not isinstance(result, torch.Tensor) or result.dtype != getattr(torch, dtype) or result.device.type != "cpu":
        return None
    result = result.detach().resolve_conj().resolve_neg()
    return (result.view(torch.int16) if dtype == "bfloat16" else result).numpy()


def difference(result, expected, kind, dtype):
    """None if ``result`` is bit for bit ``expected`` (in storage form), else what differs."""
    got = storage_of(result, kind, dtype)
    if got is None:
        return f"got a {type(result).__module__}.{type(result).__name__} of dtype {getattr(result, 'dtype', None)}"
    if got.shape != expected.shape:
        return f"shape {got.shape}, expected {expected.shape}"
    if np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(expected).tobytes():
        return None
    wrong = np.argwhere(np.ascontiguousarray(got).view(np.uint8).reshape(got.shape + (-1,))
                        != np.ascontiguousarray(expected).view(np.uint8).reshape(expected.shape + (-1,)))
    return f"{len({tuple(w[:-1]) for w in wrong})} elements differ, first at {tuple(int(i) for i in wrong[0][:-1])}"


def padded_adjoint(extents, h, periodic, weights, axis):
    """Gradient (float64) wrt the global field of sum_q (rank q's window of the padded field * weights[q]).

    The field has ``sum(extents)`` rows along ``axis`` and rank q's window rows
    ``[offset_q, offset_q + extents[q] + 2h)`` of the padded field: each global row gets the
    weights of every place it appears in any window (wrapped ghost rows included).
    """
    total = sum(extents)
    rows = np.arange(total)
    index = np.pad(rows, h, mode="wrap") if periodic else np.pad(rows, h, constant_values=-1)
    shape = list(weights[0].shape)
    shape[axis] = total
    grad = np.zeros(shape)
    front = np.moveaxis(grad, axis, 0)
    offset = 0
    for n, w in zip(extents, weights):
        window = index[offset:offset + n + 2 * h]
        keep = window >= 0
        np.add.at(front, window[keep], np.moveaxis(np.asarray(w, np.float64), axis, 0)[keep])
        offset += n
    return grad


# -- random legal sequences -----------------------------------------------------------------------


class Layout:
    """One kind of call: manager, array kind, dtype, shape, halo width, periodic; per-rank extents."""

    def __init__(self, index, rng, manager_index, manager, kinds, world_size, big=False):
        self.index = index
        self.manager_index = manager_index
        self.kind = str(rng.choice(kinds))
        self.dtype = str(rng.choice(TORCH_DTYPES if self.kind == "torch" else NUMPY_DTYPES))
        self.ndim = int(rng.integers(2, 5))
        self.h = int(rng.integers(0, 4))
        if big:  # halos of BIG_ROW bytes a row: large enough to arrive in place (docs/halo.md)
            self.dtype, self.ndim, self.h = str(rng.choice(["float64", "complex64"])), 2, int(rng.integers(1, 4))
        self.axis = manager.shard_dim % self.ndim  # the dim the manager shards
        self.shape = [int(n) for n in rng.integers(1, 5, self.ndim)]  # extents, but along axis
        if big:
            self.shape[1 - self.axis] = BIG_ROW // 8
        self.periodic = bool(rng.integers(2))
        # Along axis, per world rank: at least h rows (0 allowed where h = 0).
        self.extents = [int(rng.integers(self.h, MAX_EXTENT)) for _ in range(world_size)]

    def __repr__(self):
        return (f"layout {self.index} (manager {self.manager_index}, {self.kind} {self.dtype}, shape {self.shape} "
                f"sharded axis {self.axis}, h={self.h}, periodic={self.periodic})")


class Step:
    """Everything one step does, drawn from the shared RNG: alike on every rank."""

    def __init__(self, number, layout, op, extents):
        self.number, self.layout, self.op, self.extents = number, layout, op, extents
        self.hold_id = None  # the held plan a "reuse" step exchanges with
        self.free_ids = ()  # held plans a "hold" step frees first (local)

    def __repr__(self):
        along = f" along axis {self.unsharded}" if self.op == "unsharded" else (
            f" along axis {self.gradient_axis}" if self.op == "autograd" else "")
        if self.op == "reuse":
            return f"step {self.number} reuse of the plan held since step {self.hold_id}"
        return f"step {self.number} {self.op}{along} on {self.layout}, extents {self.extents}, {self.view} input"


class Call:
    """What this rank passes at one step (a deviation changes it on one rank)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __repr__(self):
        x = self.x
        what = f"{type(x).__name__} {getattr(x, 'dtype', '')} {tuple(getattr(x, 'shape', ()))}"
        return f"{self.op}(x={what}, h={self.h!r}, dim={self.dim!r}, periodic={self.periodic!r})"


class Sequence:
    """A random sequence of legal mpidomain calls, checked against the global reference.

    ``shared`` is seeded alike on every rank and drives everything but the
    choices each rank may make alone (``mine``: the spelling of ``dim``).
    """

    def __init__(self, seed, managers, kinds, world, layouts_per_manager, groups=("domain", "data_parallel")):
        self.seed = seed
        self.groups = groups
        self.shared = np.random.default_rng(seed)
        self.mine = np.random.default_rng([seed, world.rank])
        self.size, self.rank = world.size, world.rank
        self.managers = managers
        self.kinds = kinds
        self.layouts = [Layout(len(managers) * i + m, self.shared, m, manager, kinds, world.size, big=i % 10 == 9)
                        for i in range(layouts_per_manager) for m, manager in enumerate(managers)]
        self.held = {}  # hold step number -> (plan, shard, expected padded shard)
        self.live_holds = []  # at draw time
        self.visited = {m: set() for m in range(len(managers))}
        self.kept = []  # (step, name, result, expected): results the program holds must never change
        self.test_bug = None

    # -- drawing (shared RNG only) --
    def layout_order(self, steps):
        """Every layout once, plus random revisits, shuffled."""
        count = len(self.layouts)
        extra = list(self.shared.integers(0, count, max(0, steps - count)))
        return [self.layouts[int(i)] for i in self.shared.permutation(list(range(count)) + extra)][:steps]

    def draw(self, number, layout):
        """Return step ``number`` on ``layout``, first changing the extents of some ranks."""
        rng = self.shared
        if rng.random() < 0.5:  # some ranks only (all of one, in a world of one) change their extent
            changing = rng.choice(self.size, int(rng.integers(1, self.size)) if self.size > 1 else 1, replace=False)
            for q in changing:
                layout.extents[q] = int(np.clip(layout.extents[q] + rng.choice([-1, 1]), layout.h, MAX_EXTENT - 1))
        ops = ["exchange"] * 3 + ["unsharded", "plan", "hold", "gather", "allreduce"]
        if layout.kind == "torch":
            ops += ["nn"] * 2 + ["autograd"] * 4 * (layout.dtype in FLOATS)
        if self.live_holds:
            ops += ["reuse"] * 2
        op = str(rng.choice(ops))
        step = Step(number, layout, op, list(layout.extents))
        step.values = random_values(rng, self.full_shape(layout, sum(step.extents)), layout.dtype)
        step.view = str(rng.choice(VIEWS))
        if (step.view == "reversed" and layout.kind != "numpy") or (
                step.view == "conjugate" and (layout.kind, layout.dtype) != ("torch", "complex64")):
            step.view = "contiguous"
        step.variant = int(rng.integers(2))  # halo_exchange or HaloExchange; exchange or start/wait; out=
        step.keep = bool(rng.random() < 0.15)  # hold on to its results, check them again at the end
        others = [a for a in range(layout.ndim) if a != layout.axis and layout.shape[a] >= layout.h]
        step.unsharded = int(rng.choice(others)) if others else None
        if op == "unsharded" and step.unsharded is None:
            step.op = "exchange"
        step.gradient_axis = step.unsharded if (step.unsharded is not None and rng.random() < 0.25) else layout.axis
        if op == "autograd":
            step.weights = [rng.integers(-3, 4, size=self.shard_shape(layout, n, step.gradient_axis, layout.h))
                            for n in step.extents]
        if op == "allreduce":
            step.group = str(rng.choice(self.groups))
            step.reduce_op = "max" if layout.dtype in ("bfloat16", "float16") else "sum"
            step.reduce_op = str(rng.choice(["max", "min"])) if layout.dtype != "complex64" and rng.random() < 0.3 \
                else step.reduce_op
            step.addends = [random_values(rng, self.full_shape(layout, 2), layout.dtype) for _ in range(self.size)]
        if op == "hold":
            if len(self.live_holds) == 3:
                step.free_ids = (self.live_holds.pop(0),)
            self.live_holds.append(number)
        if op == "reuse":
            step.hold_id = self.live_holds[int(rng.integers(len(self.live_holds)))]
        self.visited[layout.manager_index].add(layout.index)
        return step

    @staticmethod
    def full_shape(layout, extent, axis=None):
        shape = list(layout.shape)
        shape[layout.axis if axis is None else axis] = extent
        return tuple(shape)

    @staticmethod
    def shard_shape(layout, n, axis, h):
        shape = list(layout.shape)
        shape[layout.axis] = n
        shape[axis] += 2 * h
        return tuple(shape)

    # -- this rank's view --
    def members(self, manager, group="domain"):
        d = manager.domain_parallel_size
        if group == "domain":
            first = self.rank // d * d
            return list(range(first, first + d))
        return [q for q in range(self.size) if q % d == self.rank % d]

    def spell(self, axis, ndim, manager, none_ok=True):
        """``axis`` as this rank spells it: positive, negative, or None for the manager's shard_dim."""
        choices = [axis, axis - ndim]
        if none_ok and axis == manager.shard_dim % ndim:
            choices.append(None)
        return choices[int(self.mine.integers(len(choices)))]

    def prepare(self, step):
        """Return (this rank's Call, the expected results) for ``step``."""
        layout = step.layout
        manager = self.managers[layout.manager_index]
        members = self.members(manager)
        starts = np.concatenate([[0], np.cumsum(step.extents)]).astype(int)
        n, axis = step.extents[self.rank], layout.axis
        group = take(step.values, axis, starts[members[0]], starts[members[-1] + 1])
        offset = starts[self.rank] - starts[members[0]]
        shard = take(step.values, axis, starts[self.rank], starts[self.rank] + n)
        x = as_array(stored(shard, layout.dtype), layout.kind, layout.dtype, step.view)
        call = Call(op=step.op, x=x, h=layout.h, periodic=layout.periodic, manager=manager, axis=axis,
                    dim=self.spell(axis, layout.ndim, manager), variant=step.variant, step=step, out=None)
        h, periodic = layout.h, layout.periodic
        padded_group = pad_along(stored(group, layout.dtype), axis, h, periodic)
        expected = {"padded": take(padded_group, axis, offset, offset + n + 2 * h)}
        if step.op == "unsharded":
            call.axis = step.unsharded
            call.dim = self.spell(step.unsharded, layout.ndim, manager)
            expected["padded"] = pad_along(stored(shard, layout.dtype), step.unsharded, h, periodic)
        if step.op in ("exchange", "unsharded") and self.mine.random() < 0.4:  # out= on some ranks only
            call.out = empty_result(expected["padded"].shape, layout.kind, layout.dtype)
            expected["out"] = expected["padded"]
        if step.op == "gather":
            call.dim = self.spell(axis, layout.ndim, manager, none_ok=False)
            expected = {"gathered": stored(group, layout.dtype)}
        elif step.op == "allreduce":
            reduce = {"sum": np.sum, "max": np.max, "min": np.min}[step.reduce_op]
            together = np.stack([step.addends[q] for q in self.members(manager, step.group)])
            call.x = as_array(stored(step.addends[self.rank], layout.dtype), layout.kind, layout.dtype, step.view)
            call.reduce_op, call.group = step.reduce_op, step.group
            expected = {"reduced": stored(reduce(together, axis=0), layout.dtype)}
        elif step.op == "autograd":
            gaxis = step.gradient_axis
            call.x = x.requires_grad_()
            call.axis = gaxis
            call.dim = self.spell(gaxis, layout.ndim, manager)
            call.weights = as_array(stored(step.weights[self.rank], layout.dtype), "torch", layout.dtype)
            if gaxis == axis:
                grad = padded_adjoint([step.extents[q] for q in members], h, periodic,
                                      [step.weights[q] for q in members], axis)
                expected["grad"] = take(grad, axis, offset, offset + n)
            else:
                expected["padded"] = pad_along(stored(shard, layout.dtype), gaxis, h, periodic)
                expected["grad"] = padded_adjoint([layout.shape[gaxis]], h, periodic, [step.weights[self.rank]], gaxis)
        elif step.op == "reuse":
            call = None
            expected = {}
        return call, expected

    # -- running --
    def perform(self, call):
        """Make ``call``; return {name: result}. Collective, like the calls it makes."""
        op, x, h, dim, periodic, manager = call.op, call.x, call.h, call.dim, call.periodic, call.manager
        if op in ("exchange", "unsharded"):
            return {"padded": halo_exchange(x, h, dim, periodic=periodic, manager=manager, out=call.out),
                    "out": call.out}
        if op == "nn":
            from mpidomain.nn import HaloExchange

            return {"padded": HaloExchange(h, dim, periodic, manager=manager)(x)}
        if op in ("plan", "hold"):
            plan = HaloPlan(x, h, dim, periodic=periodic, manager=manager)
            results = {"padded": plan.pad(x, out=plan.empty()) if call.variant else plan.pad(x)}
            if op == "hold":
                self.held[call.step.number] = (plan, x, None)
                return results
            with plan:
                buffer = plan.empty()
                plan.interior(buffer)[...] = x
                if call.variant:
                    plan.start(buffer)
                    plan.wait()
                else:
                    plan.exchange(buffer)
                results["exchanged"] = buffer
            return results
        if op == "gather":
            return {"gathered": gather_tensor(x, dim, manager)}
        if op == "allreduce":
            return {"reduced": allreduce(x, op=call.reduce_op, group=call.group, manager=manager)}
        if op == "autograd":
            if call.variant:
                from mpidomain.nn import HaloExchange

                padded = HaloExchange(h, dim, periodic, manager=manager)(x)
            else:
                padded = halo_exchange(x, h, dim, periodic=periodic, manager=manager)
            (padded * call.weights).sum().backward()
            return {"padded": padded, "grad": x.grad}
        if op == "call_plan":  # a deviation: build a plan where the others call halo_exchange
            with HaloPlan(x, h, dim, periodic=periodic, manager=manager) as plan:
                return {"padded": plan.pad(x)}
        if op == "call_allreduce":
            return {"reduced": allreduce(x, manager=manager)}
        if op == "call_gather":
            return {"gathered": gather_tensor(x, call.axis, manager)}
        raise AssertionError(f"unknown op {op}")

    def run(self, step, deviation=None):
        """Run ``step`` on this rank (``deviation(call)`` changes this rank's call); return the problems found."""
        if step.op == "reuse":
            return self.reuse(step)
        for number in step.free_ids:  # local: plans free without communication
            entry = self.held.pop(number, None)
            if entry is not None:
                entry[0].free()
        call, expected = self.prepare(step)
        if deviation is not None:
            try:
                call = deviation(call)
            except Exception as exc:  # a bug of this test: still make a call the others can detect
                call.x, self.test_bug = None, f"TEST BUG: the deviation raised {type(exc).__name__}: {exc}"
            expected = {}
        results = self.perform(call)
        if step.op == "hold" and deviation is None:
            plan, x, _ = self.held[step.number]
            self.held[step.number] = (plan, x, expected["padded"])
        layout = step.layout
        problems = []
        for name, want in expected.items():
            got = results.get(name)
            if name == "grad":
                got = None if got is None else got.double().numpy()
                wrong = "no gradient" if got is None else difference(got, want, "numpy", "float64")
            else:
                wrong = difference(got, want, layout.kind, layout.dtype)
            if wrong is not None:
                problems.append(f"{step}: rank {self.rank} called {call}: {name}: {wrong}")
            elif name != "grad" and step.keep:
                self.kept.append((step, name, got, want))
        return problems

    def check_kept(self):
        """Return the problems with results held since earlier steps: the library must never write them again."""
        return [f"{step}: rank {self.rank}: its {name} result changed later: {wrong}"
                for step, name, result, want in self.kept
                if (wrong := difference(result, want, step.layout.kind, step.layout.dtype)) is not None]

    def reuse(self, step):
        """Exchange again with a plan held since an earlier step (its cache churned meanwhile)."""
        entry = self.held.get(step.hold_id)
        if entry is None or entry[2] is None:
            return []  # its hold step raised on every rank: nothing to reuse
        plan, x, want = entry
        buffer = plan.empty()
        plan.interior(buffer)[...] = x
        plan.exchange(buffer)
        wrong = difference(buffer, want, _kind_of(x), str(x.dtype).replace("torch.", ""))
        return [] if wrong is None else [f"{step}: rank {self.rank} reused the plan held since step "
                                         f"{step.hold_id} ({plan!r}): {wrong}"]

    def close(self):
        for plan, _, _ in self.held.values():
            plan.free()
        self.held.clear()


def run_legal_sequence(seed, managers, kinds, world, steps):
    """Run ``steps`` random legal steps; return (problems, sequence). Raises nothing on one rank alone."""
    sequence = Sequence(seed, managers, kinds, world, layouts_per_manager=CACHE_SIZE + 4)
    problems = []
    try:
        for number, layout in enumerate(sequence.layout_order(steps)):
            step = sequence.draw(number, layout)
            try:
                problems += sequence.run(step)
            except Exception as exc:  # raised alike on every rank by the library's agreement step
                problems.append(f"{step}: rank {world.rank} raised {type(exc).__name__}: {exc}")
        problems += sequence.check_kept()
    finally:
        sequence.close()
    return problems, sequence


@pytest.fixture
def managers(world, fresh_manager):
    """The global manager (one domain group of all ranks) and a second one: other D, other shard_dim."""
    first = mpidomain.initialize_domain_parallel(world.size, world.size, abort_on_error=False)
    d = world.size // 2 if world.size > 1 and world.size % 2 == 0 else 1
    with DomainParallelManager(world.size, d, shard_dim=-1) as second:
        yield first, second


def check_sequence(seed, managers, kinds, world, steps=96):
    """Run a legal sequence; assert once, at the end, that it covered the caches and every step was right."""
    problems, sequence = run_legal_sequence(seed, managers, kinds, world, steps)
    for index, visited in sequence.visited.items():
        assert len(visited) > CACHE_SIZE, f"seed {seed}: manager {index} saw only {len(visited)} layouts"
    assert not problems, f"seed {seed}, rank {world.rank}: {len(problems)} wrong steps:\n" + "\n".join(problems[:15])


@pytest.mark.parametrize("seed", [101, 102])
@pytest.mark.fuzz
def test_random_legal_sequences_numpy(world, managers, seed):
    """Halo exchanges, plans, gathers and all-reduces of NumPy arrays match the global reference bit for bit."""
    check_sequence(seed, managers, ("numpy",), world)


@pytest.mark.parametrize("seed", [201, 202])
@pytest.mark.fuzz
def test_random_legal_sequences_numpy_and_torch(world, managers, seed):
    """The same with Torch tensors interleaved: bfloat16 and float16 too, HaloExchange, and exact gradients."""
    pytest.importorskip("torch")
    check_sequence(seed, managers, ("numpy", "torch"), world, steps=128)


def test_unsharded_dim_of_uneven_shards_pads_locally(world, managers):
    """Longitude of an uneven latitude-sharded field (721 rows over 4 ranks) wraps locally."""
    manager = managers[0]
    x = np.arange(4.0 * (5 + manager.domain_rank)).reshape(5 + manager.domain_rank, 4)
    try:
        padded = halo_exchange(x, 1, dim=-1, periodic=True)
        wrong = None if np.array_equal(padded, pad_along(x, 1, 1, True)) else "wrong values"
    except ValueError as exc:
        wrong = f"ValueError: {exc}"
    assert wrong is None, wrong


# -- illegal deviations, in fresh jobs ------------------------------------------------------------


def exchange_axis(step):
    """The (normalised) axis ``step``'s call exchanges or gathers along."""
    return {"unsharded": step.unsharded, "autograd": step.gradient_axis}.get(step.op, step.layout.axis)


def signature(step):
    """What the ranks' agreement compares for ``step``'s call, sharded extents left out (None: not comparable).

    Two steps with equal signatures may be indistinguishable: skipping one and
    making the other is then the limitation the library cannot detect.
    """
    layout = step.layout
    others = tuple(n for a, n in enumerate(layout.shape) if a not in (layout.axis, exchange_axis(step)))
    if step.op == "reuse":
        return None  # a held plan's exchange makes no agreement step
    if step.op == "allreduce":  # compares op, shape, dtype and requires_grad; not the array kind
        return ("allreduce", step.group, step.reduce_op, tuple(layout.shape), layout.ndim, layout.axis, layout.dtype)
    if step.op == "gather":  # compares dtypes and extents; not the array kind
        return ("gather_tensor", layout.dtype, layout.ndim, layout.axis, others)
    call = {"plan": "HaloPlan", "hold": "HaloPlan", "autograd": "pad+grad"}.get(step.op, "pad")
    return (call, layout.kind, layout.dtype, layout.ndim, exchange_axis(step), others, layout.h, layout.periodic)


def deviations(sequence, steps, index):
    """Return [(name, change)]: ways one rank can get step ``index`` wrong that the others must detect.

    ``change(call)`` returns the deviating rank's call.
    """
    step = steps[index]
    layout = step.layout
    kind, dtype, ndim, h = layout.kind, layout.dtype, layout.ndim, layout.h
    axis = exchange_axis(step)
    spare = [a for a in range(ndim) if a not in (layout.axis, axis)]  # an axis whose extent all ranks share
    rng = sequence.shared
    grow = int(rng.integers(1, 3))
    other_dtype = str(rng.choice([d for d in (TORCH_DTYPES if kind == "torch" else NUMPY_DTYPES) if d != dtype]))
    found = []

    def add(name, **fields):
        def change(call):
            for field, value in fields.items():
                setattr(call, field, value(call) if callable(value) else value)
            return call
        found.append((name, change))

    if step.op in ("exchange", "unsharded", "nn", "plan", "hold", "autograd"):
        add(f"halo_width+{grow}", h=h + grow)
        add("halo_width=-1", h=-1)
        add("halo_width as a float", h=float(h))
        add("periodic flipped", periodic=not layout.periodic)
        add("dim of another axis", dim=(axis + 1) % ndim)
        add("dim out of range", dim=ndim + 1)
        add("x=None", x=None)
        add("x a list", x=lambda c: c.x.tolist())
        add(f"dtype {other_dtype}", x=lambda c: _retyped(c.x, kind, other_dtype))
        add("one more dimension", x=lambda c: c.x[..., None])
        if step.op in ("exchange", "unsharded"):
            add("out with a row too many", out=lambda c: empty_result(_padded_shape(c.x, axis, h, 1), kind, dtype))
            add("out not C-contiguous (else a row short)", out=lambda c: _strided_out(c.x, axis, h, kind, dtype))
        if spare and layout.shape[spare[0]] > 1:
            add("another extent", x=lambda c: take(c.x, spare[0], 1, layout.shape[spare[0]]))
        if h >= 1:
            add("fewer rows than halo_width", x=lambda c: take(c.x, axis, 0, h - 1))
        if step.op in ("plan", "hold"):
            add("halo_exchange instead of HaloPlan", op="exchange")
        else:
            add("HaloPlan of float64 instead", op="call_plan", x=lambda c: _retyped(c.x, kind, "float64"))
        add("allreduce instead", op="call_allreduce")
        add("gather_tensor instead", op="call_gather")
        if "torch" in sequence.kinds:
            add("the other array kind", x=lambda c: _other_kind(c.x))
        torch_only(add, kind, step)
        if kind == "torch" and dtype in FLOATS and step.op not in ("plan", "hold"):
            add("requires_grad flipped", x=lambda c: c.x.detach() if c.x.requires_grad else c.x.requires_grad_())
    elif step.op == "allreduce" and step.group == "domain":
        add("op differs", reduce_op="mean" if dtype == "complex64" else "min" if step.reduce_op == "max" else "max")
        add("another shape", x=lambda c: c.x[..., None])
        add(f"dtype {other_dtype}", x=lambda c: _retyped(c.x, kind, other_dtype))
        add("x=None", x=None)
        add("halo_exchange instead", op="exchange", h=0, dim=0, periodic=False)
        torch_only(add, kind, step)
    elif step.op == "gather":
        add("dim of another axis", dim=(axis + 1) % ndim)
        add(f"dtype {other_dtype}", x=lambda c: _retyped(c.x, kind, other_dtype))
        add("one more dimension", x=lambda c: c.x[..., None])
        add("x=None", x=None)
        add("allreduce instead", op="call_allreduce")
        torch_only(add, kind, step)
    following = steps[index + 1]
    if found and None not in (signature(step), signature(following)) and signature(step) != signature(following):
        found.append(("skipped this call, made the next one", lambda call: sequence.prepare(following)[0]))
    return found


def torch_only(add, kind, step):
    """Add the deviations only a Torch tensor can make: alike in shape and dtype, unlike in layout or device."""
    if kind != "torch" or step.op == "autograd":
        return
    add("a sparse tensor", x=lambda c: c.x.detach().resolve_conj().to_sparse())
    add("a tensor on the meta device", x=lambda c: _torch().empty(tuple(c.x.shape), dtype=c.x.dtype, device="meta"))


def _padded_shape(x, axis, h, more=0):
    shape = list(x.shape)
    shape[axis] += 2 * h + more
    return tuple(shape)


def _strided_out(x, axis, h, kind, dtype):
    """A wrong ``out``: the result's shape but not C-contiguous, or (where every layout is) a row short."""
    out = empty_result(_padded_shape(x, axis, h), kind, dtype, contiguous=False)
    contiguous = out.flags.c_contiguous if kind == "numpy" else out.is_contiguous()
    short = -1 if x.shape[axis] + 2 * h else 1  # a row too many where there is none to take away
    return empty_result(_padded_shape(x, axis, h, short), kind, dtype) if contiguous else out


def _retyped(x, kind, dtype):
    if kind == "numpy":
        return x.astype(dtype)
    return x.detach().to(getattr(_torch(), dtype))


def _kind_of(x):
    return "torch" if type(x).__module__.startswith("torch") else "numpy"


def _other_kind(x):
    """``x`` as the other kind of array: NumPy for Torch (bfloat16 as float32), Torch for NumPy."""
    if _kind_of(x) == "numpy":
        return _torch().from_numpy(np.ascontiguousarray(x))  # Torch takes no negative strides
    x = x.detach().resolve_conj()
    return (x.float() if x.dtype == _torch().bfloat16 else x).numpy()


def job(argv):
    """Run trials of random deviations in this MPI job (``python test_divergence.py --seed S``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--uncaught", choices=["collective", "local"])
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    rank = world.rank
    kinds = ("numpy", "torch") if args.torch else ("numpy",)
    if args.torch:
        importlib.import_module("mpidomain.nn")  # and torch: imported now, not inside a timed step
    if args.uncaught:
        manager = mpidomain.initialize_domain_parallel(world.size, world.size)  # default: abort on error
        return uncaught(manager, world, args.uncaught)
    manager = mpidomain.initialize_domain_parallel(world.size, world.size, abort_on_error=False)
    sequence = Sequence(args.seed, [manager], kinds, world, layouts_per_manager=8, groups=("domain",))
    number = 0
    for trial in range(args.trials):
        polite_barrier(world)  # so a step's time is its own, not another rank's start-up
        layouts = sequence.layout_order(int(sequence.shared.integers(3, 6)))
        steps = []
        for layout in layouts:
            steps.append(sequence.draw(number, layout))
            number += 1
        candidates = [i for i in range(len(steps) - 1) if steps[i].op != "reuse"]  # never the last call
        bad_step = int(sequence.shared.choice(candidates)) if candidates else None
        bad_rank = int(sequence.shared.integers(world.size))
        options = deviations(sequence, steps, bad_step) if bad_step is not None else []
        name, change = options[int(sequence.shared.integers(len(options)))] if options else (None, None)
        bad_step = bad_step if options else None
        if rank == 0:
            say(f"TRIAL {trial} DEVIATES AT STEP {bad_step} ON RANK {bad_rank}: {name}; "
                f"{steps[bad_step] if bad_step is not None else ''}")
        for index, step in enumerate(steps):
            if rank == 0:
                say(f"TRIAL {trial} STEP {index} IS {step}")
            deviation = change if index == bad_step and rank == bad_rank else None
            started = time.monotonic()
            watchdog = threading.Timer(WATCHDOG_SECONDS, hung, [f"RANK {rank} TRIAL {trial} STEP {index} HUNG "
                                                                f"{WATCHDOG_SECONDS}.000s still in {step}"])
            watchdog.daemon = True
            watchdog.start()
            try:
                if step.op == "reuse" and sequence.held.get(step.hold_id, (None, None, None))[2] is None:
                    status, detail = "SKIPPED", "its hold step raised"
                else:
                    problems = sequence.run(step, deviation)
                    status, detail = ("WRONG", "; ".join(problems)) if problems else ("OK", "")
            except Exception as exc:
                status, detail = "RAISED", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            watchdog.cancel()
            if sequence.test_bug:
                status, detail, sequence.test_bug = "WRONG", sequence.test_bug, None
            say(f"RANK {rank} TRIAL {trial} STEP {index} {status} {time.monotonic() - started:.3f}s {detail}")
    sequence.close()
    manager.close()
    say(f"RANK {rank} DONE")
    return 0


def polite_barrier(comm):
    """A barrier that sleeps while it waits, leaving the (oversubscribed) cores to the ranks still working."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def hung(line):
    """End the job from a watchdog thread: one step ran past WATCHDOG_SECONDS (MPI waits without the GIL)."""
    say(line)
    stack = traceback.format_stack(sys._current_frames()[threading.main_thread().ident])
    sys.stderr.write(f"[{line.split(' HUNG ')[0]}] hung in:\n" + "".join(stack[-8:]))
    sys.stderr.flush()
    os._exit(3)


def say(line):
    """Print one line in one write, so the launcher never interleaves two ranks' lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def uncaught(manager, world, mode):
    """A few legal exchanges, then one rank's mistake that nobody catches: the job must end, with an error."""
    x = np.arange(12.0).reshape(3, 4) + world.rank
    for _ in range(3):
        halo_exchange(x, 1, dim=0)
    last = world.rank == world.size - 1
    if mode == "collective":  # raises on every rank
        halo_exchange(x, 2 if last else 1, dim=0)
    else:  # a held plan checks its arrays locally: raises on the last rank only, the others wait
        plan = HaloPlan(x, 1, 0)
        padded = plan.empty()
        plan.interior(padded)[...] = x
        plan.exchange(np.zeros((4, 4)) if last else padded)
    world.Barrier()
    say(f"RANK {world.rank} DONE")
    return 0


def _text(data):
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def run_job(world, n, args, timeout=JOB_TIMEOUT, env=None):
    """Run this file as a fresh ``n``-rank job, on rank 0; share (status, stdout, stderr, seconds) with every rank.

    The status is None if the job ran past ``timeout`` (it is killed).
    """
    result = None
    if world.rank == 0:
        started = time.monotonic()
        try:
            done = run_mpi(n, [os.path.abspath(__file__), *args], timeout=timeout, env=env)
            result = (done.returncode, done.stdout, done.stderr)
        except subprocess.TimeoutExpired as exc:
            result = (None, _text(exc.stdout), _text(exc.stderr))
        except BaseException as exc:  # never leave the other ranks waiting below
            result = (None, "", f"{type(exc).__name__}: {exc}")
        result += (time.monotonic() - started,)
    polite_barrier(world)  # the job needs the cores
    return world.bcast(result)


def judge(n, seed, trials, stdout):
    """Return the problems in a deviation job's output: each deviating step raised on every rank, the rest passed.

    A hang ends the job (its watchdog prints HUNG): what follows it is not judged.
    """
    plans, lines, what = {}, {}, {}
    for text in stdout.splitlines():
        if m := WHAT.match(text):
            what[int(m[1]), int(m[2])] = m[3]
        elif m := PLAN.match(text):
            plans[int(m[1])] = (None if m[2] == "None" else int(m[2]), int(m[3]), m[4])
        elif m := LINE.match(text):
            lines.setdefault((int(m[2]), int(m[3])), {})[int(m[1])] = (m[4], float(m[5]), m[6])
    problems, ended = [], False
    for trial, (bad_step, bad_rank, name) in sorted(plans.items()):
        where = f"seed {seed}, {n} ranks, trial {trial}"
        deviation = f"rank {bad_rank} deviates at step {bad_step}: {name}"
        for step in sorted(s for t, s in lines if t == trial):
            if ended:
                break
            outcomes = {r: lines[trial, step].get(r, ("MISSING", 0.0, "")) for r in range(n)}
            ended = any(o[0] in ("HUNG", "MISSING") for o in outcomes.values())
            if step == bad_step:
                quiet = [f"rank {r}: {o[0]} {o[2]}" for r, o in outcomes.items() if o[0] != "RAISED"]
                slow = [f"rank {r}: {o[1]} s" for r, o in outcomes.items() if o[1] > DETECTION_SECONDS]
                kinds = sorted({o[2].split(":")[0] for o in outcomes.values()})
                if quiet:
                    problems.append(f"{where}, {deviation}: not every rank raised ({'; '.join(quiet)})")
                elif slow:
                    problems.append(f"{where}, {deviation}: raising took over {DETECTION_SECONDS} s ({', '.join(slow)})")
                elif len(kinds) > 1 or not set(kinds) <= {"ValueError", "TypeError", "RuntimeError"}:
                    problems.append(f"{where}, {deviation}: the ranks raised {kinds}")
                continue
            wrong = {}
            for r, (status, _, detail) in outcomes.items():
                if status not in ("OK", "SKIPPED"):
                    wrong.setdefault(f"{status} {detail}", []).append(r)
            for outcome, ranks in wrong.items():
                problems.append(f"{where} ({deviation}), legal {what.get((trial, step), f'step {step}')}: "
                                f"ranks {ranks}: {outcome}")
    if sorted(plans) != list(range(trials)) and not ended:
        problems.append(f"trials begun: {sorted(plans)}, expected 0 to {trials - 1}")
    if not any(step is not None for step, _, _ in plans.values()):
        problems.append("no trial deviated")
    return problems


@pytest.mark.parametrize("n, seed", [(2, 1), (3, 2)])
@pytest.mark.fuzz
@pytest.mark.mpi_job
def test_random_deviations_raise_on_every_rank(world, n, seed):
    """Each trial: one random rank deviates at one random step; every rank raises there, then goes on."""
    seed += 1000 * int(os.environ.get("MPIDOMAIN_TEST_DIVERGENCE_SEED", 0))
    trials = 20
    flags = ["--torch"] if importlib.util.find_spec("torch") is not None else []
    status, stdout, stderr, seconds = run_job(world, n, ["--seed", str(seed), "--trials", str(trials), *flags])
    command = f"mpiexec -n {n} python tests/test_divergence.py --seed {seed} --trials {trials} {' '.join(flags)}"
    problems = judge(n, seed, trials, stdout)
    if status is None:
        problems.insert(0, f"killed after {seconds:.0f} s")
    elif status != 0:
        problems.insert(0, f"ended with status {status} after {seconds:.0f} s")
    elif not all(f"RANK {r} DONE" in stdout for r in range(n)):
        problems.insert(0, "did not finish on every rank")
    tail = "\n".join(stdout.splitlines()[-6:]) + "\n" + stderr[-1500:]
    assert not problems, f"{command}:\n" + "\n".join(problems[:12]) + f"\n--- end of its output:\n{tail}"


@pytest.mark.parametrize("mode, message", [
    ("collective", "ValueError: halo exchange inputs disagree across the domain group"),
    ("local", "ValueError: padded must be a numpy array of shape (5, 4)"),
])
@pytest.mark.mpi_job
def test_uncaught_deviation_ends_the_job(world, mode, message):
    """With the default abort-on-error hook, one rank's uncaught mistake ends the whole job within seconds."""
    status, stdout, stderr, seconds = run_job(world, 2, ["--uncaught", mode], timeout=60,
                                              env={"MPIDOMAIN_ABORT_ON_ERROR": "1"})
    where = f"mpiexec -n 2 python tests/test_divergence.py --uncaught {mode}"
    assert status is not None, f"{where} hung: killed after {seconds:.0f} s:\n{stderr[-2000:]}"
    assert status != 0 and "DONE" not in stdout, f"{where} ended with status {status}:\n{stdout}\n{stderr[-2000:]}"
    assert seconds < 30, f"{where} took {seconds:.0f} s to end"
    assert f"[rank 1] {message}" in stderr and "aborting all ranks" in stderr, f"{where}: stderr:\n{stderr[-2000:]}"


if __name__ == "__main__":
    sys.exit(job(sys.argv[1:]))
