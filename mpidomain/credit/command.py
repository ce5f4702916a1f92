"""``python -m mpidomain credit train|rollout``: the command line (``add_commands``) and its run (``run``).

This module imports neither torch nor CREDIT at import time (``--help`` runs without them); ``run``
imports what the chosen command needs after checking, on every rank, that it is installed.
"""

import argparse
import dataclasses
import os
import resource
import sys

from .._errors import raised_alike
from ..command import Requirement, UsageError, add_rng_option, positive_int, require, world

__all__ = ["add_commands", "run"]

CREDIT_LINE = "pip install einops && pip install --no-deps miles-credit==2026.2.0"
_ROLLOUT_HELP = """\
Forecast from a CREDIT gen2 checkpoint domain-parallel, as CREDIT's `credit rollout` does, with no
rank holding a whole field: the config's inference block (batch_forecast or single_forecast, output
format, group_by, output_interval, variables, metadata, encoding, save_forecast), the weights of
CREDIT's or mpidomain's credit train at any layout, the init times split over the data-parallel
groups, every step on tiles (the prognostics fed back in physical units and normalised again, the
dynamic forcing read by tile). Writes CREDIT's files (save_forecast/<init>/<valid>.nc or .zarr) and
the latitude-weighted RMSE and ACC by lead time and variable against the data files (printed, and
save_forecast/scores.csv).
"""
_TRAIN_HELP = """\
Train a CREDIT gen2 config domain-parallel: every rank reads its tile of the yearly files, the
model is CREDIT's own (its loader, converted), and the training equals CREDIT's one-process
`credit train` (per-step losses to about 1e-6 relative). trainer.parallelism.domain (or -D) sets
the ranks per domain group; the other ranks form data-parallel groups (data: ddp).
Writes save_loc/checkpoint.pt (CREDIT's keys, each epoch), training_log.csv (CREDIT's columns)
and training_steps.csv (each step's loss and its rollout steps').
"""


def _domain(text):
    try:
        parts = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        parts = ()
    if len(parts) not in (1, 2) or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected a rank count such as 4 or tiles such as 2x2, got {text!r}")
    return parts


def _signals(text):
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected signal names such as SIGTERM,SIGUSR1, got {text!r}")
    return names


