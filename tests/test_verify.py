"""``tessera verify``: fidelity against full prefill, thresholds and calibration on a tiny random model."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from tessera.benchmark.quality import best_f1
from tessera.benchmark.verify import (
    Layouts,
    Setting,
    bootstrap,
    format_rows,
    overlay_toml,
    prompts_from_file,
    prompts_from_workload,
    ratio_interval,
    summarize,
    verify,
)
from tessera.benchmark.workloads import synthetic_workload
from tessera.cli import app
from tessera.composition.policies import get_policy
from tessera.config_file import load_config
from tessera.engines.offline import compose, prefill_units
from tessera.engines.reference import ReferenceEngine
from tessera.engines.tiny import write_tiny_checkpoint
from tessera.errors import ConfigError


@pytest.fixture(scope="module")
def tiny_config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("verify")
    model = write_tiny_checkpoint(root / "tiny")
    path = root / "tiny.toml"
    path.write_text(f'base = "default"\nkv_dtype = "float32"\n[model]\nsource = "{model}"\nthreads = 1\n'
                    f'[composition]\ncalibration_dir = "{root / "records"}"\n')
    return path


def _run(config: Path, tmp: Path, *args: str) -> tuple[int, dict[str, object], str]:
    out = tmp / "verify.json"
    result = CliRunner().invoke(app, ["verify", "--workload", "synthetic", "--samples", "4", "--answer-tokens", "4",
                                      "--kl-positions", "2", "--unit-words", "12", "--config", str(config),
                                      "--out", str(out), *args])
    report = json.loads(out.read_text()) if out.is_file() else {}
    return result.exit_code, report, result.output


def test_full_prefill_scores_kl_zero_and_full_agreement(tiny_config_file: Path) -> None:
    """Composing with ``full`` reproduces full prefill exactly; naive over random weights does not."""
    cfg = load_config(tiny_config_file)
    engine = ReferenceEngine.from_config(cfg, prefix_cache_tokens=0)
    prompts = prompts_from_workload(cfg, synthetic_workload(3, n_units=6, unit_words=12, units_per_request=2),
                                    engine.tokenizer)
    settings = [Setting("full"), Setting("naive", unit_lead="<|endoftext|>")]
    scores = verify(engine, engine.tokenizer, cfg, prompts, settings, answer_tokens=4, kl_positions=2)
    full = scores[Setting("full")]
    assert full.kl == [0.0] * 3 and full.prefix == [1.0] * 3 and full.exact == [1.0] * 3 and full.top1 == [1.0] * 3
    naive = scores[Setting("naive", unit_lead="<|endoftext|>")]
    assert max(naive.kl) > 0 and naive.cost == [0.0] * 3
    assert min(full.cost) > 0


def test_bootstrap_interval_brackets_the_mean() -> None:
    """The 95% interval contains the mean and collapses for constant values."""
    iv = bootstrap([0.0, 1.0, 1.0, 0.0, 1.0])
    assert iv.lo <= iv.mean <= iv.hi and iv.mean == pytest.approx(0.6)
    assert bootstrap([0.5] * 4) == bootstrap([0.5] * 4) and bootstrap([0.5] * 4).lo == 0.5


def test_a_missed_threshold_exits_non_zero(tiny_config_file: Path, tmp_path: Path) -> None:
    """The configured setting (epic k=16 f=0.25) misses KL = 0; full meets it."""
    code, report, output = _run(tiny_config_file, tmp_path, "--policies", "naive", "--max-kl", "0")
    assert code == 1 and "FAIL" in output
    assert report["configured"] == "epic k=16 f=0.25 inline=0.75 lead=none"
    full_cfg = tmp_path / "full.toml"
    full_cfg.write_text(f'base = "{tiny_config_file}"\n[composition]\npolicy = "full"\nunit_lead = ""\n')
    code, _, output = _run(full_cfg, tmp_path, "--policies", "full", "--max-kl", "0", "--min-agreement", "1")
    assert code == 0, output


def test_calibration_picks_the_cheapest_passing_setting_and_its_overlay_loads(tiny_config_file: Path,
                                                                              tmp_path: Path) -> None:
    """Among settings meeting the target, the one recomputing the fewest unit tokens is written as an overlay."""
    overlay = tmp_path / "cal.toml"
    code, report, output = _run(tiny_config_file, tmp_path, "--ks", "2,64", "--fractions", "0.5,1.0",
                                "--calibrate", "--target-kl", "0", "--overlay", str(overlay))
    assert code == 0, output
    rows = report["rows"]
    assert isinstance(rows, list)
    passing = [r for r in rows if r["kl"]["mean"] <= 0]
    chosen = report["calibrated"]
    assert isinstance(chosen, dict)
    assert chosen["cost"] == min(r["cost"] for r in passing)
    loaded = load_config(overlay).composition
    assert Setting.of(loaded).label == chosen["setting"]
    code, report, _ = _run(tiny_config_file, tmp_path, "--calibrate", "--target-agreement", "0",
                           "--overlay", str(overlay))
    assert code == 0 and report["calibrated"]["cost"] == 0  # type: ignore[index]
    assert load_config(overlay).composition.policy == "naive"  # every setting passes: reuse everything


def test_frontier_times_each_setting_and_plots_it(tiny_config_file: Path, tmp_path: Path) -> None:
    """--frontier adds a composed-prefill time per setting and writes the frontier plot."""
    code, report, output = _run(tiny_config_file, tmp_path, "--policies", "naive,full", "--leads", "none",
                                "--frontier")
    assert code == 0, output
    rows = report["rows"]
    assert isinstance(rows, list) and all(r["prefill_s"] > 0 for r in rows)
    assert Path(str(report["frontier_plot"])).is_file()


def test_bench_fidelity_scores_the_configured_setting_on_measured_requests(tiny_config_file: Path) -> None:
    """``bench --fidelity N`` scores N requests from the measured part with the configured setting."""
    from tessera.benchmark.verify import format_fidelity, measured_fidelity

    cfg = load_config(tiny_config_file)
    wl = synthetic_workload(8, n_units=6, unit_words=12, units_per_request=2)
    fid = measured_fidelity(cfg, wl, 3, 0.5, answer_tokens=3, kl_positions=2)
    assert fid["prompts"] == 3 and fid["setting"] == "epic k=16 f=0.25 inline=0.75 lead=none"
    assert 0.0 <= fid["prefix"]["mean"] <= 1.0 and fid["kl"]["mean"] >= 0.0
    assert "measured requests" in format_fidelity(fid)


def test_calibration_without_targets_matches_the_configured_setting(tiny_config_file: Path, tmp_path: Path) -> None:
    """No target given: the chosen setting is no worse than the configured one on KL and agreement."""
    overlay = tmp_path / "cal.toml"
    # thresholds the configured setting meets on random weights: the target is then its own score
    code, report, output = _run(tiny_config_file, tmp_path, "--ks", "4,16", "--calibrate", "--overlay", str(overlay),
                                "--max-kl", "1000", "--min-agreement", "0")
    assert code == 0, output
    rows = {r["setting"]: r for r in report["rows"]}  # type: ignore[union-attr]
    mine, chosen = rows[report["configured"]], report["calibrated"]
    assert isinstance(chosen, dict)
    assert chosen["kl"]["mean"] <= mine["kl"]["mean"] and chosen["prefix"]["mean"] >= mine["prefix"]["mean"]
    assert chosen["cost"] <= mine["cost"]


def test_unit_bos_is_named_in_every_label_and_the_overlay(tiny_config_file: Path, tmp_path: Path) -> None:
    """A run under ``unit_bos = true`` labels every setting ``bos`` (it changes every unit's state,
    so the score), writes it into the overlay, and refuses a setting the engine cannot serve."""
    bos_cfg = tmp_path / "bos.toml"
    bos_cfg.write_text(f'base = "{tiny_config_file}"\n[composition]\nunit_bos = true\n')
    overlay = tmp_path / "cal.toml"
    code, report, output = _run(bos_cfg, tmp_path, "--policies", "naive", "--leads", "none", "--calibrate",
                                "--target-agreement", "0", "--overlay", str(overlay))
    assert code == 0, output
    assert report["configured"] == "epic k=16 f=0.25 inline=0.75 lead=none bos"
    rows = report["rows"]
    assert isinstance(rows, list) and {r["setting"] for r in rows} == {
        "epic k=16 f=0.25 inline=0.75 lead=none bos", "naive lead=none bos"}
    assert all(r["composition"]["unit_bos"] for r in rows)
    loaded = load_config(overlay).composition
    assert loaded.unit_bos and Setting.of(loaded).label == "naive lead=none bos"
    # the default labels say nothing of it: their settings are served without
    assert Setting.of(load_config(tiny_config_file).composition).label == "epic k=16 f=0.25 inline=0.75 lead=none"
    cfg = load_config(bos_cfg)
    engine = ReferenceEngine.from_config(cfg, prefix_cache_tokens=0)
    with pytest.raises(ConfigError, match="unit_bos"):
        verify(engine, engine.tokenizer, cfg, [], [Setting("naive")], answer_tokens=2, kl_positions=1)


EXAMPLE_TRACE = Path(__file__).resolve().parents[1] / "bench" / "traces" / "example.jsonl"


def test_a_trace_file_is_scored_with_its_units(tiny_config_file: Path, tmp_path: Path) -> None:
    """Regression: ``verify --prompts bench/traces/example.jsonl`` (the trace format) scored every prompt
    without its units and reported KL 0 and agreement 1 for every setting, naive included."""
    cfg = load_config(tiny_config_file)
    trace = prompts_from_file(EXAMPLE_TRACE, cfg)
    first = json.loads(EXAMPLE_TRACE.read_text().splitlines()[0])
    as_request = tmp_path / "request.jsonl"  # the same line in the API's format
    as_request.write_text(json.dumps({"messages": first["messages"], "context_units": first["units"],
                                      "scope": first["scope"], "unit_placement": first["placement"]}) + "\n")
    assert trace[0] == prompts_from_file(as_request, cfg)[0] and all(p.units for p in trace)
    code, report, output = _run(tiny_config_file, tmp_path, "--prompts", str(EXAMPLE_TRACE), "--samples", "3",
                                "--policies", "naive", "--leads", "none")
    assert code == 0, output
    naive = next(r for r in report["rows"] if r["setting"] == "naive lead=none")  # type: ignore[union-attr]
    assert naive["kl"]["mean"] > 0


@pytest.mark.parametrize(("line", "needle"), [
    ({"messages": [{"role": "user", "content": "q"}]}, ":1: the prompt brings no units"),
    ({"messages": [{"role": "user", "content": "q"}], "placement": "user", "units": ["a", {"id": "doc-17"}]},
     ":1: units[1]: a private unit needs a non-empty string id and tokens >= 1, got {'id': 'doc-17'}"),
    ({"messages": [{"role": "user", "content": "q"}], "context_unit": ["a"]},
     "unknown field 'context_unit' (did you mean 'context_units'?)"),
])
def test_a_prompt_whose_units_verify_cannot_find_is_refused_naming_it(tmp_path: Path, line: dict[str, Any],
                                                                     needle: str) -> None:
    """A prompt without units, a private unit without its length, or a misspelt context_units: refused,
    naming the line and the unit, instead of scored as exact."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ConfigError) as info:
        prompts_from_file(path, load_config(None))
    assert needle in str(info.value)


