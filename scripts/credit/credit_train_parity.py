"""The parity table of ``python -m mpidomain credit train`` against CREDIT's own ``credit train``.

    python scripts/credit/credit_train_parity.py [--out FOLDER]

Writes the synthetic CREDIT-layout dataset and gen2 config (``mpidomain.credit.synthetic``: 48 x 64,
three of five levels, yearly netCDF files across a year boundary, ``era5_normalizer``, ``loss: {type:
base}`` with latitude and inverse-variance weights, a slim CrossFormer with Earth padding, AdamW,
linear-warmup-cosine, ``grad_max_norm: dynamic``, EMA, validation; 10 optimizer steps of
``forecast_len: 2`` over two epochs), then trains it:

- with CREDIT's ``credit train`` in one process (CPU, float32, one thread; its two 2026.2.0 defects
  corrected in the subprocess only, ``mpidomain.credit.reference``): the reference;
- with ``mpiexec -n N python -m mpidomain.credit.command train`` (the command ``python -m mpidomain
  credit train`` runs) at D = 1, 2, 4, 2 x 2 and D = 2 with two data-parallel groups of batch 1;
- with CREDIT's own domain-parallel trainer at D = 2 (``torchrun --nproc-per-node 2``, gloo), as the
  config is and with ``use_ema: false``.

Prints, per optimizer step, each run's summed loss relative to the reference's; the worst rollout
step's; the final weights' relative difference (CREDIT's domain-parallel checkpoint renames keys: they
are matched by position and shape); and the commands.
"""

import argparse
import copy
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

LAYOUTS = [("D=1", 1, "1", 2), ("D=2", 2, "2", 2), ("D=4", 4, "4", 2), ("2 x 2 tiles", 4, "2x2", 2),
           ("D=2, 2 groups", 4, "2", 1)]


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"  # one torch thread per rank, as the reference
    return env


def _mpiexec():
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else shutil.which("mpiexec")


def _steps_csv(save_loc):
    with open(os.path.join(save_loc, "training_steps.csv"), newline="") as file:
        rows = list(csv.reader(file))[1:]
    return [[float(v) for v in row[2:]] for row in rows]


def _weights(path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)["model_state_dict"]


def _weights_difference(ours, reference):
    """Relative norm over every floating tensor; renamed keys matched by sorted position, shape and last name."""
    unmatched_ours = sorted(k for k in ours if k not in reference)
    unmatched_ref = sorted(k for k in reference if k not in ours)
    pairs = [(k, k) for k in reference if k in ours]
    renamed = 0
    for a, b in zip(unmatched_ours, unmatched_ref):
        if ours[a].shape == reference[b].shape and a.rsplit(".", 1)[-1] == b.rsplit(".", 1)[-1]:
            pairs.append((a, b))
            renamed += 1
    num = den = 0.0
    for a, b in pairs:
        if reference[b].is_floating_point():
            num += float((ours[a].double() - reference[b].double()).norm() ** 2)
            den += float(reference[b].double().norm() ** 2)
    return (num / den) ** 0.5, renamed, len(reference)


