"""How many bytes of activations autograd keeps for backward: :class:`SavedActivations`."""

import torch

__all__ = ["SavedActivations"]


class SavedActivations:
    """Count the bytes of the tensors autograd saves for backward inside a ``with`` block.

    Local (no communication). Each storage counts once, whole: a view that keeps a
    larger tensor alive (a narrowed padded copy) costs the larger tensor's bytes.
    Parameters and buffers are left out. ``nbytes`` after the block::

        with SavedActivations() as saved:
            loss = model(x).square().sum()
        print(saved.nbytes / 2**20, "MiB kept for backward")

    :param exclude: Tensors whose storages do not count (e.g. ``model.parameters()``: views of them are saved too).
    """

    def __init__(self, exclude=()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages = {}
        self._hooks = None

    @property
    def nbytes(self):
        """The bytes of the distinct storages saved so far."""
        return sum(self._storages.values())

    def _pack(self, tensor):
        if not isinstance(tensor, torch.nn.Parameter) and tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._exclude and key:
                self._storages[key] = max(self._storages.get(key, 0), storage.nbytes())
        return tensor

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None
        return False