def test_calibrate_judges_the_configured_setting_by_the_gates_thresholds(tiny_config_file: Path,
                                                                        tmp_path: Path) -> None:
    """``--calibrate`` prints one PASS / FAIL line against composition.max_kl / min_agreement; when the
    configured setting fails, the overlay is the cheapest setting that passes (exit 0), or none does (exit 1)."""
    lenient = tmp_path / "lenient.toml"
    lenient.write_text(f'base = "{tiny_config_file}"\n[composition]\nmax_kl = 1000.0\nmin_agreement = 0.0\n')
    code, report, output = _run(lenient, tmp_path, "--calibrate", "--overlay", str(tmp_path / "a.toml"))
    assert code == 0 and report["passed"] is True, output
    assert "PASS: epic k=16 f=0.25 inline=0.75 lead=none on 4 prompts" in output and "fidelity gate's" in output

    strict = tmp_path / "strict.toml"
    strict.write_text(f'base = "{tiny_config_file}"\n[composition]\nmax_kl = 0.0\nmin_agreement = 1.0\n')
    overlay = tmp_path / "b.toml"
    code, report, output = _run(strict, tmp_path, "--calibrate", "--policies", "naive,epic,full",
                                "--overlay", str(overlay))
    assert "FAIL: epic k=16 f=0.25 inline=0.75 lead=none on 4 prompts" in output
    assert "PASS: full lead=none (the overlay)" in output and code == 0 and report["passed"] is True, output
    assert load_config(overlay).composition.policy == "full"
    code, report, output = _run(strict, tmp_path, "--calibrate", "--overlay", str(tmp_path / "c.toml"))
    assert code == 1 and report["passed"] is False and "no setting meets" in output, output