def add_commands(subparsers):
    """Add ``train`` and ``rollout`` to ``subparsers`` (the ``credit`` command's); imports neither torch nor CREDIT."""
    train = subparsers.add_parser("train", help="train a CREDIT gen2 config domain-parallel, equal to credit train",
                                  description=_TRAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.set_defaults(credit_command="train")
    train.add_argument("-c", "--config", required=True, metavar="CONFIG.yml", help="the CREDIT gen2 config")
    train.add_argument("-D", "--domain-parallel-size", type=_domain, default=None, metavar="D|DLATxDLON",
                       help="ranks per domain group (latitude slabs) or tiles such as 2x2; overrides "
                            "trainer.parallelism.domain")
    train.add_argument("--resume", metavar="CHECKPOINT|auto",
                       help="continue a run: a checkpoint file (ours or CREDIT's checkpoint.pt, any -D), or auto: the "
                            "newest complete one in save_loc (none: start fresh)")
    train.add_argument("--checkpoint-every", type=positive_int, metavar="N",
                       help="also save save_loc/checkpoint-step-<step>.pt every N optimizer steps")
    train.add_argument("--keep", type=positive_int, default=3, metavar="K",
                       help="numbered step checkpoints to keep, the newest (default: 3)")
    train.add_argument("--stop-signals", type=_signals, default=("SIGTERM", "SIGUSR1"), metavar="SIG,...",
                       help="signals that stop training after the current step with a checkpoint (default: "
                            "SIGTERM,SIGUSR1)")
    train.add_argument("--stop-after", type=positive_int, metavar="STEP",
                       help="stop after this optimizer step with a numbered checkpoint (resume with --resume auto)")
    train.add_argument("--skip-nan", action="store_true",
                       help="skip a step whose samples or loss are not finite (as trainer.skip_nan_prune: true); "
                            "default: stop, naming the variable, time and step")
    train.add_argument("--estimate", action="store_true",
                       help="print each rank's predicted memory and bytes read per step for this layout, then stop "
                            "(runs in one process: no launcher needed)")
    train.add_argument("--bind-device", default="auto", metavar="auto|none|0,1,...",
                       help="GPU per rank: node-local rank modulo the GPU count (auto), leave it (none), or one "
                            "index per node-local rank")
    train.add_argument("--compile", action="store_true",
                       help="compile the model with torch.compile (as trainer.compile: true)")
    train.add_argument("--activation-checkpoint", action="store_true",
                       help="recompute the marked blocks' activations in backward (as trainer.activation_checkpoint: "
                            "true)")
    train.add_argument("--amp", choices=("bf16",), default=None,
                       help="train under torch.autocast to bfloat16 on any device (overrides trainer.amp, which is "
                            "float16 with a scaler on CUDA and nothing on a CPU, as in CREDIT)")
    add_rng_option(train)
    rollout = subparsers.add_parser("rollout", help="forecast from a CREDIT gen2 checkpoint on tiles, writing "
                                    "CREDIT's forecast files and the scores", description=_ROLLOUT_HELP,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    rollout.set_defaults(credit_command="rollout")
    rollout.add_argument("-c", "--config", required=True, metavar="CONFIG.yml",
                         help="the CREDIT gen2 config with its inference block")
    rollout.add_argument("-D", "--domain-parallel-size", type=_domain, default=None, metavar="D|DLATxDLON",
                         help="ranks per domain group (latitude slabs) or tiles such as 2x2; overrides "
                              "trainer.parallelism.domain (default 1); the other ranks form groups that split "
                              "the init times")
    rollout.add_argument("--checkpoint", metavar="PATH",
                         help="the weights (default: save_loc/model_checkpoint.pt, else save_loc/checkpoint.pt, as "
                              "credit rollout looks for them); CREDIT's or credit train's, written at any layout")
    rollout.add_argument("--run-mode", choices=("batch", "single"), default=None,
                         help="override inference.run_mode (as credit rollout's --run-mode)")
    rollout.add_argument("--init-time", metavar="TIME",
                         help="one forecast from TIME, e.g. 2020-06-01T00 (implies --run-mode single)")
    rollout.add_argument("--save-dir", metavar="FOLDER", help="override inference.save_forecast")
    rollout.add_argument("--climatology", default="auto", metavar="auto|mean|validation|none|FILE",
                         help="ACC's climatology: the era5_normalizer mean file (mean), the mean of the "
                              "validation_data period (validation), a netCDF/Zarr file, or none; auto: mean where "
                              "the config has one, else validation, else none")
    rollout.add_argument("--scores", metavar="CSV",
                         help="where the scores table goes (default: <save_forecast>/scores.csv)")
    rollout.add_argument("--bind-device", default="auto", metavar="auto|none|0,1,...",
                         help="GPU per rank: node-local rank modulo the GPU count (auto), leave it (none), or one "
                              "index per node-local rank")
    rollout.add_argument("--compile", action="store_true", help="compile the model with torch.compile")
    rollout.add_argument("--amp", choices=("bf16",), default=None,
                         help="run the model under torch.autocast to bfloat16 (default: the model's dtype)")
    add_rng_option(rollout)
    return train, rollout


def _requirements(conf, command="train", output_format=None):
    needs = [Requirement("torch", "the model", "pip install torch"),
             Requirement("yaml", "reading the config", "pip install pyyaml"),
             Requirement("pandas", "the data's times", "pip install pandas"),
             Requirement("xarray", "reading the data", "pip install xarray"),
             Requirement("einops", "CREDIT's models", "pip install einops"),
             Requirement("credit", "CREDIT's model loader, scheduler and loss weights" if command == "train" else
                         "CREDIT's model loader and channel layout", CREDIT_LINE)]
    paths = []
    for block in (conf.get("data"), conf.get("validation_data")):
        for source in ((block or {}).get("source") or {}).values():
            for field in ((source or {}).get("variables") or {}).values():
                if isinstance(field, dict) and isinstance(field.get("path"), str):
                    paths.append(field["path"])
    if any(".zarr" in p for p in paths):
        needs.append(Requirement("zarr", "reading the Zarr files", "pip install zarr"))
    if any(not p.rstrip("/*").endswith(".zarr") for p in paths):
        needs.append(Requirement("netCDF4", "reading the netCDF files", "pip install netCDF4"))
    if output_format == "netcdf":
        needs.append(Requirement("netCDF4", "writing the netCDF forecast files", "pip install netCDF4"))
    elif output_format == "zarr":
        needs.append(Requirement("zarr", "writing the Zarr forecast files", "pip install 'zarr>=3.1.5'",
                                 minimum="3.1.5"))
    blocks = [b for section in (conf.get("preblocks") or {}, conf.get("postblocks") or {}) if isinstance(section, dict)
              for group in section.values() if isinstance(group, dict) for b in group.values() if isinstance(b, dict)]
    loss_args = (conf.get("loss") or {}).get("args") or {} if isinstance(conf.get("loss"), dict) else {}
    weighted = command == "train" and loss_args.get(
        "var_weighting", "inverse_variance" if (conf.get("loss") or {}).get("type") == "base" else "none") in (
        "inverse_variance", "learnable")
    if any(b.get("type") in ("era5_normalizer", "bridgescaler_transform") for b in blocks) or weighted:
        needs.append(Requirement("bridgescaler", "the normalisation (era5_normalizer and bridgescaler_transform)" +
                                 (" and the loss's inverse-variance weights" if command == "train" else ""),
                                 "pip install bridgescaler"))
    return needs


def _conf(args, command="credit train"):
    """The config file, read on every rank; a file one rank cannot read is an error on every rank."""
    from ..command import agreed
    from .config import load_config

    return agreed(world(), f"{command}: reading the config", lambda: load_config(args.config))


def _manager(domain, bind_device):
    from .. import binding
    from ..manager import initialize_domain_parallel

    binding._find_devices(import_libraries=True)
    tiles = len(domain) == 2
    policy = bind_device
    if policy not in ("auto", "none"):
        try:
            policy = [int(i) for i in str(policy).split(",")]
        except ValueError:
            raise UsageError(f"--bind-device {bind_device}: expected auto, none or device indices such as 0,1") \
                from None
    return initialize_domain_parallel(world().Get_size(), domain if tiles else domain[0],
                                      (-2, -1) if tiles else -2, bind_device=policy)


def _say(line):
    if world().Get_rank() == 0:
        print(line, flush=True)


def _train(args):
    from .config import read_settings

    comm = world()
    require("credit train", [Requirement("yaml", "reading the config", "pip install pyyaml")])  # before reading it
    conf = _conf(args)
    try:
        settings = _settings_for_estimate(conf, args) if args.estimate else \
            read_settings(conf, comm.Get_size(), args.domain_parallel_size)
    except UsageError as error:  # every rank read the same config: the same error everywhere
        raise raised_alike(error) from None
    settings = dataclasses.replace(settings, compile=settings.compile or args.compile,
                                   activation_checkpoint=settings.activation_checkpoint or args.activation_checkpoint)
    missing_optional = require("credit train", _requirements(conf),
                               optional=[Requirement("tqdm", "the progress bar", "pip install tqdm")])
    if args.estimate:
        from .estimate import estimate_lines

        for line in estimate_lines(settings, args.rng):
            _say(line)
        return 0
    import torch

    from .trainer import TrainOptions, train

    manager = _manager(settings.domain, args.bind_device)
    try:
        if not os.environ.get("OMP_NUM_THREADS"):  # the node's cores shared by its ranks, unless set
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // manager.local_size))
        options = TrainOptions(resume=args.resume, checkpoint_every=args.checkpoint_every, keep=args.keep,
                               stop_signals=args.stop_signals, skip_nan=args.skip_nan, stop_after=args.stop_after,
                               config_path=os.path.abspath(args.config), progress="tqdm" not in missing_optional,
                               amp=args.amp, rng=args.rng)
        layout = "x".join(map(str, settings.domain))
        _say(f"mpidomain credit train: {comm.Get_size()} ranks = {manager.data_parallel_size} data-parallel group(s) "
             f"x D={layout} ({'tiles' if manager.tiled else 'latitude slabs'}); config {args.config}; save_loc "
             f"{settings.save_loc}")
        summary = train(settings, options, manager, say=_say)
        _summary(summary, settings, manager, layout)
    finally:
        manager.close()
    return 0


def _settings_for_estimate(conf, args):
    """The settings for ``--estimate``: the layout alone (one data-parallel group), whatever the ranks."""
    from .config import parse_domain, read_settings

    size = 1
    if args.domain_parallel_size is not None:
        for d in args.domain_parallel_size:
            size *= d
    else:
        try:
            for d in parse_domain((conf["trainer"].get("parallelism") or {}).get("domain", 1)):
                size *= d
        except (UsageError, KeyError, AttributeError, TypeError):
            pass  # read_settings names the key
    return read_settings(conf, size, args.domain_parallel_size)


def _summary(summary, settings, manager, layout):
    import numpy as np

    from ..manager import library_comm
    from .._mpi import mpi

    run = summary["run"]
    comm = library_comm(manager, "world")
    peak = comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, op=mpi().MAX)
    read = comm.allreduce(run.bytes_read, op=mpi().MAX)
    losses = run.history.get("train_loss", [])
    per_step = float(np.median(run.step_seconds)) if run.step_seconds else float("nan")
    if summary["stopped"]:
        _say(f"credit train stopped by {summary['stopped']} after step {run.step}; resume with --resume auto "
             f"(save_loc {settings.save_loc})")
        return
    valid = run.history.get("valid_loss") if not settings.skip_validation else None
    _say(f"credit train done: D={layout} x {manager.data_parallel_size} group(s), {run.stack.summary()}; "
         f"{run.step} steps"
         f"{'; train_loss ' + format(losses[-1], '.6g') if losses else ''}"
         f"{'; valid_loss ' + format(valid[-1], '.6g') if valid else ''}"
         f"{'; skipped steps ' + ','.join(map(str, run.skipped)) if run.skipped else ''}; {per_step:.3f} s/step; "
         f"peak {peak / 2**20:.0f} MiB/rank; read {read / 2**20:.2f} MiB/rank; {summary['seconds']:.1f} s; "
         f"checkpoint {os.path.join(settings.save_loc, 'checkpoint.pt')}")


def _rollout_domain(conf, args, size):
    """The rollout's layout: -D, else trainer.parallelism.domain, else 1; it must divide the job's ranks."""
    from .config import parse_domain

    if args.domain_parallel_size is not None:
        domain, where = tuple(args.domain_parallel_size), "-D"
    else:
        trainer = conf.get("trainer") if isinstance(conf.get("trainer"), dict) else {}
        parallelism = trainer.get("parallelism") if isinstance(trainer.get("parallelism"), dict) else {}
        domain, where = parse_domain(parallelism.get("domain", 1)), "trainer.parallelism.domain"
    ranks = 1
    for d in domain:
        ranks *= d
    if size % ranks:
        raise UsageError(f"{where} = {'x'.join(map(str, domain))}: {size} ranks do not split into domain groups of "
                         f"{ranks}; launch a multiple of {ranks} ranks or choose -D")
    return domain


def _rollout(args):
    comm = world()
    require("credit rollout", [Requirement("yaml", "reading the config", "pip install pyyaml"),
                               Requirement("pandas", "the config's times", "pip install pandas")])
    conf = _conf(args, "credit rollout")
    from .inference_settings import read_inference_settings
    from .rollout import rollout_config

    try:
        settings = read_inference_settings(conf, save_dir=args.save_dir, init_time=args.init_time,
                                           run_mode=args.run_mode)
        domain = _rollout_domain(conf, args, comm.Get_size())
    except UsageError as error:  # every rank read the same config
        raise raised_alike(error) from None
    require("credit rollout", _requirements(rollout_config(conf, settings), "rollout", settings.output.format))
    import torch

    from .rollout import RolloutOptions, rollout

    manager = _manager(domain, args.bind_device)
    try:
        if not os.environ.get("OMP_NUM_THREADS"):  # the node's cores shared by its ranks, unless set
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // manager.local_size))
        layout = "x".join(map(str, domain))
        _say(f"mpidomain credit rollout: {comm.Get_size()} ranks = {manager.data_parallel_size} group(s) x "
             f"D={layout} ({'tiles' if manager.tiled else 'latitude slabs'}); config {args.config}")
        options = RolloutOptions(checkpoint=args.checkpoint, climatology=args.climatology, scores=args.scores,
                                 compile=args.compile, amp=args.amp, rng=args.rng)
        summary = rollout(conf, settings, options, manager, say=_say)
        _rollout_summary(summary, settings, manager, layout, options.stack().summary())
    finally:
        manager.close()
    return 0


def _rollout_summary(summary, settings, manager, layout, stack):
    from .._mpi import mpi
    from ..manager import library_comm

    comm = library_comm(manager, "world")
    peak = comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, op=mpi().MAX)
    read = comm.allreduce(summary.bytes_read, op=mpi().MAX)
    files = comm.allreduce(len(summary.files) if manager.domain_rank == 0 else 0)
    seconds = comm.allreduce(summary.seconds, op=mpi().MAX)
    for line in summary.table.format().splitlines():
        _say(line)
    if summary.unscored:
        _say(f"not scored: {len(summary.unscored)} valid time(s) the data files do not hold (the first "
             f"{summary.unscored[0]:%Y-%m-%d %H:%M}); their forecasts are written")
    _say(f"credit rollout done: D={layout} x {manager.data_parallel_size} group(s), {stack}; "
         f"{len(settings.init_times)} "
         f"forecast(s), {files} file(s) under {settings.save_forecast}; scores {summary.scores_csv}; "
         f"{seconds:.1f} s; peak {peak / 2**20:.0f} MiB/rank; read {read / 2**20:.2f} MiB/rank")


def run(args):
    """Run ``python -m mpidomain credit <args.credit_command>`` on every rank; return the exit status.

    Collective over every rank of the job: call with the same ``args`` everywhere.
    """
    command = getattr(args, "credit_command", None)
    if command == "rollout":
        return _rollout(args)
    if command != "train":
        raise raised_alike(UsageError("choose a credit command: train or rollout"))
    return _train(args)


def main(argv=None):
    """``python -m mpidomain.credit.command train ...``: the same command without the package's dispatcher."""
    from ..command import run_command

    parser = argparse.ArgumentParser(prog="python -m mpidomain credit")
    add_commands(parser.add_subparsers(dest="credit", required=True))
    args = parser.parse_args(argv)
    return run_command(f"credit {args.credit_command}", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
