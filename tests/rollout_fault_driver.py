"""Run ``python -m mpidomain credit rollout ...`` with one fault injected on one rank: the rollout's fault tests.

    python tests/rollout_fault_driver.py ACTION:STAGE:RANK[:N] credit rollout -c CONFIG.yml ...

ACTION is ``raise`` (a RuntimeError) or ``kill`` (SIGKILL of the rank itself); STAGE where, on world rank RANK,
at the N-th time the stage is reached on that rank (default 1):

- ``step``: between two rollout steps (before the next step's inputs are assembled);
- ``write``: right after the rank's part of writing a forecast step (its chunks sent, or, on the rank writing
  the file, written), before anything else: in the middle of a file that holds several steps.

Before the fault the rank prints ``FAULT <stage> <time.time()>`` on stderr. The faults wrap the functions the
command calls (as ``tests/fault_driver.py`` does for the forecast): the library has no hook for them.
"""

import sys

from fault_driver import _counted


def install(spec):
    """Wrap the function the stage of ``spec`` (``ACTION:STAGE:RANK[:N]``) names."""
    action, stage, rank, *rest = spec.split(":")
    nth = int(rest[0]) if rest else 1
    from mpi4py import MPI

    mine = MPI.COMM_WORLD.Get_rank() == int(rank)
    import mpidomain.credit.output as output
    import mpidomain.credit.rollout as rollout

    if stage == "step":
        rollout.assemble_inputs = _counted(rollout.assemble_inputs, action, stage, mine, nth)
    elif stage == "write":
        for name in ("_write_netcdf", "_write_zarr"):
            setattr(output.ForecastWriter, name,
                    _counted(getattr(output.ForecastWriter, name), action, stage, mine, nth, before=False))
    else:
        raise SystemExit(f"rollout_fault_driver: unknown stage {stage!r}")


if __name__ == "__main__":
    install(sys.argv[1])
    from mpidomain.__main__ import main

    sys.exit(main(sys.argv[2:]))
