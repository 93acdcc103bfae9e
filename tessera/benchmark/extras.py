"""Plots (matplotlib) and progress bars (tqdm): the ``lab`` extra, imported only where drawn.

Serving needs neither, so neither is a dependency of ``tessera``; the bench commands that draw
get them here, and without the extra a command fails before it starts measuring, with an error
that says what to install.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from tessera.errors import ConfigError

INSTALL = "pip install 'tessera[lab]'"


class MissingExtra(ConfigError):
    """A command needs the ``lab`` extra (plots, progress bars); the message says how to install it."""


def require(command: str, *modules: str) -> None:
    """Raise :class:`MissingExtra` unless ``modules`` (default: matplotlib and tqdm) can be imported."""
    missing = [m for m in modules or ("matplotlib", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtra(f"{command} draws plots and progress bars with {' and '.join(missing)}, which are not "
                           f"installed: {INSTALL}")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed)."""
    require("plotting", "matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def progress_bar(total: int, desc: str, unit: str) -> Any:
    """A tqdm bar on stderr that is erased when closed."""
    require("a progress bar", "tqdm")
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False)
