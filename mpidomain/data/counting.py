"""Count the bytes a reader takes from a Zarr store, and those a writer puts in it: a store wrapper.

For measuring what :func:`~mpidomain.data.select_tile` reads and
:func:`~mpidomain.data.write_tile` writes (tests and scripts/bench/bench_io.py):
wrap the store, open it with xarray (or pass it to ``write_tile``), read or
write, look at ``bytes_read`` or ``bytes_written``.
"""

from zarr.storage import WrapperStore

__all__ = ["CountingStore"]


class _Tally:
    """Bytes, reads and writes so far (shared by a store and the copies zarr makes of it)."""

    def __init__(self):
        self.bytes_read = self.reads = self.bytes_written = self.writes = 0


class CountingStore(WrapperStore):
    """A Zarr (v3 API) store that counts the bytes and keys of everything got through it and put in it.

    ``CountingStore(zarr.storage.LocalStore(path, read_only=True))``; pass it
    to ``xarray.open_zarr``. Metadata counts too: :meth:`reset` after opening
    to count the data alone. Writes (``set``, ``set_if_not_exists`` where the
    key was new, and zarr's batched sets) count in ``bytes_written`` and
    ``writes``: each rank passes its own ``CountingStore(LocalStore(path))`` to
    :func:`~mpidomain.data.write_tile`.
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

    @property
    def bytes_written(self):
        """Bytes of the values stored by ``set`` (and its variants) since creation or :meth:`reset`."""
        return self._tally.bytes_written

    @property
    def writes(self):
        """Keys (chunks, metadata) stored since creation or :meth:`reset`."""
        return self._tally.writes

    def reset(self):
        """Start counting from zero (reads and writes)."""
        self._tally.bytes_read = self._tally.reads = self._tally.bytes_written = self._tally.writes = 0

    def _count(self, buffer):
        if buffer is not None:
            self._tally.bytes_read += len(buffer)
            self._tally.reads += 1
        return buffer

    async def get(self, key, prototype, byte_range=None):
        return self._count(await self._store.get(key, prototype, byte_range))

    async def get_partial_values(self, prototype, key_ranges):
        return [self._count(b) for b in await self._store.get_partial_values(prototype, key_ranges)]

    def _count_write(self, value):
        self._tally.bytes_written += len(value)
        self._tally.writes += 1

    async def set(self, key, value):
        await self._store.set(key, value)
        self._count_write(value)

    async def set_if_not_exists(self, key, value):
        if not await self._store.exists(key):
            await self._store.set_if_not_exists(key, value)
            self._count_write(value)

    async def _set_many(self, values):
        for key, value in values:
            await self.set(key, value)
