"""Bench workloads: what to ingest and which chat requests to send, in which order.

* ``rag``: MuSiQue questions; their passages are the units, ingested into one scope and
  retrieved top-k by the real embedder + usearch. Query popularity is Zipf-distributed, so
  units recur.
* ``locomo``: agent-memory replay of LoCoMo: one memory scope per conversation whose records
  are the ``observation`` facts; each question (categories 1-4) recalls the top-k records,
  placed inside the newest user message (OpenViking style) or after the system prompt (Mem0).
* ``synthetic``: a generated corpus and Zipf-popular unit combinations sent as
  ``context_units`` (the caller brings recalled records), so the bench runs without data.

A workload is data only: it never talks to a server.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ConfigError

DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"
RAG_SYSTEM = ("You are a helpful assistant. Answer the question using the passages below. "
              "Reply with a short phrase only.")
MEMORY_SYSTEM = ("You are a helpful assistant with a long-term memory of conversations between {a} and {b}. "
                 "Use the relevant memories to answer. Reply with a short phrase only.")
SYNTHETIC_SYSTEM = "You are a helpful assistant. Use the records below to answer briefly."


@dataclass(frozen=True)
class CorpusUnit:
    scope: str
    text: str


@dataclass(frozen=True)
class BenchRequest:
    messages: tuple[dict[str, str], ...]
    stream: str  # trace stream: one conversation / dataset
    retrieval: dict[str, Any] | None = None  # {query, top_k, scope}
    context_units: tuple[str, ...] = ()
    scope: str = "default"
    placement: str = "system"
    answers: tuple[str, ...] = ()
    category: int = 0
    max_tokens: int | None = None  # this request's own reply length (a trace's); None: the bench's

    def body(self, max_tokens: int) -> dict[str, Any]:
        """The /v1/chat/completions body (Tessera extension fields included)."""
        body: dict[str, Any] = {
            "model": "tessera",
            "messages": list(self.messages),
            "max_tokens": self.max_tokens or max_tokens,
            "temperature": 0.0,
            "unit_placement": self.placement,
            "scope": self.scope,
        }
        if self.retrieval is not None:
            body["retrieval"] = dict(self.retrieval)
        if self.context_units:
            body["context_units"] = list(self.context_units)
        return body


@dataclass
class Workload:
    name: str
    corpus: list[CorpusUnit]
    requests: list[BenchRequest]
    notes: dict[str, Any] = field(default_factory=dict)


class Zipf:
    """Item popularity P(rank r) ∝ 1/(r+1)^s over a fixed random permutation of the items."""

    def __init__(self, n_items: int, s: float, rng: random.Random) -> None:
        weights = 1.0 / np.power(np.arange(1, n_items + 1, dtype=np.float64), s)
        self.p = weights / weights.sum()
        self.order = list(range(n_items))
        rng.shuffle(self.order)
        self._gen = np.random.default_rng(rng.randrange(2**32))

    def draw(self, n: int) -> list[int]:
        return [self.order[int(r)] for r in self._gen.choice(len(self.order), size=n, p=self.p)]

    def draw_distinct(self, k: int) -> list[int]:
        """k distinct items, popular ones more likely, in draw order (so their order varies)."""
        k = min(k, len(self.order))
        picked: dict[int, None] = {}
        while len(picked) < k:
            for item in self.draw(k):
                if len(picked) < k:
                    picked.setdefault(item)
        return list(picked)


def _truncate(text: str, max_words: int) -> str:
    words = text.split()
    return text if max_words <= 0 or len(words) <= max_words else " ".join(words[:max_words])


class DataMissing(ConfigError):
    """A workload's data set is not on this machine; the message says where it was looked for."""


def _load_json(data_dir: Path, dataset: str, name: str, what: str) -> Any:
    path = data_dir / dataset / name
    if not path.is_file():
        dest = "" if data_dir == DATA_DIR else f" --dest {data_dir}"
        raise DataMissing(f"{what} data not found at {path}; fetch it with `tessera data fetch --only {dataset}"
                          f"{dest}` (docs/data.md), or pass --data-dir DIR, a folder with "
                          "musique/musique_s.json and locomo/locomo10.json")
    return json.loads(path.read_text())


def rag_workload(n_requests: int, *, data_dir: Path = DATA_DIR, zipf_s: float = 1.0, top_k: int = 5,
                 unit_words: int = 0, n_questions: int = 0, seed: int = 0) -> Workload:
    data = _load_json(data_dir, "musique", "musique_s.json", "MuSiQue")
    if n_questions:
        data = data[:n_questions]
    scope = "musique"
    seen: set[str] = set()
    corpus: list[CorpusUnit] = []
    for q in data:
        for ctx in q["ctxs"]:
            text = _truncate(ctx["text"].strip(), unit_words)
            if text and text not in seen:
                seen.add(text)
                corpus.append(CorpusUnit(scope, text))
    requests = []
    for i in Zipf(len(data), zipf_s, random.Random(seed)).draw(n_requests):
        q = data[i]
        requests.append(BenchRequest(
            messages=({"role": "system", "content": RAG_SYSTEM}, {"role": "user", "content": q["question"]}),
            stream=scope,
            retrieval={"query": q["question"], "top_k": top_k, "scope": scope},
            scope=scope,
            placement="system",
            answers=tuple(str(a) for a in q.get("answers", [])),
        ))
    return Workload("rag", corpus, requests, {"questions": len(data), "passages": len(corpus), "zipf_s": zipf_s})


