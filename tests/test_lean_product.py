"""The product loads no lab: ``tessera``'s CLI and its role processes import neither
``tessera_lab`` nor the ``lab`` extra (matplotlib, tqdm).

Each check runs in a fresh interpreter, whose ``sys.modules`` is the evidence. There, an
import finder refuses ``tessera_lab`` to everyone and matplotlib and tqdm to ``tessera``'s own
modules, as an install without the lab would: a module that imports one of them fails the
process. tqdm stays importable by third parties, because some of the serving dependencies
(usearch, torch's hub) import it themselves.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.config_file import load_config

# Runs first in the child: the finder, then a report of what was loaded and who asked for it.
PRELUDE = '''
import importlib.abc, json, sys

LAB, EXTRAS = "tessera_lab", ("matplotlib", "tqdm")
asked = []  # (module, importer) of every refused import

def _importer():
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib")
                                 or frame.f_globals.get("__name__", "").startswith("importlib")):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""

class NoLab(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top, importer = name.split(".")[0], _importer()
        if top == LAB or (top in EXTRAS and importer.split(".")[0] == "tessera"):
            asked.append((name, importer))
            raise ModuleNotFoundError(f"No module named {name!r} (refused to {importer})", name=name)
        return None

sys.meta_path.insert(0, NoLab())

def report():
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in (LAB, *EXTRAS))
    print(json.dumps({"loaded": loaded, "asked": asked}))
'''

# the role process's own start, up to the moment it would start serving: tessera run's
# command, config, checks and the role's app, built; then a report instead of the event loop
ROLE = '''
import tessera.runtime

def serve_instead(start):
    report()
    return 0

tessera.runtime.run = serve_instead
from tessera.cli import main
sys.argv = ["tessera", "run", *sys.argv[1:]]
main()
'''

CLI = '''
import typer.main
import tessera.cli

commands = sorted(typer.main.get_command(tessera.cli.app).commands)
report()
print(json.dumps(commands))
'''


def _child(tmp_path: Path, code: str, *args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PRELUDE + code, *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout.splitlines()


def assert_no_lab(line: str) -> dict[str, list[str]]:
    """The report line shows no tessera_lab or matplotlib module and no refused import."""
    seen: dict[str, list[str]] = json.loads(line)
    assert not seen["asked"], f"tessera imported the lab or its extras: {seen['asked']}"
    assert not [m for m in seen["loaded"] if m.split(".")[0] in ("tessera_lab", "matplotlib")], seen["loaded"]
    return seen


def test_importing_the_cli_loads_no_lab_and_no_extras(tmp_path: Path) -> None:
    """``import tessera.cli`` and building every command (``tessera --help``) loads none of the lab,
    matplotlib or tqdm, and still lists the lab's commands."""
    report, commands = _child(tmp_path, CLI)
    assert assert_no_lab(report)["loaded"] == []
    assert {"simulate", "chaos", "hosts", "eval", "bench", "run", "up"} <= set(json.loads(commands))


@pytest.mark.parametrize("role", ["generation", "kvpool", "retrieval"])
def test_a_role_process_starts_without_the_lab(tmp_path: Path, role: str) -> None:
    """``tessera run --role ROLE`` (the embedded config's first node) builds its app without importing
    tessera_lab, matplotlib, or tqdm from tessera's own code."""
    config = load_config(None)
    node = {"generation": config.generation[0].name, "kvpool": config.kvpools[0].name}.get(role)
    args = ["--role", role, *(["--node", node] if node else [])]
    assert_no_lab(_child(tmp_path, ROLE, *args)[-1])


def test_the_finder_refuses_an_extra_to_tessera_code(tmp_path: Path) -> None:
    """The check can fail: a tessera-side import of tqdm is refused and reported."""
    code = ("import tessera.benchmark.extras as x\n"
            "try:\n    x.progress_bar(1, 'd', 'u')\nexcept ModuleNotFoundError:\n    pass\n"
            "report()\n")
    seen = json.loads(_child(tmp_path, code)[-1])
    assert seen["asked"] == [["tqdm", "tessera.benchmark.extras"]]
