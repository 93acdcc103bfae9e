"""Every shell command of the README and of docs/ is run by a named test, so none can silently break.

``COVERED`` maps a command's key (the program and its subcommand or script) to the test(s) that
run it, a smoke run with tiny parameters where the real one is long. ``NOT_YET`` lists the keys
no test runs yet and why; a command of README.md or docs/**/*.md in neither table fails this file.
"""

from __future__ import annotations

import re
from pathlib import Path

from fixtures.tiers import SYSTEM_MODULES, UNIT_MODULES
from helpers.cluster import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"


def documents() -> list[Path]:
    """The files whose commands must stay under test: the README and every page under docs/."""
    return [README, *sorted(DOCS.rglob("*.md"))]

SHORT_CHAOS = "tests/test_chaos.py::test_a_short_chaos_run_answers_every_request_correctly_or_refuses_it_cleanly"
SMOKE = "tests/test_readme_smoke.py::"
DEMO = SMOKE + "test_tessera_demo_compares_prefix_caching_and_tessera_on_a_tiny_run"
THIS = "tests/test_readme_commands.py::"
HA_UP = "tests/test_ha_up.py::"
# a key's tests together run its command: `make demo` is the Makefile's `$(BIN)/tessera demo`
COVERED: dict[str, str | tuple[str, ...]] = {
    "make demo": (THIS + "test_make_demo_runs_exactly_tessera_demo", DEMO),
    "make test": THIS + "test_ci_runs_make_test_and_make_test_is_lint_typecheck_and_every_tier",
    "make unit": THIS + "test_ci_runs_make_test_and_make_test_is_lint_typecheck_and_every_tier",
    "make integration": THIS + "test_ci_runs_make_test_and_make_test_is_lint_typecheck_and_every_tier",
    "make system": THIS + "test_ci_runs_make_test_and_make_test_is_lint_typecheck_and_every_tier",
    "tessera trace": "tests/test_traffic_trace.py::test_tessera_trace_from_workload_writes_a_trace_that_analyze_reads",
    "tessera data": ("tests/test_data_fetch.py::test_the_cli_fetches_the_real_manifest_from_a_mirror_and_check_passes",
                     "tests/test_data_fetch.py::test_the_cli_names_a_file_missing_on_the_mirror"),
    "pytest tests/test_hosts.py": "tests/test_hosts.py::test_a_short_multi_host_chaos_run_keeps_every_invariant",
    "tessera up": (SMOKE + "test_tessera_up_serves_an_openai_chat_request_and_stops_cleanly_on_ctrl_c",
                   HA_UP + "test_tessera_up_with_two_replicas_serves_chat_on_both_and_stops_on_ctrl_c"),
    "tessera hosts": (SMOKE + "test_tessera_hosts_up_serves_through_its_forward_and_ctrl_c_deletes_the_hosts",
                      SMOKE + "test_tessera_hosts_clean_deletes_what_a_killed_hosts_up_left_behind"),
    "bench/gpu.sh prepare": "tests/test_bench_gpu.py::"
                            "test_gpu_sh_prepare_fills_dot_gpu_with_what_the_gpu_machine_lacks_within_the_carry_limit",
    "tessera run": "tests/test_security.py::test_control_rpcs_do_not_exist_on_the_public_port",
    "python bench/control_plane.py": SMOKE + "test_bench_control_plane_plans_requests_and_prints_its_rates",
    "valgrind --tool=callgrind": SMOKE + "test_bench_control_plane_under_callgrind_counts_only_the_plans",
    "tessera bench": SMOKE + "test_tessera_bench_sweeps_a_tiny_synthetic_workload_and_reports_ttft",
    "tessera simulate": ("tests/test_simulate.py::test_the_cli_calibrates_then_simulates_a_tiny_synthetic_sweep",
                         "tests/test_simulate.py::test_the_cli_measures_each_roles_cpu_on_a_real_tiny_cluster"),
    "python bench/scale.py":
        "tests/test_simulate.py::test_bench_scale_prints_a_row_per_fleet_size_and_the_shared_tier_sweep",
    "tessera analyze": "tests/test_benchmark.py::test_analyze_cli_prints_the_classification",
    "tessera report": "tests/test_bench_merge.py::"
                      "test_tessera_report_merges_runs_writes_the_merged_report_and_refuses_bad_input",
    "tessera eval": SMOKE + "test_tessera_eval_scores_each_policy_against_gold_answers_and_full",
    "tessera verify": ("tests/test_verify.py::test_a_missed_threshold_exits_non_zero",
                       "tests/test_verify.py::test_the_first_hour_path_calibrates_from_a_trace_of_requests"),
    "tessera chaos": (SHORT_CHAOS, "tests/test_chaos.py::test_a_replicated_chaos_run_survives_leader_kills_and_pauses",
                      "tests/test_sglang_engine.py::test_a_short_chaos_run_on_sglang_nodes_keeps_every_invariant"),
    "pytest tests/test_chaos.py": SHORT_CHAOS,
    "python bench/cpu_profile.py": SMOKE + "test_bench_profile_stages_each_roles_cpu_for_prefix_caching_and_tessera",
    "python bench/overload.py": SMOKE + "test_bench_overload_drives_load_and_reports_ttft_against_the_unloaded_p99",
    "python bench/engine.py": SMOKE + "test_bench_engine_times_full_and_composed_prefill_on_smollm2",
    "python bench/forward_cost.py": SMOKE + "test_bench_forward_cost_splits_a_forward_into_fixed_and_per_token_cost",
    "python bench/queue_model.py": "tests/test_queue_model.py::"
                                   "test_the_command_reads_a_bench_folder_and_prints_each_runs_split",
    "python bench/fidelity.py": "tests/test_first_hour.py::test_bench_fidelity_runs_with_float16_states",
    "python bench/store_startup.py":
        SMOKE + "test_bench_store_startup_reopens_a_saved_a_crashed_and_an_index_less_store",
    "python bench/transport.py": (SMOKE + "test_bench_transport_measures_every_transport_next_to_its_ceilings",
                                  SMOKE + "test_bench_transport_across_hosts_measures_the_network_transports"),
    "bench/gpu.sh smoke": "tests/test_first_hour.py::test_gpu_sh_smoke_runs_on_a_fresh_clone",
    "pytest tests/test_ha_election.py":
        "tests/test_ha_election.py::test_a_leader_that_cannot_renew_stops_before_its_successor_starts",
    "pytest tests/test_ha_failover.py":
        "tests/test_ha_failover.py::test_killing_the_leader_hands_over_without_connection_errors_or_lost_units",
    "python bench/failover.py": HA_UP + "test_bench_failover_kills_the_leader_and_prints_its_figures",
    "pytest tests/test_sglang_engine.py":
        "tests/test_sglang_engine.py::test_openai_client_against_sglang_nodes_composes_like_the_offline_engine",
    "python bench/sglang_agreement.py":
        "tests/test_sglang_engine.py::test_bench_sglang_agreement_compares_three_engines_greedy_tokens",
}

