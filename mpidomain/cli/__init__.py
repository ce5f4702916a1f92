"""The commands of ``python -m mpidomain`` (``check``, ``info``, ``demo``; ``forecast`` is
:mod:`mpidomain.forecast`'s). Imported by ``__main__`` only: nothing in the library imports them."""
