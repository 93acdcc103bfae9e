"""The data sets the benchmarks read: each file's public source, checksum and licence, and
``tessera data fetch | check``, which download them and verify what is on disk.

A file is only ever moved into the data directory whole and with the published SHA-256, so a
half-downloaded or altered file is never read as data: it streams to a temporary file beside its
target, is hashed on the way, and replaces the target in one ``os.replace``. This module knows
nothing of the files' contents; the workloads (:mod:`tessera.benchmark.workloads`) parse them.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import IO

from tessera.benchmark.workloads import DATA_DIR
from tessera.errors import ConfigError, TesseraError

DOCS = "docs/data.md"
_CHUNK = 1 << 16
_TIMEOUT_S = 60.0
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class DataFile:
    """One file of a data set: where it lives under the data directory and where it comes from."""

    dataset: str  # the name --only takes
    path: str  # relative to the data directory, "/"-separated; also its path on a --base-url mirror
    url: str  # the authors' public release
    sha256: str
    licence: str

    def __post_init__(self) -> None:
        rel = PurePosixPath(self.path)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ConfigError(f"data file path {self.path!r}: expected a relative path inside the data directory")
        if not _SHA256.fullmatch(self.sha256):
            raise ConfigError(f"{self.path}: sha256 {self.sha256!r} is not 64 lowercase hex digits")
        if not self.url.startswith(("https://", "http://")):
            raise ConfigError(f"{self.path}: url {self.url!r} is not http(s)")

    def target(self, dest: Path) -> Path:
        return dest.joinpath(*PurePosixPath(self.path).parts)

    def source(self, base_url: str | None) -> str:
        """The public URL, or the file's place on a mirror laid out like the data directory."""
        return f"{base_url.rstrip('/')}/{self.path}" if base_url else self.url


LOCOMO_LICENCE = "CC BY-NC 4.0"
MUSIQUE_LICENCE = "CC BY 4.0 (MuSiQue)"
# CacheBlend's 150-question MuSiQue subset, pinned to the commit that last changed it, so the
# rag workload reads the same questions and passages as the CacheBlend/EPIC evaluations
_CACHEBLEND = "https://raw.githubusercontent.com/YaoJiayi/CacheBlend/b72d7945e6d6306f12be66520196e0f081fa2b0c"
_LOCOMO = "https://raw.githubusercontent.com/snap-research/locomo/main"

MANIFEST: tuple[DataFile, ...] = (
    DataFile("locomo", "locomo/locomo10.json", f"{_LOCOMO}/data/locomo10.json",
             "79fa87e90f04081343b8c8debecb80a9a6842b76a7aa537dc9fdf651ea698ff4", LOCOMO_LICENCE),
    # the licence travels with the data: CC BY-NC asks that it accompany copies
    DataFile("locomo", "locomo/LICENSE.txt", f"{_LOCOMO}/LICENSE.txt",
             "41003d4a74749c0220e33dd415042164b5a1093ed401f36277234f772d22d3d0", LOCOMO_LICENCE),
    DataFile("musique", "musique/musique_s.json", f"{_CACHEBLEND}/inputs/musique_s.json",
             "d679da1dad32b7f3645de9db0d7a1aaa7e679eb76ed48c02c4688137e5ce6674", MUSIQUE_LICENCE),
)


class DataError(TesseraError):
    """A data file could not be fetched; the message names the file and the URL."""


class ChecksumMismatch(DataError):
    """A file's SHA-256 is not the published one; the message names the file and both hashes."""

    def __init__(self, path: str, source: str, expected: str, actual: str) -> None:
        super().__init__(f"{path}: SHA-256 mismatch for {source}: expected {expected}, got {actual}; "
                         f"nothing was written (a changed upstream file or a bad mirror; see {DOCS})")
        self.expected = expected
        self.actual = actual


class Status(StrEnum):
    ok = "ok"
    missing = "missing"
    differs = "differs"


def select(only: Sequence[str] | None, manifest: Sequence[DataFile] = MANIFEST) -> tuple[DataFile, ...]:
    """The manifest's files of the named data sets (every file when ``only`` is empty)."""
    known = list(dict.fromkeys(f.dataset for f in manifest))
    unknown = [name for name in only or () if name not in known]
    if unknown:
        raise ConfigError(f"--only {', '.join(unknown)}: unknown data set; known: {', '.join(known)}")
    return tuple(f for f in manifest if not only or f.dataset in only)


