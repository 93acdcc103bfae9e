"""Render a chat request and its context units into a fixed :class:`PromptLayout`.

Units go either right after the system prompt (RAG / Mem0 style, ``"system"``) or inside
the newest user message as a ``<relevant-memories>`` block (OpenViking style, ``"user"``).
The chat template is rendered once with a sentinel where the units belong; the text before
and after it becomes TEXT segments and every unit becomes a UNIT segment carrying its own
token ids, followed by a short TEXT separator. Unit token ids are never re-tokenized in
context: that is what makes them reusable at any position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessera.engines.tokenizer import Tokenizer
from tessera.errors import BadRequest
from tessera.messages import PromptLayout, Segment, SegmentKind
from tessera.units import ContextUnit, TokenCache

# private-use code points: never produced by tokenizers' normal text, never in a template
SENTINEL = "\ue000tessera-units\ue001"
UNIT_SEPARATOR = "\n"
MEMORY_OPEN = "<relevant-memories>\n"
MEMORY_CLOSE = "</relevant-memories>\n\n"


class PromptBuilder:
    """Builds layouts for one tokenizer; text pieces go through a token cache."""

    def __init__(self, tokenizer: Tokenizer, tokens: TokenCache) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens

    def build(self, messages: Sequence[dict[str, Any]], units: Sequence[ContextUnit], placement: str) -> PromptLayout:
        if not units:
            text = self.tokenizer.render_chat(list(messages))
            return PromptLayout((Segment(SegmentKind.TEXT, self.tokens.tokens(text)),))
        rendered = self.tokenizer.render_chat(self._with_sentinel(messages, placement))
        if rendered.count(SENTINEL) != 1:
            raise BadRequest("message text may not contain the reserved code points U+E000/U+E001")
        before, after = rendered.split(SENTINEL)
        segments: list[Segment] = []
        self._text(segments, before)
        for unit in units:
            segments.append(Segment(SegmentKind.UNIT, unit.token_ids, unit.unit_id))
            self._text(segments, UNIT_SEPARATOR)
        self._text(segments, after)
        return PromptLayout(tuple(segments))

    def _text(self, segments: list[Segment], text: str) -> None:
        if not text:
            return
        ids = self.tokens.tokens(text)
        if segments and segments[-1].kind is SegmentKind.TEXT:
            segments[-1] = Segment(SegmentKind.TEXT, segments[-1].token_ids + ids)
        else:
            segments.append(Segment(SegmentKind.TEXT, ids))

    @staticmethod
    def _with_sentinel(messages: Sequence[dict[str, Any]], placement: str) -> list[dict[str, Any]]:
        out = [dict(m) for m in messages]
        if placement == "system":
            if out and out[0].get("role") == "system":
                out[0]["content"] = f"{out[0]['content']}\n\n{SENTINEL}"
            else:
                out.insert(0, {"role": "system", "content": SENTINEL})
            return out
        assert placement == "user", placement
        for m in reversed(out):
            if m.get("role") == "user":
                m["content"] = f"{MEMORY_OPEN}{SENTINEL}{MEMORY_CLOSE}{m['content']}"
                return out
        raise BadRequest('unit_placement "user" needs at least one user message')


def trace_record(layout: PromptLayout, stream: str) -> dict[str, Any]:
    """A layout as one trace line for ``tessera analyze``: its tokens and its unit ranges."""
    units, offset = [], 0
    for seg in layout.segments:
        if seg.kind is SegmentKind.UNIT:
            units.append([offset, offset + len(seg.token_ids)])
        offset += len(seg.token_ids)
    return {"stream": stream, "tokens": layout.token_ids(), "units": units}
