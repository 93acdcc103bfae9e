"""``tessera trace from-workload | from-rendered``: write traffic traces, printing what was written.

The conversions are :mod:`tessera.benchmark.traffic_convert`; this module loads what they
need from the config (tokenizer, unit factory; the embedder and unit store only for workloads
that retrieve) and writes the file.
"""

from __future__ import annotations

from pathlib import Path

from tessera.benchmark.options import say
from tessera.benchmark.trace import read_trace
from tessera.benchmark.traffic import write_traffic
from tessera.benchmark.traffic_convert import RenderedConverter, from_workload
from tessera.benchmark.workloads import BenchRequest, WorkloadName, select_workload
from tessera.config import ClusterConfig
from tessera.engines.checkpoint import resolve
from tessera.engines.tokenizer import load_tokenizer, serving_fingerprint, unit_factory
from tessera.errors import ConfigError
from tessera.units import ContextUnit


def write_workload_trace(config: ClusterConfig, workload: WorkloadName, out: Path, *, requests: int, rate: float,
                         private: bool, top_k: int | None, unit_words: int, placement: str, conversations: int,
                         data_dir: Path | None, seed: int) -> None:
    if rate < 0:
        raise ConfigError(f"--rate must be >= 0, got {rate}")
    wl = select_workload(workload, requests, data_dir, 1.0, top_k, unit_words, placement, seed, conversations)
    if any(r.retrieval is not None for r in wl.requests):
        from tessera.benchmark.render import PromptRenderer

        renderer = PromptRenderer(config)
        renderer.ingest(wl)
        units_of = renderer.units
    else:
        checkpoint = resolve(config.model)
        tokenizer = load_tokenizer(checkpoint)
        factory = unit_factory(config, serving_fingerprint(config, checkpoint, tokenizer), tokenizer)

        def units_of(req: BenchRequest) -> list[ContextUnit]:
            return [factory.make(req.scope, t) for t in req.context_units]

    n = write_traffic(out, from_workload(wl, units_of, private=private, rate=rate, seed=seed))
    say(f"wrote {n} requests of {wl.name} to {out}; see its ceiling with: tessera analyze {out}")


def write_rendered_trace(config: ClusterConfig, rendered: Path, out: Path, *, private: bool) -> None:
    if not rendered.is_file():
        raise ConfigError(f"{rendered} does not exist")
    checkpoint = resolve(config.model)
    tokenizer = load_tokenizer(checkpoint)
    converter = RenderedConverter(tokenizer, unit_factory(config, serving_fingerprint(config, checkpoint, tokenizer),
                                                          tokenizer))
    n = write_traffic(out, (converter.convert(rec, f"{rendered}: request {i}", private)
                                   for i, rec in enumerate(read_trace(rendered), 1)))
    say(f"wrote {n} requests to {out}; {n - converter.mismatched} of them render back to the same tokens")
    if converter.mismatched:
        say(f"{converter.mismatched} requests render differently (another tokenizer or template than the one "
            "that rendered them, or text that does not survive decoding)", err=True)
