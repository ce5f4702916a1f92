"""Halo plans' lifetime: each manager's live plans, and ``halo_exchange``'s cache of them.

Every :class:`mpidomain.HaloPlan` is registered with its manager, whose
``close()`` frees it. Each manager also keeps a :class:`PlanCache`: its
``halo_exchange`` plans, least recently used first, at most
:data:`CACHE_SIZE`. The cache decides nothing alone: ``halo_exchange``
settles every hit or miss for all ranks of the group in its agreement step.
"""

import weakref
from collections import OrderedDict
from typing import NamedTuple

__all__ = ["CACHE_SIZE", "PlanCache", "QuickEntry", "cache_of", "cached_plans", "register", "unregister"]

CACHE_SIZE = 16

_CACHES = weakref.WeakKeyDictionary()  # manager -> PlanCache
_LIVE = weakref.WeakSet()  # every plan not yet freed, so a closing manager frees its own
_WATCHED = weakref.WeakSet()  # managers whose close() frees their plans
_LAST = [lambda: None, None]  # weak reference to the manager cache_of answered last, and its cache


class QuickEntry(NamedTuple):
    """A plan filed under a quick key: the plan's ``key``, the ``plan`` and what validation returned (``info``)."""

    key: object
    plan: object
    info: object


class PlanCache:
    """One manager's plans by key, least recently used first; evicted plans are freed.

    Besides the key (what a rank's arrays and arguments describe), each plan
    may be found by quick keys: the arguments as the caller spelled them, so
    the hot path skips validating arguments it has seen before. A quick key
    stores what validation returned (``info``), for the agreement step. The
    hot path hashes neither the key nor the plan's description: the recency
    order is kept by plan.
    """

    def __init__(self, size=CACHE_SIZE):
        self.size = size
        self._plans = {}  # key -> plan
        self._order = OrderedDict()  # id(plan) -> key, least recently used first
        self._quick = {}  # quick key -> QuickEntry; the entry keeps its plan alive, so its id stays its own

    def __len__(self):
        return len(self._plans)

    def plans(self):
        """Return the cached plans, least recently used first."""
        return [self._plans[key] for key in self._order.values()]

    def get(self, key):
        """Return the plan under ``key``, or None (also if the program freed it)."""
        plan = self._plans.get(key)
        return None if plan is None or plan.freed else plan

    def quick(self, quick_key):
        """Return the :class:`QuickEntry` under ``quick_key`` if its plan is still cached (and not freed), else None."""
        entry = self._quick.get(quick_key)
        if entry is None:
            return None
        plan = entry.plan
        return None if id(plan) not in self._order or plan.freed else entry

    def remember(self, quick_key, key, info):
        """File ``quick_key`` as another spelling of the plan under ``key``, with ``info``."""
        if len(self._quick) >= 8 * self.size:
            self._quick.clear()
        self._quick[quick_key] = QuickEntry(key, self._plans[key], info)

    def touch(self, plan):
        """Mark cached ``plan`` as the most recently used."""
        self._order.move_to_end(id(plan))

    def put(self, key, plan):
        """Cache ``plan`` under ``key``, freeing the plan it replaces and the least recently used beyond ``size``."""
        old = self._plans.pop(key, None)
        if old is not None:
            del self._order[id(old)]
            old.free()
        self._plans[key] = plan
        self._order[id(plan)] = key
        while len(self._plans) > self.size:
            self._plans.pop(self._order.popitem(last=False)[1]).free()

    def clear(self):
        """Free every cached plan."""
        plans, self._plans, self._order, self._quick = self.plans(), {}, OrderedDict(), {}
        for plan in plans:
            plan.free()


def cache_of(manager):
    """Return ``manager``'s :class:`PlanCache` (made on first use; local)."""
    last, cache = _LAST
    if last() is manager:
        return cache
    cache = _CACHES.get(manager)
    if cache is None:
        cache = _CACHES[manager] = PlanCache()
        _watch(manager)
    _LAST[:] = weakref.ref(manager), cache
    return cache


def cached_plans(manager):
    """Return the plans ``halo_exchange`` holds for ``manager``, least recently used first."""
    cache = _CACHES.get(manager)
    return [] if cache is None else cache.plans()


def register(plan):
    """Track ``plan`` (with a ``manager`` and a ``free()``) so its manager's close() frees it."""
    _LIVE.add(plan)
    _watch(plan.manager)


def unregister(plan):
    """Stop tracking ``plan`` (it was freed)."""
    _LIVE.discard(plan)


def _watch(manager):
    if manager not in _WATCHED:
        _WATCHED.add(manager)
        manager.on_close(_release_plans_of)


def _release_plans_of(manager):
    """Free every plan of ``manager`` (its close() calls this)."""
    cache = _CACHES.pop(manager, None)
    if _LAST[0]() is manager:
        _LAST[:] = lambda: None, None
    if cache is not None:
        cache.clear()
    for plan in [p for p in _LIVE if p.manager is manager]:
        plan.free()