def fetch_command(dest: Path, only: Sequence[str] | None = None) -> str:
    """The ``tessera data fetch`` command line that fills ``dest`` with ``only`` (every data set if empty)."""
    words = ["tessera data fetch", *(f"--only {name}" for name in only or ())]
    return " ".join(words + ([] if dest == DATA_DIR else [f"--dest {dest}"]))


def sha256_of(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def status(file: DataFile, dest: Path) -> tuple[Status, str]:
    """Whether ``file`` is under ``dest`` with its published hash; the hash found ("" if absent)."""
    target = file.target(dest)
    if not target.is_file():
        return Status.missing, ""
    actual = sha256_of(target)
    return (Status.ok if actual == file.sha256 else Status.differs), actual


Progress = Callable[[int, int | None], None]  # (bytes so far, total bytes if the server said)


def _download(file: DataFile, source: str, out: IO[bytes], progress: Progress) -> str:
    """Stream ``source`` into ``out``; its SHA-256."""
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(source, timeout=_TIMEOUT_S) as response:
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            done = 0
            for chunk in iter(lambda: response.read(_CHUNK), b""):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                progress(done, total)
    except urllib.error.HTTPError as exc:
        raise DataError(f"{file.path}: HTTP {exc.code} {exc.reason} from {source}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise DataError(f"{file.path}: cannot download {source}: {reason}; without network access, fetch "
                        f"from a mirror with --base-url URL (see {DOCS})") from None
    return digest.hexdigest()


def fetch_file(file: DataFile, dest: Path, base_url: str | None = None,
               progress: Progress = lambda done, total: None) -> Path:
    """Download ``file`` into ``dest``, verified, replacing the target in one step.

    Raises :class:`ChecksumMismatch` (the temporary file deleted, the target untouched) or
    :class:`DataError` for a failed download.
    """
    source = file.source(base_url)
    if not source.startswith(("https://", "http://")):
        raise ConfigError(f"--base-url {base_url!r}: expected an http:// or https:// URL")
    target = file.target(dest)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            actual = _download(file, source, out, progress)
            out.flush()
            os.fsync(out.fileno())
        if actual != file.sha256:
            raise ChecksumMismatch(file.path, source, file.sha256, actual)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


class _StderrProgress:
    """One line per file; on a terminal, a percentage updated in place while it downloads."""

    def __init__(self, name: str, stream: IO[str]) -> None:
        self.name = name
        self.stream = stream
        self.live = stream.isatty()
        self.done = 0

    def __call__(self, done: int, total: int | None) -> None:
        self.done = done
        if self.live:
            share = f"{100 * done // total}%" if total else _size(done)
            self.stream.write(f"\r  {self.name}: {share}")
            self.stream.flush()

    def finish(self, note: str) -> None:
        self.stream.write(f"\r  {self.name}: {_size(self.done)}, {note}\n" if self.done
                          else f"  {self.name}: {note}\n")


def run_fetch(dest: Path | None, only: Sequence[str] | None, base_url: str | None,
              manifest: Sequence[DataFile] = MANIFEST, stream: IO[str] | None = None) -> int:
    """``tessera data fetch``: every selected file present and verified; the exit code. Progress on stderr."""
    dest = dest or DATA_DIR
    stream = stream or sys.stderr
    files = select(only, manifest)
    stream.write(f"tessera data fetch: {len(files)} file(s) into {dest}\n")
    for file in files:
        state, _ = status(file, dest)
        if state is Status.ok:
            stream.write(f"  {file.path}: present, sha256 ok\n")
            continue
        progress = _StderrProgress(file.path, stream)
        if state is Status.differs:
            stream.write(f"  {file.path}: present with another sha256; fetching the published file\n")
        try:
            fetch_file(file, dest, base_url, progress)
        except DataError as exc:
            stream.write("\n" if progress.live else "")
            stream.write(f"tessera data fetch: {exc}\n")
            return 1
        progress.finish(f"sha256 ok ({file.licence})")
    return 0


def run_check(dest: Path | None, only: Sequence[str] | None, manifest: Sequence[DataFile] = MANIFEST,
              stream: IO[str] | None = None) -> int:
    """``tessera data check``: each selected file's state on stdout; exit code 1 unless all are ok."""
    dest = dest or DATA_DIR
    stream = stream or sys.stdout
    bad = 0
    for file in select(only, manifest):
        state, actual = status(file, dest)
        note = f"sha256 {actual}, expected {file.sha256}" if state is Status.differs else file.licence
        stream.write(f"{state.value:<8} {file.path}  {note}\n")
        bad += state is not Status.ok
    if bad:
        stream.write(f"{bad} file(s) missing or changed under {dest}; run `{fetch_command(dest, only)}` ({DOCS})\n")
    return 1 if bad else 0
