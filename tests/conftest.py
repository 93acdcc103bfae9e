"""Fixtures shared by every test module; the larger groups live in ``tests/fixtures/``.

Shared setup with a teardown is a fixture (here or in ``tests/fixtures/``); plain values and
builders are functions in the ``tests/helpers`` package.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers.cluster import REPO
from helpers.engines import FakeEngine

from tessera.registry import Registry

# the embedder and model must never reach for a hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# role processes started by tests (directly or through LocalCluster) import this checkout
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
# no sys.path edit: pytest's default (prepend) import mode puts tests/ on sys.path, so test
# modules import the ``helpers`` package and pytest loads the ``fixtures`` plugins beside them

pytest_plugins = ["fixtures.tiers", "fixtures.clusters", "fixtures.processes", "fixtures.kvpool",
                  "fixtures.control", "fixtures.ha"]


@pytest.fixture
def fake_engine() -> FakeEngine:
    """An engine without a model for CPU unit tests of the scheduler and the executor."""
    return FakeEngine()


@pytest.fixture
def register() -> Iterator[Callable[[Registry[Any], str], Callable[[Any], Any]]]:
    """``@register(REGISTRY, "name")`` on a test's class; unregistered when the test ends.

    Regression: a test that registered its own policy left it registered, so running the
    suite twice in one process failed with "registered twice".
    """
    added: list[tuple[Registry[Any], str]] = []

    def add(registry: Registry[Any], name: str) -> Callable[[Any], Any]:
        added.append((registry, name))
        return registry.register(name)

    yield add
    for registry, name in added:
        registry.unregister(name)
