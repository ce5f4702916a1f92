"""``python -m mpidomain demo``: the domain-parallel U-Net trains to the one-process model's numbers."""

import pytest

pytest.importorskip("torch")

from mpitest import run_mpi, share  # noqa: E402


def test_demo_in_process(world, fresh_manager):
    from mpidomain.cli.demo import run_demo

    lines = []
    status = run_demo(steps=2, domain_parallel_size=world.size, size=(8 * world.size, 32), out=lines.append)
    assert status == 0, lines
    if world.rank == 0:
        assert len(lines) == 4 and lines[-1].startswith("largest parameter difference after 2 steps"), lines
        assert "within 1e-05" in lines[-1] and "is identical" in lines[-1], lines


def _demo(world, n, args):
    result = None
    if world.rank == 0:
        done = run_mpi(n, ["-m", "mpidomain", "demo", *args], timeout=240)
        result = (done.returncode, done.stdout, done.stderr)
    return share(world, result)


@pytest.mark.mpi_job
def test_demo_on_four_ranks(world):
    status, out, err = _demo(world, 4, ["--steps", "2", "--size", "32x64"])
    assert status == 0, out + err
    assert "4 ranks = 2 data-parallel replicas x D=2 latitude shards" in out
    assert out.count("\nstep ") == 2 and "domain-parallel," in out, out
    assert "within 1e-05" in out and "is identical" in out, out


@pytest.mark.mpi_job
def test_demo_on_tiles(world):
    """demo -D 2x2 trains on latitude x longitude tiles to the one-process model's numbers."""
    status, out, err = _demo(world, 4, ["-D", "2x2", "--steps", "2", "--size", "32x64"])
    assert status == 0, out + err
    assert "4 ranks = 1 data-parallel replicas x 2 x 2 latitude x longitude tiles" in out, out
    assert out.count("\nstep ") == 2 and "within 1e-05" in out and "is identical" in out, out


@pytest.mark.parametrize("args, message", [
    (["-D", "2x2", "--size", "32x62"], "--size 32x62 with 2 x 2 tiles: the U-Net halves the field once"),
    (["--size", "30x64"], "--size 30x64 with D=2: the U-Net halves the field once"),
    (["-D", "3"], "domain_parallel_size=3 does not divide world_size=4"),
    (["--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
])
@pytest.mark.mpi_job
def test_demo_layouts_it_cannot_run(world, args, message):
    status, out, err = _demo(world, 4, args)
    assert status == 2 and err.count(message) == 1, out + err