def test_by_default_only_the_configured_unit_lead_is_scored(tiny_config_file: Path, tmp_path: Path) -> None:
    """The default grid is the configured lead's (none here), without ``full`` (the reference itself)."""
    code, report, output = _run(tiny_config_file, tmp_path)
    assert code == 0, output
    labels = [r["setting"] for r in report["rows"]]  # type: ignore[union-attr]
    assert labels == ["epic k=16 f=0.25 inline=0.75 lead=none", "naive lead=none",
                      "epic k=4 f=1 inline=0.75 lead=none", "epic k=16 f=1 inline=0.75 lead=none"]
    assert report["passed"] is None and "PASS" not in output and "FAIL" not in output


def test_an_answer_scored_in_one_forward_matches_scoring_it_a_decode_step_a_token(tiny_config_file: Path) -> None:
    """The reference engine scores a forced answer inside the prompt's forward (``Extend.tail_logits``):
    the logits before each answer token are those a decode step per token gives."""
    from tessera.composition.policies import get_policy
    from tessera.engines.offline import compose, prefill_units

    cfg = load_config(tiny_config_file)
    engine = ReferenceEngine.from_config(cfg, prefix_cache_tokens=0)
    prompt = prompts_from_workload(cfg, synthetic_workload(1, n_units=4, unit_words=12, units_per_request=2),
                                   engine.tokenizer)[0]
    policy = get_policy("epic", recompute_tokens=2)
    built = Layouts(engine, engine.tokenizer, cfg).build(prompt, "", policy, 5)
    states = prefill_units(engine, built.rendered)
    answer = [5, 9, 2, 7, 3]
    one = compose(engine, built.served, policy, states, forced=answer, use_prefix_cache=False)
    engine.scores_tail = False  # the decode-step path every engine has
    try:
        stepped = compose(engine, built.served, policy, states, forced=answer, use_prefix_cache=False)
    finally:
        del engine.scores_tail
    assert len(one.forced_logits) == len(stepped.forced_logits) == len(answer) and one.computed == stepped.computed
    for a, b in zip(one.forced_logits, stepped.forced_logits, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), float((a - b).abs().max())


