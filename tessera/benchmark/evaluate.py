"""``tessera eval``: answer quality of composition policies (LongBench-style word F1).

For each question the context units are chosen the way the bench chooses them (MuSiQue:
the top-k of its passages by the real embedder; LoCoMo: the top-k observation records of its
conversation), the prompt is rendered exactly as the serving path renders it, every unit is
prefilled independently once, and the greedy answer is generated with each policy (``full``
recomputes everything and is the reference). Runs in process on the reference engine.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tessera.benchmark.quality import best_f1
from tessera.benchmark.workloads import BenchRequest, Workload
from tessera.config import ClusterConfig
from tessera.engines.base import UnitState
from tessera.engines.compose import compose, prefill_units
from tessera.engines.composition import get_policy
from tessera.engines.reference import ReferenceEngine
from tessera.engines.tokenizer import unit_factory
from tessera.serving.prompt import PromptBuilder
from tessera.units import TokenCache


@dataclass
class PolicyScore:
    f1: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return 100.0 * float(np.mean(self.f1)) if self.f1 else float("nan")


class Ranker:
    """Exact cosine top-k over candidate texts with the MiniLM embedder (cached embeddings)."""

    def __init__(self) -> None:
        from tessera.control.embedder import Embedder

        self.embedder = Embedder()
        self._cache: dict[str, np.ndarray] = {}

    def _vectors(self, texts: Sequence[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in self._cache]
        if missing:
            for t, v in zip(missing, self.embedder.embed(missing), strict=True):
                self._cache[t] = np.asarray(v, dtype=np.float32)
        return np.stack([self._cache[t] for t in texts])

    def top_k(self, query: str, candidates: Sequence[str], k: int) -> list[str]:
        q = self._vectors([query])[0]
        scores = self._vectors(candidates) @ q
        return [candidates[i] for i in np.argsort(-scores, kind="stable")[:k]]


def candidates_by_scope(workload: Workload) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for u in workload.corpus:
        out.setdefault(u.scope, []).append(u.text)
    return out


def evaluate(config: ClusterConfig, workload: Workload, questions: int, policies: Sequence[str],
             max_new_tokens: int = 24, progress: bool = True) -> dict[str, Any]:
    engine = ReferenceEngine.from_config(config)
    tokens = TokenCache(engine.tokenizer.encode)
    factory = unit_factory(config, engine.fingerprint, engine.tokenizer, tokens)
    builder = PromptBuilder(engine.tokenizer, tokens)
    ranker = Ranker()
    scores = {p: PolicyScore() for p in policies}
    opts = {"recompute_tokens": config.composition.recompute_tokens}
    policy_objs = {p: get_policy(p, **opts) if p == "epic" else get_policy(p) for p in policies}
    states: dict[str, UnitState] = {}
    candidates = candidates_by_scope(workload)
    distinct: dict[tuple[str, str], BenchRequest] = {}
    for r in workload.requests:
        if r.answers and r.retrieval is not None:
            distinct.setdefault((r.scope, r.retrieval["query"]), r)
    requests = list(distinct.values())[:questions]
    t0 = time.perf_counter()
    for i, req in enumerate(requests):
        assert req.retrieval is not None
        texts = ranker.top_k(req.retrieval["query"], candidates[req.scope], int(req.retrieval["top_k"]))
        units = [factory.make(req.scope, t) for t in texts]
        layout = builder.build(list(req.messages), units, req.placement)
        todo = [u for u in units if u.unit_id not in states]
        if todo:
            sub = builder.build(list(req.messages), todo, req.placement)
            states.update(prefill_units(engine, sub))
        for name, policy in policy_objs.items():
            comp = compose(engine, layout, policy, states, max_new_tokens=max_new_tokens,
                           stop_ids=engine.eos_token_ids, use_prefix_cache=False)
            text = engine.decode_tokens([t for t in comp.generated if t not in engine.eos_token_ids])
            scores[name].answers.append(text)
            scores[name].f1.append(best_f1(text, req.answers))
        if progress:
            line = " ".join(f"{p}={s.mean:.1f}" for p, s in scores.items())
            print(f"\r[{workload.name}] {i + 1}/{len(requests)} F1 {line} ({time.perf_counter() - t0:.0f}s)",
                  end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    ref = scores.get("full")
    out: dict[str, Any] = {"workload": workload.name, "questions": len(requests), "f1": {}, "agreement_with_full": {}}
    for name, s in scores.items():
        out["f1"][name] = s.mean
        if ref is not None and name != "full":
            pair = [100.0 * best_f1(a, [b]) for a, b in zip(s.answers, ref.answers, strict=True)]
            out["agreement_with_full"][name] = float(np.mean(pair)) if pair else float("nan")
    return out
