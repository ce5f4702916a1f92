"""CREDIT's CrossFormer module for tests, importable without torchvision (see ``credit_models``)."""

import credit_models
from mpitest import import_credit


def crossformer():
    """Return CREDIT's ``credit.models.wxformer.crossformer`` module (skip the test where CREDIT is missing)."""
    import_credit()
    return credit_models.crossformer()
