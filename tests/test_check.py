"""``python -m mpidomain check``: passes on a sound job, names the step and ranks when one fails."""

import re

import numpy as np
import pytest
from mpi4py import MPI

from mpidomain.cli import check
from mpidomain.__main__ import main
from mpitest import nth_divisor, run_mpi


def run(world, capsys, *args):
    status = main(["check", *args])
    out = capsys.readouterr().out
    return status, out if world.rank == 0 else ""


@pytest.mark.parametrize("d_index", range(3))
def test_check_passes(world, capsys, fresh_manager, d_index):
    d = nth_divisor(world.size, d_index)
    nodes = len(set(world.allgather(MPI.Get_processor_name())))
    status, out = run(world, capsys, "-D", str(d), "--shape", f"2,3,{4 * d + 1},10", "--repeats", "2")
    assert status == 0
    if world.rank == 0:
        assert [line[:5] for line in out.splitlines() if re.match(r"\[\d/5\]", line)] == [f"[{i}/5]" for i in range(1, 6)]
        links = re.findall(r"^  rank (\d+) <-> rank (\d+) \(", out, re.M)
        expected = [(str(g * d + k), str(g * d + k + 1)) for g in range(world.size // d) for k in range(d - 1)]
        assert sorted(links) == sorted(expected), out
        assert ("slowest link: rank" in out) == (d > 1)
        verdict = out.strip().splitlines()[-1]
        assert verdict.startswith("check passed: halo exchange and shard/gather exact;"), verdict
        assert f"{world.size} ranks on {nodes} node(s), D={d}, T=1, dp={world.size // d}, cpu" in verdict


def test_check_names_the_failing_step_and_ranks(world, capsys, fresh_manager, monkeypatch):
    # The last rank's reference is off by one row's worth: its halo check must fail, and only its.
    last = world.size - 1
    reference = check._padded_global

    def skewed(*args):
        expected = reference(*args)
        return expected + 1 if world.rank == last else expected

    monkeypatch.setattr(check, "_padded_global", skewed)
    status, out = run(world, capsys, "--shape", f"1,2,{4 * world.size},8", "--repeats", "1")
    assert status == 1
    if world.rank == 0:
        assert f"FAILED on rank {last}: halo_exchange(zeros):" in out
        verdict = out.strip().splitlines()[-1]
        assert verdict.startswith(f"check FAILED: halo exchange on rank {last}: halo_exchange(zeros): ")
        assert "differ from the global reference" in verdict


def test_check_rejects_too_few_rows(world, capsys, fresh_manager):
    status = main(["check", "--shape", f"1,1,{world.size},4", "--halo-width", "2"])
    err = capsys.readouterr().err
    assert status == 2
    if world.rank == 0:
        assert f"{world.size} rows over D={world.size} ranks leaves some with 1, fewer than --halo-width 2" in err


def cuda_everywhere(world):
    try:
        import torch
    except ImportError:
        return False
    return bool(world.allreduce(int(torch.cuda.is_available()), op=MPI.MIN))


def test_check_device_cuda_needs_a_gpu_on_every_rank(world, capsys, fresh_manager):
    if cuda_everywhere(world):
        pytest.skip("every rank has a GPU here")
    status = main(["check", "--device", "cuda", "--repeats", "1"])
    err = capsys.readouterr().err
    assert status == 2
    if world.rank == 0:
        assert "--device cuda, but ranks 0" in err and "have no CUDA device bound" in err


def test_check_on_gpus(world, capsys, fresh_manager):
    if not cuda_everywhere(world):
        pytest.skip("needs torch with CUDA on every rank")
    status, out = run(world, capsys, "--device", "cuda", "--repeats", "5")
    assert status == 0
    if world.rank == 0:
        assert out.strip().splitlines()[-1].startswith("check passed:")
        assert len(re.findall(r"^  rank \d+ \(.*\): cuda:\d", out, re.M)) == world.size


@pytest.mark.mpi_job
def test_check_in_a_fresh_four_rank_job(world):
    if world.rank == 0:
        result = run_mpi(4, ["-m", "mpidomain", "check", "-D", "2", "--repeats", "3"], timeout=240)
        assert result.returncode == 0, result.stdout + result.stderr
        lines = result.stdout.strip().splitlines()
        assert lines[0].startswith("mpidomain check: 4 ranks, D=2, T=1, dp=2, device cpu, global shape (1, 32, 32, 1440)")
        assert "domain groups     : [0,1] [2,3]" in result.stdout
        assert re.search(r"slowest link: rank (0 <-> rank 1|2 <-> rank 3) \(", result.stdout)
        assert lines[-1].startswith("check passed:"), result.stdout


def test_padded_global_reference():
    """check's references: zeros, periodic, and the Earth's fold (CREDIT's example, H=3, W=4, x = 10h + w)."""
    full = np.arange(6 * 2, dtype=np.float32).reshape(6, 2)
    assert check._padded_global(full, (1, 0), "zeros")[:3].tolist() == [[0, 0], [0, 1], [2, 3]]
    assert check._padded_global(full, (1, 0), "periodic")[[0, -1]].tolist() == [[10, 11], [0, 1]]
    earth = np.array([[10 * h + w for w in range(4)] for h in range(3)], dtype=np.float32)
    assert check._padded_global(earth, (1, 1), "earth").tolist() == [
        [1, 2, 3, 0, 1, 2], [3, 0, 1, 2, 3, 0], [13, 10, 11, 12, 13, 10], [23, 20, 21, 22, 23, 20],
        [21, 22, 23, 20, 21, 22]]


def test_check_passes_on_tiles(world, capsys, fresh_manager):
    """check -D AxB verifies the zero, periodic and Earth exchanges of uneven tiles against the global field."""
    problems = []  # asserted after the loop: a rank failing alone must not leave the others in the next check
    for a in [a for a in range(1, world.size + 1) if world.size % a == 0]:
        b = world.size // a
        status, out = run(world, capsys, "-D", f"{a}x{b}", "--shape", f"1,2,{4 * a + 1},{4 * b + 3}", "--repeats", "2")
        if status != 0:
            problems.append((a, b, status, out))
        elif world.rank == 0 and not (
                "halo exchange against the global reference (zero edges, periodic, then the Earth's" in out
                and f"D={world.size} ({a}x{b} tiles), T=1" in out.strip().splitlines()[-1]
                and f"{a} x {b} latitude x longitude tiles" in out and " tile " in out):
            problems.append((a, b, out))
    assert not problems, problems


def test_check_reports_each_ranks_gpu_and_sharing(world, capsys, fresh_manager, monkeypatch):
    # Every rank is given the same (fake) GPU; the arrays stay on the CPU.
    from mpidomain import binding
    from test_binding import FakeDevices

    monkeypatch.setattr(binding, "_find_devices", lambda import_libraries: FakeDevices(["GPU-0123456789ab"]))
    hosts = world.allgather(MPI.Get_processor_name())
    sharing = [r for r, host in enumerate(hosts) if hosts.count(host) > 1]  # one fake GPU per node
    status, out = run(world, capsys, "--device", "cpu", "--shape", f"1,1,{2 * world.size},4", "--repeats", "1")
    assert status == 0
    if world.rank == 0:
        assert len(re.findall(r"^  rank \d+ \(.*\): cuda:0 \(GPU-01234567\)", out, re.M)) == world.size, out
        verdict = out.strip().splitlines()[-1]
        assert verdict.startswith("check passed:")
        from mpidomain._errors import rank_ranges

        assert (f"(warning: ranks {rank_ranges(sharing) if sharing else ''} share a GPU)" in verdict) == bool(sharing), verdict
