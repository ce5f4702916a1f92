"""CREDIT's CrossFormer module for tests, importable without torchvision (see ``credit_models``)."""

import pytest

import credit_models


def crossformer():
    """Return CREDIT's ``credit.models.wxformer.crossformer`` module (skip the test where CREDIT is missing)."""
    pytest.importorskip("credit")
    return credit_models.crossformer()
