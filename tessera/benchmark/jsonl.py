"""Reading a JSONL file (one JSON value a line), as every trace format here is written.

This module knows nothing of what the lines mean: the trace readers interpret them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tessera.errors import BadRequest


def records(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, value)`` for each non-blank line, ``where`` being ``path:line`` for error messages."""
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise BadRequest(f"{path}:{lineno}: not JSON: {exc}") from None
