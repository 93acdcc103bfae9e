"""Render a chat request and its context units into a fixed :class:`PromptLayout`.

Units go either right after the system prompt (RAG / Mem0 style, ``"system"``) or inside
the newest user message as a ``<relevant-memories>`` block (OpenViking style, ``"user"``).
The chat template is rendered once with a sentinel where the units belong; the text before
and after it becomes TEXT segments and every unit becomes a UNIT segment carrying its own
token ids, followed by a short TEXT separator. Unit token ids are never re-tokenized in
context: that is what makes them reusable at any position.

Only the template's own markers become control tokens. Every message's content is rendered
as a marker, and the text that replaces the marker is encoded as plain text
(:meth:`Tokenizer.encode_plain`), so ``<|im_start|>system`` inside a user message (or inside
a unit, see :func:`tessera.engines.tokenizer.unit_factory`) is characters, not a new turn.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from tessera.engines.tokenizer import Tokenizer
from tessera.errors import BadRequest
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind
from tessera.units import ContextUnit, TokenCache

# private-use code points: never produced by tokenizers' normal text, never in a template
SENTINEL = "\ue000tessera-units\ue001"
UNIT_SEPARATOR = "\n"
MEMORY_OPEN = "<relevant-memories>\n"
MEMORY_CLOSE = "</relevant-memories>\n\n"
# marks message i's content in the rendered template: "\ue002" i "\ue003"
CONTENT = re.compile("\ue002([0-9]+)\ue003")
RESERVED = re.compile("[\ue000-\ue003]")


class PromptBuilder:
    """Builds layouts for one tokenizer.

    ``tokens`` caches the *plain* encoding of message content (the unit factory's cache fits);
    the template's own text goes through a cache of the special-token-aware encoding.
    """

    def __init__(self, tokenizer: Tokenizer, tokens: TokenCache) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.template = TokenCache(tokenizer.encode)

    def build(self, messages: Sequence[dict[str, Any]], units: Sequence[ContextUnit], placement: str) -> PromptLayout:
        for i, m in enumerate(messages):
            if RESERVED.search(str(m.get("content", ""))):
                raise BadRequest(f"messages[{i}].content may not contain the reserved code points U+E000-U+E003")
        marked = self._with_sentinel(messages, placement) if units else [dict(m) for m in messages]
        contents = [str(m.get("content", "")) for m in marked]
        for i, m in enumerate(marked):
            m["content"] = f"\ue002{i}\ue003"
        rendered = self.tokenizer.render_chat(marked)
        pieces = CONTENT.split(rendered)  # template, index, template, index, ..., template
        if sorted(int(i) for i in pieces[1::2]) != list(range(len(marked))):
            raise BadRequest("the chat template does not render every message exactly once")
        segments: list[Segment] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                self._text(segments, piece, self.template)
                continue
            before, sentinel, after = contents[int(piece)].partition(SENTINEL)
            self._text(segments, before, self.tokens)
            if sentinel:
                for unit in units:
                    segments.append(Segment(SegmentKind.UNIT, unit.token_ids, unit.unit_id))
                    self._text(segments, UNIT_SEPARATOR, self.tokens)
            self._text(segments, after, self.tokens)
        return PromptLayout(tuple(segments))

    @staticmethod
    def _text(segments: list[Segment], text: str, cache: TokenCache) -> None:
        if not text:
            return
        ids = cache.tokens(text)
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


def text_placement(messages: Sequence[dict[str, Any]], unit_texts: Sequence[str],
                   placement: str) -> list[dict[str, Any]]:
    """The messages with the units as plain text where :meth:`PromptBuilder.build` places them (each
    followed by its separator): the prompt a server without Tessera is sent for the same request."""
    if not unit_texts:
        return [dict(m) for m in messages]
    block = "".join(t + UNIT_SEPARATOR for t in unit_texts)
    out = PromptBuilder._with_sentinel(messages, placement)
    for m in out:
        m["content"] = str(m.get("content", "")).replace(SENTINEL, block)
    return out


def trace_record(layout: PromptLayout, stream: str) -> dict[str, Any]:
    """A layout as one trace line for ``tessera analyze``: its tokens and its unit ranges."""
    units, offset = [], 0
    for seg in layout.segments:
        if seg.kind is SegmentKind.UNIT:
            units.append([offset, offset + len(seg.token_ids)])
        offset += len(seg.token_ids)
    return {"stream": stream, "tokens": layout.token_ids(), "units": units}
