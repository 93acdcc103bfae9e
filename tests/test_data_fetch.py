"""`tessera data fetch | check`: the data sets downloaded verified and moved into place whole, and
every command that reads a missing data set says how to fetch it.

Every download here comes from an HTTP server on 127.0.0.1 (``--base-url``), never the public hosts.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessera.benchmark.datasets import (
    MANIFEST,
    ChecksumMismatch,
    DataError,
    DataFile,
    Status,
    fetch_file,
    run_check,
    run_fetch,
    status,
)
from tessera.benchmark.workloads import DATA_DIR
from tessera.cli import app
from tessera.errors import ConfigError

ALPHA = b'[{"question": "q", "answers": ["a"], "ctxs": []}]\n'
BETA = b"licence text\n"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# a manifest of two tiny data sets laid out like the real one; its URLs are never fetched
FAKE = (
    DataFile("alpha", "alpha/alpha.json", "https://example.invalid/alpha.json", _sha(ALPHA), "CC BY 4.0"),
    DataFile("beta", "beta/LICENSE.txt", "https://example.invalid/LICENSE.txt", _sha(BETA), "CC BY-NC 4.0"),
)


@dataclass
class Mirror:
    root: Path
    url: str
    requests: list[str] = field(default_factory=list)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    seen: list[str]

    def log_message(self, *args: object) -> None:
        self.seen.append(self.path)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib would send loopback requests through a configured proxy; these tests talk to 127.0.0.1 only."""
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[Mirror]:
    """A file server on 127.0.0.1 serving ``root``, laid out like a data directory."""
    root = tmp_path / "mirror"
    root.mkdir()
    seen: list[str] = []
    handler = type("Handler", (_Quiet,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Mirror(root, f"http://127.0.0.1:{server.server_address[1]}", seen)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _put(root: Path, path: str, data: bytes) -> None:
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_fetch_downloads_each_file_verifies_it_and_moves_it_into_place(mirror: Mirror, tmp_path: Path) -> None:
    """Every manifest file ends up under --dest with its published hash, and nothing else does."""
    _put(mirror.root, "alpha/alpha.json", ALPHA)
    _put(mirror.root, "beta/LICENSE.txt", BETA)
    dest = tmp_path / "data"
    log = io.StringIO()
    assert run_fetch(dest, None, mirror.url, FAKE, log) == 0, log.getvalue()
    assert (dest / "alpha" / "alpha.json").read_bytes() == ALPHA
    assert (dest / "beta" / "LICENSE.txt").read_bytes() == BETA
    assert _files_under(dest) == ["alpha/alpha.json", "beta/LICENSE.txt"]
    assert "alpha/alpha.json" in log.getvalue() and "sha256 ok" in log.getvalue()
    assert all(status(f, dest)[0] is Status.ok for f in FAKE)


def test_only_fetches_the_named_data_set_and_refuses_an_unknown_one(mirror: Mirror, tmp_path: Path) -> None:
    """--only beta fetches beta's file alone; --only gamma names the known data sets."""
    _put(mirror.root, "beta/LICENSE.txt", BETA)
    dest = tmp_path / "data"
    assert run_fetch(dest, ["beta"], mirror.url, FAKE, io.StringIO()) == 0
    assert _files_under(dest) == ["beta/LICENSE.txt"]
    with pytest.raises(ConfigError, match="gamma: unknown data set; known: alpha, beta"):
        run_fetch(dest, ["gamma"], mirror.url, FAKE, io.StringIO())


def test_files_already_present_with_the_right_hash_are_skipped(mirror: Mirror, tmp_path: Path) -> None:
    """A second fetch sends no request: both files are present and verified."""
    _put(mirror.root, "alpha/alpha.json", ALPHA)
    _put(mirror.root, "beta/LICENSE.txt", BETA)
    dest = tmp_path / "data"
    assert run_fetch(dest, None, mirror.url, FAKE, io.StringIO()) == 0
    assert len(mirror.requests) == 2, mirror.requests
    log = io.StringIO()
    assert run_fetch(dest, None, mirror.url, FAKE, log) == 0
    assert len(mirror.requests) == 2, mirror.requests
    assert log.getvalue().count("present, sha256 ok") == 2, log.getvalue()


def test_a_present_file_with_another_hash_is_replaced_by_the_published_one(mirror: Mirror, tmp_path: Path) -> None:
    """A truncated or edited copy is fetched again, not trusted."""
    _put(mirror.root, "alpha/alpha.json", ALPHA)
    dest = tmp_path / "data"
    _put(dest, "alpha/alpha.json", ALPHA[:10])
    assert run_fetch(dest, ["alpha"], mirror.url, FAKE, io.StringIO()) == 0
    assert (dest / "alpha" / "alpha.json").read_bytes() == ALPHA


def test_a_checksum_mismatch_is_refused_naming_the_file_and_both_hashes(mirror: Mirror, tmp_path: Path) -> None:
    """A mirror serving other bytes: the error names the file, the expected and the actual hash, and the
    temporary file is deleted, so nothing is left under --dest."""
    tampered = ALPHA.replace(b'"a"', b'"b"')
    _put(mirror.root, "alpha/alpha.json", tampered)
    dest = tmp_path / "data"
    with pytest.raises(ChecksumMismatch) as caught:
        fetch_file(FAKE[0], dest, mirror.url)
    message = str(caught.value)
    assert "alpha/alpha.json" in message and _sha(ALPHA) in message and _sha(tampered) in message, message
    assert _files_under(dest) == []


def test_a_mismatch_leaves_the_file_already_there_untouched(mirror: Mirror, tmp_path: Path) -> None:
    """The target is replaced only by a verified download: a bad one changes nothing on disk."""
    _put(mirror.root, "alpha/alpha.json", b"not the data\n")
    dest = tmp_path / "data"
    _put(dest, "alpha/alpha.json", b"an older copy\n")
    log = io.StringIO()
    assert run_fetch(dest, ["alpha"], mirror.url, FAKE, log) == 1
    assert (dest / "alpha" / "alpha.json").read_bytes() == b"an older copy\n"
    assert _files_under(dest) == ["alpha/alpha.json"]
    assert "SHA-256 mismatch" in log.getvalue() and _sha(b"not the data\n") in log.getvalue(), log.getvalue()


def test_a_404_is_named_with_the_file_and_its_url(mirror: Mirror, tmp_path: Path) -> None:
    """A file the mirror lacks: the error names it, its URL and the status; nothing is written."""
    dest = tmp_path / "data"
    with pytest.raises(DataError, match=rf"alpha/alpha.json: HTTP 404 .* from {mirror.url}/alpha/alpha.json"):
        fetch_file(FAKE[0], dest, mirror.url)
    assert _files_under(dest) == []


def test_check_reports_ok_missing_and_changed_files(tmp_path: Path) -> None:
    """`data check` lists each file's state and exits 1 with the fetch command unless all are ok."""
    dest = tmp_path / "data"
    _put(dest, "alpha/alpha.json", ALPHA)
    out = io.StringIO()
    assert run_check(dest, None, FAKE, out) == 1
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("ok") and "alpha/alpha.json" in lines[0]
    assert lines[1].startswith("missing") and "beta/LICENSE.txt" in lines[1]
    assert f"tessera data fetch --dest {dest}" in lines[2], lines
    _put(dest, "beta/LICENSE.txt", b"edited\n")
    out = io.StringIO()
    assert run_check(dest, ["beta"], FAKE, out) == 1
    assert out.getvalue().startswith("differs") and _sha(b"edited\n") in out.getvalue(), out.getvalue()
    _put(dest, "beta/LICENSE.txt", BETA)
    assert run_check(dest, None, FAKE, io.StringIO()) == 0


def test_the_manifest_names_the_public_sources_of_the_files_the_workloads_read() -> None:
    """Every default URL is an https URL of the authors' release; the files are those the workloads open."""
    paths = {f.path for f in MANIFEST}
    assert {"musique/musique_s.json", "locomo/locomo10.json"} <= paths
    assert {f.dataset for f in MANIFEST} == {"musique", "locomo"}
    for f in MANIFEST:
        assert f.url.startswith("https://raw.githubusercontent.com/"), f.url
        assert f.url.endswith("/" + f.path.split("/", 1)[1]), f.url


@pytest.mark.skipif(not all((DATA_DIR / f.path).is_file() for f in MANIFEST), reason="../shared/data is absent")
def test_the_cli_fetches_the_real_manifest_from_a_mirror_and_check_passes(mirror: Mirror, tmp_path: Path) -> None:
    """`tessera data fetch --base-url` with copies of ../shared/data: the published hashes are those files'."""
    for f in MANIFEST:
        _put(mirror.root, f.path, (DATA_DIR / f.path).read_bytes())
    dest = tmp_path / "data"
    runner = CliRunner()
    result = runner.invoke(app, ["data", "fetch", "--dest", str(dest), "--base-url", mirror.url])
    assert result.exit_code == 0, result.output
    assert _files_under(dest) == sorted(f.path for f in MANIFEST)
    result = runner.invoke(app, ["data", "check", "--dest", str(dest)])
    assert result.exit_code == 0 and result.output.count("ok ") == len(MANIFEST), result.output


def test_the_cli_names_a_file_missing_on_the_mirror(mirror: Mirror, tmp_path: Path) -> None:
    """`tessera data fetch` from an empty mirror: exit 1, the file and its URL named, no traceback."""
    result = CliRunner().invoke(app, ["data", "fetch", "--only", "locomo", "--dest", str(tmp_path / "data"),
                                      "--base-url", mirror.url])
    assert result.exit_code == 1, result.output
    assert "HTTP 404" in result.output and f"{mirror.url}/locomo/locomo10.json" in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("command", "dataset"), [
    (["bench", "--workload", "rag"], "musique"),
    (["bench", "--workload", "locomo"], "locomo"),
    (["verify", "--workload", "rag"], "musique"),
    (["verify", "--workload", "locomo"], "locomo"),
    (["eval", "--workload", "locomo"], "locomo"),
])
def test_a_missing_data_set_names_the_command_that_fetches_it(tmp_path: Path, command: list[str],
                                                               dataset: str) -> None:
    """Regression: bench, verify and eval said the data was missing but not where it comes from."""
    result = CliRunner().invoke(app, [*command, "--data-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert f"tessera data fetch --only {dataset} --dest {tmp_path}" in result.output, result.output
    assert "docs/data.md" in result.output, result.output


def test_the_data_directory_layout_is_the_one_the_docs_describe() -> None:
    """docs/data.md lists every manifest file with its checksum, so the page and the command agree."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text()
    for f in MANIFEST:
        assert f.path in page and f.sha256 in page and f.url in page, f.path
