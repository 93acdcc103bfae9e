"""RAG prompts for the engine benchmarks: system prompt + top passages + question, chat-rendered.

Passages become UNIT segments (tokenized on their own, as the retrieval role does); the chat
template's text around them becomes TEXT segments. Questions come from MuSiQue
(``/work/shared/data/musique/musique_s.json`` by default) or, if that file is absent, from a
deterministic generated set, so the benchmarks run without ../shared.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tessera.engines.reference import ReferenceEngine
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind
from tessera.units import unit_id_for

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique" / "musique_s.json"
SYSTEM = "You are a helpful assistant. Answer the question using the passages below. Answer briefly."
_MARK = "\x00UNIT{}\x00"


@dataclass(frozen=True)
class Question:
    question: str
    passages: tuple[str, ...]


def load_questions(path: Path | None, n: int, n_passages: int) -> tuple[list[Question], str]:
    """Up to ``n`` questions with their top ``n_passages`` passages; returns (questions, source)."""
    path = path or DEFAULT_DATA
    if path.is_file():
        items = json.loads(path.read_text())
        out = [Question(it["question"], tuple(c["text"] for c in it["ctxs"][:n_passages])) for it in items[:n]]
        return out, str(path)
    return generated_questions(n, n_passages), "generated (no MuSiQue file)"


def generated_questions(n: int, n_passages: int) -> list[Question]:
    rng = random.Random(0)
    cities = ["Lyon", "Porto", "Gdansk", "Bergen", "Tartu", "Split", "Graz", "Ghent", "Turku", "Cork"]
    things = ["museum", "bridge", "library", "observatory", "harbour", "cathedral", "market", "theatre"]
    out = []
    for _ in range(n):
        facts = []
        for _ in range(n_passages):
            city, thing, year = rng.choice(cities), rng.choice(things), rng.randint(1200, 1990)
            body = " ".join(f"The {thing} of {city} was restored in {year + k} after a long campaign by local "
                            f"guilds, and it remains a landmark of the region." for k in range(8))
            facts.append((city, thing, year, f"The {thing} of {city} was built in {year}. {body}"))
        city, thing, year, _ = facts[rng.randrange(n_passages)]
        out.append(Question(f"When was the {thing} of {city} built?", tuple(f[3] for f in facts)))
    return out


def build_layout(engine: ReferenceEngine, q: Question, passage_tokens: int, lead: tuple[int, ...] = ()
                 ) -> PromptLayout:
    """Render the chat with markers where passages go, then split into TEXT and UNIT segments.

    ``lead`` tokens start every unit (and so appear in the prompt before each passage), the way
    EPIC's chunks each start with the tokenizer's BOS.
    """
    content = SYSTEM + "".join("\n\n" + _MARK.format(i) for i in range(len(q.passages)))
    rendered = engine.tokenizer.render_chat([{"role": "system", "content": content},
                                             {"role": "user", "content": q.question}])
    segments: list[Segment] = []
    rest = rendered
    for i, passage in enumerate(q.passages):
        before, rest = rest.split(_MARK.format(i), 1)
        segments.append(Segment(SegmentKind.TEXT, tuple(engine.encode(before))))
        tokens = lead + tuple(engine.encode(passage)[:passage_tokens])
        segments.append(Segment(SegmentKind.UNIT, tokens, unit_id_for("bench", tokens, engine.fingerprint)))
    segments.append(Segment(SegmentKind.TEXT, tuple(engine.encode(rest))))
    return PromptLayout(tuple(s for s in segments if s.token_ids))