SETUP = {"source .venv/bin/activate"}  # shell set-up, not a command with output of its own

# NOTE: each of these is a gap, not an exemption; a smoke test moves its key to COVERED
NOT_YET = {
    "bench/gpu.sh run": "needs a GPU",
}


def commands_in(text: str) -> list[str]:
    """Shell commands of one Markdown text: ```bash blocks, and the indented `bench/gpu.sh` lines."""
    blocks = re.findall(r"^[ \t]*```bash\n(.*?)^[ \t]*```", text, re.S | re.M)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"^    ((?:PYTHON=\S+ )*(?:TESSERA_DATA=\S+ )?bench/gpu\.sh .*)$", text, re.M)
    out = []
    for line in lines:
        line = line.split("  #")[0].strip()
        if line and not line.startswith("#"):
            out.append(" ".join(line.split()))
    return out


def readme_commands() -> list[str]:
    """Shell commands of the README and of every docs/ page."""
    return [c for path in documents() for c in commands_in(path.read_text())]


def key(command: str) -> str:
    """`PYTHONPATH=. python bench/x.py --n 1` -> `python bench/x.py`; `tessera bench ...` -> `tessera bench`."""
    words = [w for w in command.split() if "=" not in w or w.startswith("-")]
    if words[0] == "sudo":  # root for the network namespaces: the same command
        words = words[1:]
    if words[0] == "pytest":
        return "pytest " + next(w for w in words if w.startswith("tests/"))
    return " ".join(words[:2])


