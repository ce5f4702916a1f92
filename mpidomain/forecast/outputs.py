"""The forecast's outputs, checked before any work: ``--out`` made and writable, ``--plot``'s folder and format,
and no earlier run's checkpoints overwritten by a fresh one."""

import os

from ..command import UsageError, agreed, decided, probe_writable

__all__ = ["prepare_outputs"]


def _cannot_write(option, value, where, error):
    return UsageError(f"{option} {value}: cannot write {where} ({type(error).__name__}: {error.strerror or error}); "
                      "choose a place this job can write")


def prepare_outputs(settings, folder, comm, checkpoints):
    """Make ``folder`` (``--out``) and check it, ``--plot`` and ``--data`` against it; collective over ``comm``.

    ``checkpoints`` is the run's :class:`~mpidomain.checkpoints.CheckpointFolder`: a run that does not resume
    must not replace another run's checkpoints. Raises :class:`UsageError` alike on every rank.
    """
    def not_a_file():
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise UsageError(f"--out {settings.out}: a file, not a folder; give a folder for the checkpoints and the "
                             "forecast (it is made if it does not exist)")
        if settings.data is not None:
            data = os.path.abspath(settings.data)
            for name in ("forecast.zarr", "era5-synthetic.zarr"):
                written = os.path.join(folder, name)
                if data == written or data.startswith(written + os.sep):
                    raise UsageError(f"--data {settings.data}: the run writes {written} anew; copy the store "
                                     "elsewhere or choose another --out")
    agreed(comm, "forecast: --out", not_a_file)

    def make():
        try:
            os.makedirs(folder, exist_ok=True)
            probe_writable(folder)
        except OSError as error:
            raise _cannot_write("--out", settings.out, "there", error) from None
        if not settings.resume:
            earlier = checkpoints.saved()
            if earlier:
                raise UsageError(f"--out {settings.out}: holds the checkpoints of an earlier run ({earlier[0]}"
                                 f"{f' and {len(earlier) - 1} more' if len(earlier) > 1 else ''}); continue it with "
                                 "--resume auto, or choose another --out")
    decided(comm, "forecast: making --out", make)

    def visible():
        if not os.path.isdir(folder):
            raise UsageError(f"--out {folder}: made by rank 0 but not seen by this rank; give a folder on a file "
                             "system every rank shares")
    agreed(comm, "forecast: --out on every rank", visible)
    if not settings.plot:
        return
    plot = os.path.abspath(settings.plot)
    parent = os.path.dirname(plot)

    def plot_target():
        if os.path.isdir(plot):
            raise UsageError(f"--plot {settings.plot}: a folder; give the file to draw, e.g. "
                             f"{os.path.join(settings.plot, 'forecast.png')}")
        if not os.path.isdir(parent):
            raise UsageError(f"--plot {settings.plot}: the folder {parent} does not exist; make it first or draw "
                             "elsewhere")
        import matplotlib.figure

        formats = matplotlib.figure.Figure().canvas.get_supported_filetypes()
        extension = os.path.splitext(plot)[1][1:].lower()
        if extension and extension not in formats:
            raise UsageError(f"--plot {settings.plot}: matplotlib cannot draw .{extension} files; use one of "
                             f".{', .'.join(sorted(formats))} (e.g. forecast.png)")
    agreed(comm, "forecast: --plot", plot_target)

    def writable():
        try:
            probe_writable(parent)
        except OSError as error:
            raise _cannot_write("--plot", settings.plot, f"to {parent}", error) from None
    decided(comm, "forecast: --plot writable", writable)
