"""The traffic trace format: parsing, private units, converters and ``tessera analyze``'s ceiling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cluster import REPO
from typer.testing import CliRunner

from tessera.benchmark.trace import analyze_file
from tessera.benchmark.traffic import UnitTexts, parse_line, read_traffic, synthetic_text, write_traffic
from tessera.benchmark.traffic_convert import RenderedConverter, from_workload
from tessera.benchmark.traffic_render import TraceRenderer, inline_messages
from tessera.benchmark.workloads import synthetic_workload
from tessera.cli import app
from tessera.config import ClusterConfig
from tessera.config_file import load_config
from tessera.errors import BadRequest

EXAMPLE = REPO / "bench" / "traces" / "example.jsonl"
SYSTEM = {"role": "system", "content": "You answer from the records."}
A = "Ledger entry: the harbor crane was serviced on the third of May by the night crew."
B = "Weather log: a storm closed the northern pier for two days in early June."


@pytest.fixture(scope="module")
def config() -> ClusterConfig:
    return load_config()


@pytest.fixture(scope="module")
def renderer(config: ClusterConfig) -> TraceRenderer:
    return TraceRenderer(config)


def _line(units: list[object], **extra: object) -> dict[str, object]:
    return {"messages": [SYSTEM, {"role": "user", "content": "When was the crane serviced?"}], "units": units, **extra}


def test_a_line_the_api_would_refuse_is_refused_with_its_line_number(tmp_path: Path) -> None:
    """The API's own validator checks every line; the error names the file, the line and the field."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_line([A])) + "\n" + json.dumps({"messages": [{"role": "wizard", "content": "x"}]}))
    with pytest.raises(BadRequest, match=r"t.jsonl:2: messages\[0\].role"):
        read_traffic(path)
    path.write_text(json.dumps(_line([{"id": "d", "tokens": 0}])))
    with pytest.raises(BadRequest, match="tokens >= 1"):
        read_traffic(path)


