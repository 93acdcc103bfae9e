"""Files only this user may read: the cluster secret, the API keys, the unit store.

Two directions, one rule (nothing readable by group or others):

* what Tessera is *given* (``security.secret_file``, ``security.keys_file``) is checked with
  :func:`check_private` and refused, naming the ``chmod`` that fixes it, when its mode lets
  another user read it: Tessera never loosens or silently fixes a file it did not create;
* what Tessera *keeps* (``retrieval.data_dir``: every tenant's text) is made private with
  :func:`private_dir` (0700, also a directory that existed before, so stores written before
  this rule are tightened on their next start) and :func:`make_private` (0600 per file).

This module knows nothing about what the files hold.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tessera.errors import ConfigError

log = logging.getLogger(__name__)
DIR_MODE = 0o700
FILE_MODE = 0o600


def check_private(path: str | Path, setting: str) -> None:
    """Refuse ``path`` (named by config key ``setting``) when group or others may read or write it."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(f"{setting} = {str(path)!r} cannot be read: {exc}") from None
    if mode & 0o077:
        raise ConfigError(f"{setting} = {str(path)!r} is readable by other users (mode {mode & 0o777:o}); "
                          f"run chmod 600 {path}")


def _tighten(path: Path, mode: int) -> None:
    try:
        old = path.stat().st_mode & 0o777
        if old != mode:
            os.chmod(path, mode)
            log.info("%s: mode %o -> %o (it holds the units' text)", path, old, mode)
    except OSError as exc:
        raise ConfigError(f"{path} cannot be made private (mode {mode:o}): {exc}; it must belong to the user "
                          "that runs Tessera") from None


def private_dir(path: Path) -> Path:
    """``path`` as a directory readable by this user only (created 0700, or tightened to it)."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    _tighten(path, DIR_MODE)
    return path


def make_private(path: Path) -> None:
    """Tighten an existing file to 0600 (a missing one is left alone)."""
    if path.exists():
        _tighten(path, FILE_MODE)
