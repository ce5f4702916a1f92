"""Which file holds each time of a field: CREDIT's path templates (``%Y`` and friends), :func:`index_files`.

As CREDIT 2026.2.0's local datasets find them: the strftime codes of a path
template become a glob; the date in each matching file name (at the codes'
place in the template, or ``filename_time_format`` in the name where the
template has no codes) gives the file's interval (a year for ``%Y``, a month
for ``%Y%m``, ...); a time is found by bisection. A template that matches one
file covers every time (static fields). Local: globbing and names only, no file
is opened.
"""

import bisect
import glob
import os
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Tuple

import pandas as pd

__all__ = ["FileIndex", "index_files"]

_CODES = {"%Y": r"\d{4}", "%m": r"\d{2}", "%d": r"\d{2}", "%H": r"\d{2}", "%M": r"\d{2}", "%S": r"\d{2}",
          "%j": r"\d{3}"}
_FREQ = (("%S", "s"), ("%M", "min"), ("%H", "h"), ("%j", "D"), ("%d", "D"), ("%m", "M"), ("%Y", "Y"))


@dataclass(frozen=True)
class FileIndex:
    """The files of one field type, each with the interval of times it covers (sorted by start)."""

    template: str
    intervals: Tuple[Tuple[pd.Timestamp, pd.Timestamp, str], ...]

    def find(self, time):
        """Return the path of the file covering ``time``; ValueError naming the template and the time if none."""
        time = pd.Timestamp(time)
        starts = [start for start, _, _ in self.intervals]
        at = bisect.bisect_right(starts, time) - 1
        if at >= 0 and time <= self.intervals[at][1]:
            return self.intervals[at][2]
        return self._missing(time)

    def _missing(self, time):
        covered = ", ".join(os.path.basename(p) for _, _, p in self.intervals[:6])
        more = f" and {len(self.intervals) - 6} more" if len(self.intervals) > 6 else ""
        raise ValueError(f"no file of {self.template} holds {time} (files found: {covered}{more}); add the file for "
                         "that time or move start_datetime/end_datetime inside the files' years")

    def paths(self):
        """Every file, in time order."""
        return tuple(p for _, _, p in self.intervals)


def _time_format(template, given):
    codes = [c for c in _CODES if c in template]
    if not codes:
        return given
    first = min(template.find(c) for c in codes)
    last = max(template.rfind(c) + 2 for c in codes)
    return template[first:last]


def _pattern(time_format):
    pattern = re.escape(time_format)
    for code, regex in _CODES.items():
        pattern = pattern.replace(re.escape(code), regex)
    return pattern


def index_files(template, time_format=None):
    """Return the :class:`FileIndex` of ``template`` (``filename_time_format`` where the template has no codes).

    Local. A template that matches no file, names that do not parse, or two files of one interval raise
    ValueError naming the template and the file.
    """
    fmt = _time_format(template, time_format)
    pattern = template
    for code in _CODES:
        pattern = pattern.replace(code, "*")
    files = sorted(glob.glob(pattern))
    if not files:
        raise ValueError(f"{template}: no file matches (glob {pattern}); check the path")
    if len(files) == 1:
        return FileIndex(template, ((pd.Timestamp.min, pd.Timestamp.max, files[0]),))
    if not fmt:
        raise ValueError(f"{template}: {len(files)} files match but the template has no date code (such as %Y) and "
                         "no filename_time_format says where the date is in their names")
    if fmt in template:
        anchored = re.escape(template).replace(re.escape(fmt), f"(?P<date>{_pattern(fmt)})")
        anchored = anchored.replace(re.escape("*"), r"[^/]*").replace(re.escape("?"), r"[^/]")
        search, whole = re.compile(anchored), True
    else:
        search, whole = re.compile(f"(?P<date>{_pattern(fmt)})"), False
    freq = next((f for code, f in _FREQ if code in fmt), "Y")
    intervals = []
    for path in files:
        match = search.fullmatch(path) if whole else None
        if not whole:
            found = list(search.finditer(os.path.basename(path)))
            match = found[-1] if found else None
        if match is None:
            raise ValueError(f"{template}: the date {fmt!r} is not in the name of {path}")
        try:
            period = pd.Period(datetime.strptime(match.group("date"), fmt), freq)
        except ValueError as error:
            raise ValueError(f"{template}: {path} has no valid date for {fmt!r} ({error})") from None
        intervals.append((period.start_time, period.end_time, path))
    intervals.sort(key=lambda entry: entry[0])
    for (start, _, first), (again, _, second) in zip(intervals, intervals[1:]):
        if start == again:
            raise ValueError(f"{template}: {first} and {second} hold the same {fmt!r} period; keep one")
    return FileIndex(template, tuple(intervals))
