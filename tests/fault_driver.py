"""Run ``python -m mpidomain ...`` with one fault injected on one rank: the suite's fault tests start it.

    python tests/fault_driver.py ACTION:STAGE:RANK[:N] forecast --out DIR ...

ACTION is ``raise`` (a RuntimeError), ``kill`` (SIGKILL of the rank itself) or ``signal`` (SIGUSR1 to the rank
itself, which then goes on, as a scheduler's warning does); STAGE where, on world rank
RANK, at the N-th time the stage is reached (default 1). Before the fault the rank prints
``FAULT <stage> <time.time()>`` on stderr, so the test can time how long every rank takes to end. The
faults are set up here, by wrapping the functions the command calls: the library has no hook for them.
"""

import io
import os
import signal
import sys
import time


def _fault(action, stage):
    print(f"FAULT {stage} {time.time():.3f}", file=sys.stderr, flush=True)
    if action == "signal":
        os.kill(os.getpid(), signal.SIGUSR1)
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected failure at {stage}")


def _counted(function, action, stage, mine, nth, before=True):
    """``function`` wrapped: its ``nth`` call on this rank faults (before running it, or after)."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if mine and calls[0] == nth and before:
            _fault(action, stage)
        result = function(*args, **kwargs)
        if mine and calls[0] == nth and not before:
            _fault(action, stage)
        return result
    return wrapped


def install(spec):
    """Wrap the function the stage of ``spec`` names (``ACTION:STAGE:RANK[:N]``)."""
    action, stage, rank, *rest = spec.split(":")
    nth = int(rest[0]) if rest else 1
    from mpi4py import MPI

    mine = MPI.COMM_WORLD.Get_rank() == int(rank)
    import mpidomain.checkpoints as checkpoints
    import mpidomain.data.dataset as dataset
    import mpidomain.forecast.job as job
    import mpidomain.forecast.plot as plot

    if stage == "setup":
        job.prepare_outputs = _counted(job.prepare_outputs, action, stage, mine, nth)
    elif stage == "data":
        dataset.TileDataset.__getitem__ = _counted(dataset.TileDataset.__getitem__, action, stage, mine, nth)
    elif stage == "step":
        job._Job.train_step = _counted(job._Job.train_step, action, stage, mine, nth)
    elif stage == "checkpoint":  # in the middle of writing the file: half its bytes are on disk
        real = checkpoints.torch.save

        def save(obj, file, *args, **kwargs):
            if not isinstance(file, checkpoints._Writer):  # torch also saves when a tensor is pickled for MPI
                return real(obj, file, *args, **kwargs)
            save.calls += 1
            if not (mine and save.calls == nth):
                return real(obj, file, *args, **kwargs)
            buffer = io.BytesIO()
            real(obj, buffer)
            file.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
            file.flush()
            _fault(action, stage)
        save.calls = 0
        checkpoints.torch.save = save
    elif stage == "forecast":  # a forecast step, before it is written
        job.write_tile = _counted(job.write_tile, action, stage, mine, nth)
    elif stage == "write":  # in the middle of writing a forecast step: some of its chunks are on disk
        from zarr.storage import LocalStore

        real_write, real_set = job.write_tile, LocalStore.set
        state = {"steps": 0, "chunks": 0}

        def write_tile(*args, **kwargs):
            state["steps"] += 1
            return real_write(*args, **kwargs)

        async def chunk_set(self, key, value, *args, **kwargs):
            if mine and state["steps"] == nth and "/c/" in f"/{key}":
                state["chunks"] += 1
                if state["chunks"] == 2:
                    await real_set(self, key, value, *args, **kwargs)
                    _fault(action, stage)
            return await real_set(self, key, value, *args, **kwargs)
        job.write_tile, LocalStore.set = write_tile, chunk_set
    elif stage == "plot":
        plot.draw = _counted(plot.draw, action, stage, mine, nth)
    elif stage == "scores":
        job.latitude_weighted_rmse = _counted(job.latitude_weighted_rmse, action, stage, mine, nth)
    else:
        raise SystemExit(f"fault_driver: unknown stage {stage!r}")


if __name__ == "__main__":
    install(sys.argv[1])
    from mpidomain.__main__ import main

    sys.exit(main(sys.argv[2:]))