def _train(conf, folder, name, ranks, domain, batch):
    import yaml

    conf = copy.deepcopy(conf)
    conf["save_loc"] = os.path.join(folder, f"ours-{name}")
    conf["trainer"]["train_batch_size"] = batch
    shutil.rmtree(conf["save_loc"], ignore_errors=True)
    path = os.path.join(folder, f"ours-{name}.yml")
    with open(path, "w") as file:
        yaml.safe_dump(conf, file, sort_keys=False)
    command = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpidomain.credit.command", "train", "-c", path,
               "-D", domain]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    shown = f"mpiexec -n {ranks} python -m mpidomain credit train -c {os.path.basename(path)} -D {domain}"
    return conf["save_loc"], shown, done.stdout.strip().splitlines()[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the data and the runs (default: a temporary folder, removed)")
    args = parser.parse_args()
    from mpidomain.credit.reference import run_credit_train
    from mpidomain.credit.synthetic import synthetic_config, write_synthetic_credit

    folder = os.path.abspath(args.out) if args.out else tempfile.mkdtemp(prefix="credit-train-parity-")
    os.makedirs(folder, exist_ok=True)
    try:
        write_synthetic_credit(os.path.join(folder, "data-set"))
        conf = synthetic_config(os.path.join(folder, "data-set"))
        reference_conf = dict(copy.deepcopy(conf), save_loc=os.path.join(folder, "credit-1"))
        reference = run_credit_train(reference_conf, os.path.join(folder, "credit-1-files"))
        if reference["returncode"]:
            raise SystemExit(f"CREDIT's credit train failed:\n{reference['output'][-3000:]}")
        ref_steps = reference["steps"]
        ref_weights = _weights(os.path.join(reference_conf["save_loc"], "checkpoint.pt"))
        columns, commands = [], ["python -m mpidomain.credit.reference (CREDIT's credit train, one process)"]
        for name, ranks, domain, batch in LAYOUTS:
            save_loc, shown, summary = _train(conf, folder, name.replace(" ", "").replace(",", "-"), ranks, domain,
                                              batch)
            commands.append(f"{shown}   # {name}; {summary[:90]}...")
            steps = _steps_csv(save_loc)
            weights, _, _ = _weights_difference(_weights(os.path.join(save_loc, "checkpoint.pt")), ref_weights)
            columns.append((name, steps, weights, None))
        for label, ema in (("CREDIT D=2", True), ("CREDIT D=2, no EMA", False)):
            run_conf = dict(copy.deepcopy(conf), save_loc=os.path.join(folder, f"credit-2-{int(ema)}"))
            run_conf["trainer"]["use_ema"] = ema
            outcome = run_credit_train(run_conf, os.path.join(folder, f"credit-2-{int(ema)}-files"), domain=2)
            failure = None
            if outcome["returncode"]:
                found = re.findall(r"^\[rank0\]: (\w+Error: .*)$", outcome["output"], flags=re.M)
                where = re.findall(r"^\[rank0\]:\s+File .*, in (\w+)$", outcome["output"], flags=re.M)
                failure = (f"stopped at the end of epoch 0 in {where[-2] if len(where) > 1 else '?'}: "
                           f"{found[0][:110]}" if found else "failed")
            weights = renamed = None
            checkpoint = os.path.join(run_conf["save_loc"], "checkpoint.pt")
            if os.path.exists(checkpoint) and not failure:
                weights, renamed, total = _weights_difference(_weights(checkpoint), ref_weights)
                failure = f"checkpoint renames {renamed} of {total} keys"
            columns.append((label, outcome["steps"], weights, failure))
            commands.append(f"torchrun --nproc-per-node 2 -m mpidomain.credit.reference CONFIG OUT --backend gloo   "
                            f"# {label}: parallelism {{data: none, domain: 2}}")
        _print(ref_steps, columns, commands)
    finally:
        if not args.out:
            shutil.rmtree(folder, ignore_errors=True)


def _relative(steps, ref_steps, index):
    if index >= len(steps):
        return "stopped"
    return f"{abs(sum(steps[index]) - sum(ref_steps[index])) / abs(sum(ref_steps[index])):.1e}"


def _print(ref_steps, columns, commands):
    names = [c[0] for c in columns]
    print("Per-step training loss (train_loss: the sum of the 2 rollout steps' losses), relative to CREDIT's "
          "one-process credit train:\n")
    print("| step | CREDIT, one process | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for index, steps in enumerate(ref_steps):
        print(f"| {index + 1} | {sum(steps):.6e} | " + " | ".join(_relative(c[1], ref_steps, index) for c in columns)
              + " |")
    worst = []
    for _, steps, _, _ in columns:
        values = [abs(a - b) / abs(b) for s, r in zip(steps, ref_steps) for a, b in zip(s, r)]
        worst.append(f"{max(values):.1e}" if values else "-")
    print("| worst rollout step | | " + " | ".join(worst) + " |")
    medians = []
    for _, steps, _, _ in columns:
        values = [abs(sum(s) - sum(r)) / abs(sum(r)) for s, r in zip(steps, ref_steps)]
        medians.append(f"{float(np.median(values)):.1e}" if values else "-")
    print("| median step | | " + " | ".join(medians) + " |")
    print("| final weights (relative norm) | | " + " | ".join(
        f"{c[2]:.1e}" if c[2] is not None else "-" for c in columns) + " |")
    print("| notes | | " + " | ".join(c[3] or "" for c in columns) + " |")
    print("\nCommands:")
    for command in commands:
        print(f"  {command}")
    print(json.dumps({"reference_steps": ref_steps, "runs": {c[0]: c[1] for c in columns}}))


if __name__ == "__main__":
    main()
