"""Calibration records and the fidelity gate: is approximate composition allowed to serve?

A *calibration record* is what ``tessera verify --calibrate`` measured for one serving
fingerprint: the model (checkpoint identity), its compute and KV dtypes, and the composition
setting with every knob that shapes it (:func:`knobs`); the mean KL to full prefill and the
greedy agreement, each with its 95% interval, over how many prompts. Records are JSON files
named by the fingerprint's digest in ``composition.calibration_dir``.

The *gate* (:func:`decide`) runs once per role process at start-up, the generation node and
the retrieval role deciding alike from the same config and records:

* an exact setting (``full``, or ``control.mode = "prefix"``) needs no record;
* otherwise, a missing record is a start-up warning; with ``require_calibration = true`` the
  setting serves only under a record whose mean KL is at most ``max_kl`` and whose greedy
  agreement is at least ``min_agreement``, else the process serves full prefill instead.

The decision is part of every reply's receipt and of the metrics. This module knows nothing
about engines or servers: callers pass the model identity.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.config import CompositionConfig

EXACT_POLICIES = frozenset({"full"})
RECORD_VERSION = 1


def knobs(config: CompositionConfig) -> dict[str, Any]:
    """The ``[composition]`` keys that shape what ``config.policy`` serves, by name (all of them)."""
    out: dict[str, Any] = {"policy": config.policy}
    if config.policy == "epic":
        out.update(recompute_tokens=config.recompute_tokens, recompute_fraction=float(config.recompute_fraction),
                   inline_share=float(config.inline_share))
    out.update(unit_lead=config.unit_lead, unit_bos=config.unit_bos)
    return out


@dataclass(frozen=True)
class Fingerprint:
    """What a calibration record is valid for."""

    model: str  # checkpoint name:identity (the serving fingerprint's model)
    dtype: str  # compute dtype
    kv_dtype: str
    setting: tuple[tuple[str, Any], ...]  # knobs(config), in order

    @classmethod
    def of(cls, config: CompositionConfig, model: str, dtype: str, kv_dtype: str) -> Fingerprint:
        return cls(model, dtype, kv_dtype, tuple(knobs(config).items()))

    @property
    def digest(self) -> str:
        text = json.dumps([self.model, self.dtype, self.kv_dtype, list(self.setting)], sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "kv_dtype": self.kv_dtype, **dict(self.setting)}


def records_dir(config: CompositionConfig) -> Path:
    """``composition.calibration_dir``, or ``$XDG_DATA_HOME/tessera/calibration`` when it is ``""``."""
    if config.calibration_dir:
        return Path(config.calibration_dir).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tessera" / "calibration"


def write_record(directory: Path, fingerprint: Fingerprint, kl: dict[str, float], agreement: dict[str, float],
                 prompts: int, source: str) -> Path:
    """Write (replace) the record of ``fingerprint``: ``kl`` and ``agreement`` are {mean, lo, hi}."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{fingerprint.digest}.json"
    body = {"version": RECORD_VERSION, "fingerprint": fingerprint.as_dict(), "kl": kl, "agreement": agreement,
            "prompts": prompts, "source": source, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)
    return path


def read_record(directory: Path, fingerprint: Fingerprint) -> dict[str, Any] | None:
    """The record of exactly ``fingerprint``, or None (missing, unreadable, or another fingerprint)."""
    path = directory / f"{fingerprint.digest}.json"
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if body.get("version") != RECORD_VERSION or body.get("fingerprint") != fingerprint.as_dict():
        return None
    return dict(body)


@dataclass(frozen=True)
class Decision:
    """The gate's verdict for one process: what it serves, and why."""

    configured: CompositionConfig
    served: CompositionConfig
    status: str  # exact | calibrated | uncalibrated | below-target | fallback-full
    fingerprint: Fingerprint
    record: dict[str, Any] | None
    reason: str

    def describe(self) -> dict[str, Any]:
        """What every receipt says about composition: the served policy's knobs and its fidelity."""
        out: dict[str, Any] = {"policy": knobs(self.served), "calibration": self.status}
        if self.served != self.configured:
            out["configured_policy"] = knobs(self.configured)
        if self.record is not None:
            out["fidelity"] = {k: self.record[k] for k in ("kl", "agreement", "prompts", "source", "created")
                               if k in self.record}
        if self.status != "exact":
            out["reason"] = self.reason
        return out

    @property
    def warning(self) -> str | None:
        """What start-up logs: a missing record, a record below target, or a fallback."""
        return None if self.status in ("exact", "calibrated") else self.reason


def decide(config: CompositionConfig, mode: str, model: str, dtype: str, kv_dtype: str) -> Decision:
    """The gate (see the module docstring); reads the record of this fingerprint, if any."""
    fp = Fingerprint.of(config, model, dtype, kv_dtype)
    if mode != "compose" or config.policy in EXACT_POLICIES:
        return Decision(config, config, "exact", fp, None, "exact: no approximation to calibrate")
    directory = records_dir(config)
    record = read_record(directory, fp)
    fallback = dataclasses.replace(config, policy="full")
    if record is None:
        reason = (f"no calibration record for this serving fingerprint ({fp.digest} in {directory}); "
                  "measure it with: tessera verify --calibrate")
        if config.require_calibration:
            return Decision(config, fallback, "fallback-full", fp, None, reason + "; serving full prefill")
        return Decision(config, config, "uncalibrated", fp, None, reason)
    kl, agreement = float(record["kl"]["mean"]), float(record["agreement"]["mean"])
    if kl <= config.max_kl and agreement >= config.min_agreement:
        return Decision(config, config, "calibrated", fp, record,
                        f"calibrated: KL {kl:.4f} <= {config.max_kl}, agreement {agreement:.3f} >= "
                        f"{config.min_agreement}")
    reason = (f"the calibration record misses the targets: KL {kl:.4f} (max_kl {config.max_kl}), agreement "
              f"{agreement:.3f} (min_agreement {config.min_agreement})")
    if config.require_calibration:
        return Decision(config, fallback, "fallback-full", fp, record, reason + "; serving full prefill")
    return Decision(config, config, "below-target", fp, record, reason)
