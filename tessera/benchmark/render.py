"""Render a workload's prompts in process, the way the retrieval role renders them.

Same tokenizer, unit factory (identity, unit lead), MiniLM + usearch retrieval pool and
prompt builder as ``tessera run --role retrieval``, without any server. Used for
``tessera bench --trace-only`` (token traces for ``tessera analyze``) and ``tessera eval``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tessera.benchmark.workloads import BenchRequest, Workload
from tessera.config import ClusterConfig
from tessera.engines.checkpoint import resolve
from tessera.engines.tokenizer import Tokenizer, load_tokenizer, serving_fingerprint, unit_factory
from tessera.messages.prompt import PromptLayout
from tessera.retrieval.embedder import Embedder
from tessera.retrieval.prompt import PromptBuilder, trace_record
from tessera.retrieval.store.unit_store import UnitStore
from tessera.units import ContextUnit


class PromptRenderer:
    def __init__(self, config: ClusterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(resolve(config.model))
        fingerprint = serving_fingerprint(config, resolve(config.model), self.tokenizer)
        self.factory = unit_factory(config, fingerprint, self.tokenizer)
        # one inserting thread: a workload retrieves the same records in every run, so runs compare
        retrieval = dataclasses.replace(config.retrieval, index_threads=1)
        self.pool = UnitStore(self.factory, Embedder(threads=config.retrieval.embed_threads), retrieval)
        self.builder = PromptBuilder(self.tokenizer, self.factory.tokens)

    def ingest(self, workload: Workload, batch: int = 256) -> None:
        corpus = workload.corpus
        for i in range(0, len(corpus), batch):
            self.pool.ingest([(u.scope, u.text, {}) for u in corpus[i:i + batch]])
            print(f"\r[{workload.name}] indexed {min(i + batch, len(corpus))}/{len(corpus)} units",
                  end="", file=sys.stderr, flush=True)
        if corpus:
            print(file=sys.stderr)

    def units(self, req: BenchRequest) -> list[ContextUnit]:
        if req.retrieval is not None:
            r = req.retrieval
            return [h.unit for h in self.pool.retrieve(r["scope"], query=r["query"], top_k=r["top_k"])]
        return [self.pool.identify(req.scope, text) for text in req.context_units]

    def layout(self, req: BenchRequest) -> tuple[list[ContextUnit], PromptLayout]:
        units = self.units(req)
        return units, self.builder.build(list(req.messages), units, req.placement)


def render_traces(config: ClusterConfig, workload: Workload) -> Iterator[dict[str, Any]]:
    renderer = PromptRenderer(config)
    renderer.ingest(workload)
    for req in workload.requests:
        _, layout = renderer.layout(req)
        yield trace_record(layout, req.stream)


def write_traces(config: ClusterConfig, workload: Workload, path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w") as fh:
        for rec in render_traces(config, workload):
            fh.write(json.dumps(rec) + "\n")
            n += 1
    return n
