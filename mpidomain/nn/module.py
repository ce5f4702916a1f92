"""The base class of domain-parallel modules: one wrapped module, its state_dict keys kept.

Every layer of this library derives from :class:`DomainParallelModule`, and
so may a user's own: :func:`~mpidomain.nn.convert_to_domain_parallel` leaves
any instance (and its children) as it is, so converting twice changes nothing.
"""

import torch

from .._current import require_manager

__all__ = ["DomainParallelModule"]


class DomainParallelModule(torch.nn.Module):
    """Subclass this for a domain-parallel module that wraps one module, and write its ``forward``.

    The wrapped module is a child (``self.module``; a subclass may name it with the class attribute
    ``_child``), yet ``state_dict()`` shows its parameters under the wrapped module's own keys, so a
    checkpoint of the model before conversion loads into the converted model and back. The converter
    leaves every instance, children included, as it is ("domain-parallel already").

    :param module: The module this one replaces (kept as a child, e.g. ``self.module``).
    :param shard_dim: The sharded dim of the inputs (-2: latitude), or ``(-2, -1)`` for tiles; a rule gets
        it as ``context.shard_dim``.
    :param manager: The manager its forward uses; None: the global one when it runs (``context.manager``).
    """

    _child = "module"
    keeps_child_prefix = False  # True: the state_dict keys keep "<child>." (the wrapped module's parent's keys)

    def __init__(self, module, shard_dim, manager):
        super().__init__()
        setattr(self, self._child, module)
        self.shard_dim = shard_dim
        self.manager = manager
        register_post = getattr(self, "register_state_dict_post_hook", None) or self._register_state_dict_hook
        register_post(_strip_child_prefix)
        self.register_load_state_dict_pre_hook(_add_child_prefix)

    @property
    def wrapped(self):
        """The wrapped module."""
        return getattr(self, self._child)

    @property
    def weight(self):
        """The wrapped module's weight (or None)."""
        return self.wrapped.weight

    @property
    def bias(self):
        """The wrapped module's bias (or None)."""
        return self.wrapped.bias

    def _manager(self):
        return require_manager(self.manager, type(self).__name__)

    def _pre_hooks(self, x):
        """Run the wrapped module's forward pre-hooks on ``(x,)``; return the input they leave."""
        module = self.wrapped
        for hook in list(module._forward_pre_hooks.values()):
            result = hook(module, (x,))
            if result is not None:
                x = result[0] if isinstance(result, tuple) else result
        return x


def _strip_child_prefix(module, state_dict, prefix, local_metadata):
    if getattr(module, "keeps_child_prefix", False):
        return
    inner = prefix + module._child + "."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_child_prefix(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    if getattr(module, "keeps_child_prefix", False):
        return
    inner = prefix + module._child + "."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
