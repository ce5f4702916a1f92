"""Progress of the forecast's phases on rank 0: a tqdm bar, or plain lines where tqdm is not installed."""

import sys

__all__ = ["progress"]


class _Quiet:
    """No progress shown (ranks other than 0)."""

    def update(self, n=1):
        pass

    def set_postfix_str(self, text):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Lines(_Quiet):
    """Progress as plain lines on stderr, about ten per phase."""

    def __init__(self, total, what, initial):
        self.total, self.what, self.done, self.postfix = total, what, initial, ""
        self.every = max(1, (total - initial) // 10)

    def set_postfix_str(self, text):
        self.postfix = text

    def update(self, n=1):
        self.done += n
        if self.done == self.total or self.done % self.every == 0:
            print(f"{self.what}: {self.done}/{self.total} steps{', ' + self.postfix if self.postfix else ''}",
                  file=sys.stderr, flush=True)


def progress(shown, plain, total, what, initial=0):
    """Return a context manager with ``update`` and ``set_postfix_str``: a tqdm bar on stderr where ``shown``
    (world rank 0), plain lines instead where ``plain`` (tqdm missing), nothing elsewhere. Local."""
    if not shown:
        return _Quiet()
    if plain:
        return _Lines(total, what, initial)
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=what, unit="step", dynamic_ncols=True, leave=True)
