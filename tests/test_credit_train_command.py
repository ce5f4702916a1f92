"""``python -m mpidomain credit train`` as a user runs it: its own MPI jobs (rank 0 starts them).

``--help`` imports neither torch nor CREDIT; a refused config key or bad data is one line from rank 0 and
exit status 2, before any rank trains; a stop signal on one rank ends every rank after the same step with
a checkpoint and exit status 0, and ``--resume auto`` finishes the run; ``--estimate`` runs in one process.
"""

import copy
import json
import os
import re

import pytest
import yaml

from credit_train_support import WORLD, credit_data, credit_reference, fresh, step_losses  # noqa: F401
from mpitest import program_lines, run_mpi, run_python, share

pytestmark = [pytest.mark.mpi_job, pytest.mark.credit]
COMMAND = ["-m", "mpidomain.credit.command", "train"]


def _config(folder, name, conf):
    path = os.path.join(folder, name)
    if WORLD.rank == 0:
        with open(path, "w") as file:
            yaml.safe_dump(conf, file, sort_keys=False)
    return share(WORLD, path)


def test_help_imports_neither_torch_nor_credit():
    program = ("import argparse, sys; from mpidomain.credit.command import add_commands; "
               "p = argparse.ArgumentParser(prog='python -m mpidomain credit'); "
               "train, _ = add_commands(p.add_subparsers(dest='c')); p.print_help(); train.print_help(); "
               "print(sorted(m for m in ('torch', 'credit', 'xarray') if m in sys.modules))")
    done = run_python(["-c", program], timeout=60) if WORLD.rank == 0 else None
    done = share(WORLD, None if done is None else (done.returncode, done.stdout, done.stderr))
    status, out, err = done
    assert status == 0, err
    assert "{train,rollout}" in out and out.strip().endswith("[]"), out
    assert all(option in out for option in ("--compile", "--activation-checkpoint", "--amp {bf16}",
                                            "--rng {tile,one-process}")), out


def test_refused_key_and_bad_data_are_one_line_and_exit_2(credit_data):
    folder, conf = credit_data
    bad_key = dict(conf, trainer=dict(conf["trainer"], parallelism={"data": "ddp", "tensor": 2, "domain": 1}))
    bad_data = json.loads(json.dumps(conf))
    bad_data["data"]["source"]["ERA5"]["variables"]["prognostic"]["vars_2D"] = ["SP", "VAR_3T"]
    outcomes = None
    if WORLD.rank == 0:
        outcomes = []
        for name, broken in (("bad_key.yml", bad_key), ("bad_data.yml", bad_data)):
            path = os.path.join(folder, name)
            with open(path, "w") as file:
                yaml.safe_dump(broken, file, sort_keys=False)
            done = run_mpi(2, [*COMMAND, "-c", path], timeout=300)
            outcomes.append((done.returncode, program_lines(done.stderr), done.stdout))
    outcomes = share(WORLD, outcomes)
    (status, lines, _), (data_status, data_lines, _) = outcomes
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("python -m mpidomain credit train: error: trainer.parallelism.tensor = 2: "), lines
    assert data_status == 2 and len(data_lines) == 1, data_lines
    assert "era5_synthetic_2000.nc: variable VAR_3T (prognostic) is absent" in data_lines[0], data_lines


