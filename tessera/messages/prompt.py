"""The prompt layout: an ordered list of text and unit segments, fixed before preparation.

The retrieval role builds it, the composition policies and engines read it, and it travels to
the generation node inside an execute request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SegmentKind(enum.StrEnum):
    TEXT = "text"  # request-specific tokens (system prompt, separators, question, template)
    UNIT = "unit"  # a context unit whose state may be reused


@dataclass(frozen=True, slots=True)
class Segment:
    kind: SegmentKind
    token_ids: tuple[int, ...]
    unit_id: str = ""  # set iff kind is UNIT


@dataclass(frozen=True, slots=True)
class PromptLayout:
    """The prompt as an ordered list of segments. Position of a token = its index in the prompt.

    The layout is fixed before any preparation starts; unit states are placed at the offsets
    it implies.
    """

    segments: tuple[Segment, ...]

    @property
    def n_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    def token_ids(self) -> list[int]:
        out: list[int] = []
        for s in self.segments:
            out.extend(s.token_ids)
        return out

    def unit_offsets(self) -> list[tuple[int, Segment]]:
        """(offset, segment) of every unit segment, in prompt order."""
        out: list[tuple[int, Segment]] = []
        offset = 0
        for s in self.segments:
            if s.kind is SegmentKind.UNIT:
                out.append((offset, s))
            offset += len(s.token_ids)
        return out
