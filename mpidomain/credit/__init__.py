"""A CREDIT user's gen2 job on mpidomain: ``python -m mpidomain credit train -c CONFIG.yml``.

The config read as CREDIT 2026.2.0 reads it (:mod:`.config`), the yearly files indexed by their
path templates (:mod:`.files`), each sample read by tile (:mod:`.dataset`), CREDIT's per-step pre-
and postblocks on tiles (:mod:`.blocks`), CREDIT's model converted (:mod:`.model`), the loss and
metrics of the whole field from tiles (:mod:`.loss`), CREDIT's gen2 training loop (:mod:`.trainer`)
with checkpoints in CREDIT's layout (:mod:`.checkpoints`), ``--estimate`` (:mod:`.estimate`), a
small synthetic dataset (:mod:`.synthetic`) and CREDIT's own run as the reference (:mod:`.reference`).

Importing this package needs neither torch nor CREDIT (the command line's ``--help`` runs without
them); the names that need them load on first use. The rest of mpidomain never imports it.
"""

from .config import DataSettings, FieldSettings, TrainSettings, load_config, read_settings

__all__ = ["DataSettings", "FieldSettings", "TrainSettings", "load_config", "read_settings", "TrainOptions", "train",
           "CreditTileDataset", "plan_source", "Blocks", "TileLoss", "TileMetrics", "build_model",
           "write_synthetic_credit", "synthetic_config", "run_credit_train", "credit_config"]

_LAZY = {
    "TrainOptions": "trainer", "train": "trainer", "CreditTileDataset": "dataset", "plan_source": "dataset",
    "Blocks": "blocks", "TileLoss": "loss", "TileMetrics": "loss", "build_model": "model",
    "write_synthetic_credit": "synthetic", "synthetic_config": "synthetic", "run_credit_train": "reference",
    "credit_config": "reference",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