def test_the_first_hour_path_calibrates_from_a_trace_of_requests(tiny_config_file: Path, tmp_path: Path) -> None:
    """The documented first-hour path: a trace of requests (here ``tessera trace from-workload``), then
    ``tessera verify --prompts FILE --calibrate``: a PASS / FAIL line, a record per setting, an overlay."""
    trace = tmp_path / "my_requests.jsonl"
    made = CliRunner().invoke(app, ["trace", "from-workload", "--workload", "synthetic", "--requests", "3",
                                    "--unit-words", "12", "--out", str(trace), "--config", str(tiny_config_file)])
    assert made.exit_code == 0 and len(trace.read_text().splitlines()) == 3, made.output
    lenient = tmp_path / "lenient.toml"
    lenient.write_text(f'base = "{tiny_config_file}"\n[composition]\nmax_kl = 1000.0\nmin_agreement = 0.0\n')
    overlay = tmp_path / "calibrated.toml"
    code, report, output = _run(lenient, tmp_path, "--prompts", str(trace), "--samples", "0", "--calibrate",
                                "--overlay", str(overlay))
    assert code == 0, output
    assert "PASS: epic k=16 f=0.25 inline=0.75 lead=none on 3 prompts" in output and report["prompts"] == 3
    assert len(list((tiny_config_file.parent / "records").glob("*.json"))) >= len(report["rows"])  # type: ignore[arg-type]
    assert Setting.of(load_config(overlay).composition).label == report["calibrated"]["setting"]  # type: ignore[index]
    assert float(str(report["seconds"])) > 0


