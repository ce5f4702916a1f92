"""Count the bytes a reader takes from a Zarr store: a store wrapper.

For measuring what :func:`~mpidomain.data.select_tile` reads (tests and
scripts/bench_io.py): wrap the store, open it with xarray, read, look at
``bytes_read``.
"""

from zarr.storage import WrapperStore

__all__ = ["CountingStore"]


class _Tally:
    """Bytes and reads so far (shared by a store and the copies zarr makes of it)."""

    def __init__(self):
        self.bytes_read = self.reads = 0


class CountingStore(WrapperStore):
    """A Zarr (v3 API) store that counts the bytes and reads of everything got through it.

    ``CountingStore(zarr.storage.LocalStore(path, read_only=True))``; pass it
    to ``xarray.open_zarr``. Metadata counts too: :meth:`reset` after opening
    to count the data alone.
    """

    def __init__(self, store, tally=None):
        super().__init__(store)
        self._tally = tally if tally is not None else _Tally()

    def _with_store(self, store):
        return type(self)(store, self._tally)

    @property
    def bytes_read(self):
        """Bytes returned by ``get`` and ``get_partial_values`` since creation or :meth:`reset`."""
        return self._tally.bytes_read

    @property
    def reads(self):
        """Keys (chunks, metadata) read since creation or :meth:`reset`."""
        return self._tally.reads

    def reset(self):
        """Start counting from zero."""
        self._tally.bytes_read = self._tally.reads = 0

    def _count(self, buffer):
        if buffer is not None:
            self._tally.bytes_read += len(buffer)
            self._tally.reads += 1
        return buffer

    async def get(self, key, prototype, byte_range=None):
        return self._count(await self._store.get(key, prototype, byte_range))

    async def get_partial_values(self, prototype, key_ranges):
        return [self._count(b) for b in await self._store.get_partial_values(prototype, key_ranges)]
