"""``tessera eval``: answer quality of composition policies (LongBench-style word F1).

For each question the context units are retrieved and the prompt rendered exactly as the
retrieval role does it (MuSiQue: top-k passages of the whole corpus; LoCoMo: top-k observation
records of the question's conversation; see :mod:`tessera.benchmark.render`), every unit is
prefilled independently once, and the greedy answer is generated with each policy (``full``
recomputes everything and is the reference). Runs in process on the reference engine.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tessera.benchmark.options import names, say
from tessera.benchmark.quality import best_f1
from tessera.benchmark.render import PromptRenderer
from tessera.benchmark.workloads import BenchRequest, Workload, WorkloadName, select_workload
from tessera.composition.policies import policy_from_config
from tessera.config import ClusterConfig
from tessera.engines.base import UnitPrefill, UnitState
from tessera.engines.offline import compose
from tessera.engines.reference import ReferenceEngine
from tessera.errors import ConfigError


@dataclass
class PolicyScore:
    f1: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return 100.0 * float(np.mean(self.f1)) if self.f1 else float("nan")


def evaluate(config: ClusterConfig, workload: Workload, questions: int, policies: Sequence[str],
             max_new_tokens: int = 24, progress: bool = True) -> dict[str, Any]:
    engine = ReferenceEngine.from_config(config)
    renderer = PromptRenderer(config, engine.tokenizer)
    renderer.ingest(workload)
    scores = {p: PolicyScore() for p in policies}
    policy_objs = {p: policy_from_config(dataclasses.replace(config.composition, policy=p)) for p in policies}
    states: dict[str, UnitState] = {}
    distinct: dict[tuple[str, str], BenchRequest] = {}
    for r in workload.requests:
        if r.answers and r.retrieval is not None:
            distinct.setdefault((r.scope, r.retrieval["query"]), r)
    requests = list(distinct.values())[:questions]
    t0 = time.perf_counter()
    for i, req in enumerate(requests):
        units, layout = renderer.layout(req)
        todo = {u.unit_id: UnitPrefill(u.token_ids) for u in units if u.unit_id not in states}
        if todo:
            engine.step(list(todo.values()))  # independent unit prefills, captured once per unit
            states.update({uid: w.state for uid, w in todo.items() if w.state is not None})
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


@dataclass(frozen=True)
class EvalOptions:
    """``tessera eval``'s options as given (see ``tessera eval --help`` for each one's meaning)."""

    workload: WorkloadName
    questions: int
    policies: str  # comma-separated composition policies
    max_new_tokens: int
    top_k: int | None
    unit_words: int
    placement: str
    data_dir: Path | None


def run_eval(config: ClusterConfig, opts: EvalOptions) -> None:
    """``tessera eval``: answer F1 per policy (and agreement with full) on the chosen workload, printed."""
    if opts.workload is WorkloadName.synthetic:
        raise ConfigError("the synthetic workload has no gold answers; use rag or locomo")
    n = 0 if opts.workload is WorkloadName.locomo else 5000
    wl = select_workload(opts.workload, n, opts.data_dir, 0.0, opts.top_k, opts.unit_words, opts.placement, 0)
    result = evaluate(config, wl, opts.questions, names(opts.policies), opts.max_new_tokens)
    say(f"{result['workload']}: {result['questions']} questions")
    for name, score in result["f1"].items():
        agree = result["agreement_with_full"].get(name)
        extra = f"  (answer F1 vs full: {agree:.1f})" if agree is not None else ""
        say(f"  {name:<6} F1 {score:5.1f}{extra}")