def _locomo_records(conv: dict[str, Any]) -> list[str]:
    dates = {k.removesuffix("_date_time"): v for k, v in conv["conversation"].items() if k.endswith("_date_time")}
    records = []
    for key, by_speaker in conv["observation"].items():
        session = key.removesuffix("_observation")
        date = dates.get(session, "")
        for facts in by_speaker.values():
            for fact in facts:
                text = str(fact[0]).strip()
                if text:
                    records.append(f"[{date}] {text}" if date else text)
    return records


def locomo_workload(n_requests: int = 0, *, data_dir: Path = DATA_DIR, top_k: int = 6,
                    placement: str = "user", conversations: int = 0, seed: int = 0,
                    categories: tuple[int, ...] = (1, 2, 3, 4)) -> Workload:
    if placement not in ("user", "system"):
        raise ConfigError(f"placement = {placement!r}: expected user (OpenViking style) or system (Mem0 style)")
    data = _load_json(data_dir, "locomo", "locomo10.json", "LoCoMo")
    if conversations:
        data = data[:conversations]
    corpus: list[CorpusUnit] = []
    per_conv: list[list[BenchRequest]] = []
    for conv in data:
        scope = f"locomo-{conv['sample_id']}"
        corpus.extend(CorpusUnit(scope, r) for r in dict.fromkeys(_locomo_records(conv)))
        a, b = conv["conversation"]["speaker_a"], conv["conversation"]["speaker_b"]
        system = MEMORY_SYSTEM.format(a=a, b=b)
        reqs = []
        for qa in conv["qa"]:
            if qa.get("category") not in categories or "answer" not in qa:
                continue
            reqs.append(BenchRequest(
                messages=({"role": "system", "content": system}, {"role": "user", "content": qa["question"]}),
                stream=scope,
                retrieval={"query": qa["question"], "top_k": top_k, "scope": scope},
                scope=scope,
                placement=placement,
                answers=(str(qa["answer"]),),
                category=int(qa["category"]),
            ))
        per_conv.append(reqs)
    # conversations run side by side (one agent per conversation), questions in their order
    requests: list[BenchRequest] = []
    rng = random.Random(seed)
    cursors = [0] * len(per_conv)
    live = [i for i, reqs in enumerate(per_conv) if reqs]
    while live and (not n_requests or len(requests) < n_requests):
        i = rng.choice(live)
        requests.append(per_conv[i][cursors[i]])
        cursors[i] += 1
        if cursors[i] == len(per_conv[i]):
            live.remove(i)
    return Workload("locomo", corpus, requests, {"conversations": len(data), "records": len(corpus)})


_WORDS = [
    "alpha", "bravo", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kelp",
    "lumen", "meadow", "nickel", "onyx", "prairie", "quartz", "raven", "saffron", "timber", "umber", "velvet",
    "willow", "xenon", "yarrow", "zephyr", "amber", "basalt", "cedar", "dune", "estuary", "fern", "glacier",
    "heron", "iris", "jade", "kestrel", "lagoon", "maple", "nectar", "orchid", "pebble", "quill", "reef",
    "sierra", "thistle", "tundra", "valley", "walnut",
]


def synthetic_workload(n_requests: int, *, n_units: int = 200, unit_words: int = 120, units_per_request: int = 5,
                       zipf_s: float = 1.0, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    scope = "synthetic"
    texts = []
    for i in range(n_units):
        words = [rng.choice(_WORDS) for _ in range(unit_words)]
        texts.append(f"Record {i}: " + " ".join(words) + ".")
    popularity = Zipf(n_units, zipf_s, rng)
    requests = []
    for n in range(n_requests):
        picked = popularity.draw_distinct(units_per_request)
        question = f"Which record mentions {rng.choice(_WORDS)} next to {rng.choice(_WORDS)}? (query {n})"
        requests.append(BenchRequest(
            messages=({"role": "system", "content": SYNTHETIC_SYSTEM}, {"role": "user", "content": question}),
            stream=scope,
            context_units=tuple(texts[j] for j in picked),
            scope=scope,
            placement="system",
        ))
    return Workload("synthetic", [], requests, {"units": n_units, "unit_words": unit_words})


class WorkloadName(StrEnum):
    rag = "rag"
    locomo = "locomo"
    synthetic = "synthetic"


def select_workload(name: WorkloadName, requests: int, data_dir: Path | None, zipf: float, top_k: int | None,
              unit_words: int, placement: str, seed: int, conversations: int = 0) -> Workload:
    """The named workload with the CLI's defaults (``tessera bench``, ``verify`` and ``eval``)."""
    data = data_dir or DATA_DIR
    if name is WorkloadName.rag:
        return rag_workload(requests, data_dir=data, zipf_s=zipf, top_k=top_k or 5, unit_words=unit_words, seed=seed)
    if name is WorkloadName.locomo:
        return locomo_workload(requests, data_dir=data, top_k=top_k or 6, placement=placement, seed=seed,
                                 conversations=conversations)
    return synthetic_workload(requests, units_per_request=top_k or 5, unit_words=unit_words or 120,
                                zipf_s=zipf, seed=seed)