def test_policies_that_read_the_model_are_scored_per_budget_and_their_overlay_loads(tiny_config_file: Path,
                                                                                    tmp_path: Path) -> None:
    """--policies query,deviation × --ks × --budgets: a row per setting naming every knob, the
    larger budget recomputing more, and a calibration overlay that serves the chosen one."""
    overlay = tmp_path / "cal.toml"
    code, report, output = _run(tiny_config_file, tmp_path, "--policies", "query,deviation", "--ks", "2",
                                "--fractions", "1.0", "--budgets", "0.1,0.5", "--leads", "none",
                                "--calibrate", "--target-kl", "100", "--overlay", str(overlay))
    assert code == 0, output
    rows = {r["setting"]: r for r in report["rows"]}  # type: ignore[union-attr]
    for name in ("query", "deviation"):
        low, high = (rows[f"{name} k=2 f=1 inline=0.75 budget={b} lead=none"] for b in ("0.1", "0.5"))
        assert 0 < low["cost"] < high["cost"]
    chosen = load_config(overlay).composition
    assert Setting.of(chosen).label == report["calibrated"]["setting"]  # type: ignore[index]
    for setting in (Setting("query", 2, 1.0, recompute_budget=0.5), Setting("deviation", 4, 0.25, "", 0.5,
                                                                            recompute_budget=0.1)):
        written = tmp_path / f"{setting.policy}.toml"
        written.write_text(overlay_toml(setting, str(tiny_config_file)))
        assert Setting.of(load_config(written).composition) == setting
    bad = CliRunner().invoke(app, ["verify", "--workload", "synthetic", "--samples", "1", "--policies", "query",
                                   "--budgets", "lots", "--config", str(tiny_config_file)])
    assert bad.exit_code != 0 and "--budgets" in bad.output


def test_the_answer_f1_ratio_scores_each_settings_own_greedy_answer_against_gold(tiny_config_file: Path) -> None:
    """With full prefill's answer as the gold answer, full scores F1 1 and a ratio of 1; naive's
    F1 is that of its own greedy answer, and its ratio their sum over full's; prompts without
    gold answers are not graded."""
    cfg = load_config(tiny_config_file)
    engine = ReferenceEngine.from_config(cfg, prefix_cache_tokens=0)
    tok, stops = engine.tokenizer, engine.tokenizer.eos_token_ids
    plain = prompts_from_workload(cfg, synthetic_workload(3, n_units=6, unit_words=12, units_per_request=2), tok)
    layouts = Layouts(engine, tok, cfg)
    full, naive = get_policy("full"), get_policy("naive")

    def answer(prompt: Any, policy: Any) -> str:
        built = layouts.build(prompt, "", policy, 4)
        comp = compose(engine, built.served, policy, prefill_units(engine, built.rendered), max_new_tokens=4,
                       stop_ids=stops, use_prefix_cache=False)
        return tok.decode([t for t in comp.generated if t not in stops])

    graded = [dataclasses.replace(p, answers=(answer(p, full),)) for p in plain]
    settings = [Setting("full"), Setting("naive")]
    scores = verify(engine, tok, cfg, graded, settings, answer_tokens=4, kl_positions=2)
    assert scores[Setting("full")].f1 == [1.0] * 3 and scores[Setting("full")].full_f1 == [1.0] * 3
    own = [best_f1(answer(p, naive), p.answers) for p in graded]
    assert scores[Setting("naive")].f1 == pytest.approx(own)
    rows = {r.setting: r for r in summarize(scores)}
    assert rows[Setting("full")].f1_ratio.mean == 1.0
    assert rows[Setting("naive")].f1_ratio.mean == pytest.approx(sum(own) / 3)
    assert "answer F1 / full's" in format_rows(list(rows.values()))[0]
    ungraded = summarize(verify(engine, tok, cfg, plain, settings, answer_tokens=4, kl_positions=2))
    assert all(math.isnan(r.f1_ratio.mean) for r in ungraded)
    assert "answer F1" not in format_rows(ungraded)[0]


def test_the_ratio_interval_brackets_the_ratio_of_means() -> None:
    iv = ratio_interval([0.5, 1.0, 0.0, 1.0], [1.0, 1.0, 0.5, 1.0])
    assert iv.mean == pytest.approx(2.5 / 3.5) and iv.lo <= iv.mean <= iv.hi
    assert math.isnan(ratio_interval([0.0], [0.0]).mean) and math.isnan(ratio_interval([], []).mean)
