"""Every shell command of the README is run by a named test, so none can silently break (issue 21).

``COVERED`` maps a README command's key (the program and its subcommand or script) to the test
that runs it, a smoke run with tiny parameters where the real one is long. ``NOT_YET`` lists
the keys no test runs yet and why; a README command in neither table fails this file.
"""

from __future__ import annotations

import re

from helpers.cluster import REPO

README = REPO / "README.md"

SHORT_CHAOS = "tests/test_chaos.py::test_a_short_chaos_run_answers_every_request_correctly_or_refuses_it_cleanly"
COVERED = {
    "tessera run": "tests/test_security.py::test_control_rpcs_do_not_exist_on_the_public_port",
    "tessera analyze": "tests/test_benchmark.py::test_analyze_cli_prints_the_classification",
    "tessera verify": "tests/test_verify.py::test_a_missed_threshold_exits_non_zero",
    "tessera chaos": SHORT_CHAOS,
    "pytest tests/test_chaos.py": SHORT_CHAOS,
    "python bench/fidelity.py": "tests/test_first_hour.py::test_bench_fidelity_runs_with_float16_states",
    "bench/gpu.sh smoke": "tests/test_first_hour.py::test_gpu_sh_smoke_runs_on_a_fresh_clone",
    "pytest tests/test_ha_election.py":
        "tests/test_ha_election.py::test_a_leader_that_cannot_renew_stops_before_its_successor_starts",
}

SETUP = {"source .venv/bin/activate"}  # shell set-up, not a command with output of its own

# NOTE: each of these is a gap, not an exemption; a smoke test moves its key to COVERED
NOT_YET = {
    "make demo": "runs the whole demo (~5 min)",
    "make test": "runs the whole suite",
    "tessera up": "only its failure paths are run (tests/test_first_hour.py)",
    "tessera bench": "runner-level tests only (tests/test_benchmark.py); no CLI smoke run",
    "tessera eval": "only its missing-data error is run",
    "python bench/overload.py": "no smoke test",
    "python bench/engine.py": "no smoke test",
    "python bench/control_plane.py": "owned by the control-plane work (issue 21 left it to them)",
    "python bench/store_startup.py": "no smoke test",
    "python bench/transport.py": "no smoke test",
    "bench/gpu.sh prepare": "needs the network",
    "bench/gpu.sh run": "needs a GPU",
}


def readme_commands() -> list[str]:
    """Shell commands of the README: ```bash blocks, and the indented `bench/gpu.sh` lines."""
    text = README.read_text()
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"^    ((?:PYTHON=\S+ )*(?:TESSERA_DATA=\S+ )?bench/gpu\.sh .*)$", text, re.M)
    out = []
    for line in lines:
        line = line.split("  #")[0].strip()
        if line and not line.startswith("#"):
            out.append(" ".join(line.split()))
    return out


def key(command: str) -> str:
    """`PYTHONPATH=. python bench/x.py --n 1` -> `python bench/x.py`; `tessera bench ...` -> `tessera bench`."""
    words = [w for w in command.split() if "=" not in w or w.startswith("-")]
    if words[0] == "pytest":
        return "pytest " + next(w for w in words if w.startswith("tests/"))
    return " ".join(words[:2])


def _defined(test_id: str) -> bool:
    path, name = test_id.split("::")
    return re.search(rf"^(async )?def {name}\(", (REPO / path).read_text(), re.M) is not None


def test_every_readme_command_is_run_by_a_named_test_or_listed_as_a_gap() -> None:
    keys = {key(c) for c in readme_commands()}
    unlisted = sorted(keys - COVERED.keys() - NOT_YET.keys() - SETUP)
    assert not unlisted, f"README commands no test runs: {unlisted}; add a smoke test to COVERED"
    stale = sorted((COVERED.keys() | NOT_YET.keys() | SETUP) - keys)
    assert not stale, f"no longer in the README: {stale}"


def test_each_named_smoke_test_exists() -> None:
    missing = [t for t in COVERED.values() if not _defined(t)]
    assert not missing, missing


def test_the_quick_start_says_how_to_reach_the_installed_commands() -> None:
    """Regression: bare `tessera`, `python bench/...` and `pytest` failed as the README wrote them."""
    quick = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "source .venv/bin/activate" in quick


def test_the_readme_documents_the_data_sets_and_the_optional_version() -> None:
    text = README.read_text()
    assert "### Data sets" in text and "../shared/data" in text.split("### Data sets", 1)[1][:2000]
    assert '`"version"` is optional' in text