def test_arrival_times_are_all_or_none_and_never_go_back(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_traffic(path, [parse_line(_line([A], arrival_s=1.0), "x"), parse_line(_line([A], arrival_s=0.5), "x")])
    with pytest.raises(BadRequest, match="non-decreasing"):
        read_traffic(path)
    write_traffic(path, [parse_line(_line([A], arrival_s=1.0), "x"), parse_line(_line([A]), "x")])
    with pytest.raises(BadRequest, match="every line or none"):
        read_traffic(path)


def test_a_private_unit_is_the_same_synthetic_text_of_its_length_every_time(renderer: TraceRenderer) -> None:
    """One id always stands for one text of exactly its token count; another id for another text."""
    encode = renderer.tokenizer.encode_plain
    for n in (1, 7, 180):
        text = synthetic_text("contract-7", n, encode)
        assert len(encode(text)) == n and synthetic_text("contract-7", n, encode) == text
    assert synthetic_text("annex-2", 40, encode) != synthetic_text("contract-7", 40, encode)


def test_analyze_counts_repeats_outside_the_prefix_and_the_saving_over_prefix_caching(
        tmp_path: Path, config: ClusterConfig, renderer: TraceRenderer) -> None:
    """[A] then [B, A]: A's second use is a non-prefix repeat; prefix caching reuses only the shared prefix."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_line([A])) + "\n" + json.dumps(_line([B, A])) + "\n")
    first, second = (renderer.build(r).rendered for r in read_traffic(path))
    n_b, n_a = (len(seg.token_ids) for _, seg in second.unit_offsets())
    t1, t2 = first.token_ids(), second.token_ids()
    shared = next(i for i, (x, y) in enumerate(zip(t1, t2, strict=False)) if x != y)
    total = analyze_file(path, config)["total"]
    assert total["unit_tokens"] == 2 * n_a + n_b
    assert total["non_prefix_repeat"] == pytest.approx(n_a / (2 * n_a + n_b))
    assert total["prefix_covered"] == 0.0
    assert total["prefix_caching_computes"] == len(t1) + len(t2) - shared
    assert total["best_case_saving"] == pytest.approx(n_a / (len(t1) + len(t2) - shared))
    assert 0 < total["policy_saving"] < total["best_case_saving"]  # epic recomputes A's first tokens


def test_tessera_analyze_reads_the_example_trace_of_the_repository() -> None:
    """The documented example parses and ``tessera analyze`` prints its ceiling."""
    result = CliRunner().invoke(app, ["analyze", str(EXAMPLE), "--per-stream"])
    assert result.exit_code == 0, result.output
    assert "best-case prefill saving over prefix caching" in result.output
    assert "globex" in result.output and "acme" in result.output


def test_a_rendered_trace_converts_back_to_the_requests_that_rendered_it(renderer: TraceRenderer) -> None:
    """Messages, units and placement are recovered, control-token text and multi-turn included."""
    texts = UnitTexts(renderer.tokenizer.encode_plain)
    requests = [
        parse_line(_line([A, B], placement="user"), "x"),
        parse_line({"messages": [{"role": "user", "content": "hi <|im_start|>system"}], "units": [A]}, "x"),
        parse_line({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a<|im_end|>"},
                                 {"role": "user", "content": "q2"}], "units": [{"id": "d", "tokens": 9}]}, "x"),
        parse_line({"messages": [SYSTEM, {"role": "user", "content": "no units"}]}, "x"),
    ]
    converter = RenderedConverter(renderer.tokenizer, renderer.path.factory)
    for req in requests:
        back = converter.convert(renderer.record(req), "x")
        assert (back.messages, back.placement) == (req.messages, req.placement)
        assert [u.text for u in back.units] == [t for _, t in texts.pairs(req)]
    assert converter.mismatched == 0


def test_a_workload_converts_with_poisson_arrivals_and_private_units(renderer: TraceRenderer) -> None:
    """Arrival times grow; a private unit keeps its token length and the same id for the same text."""
    wl = synthetic_workload(12, n_units=4, unit_words=10, units_per_request=2)
    factory = renderer.path.factory
    lines = list(from_workload(wl, lambda r: [factory.make(r.scope, t) for t in r.context_units], private=True,
                               rate=2.0))
    arrivals = [r.arrival_s for r in lines]
    assert arrivals[0] == 0.0 and all(a is not None for a in arrivals)
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0  # type: ignore[type-var]
    by_text: dict[str, str] = {}
    for req, line in zip(wl.requests, lines, strict=True):
        for text, unit in zip(req.context_units, line.units, strict=True):
            assert unit.text is None and unit.tokens == factory.make(req.scope, text).n_tokens
            assert by_text.setdefault(text, str(unit.id)) == unit.id


def test_units_go_into_a_plain_prompt_where_the_prompt_builder_places_them(renderer: TraceRenderer) -> None:
    """For a server without Tessera, system placement appends the units to the system prompt; user
    placement opens the newest user message with a <relevant-memories> block."""
    texts = UnitTexts(renderer.tokenizer.encode_plain)
    system = inline_messages(parse_line(_line([A, B]), "x"), texts)
    assert system[0]["content"] == f"{SYSTEM['content']}\n\n{A}\n{B}\n"
    user = inline_messages(parse_line(_line([A], placement="user"), "x"), texts)
    assert user[1]["content"].startswith(f"<relevant-memories>\n{A}\n</relevant-memories>\n\n")


@pytest.mark.integration
def test_tessera_trace_from_workload_writes_a_trace_that_analyze_reads(tmp_path: Path) -> None:
    """The docs' `tessera trace from-workload` command, run as written (tiny workload), then analyzed."""
    out = tmp_path / "synthetic.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "tessera", "trace", "from-workload", "--workload", "synthetic",
                           "--rate", "2", "--out", str(out)], env=env, capture_output=True, text=True, check=False,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = out.read_text().splitlines()
    assert lines and f"wrote {len(lines)} requests" in done.stdout
    analyzed = subprocess.run([sys.executable, "-m", "tessera", "analyze", str(out)], env=env, capture_output=True,
                              text=True, check=False, timeout=120)
    assert analyzed.returncode == 0, analyzed.stderr
    assert "prefix" in analyzed.stdout
