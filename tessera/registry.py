"""Registries of swappable policies: a name in tessera.toml picks an implementation.

Composition policies, admission policies, routers and transports each keep one
:class:`Registry`. A new implementation is a subclass of the documented base class plus
``@registry.register("name")``; tests may register their own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from tessera.errors import ConfigError

C = TypeVar("C", bound=type[Any])


class Registry(Generic[C]):
    def __init__(self, key: str, builtin_modules: Mapping[str, str] | None = None) -> None:
        self.key = key  # the config key that names an implementation, for error messages
        # built-ins imported on first use, so an optional dependency matters only when chosen
        self._builtin = dict(builtin_modules or {})
        self._classes: dict[str, C] = {}

    def register(self, name: str) -> Callable[[C], C]:
        """Class decorator: make ``cls`` selectable as ``<key> = name``."""

        def add(cls: C) -> C:
            assert self._classes.get(name, cls) is cls, f"{self.key} {name!r} registered twice"
            cls.name = name
            self._classes[name] = cls
            return cls

        return add

    def get(self, name: str) -> C:
        if name not in self._classes and name in self._builtin:
            importlib.import_module(self._builtin[name])
        cls = self._classes.get(name)
        if cls is None:
            raise ConfigError(f"{self.key} = {name!r} is not registered; known: {', '.join(self.names())}")
        return cls

    def check(self, name: str) -> None:
        """Raise ConfigError naming the registered names unless ``name`` is one of them.

        Built-ins count without being imported, so an optional dependency (Mooncake) is
        needed only by the process that uses it.
        """
        if name not in self._classes and name not in self._builtin:
            raise ConfigError(f"{self.key} = {name!r} is not registered; known: {', '.join(self.names())}")

    def unregister(self, name: str) -> None:
        """Remove a registered implementation (tests that register their own clean up with this)."""
        self._classes.pop(name, None)

    def names(self) -> list[str]:
        return sorted(set(self._classes) | set(self._builtin))