@pytest.mark.timeout(1500)
def test_a_signal_on_one_rank_stops_every_rank_and_resume_auto_finishes(credit_data, credit_reference):
    folder, conf = credit_data
    save_loc = fresh(os.path.join(folder, "signalled"))  # the data's folder outlives a run (MPIDOMAIN_TEST_CACHE)
    path = _config(folder, "signalled.yml", dict(conf, save_loc=save_loc))
    program = (
        "import os, signal, sys; from mpi4py import MPI; import mpidomain.credit.trainer as t; "
        "step = t._Run.train_step\n"
        "def hooked(self, batches, n):\n"
        "    if n == 3 and MPI.COMM_WORLD.Get_rank() == 1: os.kill(os.getpid(), signal.SIGUSR1)\n"
        "    return step(self, batches, n)\n"
        "t._Run.train_step = hooked\n"
        "from mpidomain.credit.command import main; sys.exit(main(sys.argv[1:]))")
    outcome = None
    if WORLD.rank == 0:
        first = run_mpi(2, ["-c", program, "train", "-c", path, "-D", "2"], timeout=600)
        second = run_mpi(2, [*COMMAND, "-c", path, "-D", "2", "--resume", "auto"], timeout=600)
        outcome = [(d.returncode, d.stdout, program_lines(d.stderr)) for d in (first, second)]
    outcome = share(WORLD, outcome)
    (status, out, err), (resumed_status, resumed_out, resumed_err) = outcome
    assert status == 0, err
    assert "credit train stopped by SIGUSR1 on rank 1 after step 3; resume with --resume auto" in out, out
    assert os.path.exists(os.path.join(save_loc, "checkpoint-step-000003.pt"))
    assert resumed_status == 0, resumed_err
    assert "--resume: continuing from" in resumed_out and "checkpoint-step-000003.pt" in resumed_out
    assert "credit train done: D=2 x 1 group(s), eager; 10 steps" in resumed_out, resumed_out
    _, rows = step_losses(save_loc)
    for row, reference in zip(rows, credit_reference["steps"]):
        assert abs(row[1] - sum(reference)) <= 1e-5 * abs(sum(reference))


def test_estimate_runs_in_one_process(credit_data):
    """--estimate -D 2x2 --rng one-process on a model with dropout: the memory lines and what the dropout draws."""
    folder, conf = credit_data
    conf = copy.deepcopy(conf)
    conf["model"].update(attn_dropout=0.1, ff_dropout=0.1)
    path = _config(folder, "estimate.yml", conf)
    done = run_python([*COMMAND, "-c", path, "--estimate", "-D", "2x2", "--rng", "one-process"], timeout=300) \
        if WORLD.rank == 0 else None
    status, out, err = share(WORLD, None if done is None else (done.returncode, done.stdout, done.stderr))
    assert status == 0, err
    assert "estimate for D=2x2 (tiles) on 48 x 64" in out
    assert "bytes read per rank per optimizer step" in out and "CREDIT's pattern" in out
    assert re.search(r"dropout \(\d+ calls per forward\), --rng one-process: each rank draws the whole field's "
                     r"masks, [\d.]+ MiB per forward, the largest [\d.]+ MiB at once", out), out



MISSING = [  # (hidden, what the line says, its install line)
    ("yaml", "yaml is needed for reading the config", "pip install pyyaml"),
    ("bridgescaler", "bridgescaler is needed for the normalisation", "pip install bridgescaler"),
    ("credit", "credit is needed for CREDIT's model loader", "pip install --no-deps miles-credit==2026.2.0"),
    ("netCDF4", "netCDF4 is needed for reading the netCDF files", "pip install netCDF4"),
]


def test_a_missing_package_is_one_line_on_every_rank_within_seconds(credit_data, tmp_path_factory):
    """Each package hidden (tests/hide/sitecustomize.py), the first from every rank of a 2-rank job (two ranks show
    "every rank" as four do, at half the start-up), the others from one process (the same check, the same line):
    one line from rank 0 naming it, what needs it and its install line; exit status 2, no traceback, well under the
    wait timeout; nothing written in save_loc."""
    from mpitest import hiding_env

    folder, conf = credit_data
    save_loc = os.path.join(folder, "missing-run")
    path = _config(folder, "missing.yml", dict(conf, save_loc=save_loc))
    outcomes = None
    if WORLD.rank == 0:
        import time

        outcomes = []
        for index, (hidden, _, _) in enumerate(MISSING):
            began = time.perf_counter()
            env = hiding_env(hide=(hidden,))
            done = (run_mpi(2, [*COMMAND, "-c", path], timeout=180, env=env) if index == 0 else
                    run_python([*COMMAND, "-c", path], timeout=180, env=env))
            outcomes.append((done.returncode, program_lines(done.stderr), "Traceback" in done.stderr,
                             time.perf_counter() - began, os.path.isdir(save_loc)))
    outcomes = share(WORLD, outcomes)
    for (hidden, needed, install), (status, lines, traceback, seconds, written) in zip(MISSING, outcomes):
        assert status == 2 and len(lines) == 1 and not traceback, (hidden, status, lines)
        assert lines[0].startswith("python -m mpidomain credit train: error: ") and needed in lines[0] and \
            install in lines[0], (hidden, lines)
        assert seconds < 60 and not written, (hidden, seconds, written)