def _defined(test_id: str) -> bool:
    path, name = test_id.split("::")
    return re.search(rf"^(async )?def {name}\(", (REPO / path).read_text(), re.M) is not None


def _test_ids(tests: str | tuple[str, ...]) -> tuple[str, ...]:
    return (tests,) if isinstance(tests, str) else tests


def _recipe(target: str) -> tuple[list[str], list[str]]:
    """The Makefile target's prerequisites and its recipe lines (comments dropped)."""
    text = (REPO / "Makefile").read_text()
    block = re.search(rf"^{re.escape(target)}:(.*)\n((?:\t.*\n)*)", text, re.M)
    assert block, f"no `{target}:` target in the Makefile"
    recipe = [line.strip() for line in block[2].splitlines() if not line.strip().startswith("#")]
    return block[1].split(), recipe


def test_every_readme_command_is_run_by_a_named_test_or_listed_as_a_gap() -> None:
    keys = {key(c) for c in readme_commands()}
    unlisted = sorted(keys - COVERED.keys() - NOT_YET.keys() - SETUP)
    assert not unlisted, f"README/docs commands no test runs: {unlisted}; add a smoke test to COVERED"
    stale = sorted((COVERED.keys() | NOT_YET.keys() | SETUP) - keys)
    assert not stale, f"no longer in the README or docs/: {stale}"


def test_commands_are_read_from_the_docs_pages_too() -> None:
    """A command that only a docs/ page shows is still found (the lab notebook moved out of the README)."""
    assert commands_in("text\n\n```bash\npython bench/x.py --n 1   # note\n```\n") == ["python bench/x.py --n 1"]
    gpu = DOCS / "gpu.md"
    assert "bench/gpu.sh run" in commands_in(gpu.read_text()), "docs/gpu.md lost its indented bench/gpu.sh lines"
    page = (DOCS / "bench" / "control-plane.md").read_text()
    assert any(key(c) == "python bench/control_plane.py" for c in commands_in(page))


def test_each_named_smoke_test_exists() -> None:
    missing = [t for tests in COVERED.values() for t in _test_ids(tests) if not _defined(t)]
    assert not missing, missing


def test_the_quick_start_says_how_to_reach_the_installed_commands() -> None:
    """Regression: bare `tessera`, `python bench/...` and `pytest` failed as the README wrote them."""
    quick = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "source .venv/bin/activate" in quick


def test_the_docs_document_the_data_sets_and_the_optional_version() -> None:
    """The README links the data sets page, which says where the data lives; the API says `version` is optional."""
    assert "(docs/data.md)" in README.read_text()
    assert "../shared/data" in (DOCS / "data.md").read_text()
    assert '`"version"` is optional' in (DOCS / "api.md").read_text()


def test_make_demo_runs_exactly_tessera_demo() -> None:
    """`make demo` is `tessera demo` after the install, so the demo's smoke run also runs `make demo`."""
    prerequisites, recipe = _recipe("demo")
    assert prerequisites == ["$(STAMP)"] and recipe == ["$(BIN)/tessera demo"], (prerequisites, recipe)


def test_ci_runs_make_test_and_make_test_is_lint_typecheck_and_every_tier() -> None:
    """CI (.ci/run) runs the README's `make test`: ruff, mypy, then the unit, integration and system tiers."""
    commands = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert commands[-1] == "make test", commands
    prerequisites, recipe = _recipe("test")
    assert prerequisites == ["lint", "typecheck"]
    assert "for tier in unit integration system;" in " ".join(recipe), recipe
    assert _recipe("lint")[1] == ["$(BIN)/ruff check tessera tessera_lab tests bench"]
    assert _recipe("typecheck")[1] == ["$(BIN)/mypy"]
    assert _recipe("unit")[1] == ["$(TIER) 'unit and not slow'"]
    for tier in ("integration", "system"):
        assert _recipe(tier)[1] == [f"$(TIER) '{tier} and not slow' $(PARALLEL)"]


def test_the_tier_tables_name_only_test_modules_that_exist() -> None:
    """A renamed or deleted test module cannot linger in tests/fixtures/tiers.py."""
    present = {p.name for p in (REPO / "tests").glob("test_*.py")}
    assert not (UNIT_MODULES | SYSTEM_MODULES) - present, sorted((UNIT_MODULES | SYSTEM_MODULES) - present)
    assert not UNIT_MODULES & SYSTEM_MODULES
