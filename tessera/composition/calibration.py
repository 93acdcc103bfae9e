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

A record is trusted configuration: with the gate on it decides what every reply is composed
by, and every receipt quotes it. So it is read (:func:`read_record`) only from a folder that
the serving user owns and no one else may write, as a regular file of that user that no one
else may write, of at most :data:`MAX_RECORD_BYTES`, and only if it fits the record's schema
(:class:`RecordBody`, every field bounded). Anything else is a :class:`BadRecord` naming the
file (or folder) and why: with ``require_calibration = true`` the role refuses to start,
without it the record is ignored with a start-up warning (the setting is uncalibrated).

The decision is part of every reply's receipt and of the metrics; a receipt names a record by
its file name (the fingerprint's digest), never by a server path. This module knows nothing
about engines or servers: callers pass the model identity.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tessera.composition.policies import POLICIES
from tessera.config import CompositionConfig
from tessera.errors import ConfigError

EXACT_POLICIES = frozenset({"full"})
DEFAULT_ENGINE = "reference"  # ModelConfig.engine's default
RECORD_VERSION: Final = 1
MAX_RECORD_BYTES = 1 << 20  # a record is a few hundred bytes: a larger file is not one
MAX_SOURCE_CHARS = 256  # characters of a record's source (every receipt quotes it)


class BadRecord(ConfigError):
    """A calibration record (or its folder) that cannot be trusted or does not fit the schema; names the file."""


class _Schema(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class KLInterval(_Schema):
    mean: Annotated[float, Field(ge=0)]
    lo: Annotated[float, Field(ge=0)]
    hi: Annotated[float, Field(ge=0)]


class AgreementInterval(_Schema):
    mean: Annotated[float, Field(ge=0, le=1)]
    lo: Annotated[float, Field(ge=0, le=1)]
    hi: Annotated[float, Field(ge=0, le=1)]


class RecordBody(_Schema):
    """The schema of a record file (what :func:`write_record` writes)."""

    version: Literal[1]
    fingerprint: dict[str, str | bool | int | float] = Field(max_length=16)
    kl: KLInterval
    agreement: AgreementInterval
    prompts: Annotated[int, Field(ge=1)]
    source: Annotated[str, Field(max_length=MAX_SOURCE_CHARS)]
    created: Annotated[str, Field(max_length=32)]


_DEFAULTS = CompositionConfig()


def knobs(config: CompositionConfig) -> dict[str, Any]:
    """The ``[composition]`` keys that shape what ``config.policy`` serves, by name (all of them),
    each of its default's type (a TOML ``1`` and ``1.0`` are one setting)."""
    out: dict[str, Any] = {"policy": config.policy}
    for key in POLICIES.get(config.policy).knobs:
        out[key] = type(getattr(_DEFAULTS, key))(getattr(config, key))
    out.update(unit_lead=config.unit_lead, unit_bos=config.unit_bos)
    return out


# how setting labels name the knobs (verify's tables, analyze's policy line)
_SHORT = {"recompute_tokens": "k", "recompute_fraction": "f", "inline_share": "inline", "recompute_budget": "budget"}


def setting_label(config: CompositionConfig, lead: bool = True) -> str:
    """The policy and every knob that shapes what it serves, named: ``epic k=16 f=0.25
    inline=0.75 lead=none`` (``lead``: also the unit lead and BOS)."""
    named = knobs(config)
    parts = [config.policy, *(f"{_SHORT.get(k, k)}={v:g}" if isinstance(v, float) else f"{_SHORT.get(k, k)}={v}"
                              for k, v in named.items() if k not in ("policy", "unit_lead", "unit_bos"))]
    if lead:
        parts.append(f"lead={config.unit_lead}" if config.unit_lead else "lead=none")
        if config.unit_bos:
            parts.append("bos")
    return " ".join(parts)


@dataclass(frozen=True)
class Fingerprint:
    """What a calibration record is valid for: the model, the engine that computes it and in
    which dtypes, and the composition setting."""

    model: str  # checkpoint name:identity (the serving fingerprint's model)
    dtype: str  # compute dtype
    kv_dtype: str
    setting: tuple[tuple[str, Any], ...]  # knobs(config), in order
    engine: str = DEFAULT_ENGINE  # model.engine: engines differ in numerics, so in fidelity

    @classmethod
    def of(cls, config: CompositionConfig, model: str, dtype: str, kv_dtype: str,
           engine: str = DEFAULT_ENGINE) -> Fingerprint:
        return cls(model, dtype, kv_dtype, tuple(knobs(config).items()), engine)

    def _named(self) -> dict[str, Any]:
        # the reference engine goes unnamed, so its records keep the names they have always had
        return {} if self.engine == DEFAULT_ENGINE else {"engine": self.engine}

    @property
    def digest(self) -> str:
        parts: list[Any] = [self.model, self.dtype, self.kv_dtype, list(self.setting)]
        if self._named():
            parts.append(self.engine)
        text = json.dumps(parts, sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "kv_dtype": self.kv_dtype, **self._named(),
                **dict(self.setting)}


def records_dir(config: CompositionConfig) -> Path:
    """``composition.calibration_dir``, or ``$XDG_DATA_HOME/tessera/calibration`` when it is ``""``."""
    if config.calibration_dir:
        return Path(config.calibration_dir).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tessera" / "calibration"


def record_name(fingerprint: Fingerprint) -> str:
    """The record's file name in ``calibration_dir`` (what receipts call it)."""
    return f"{fingerprint.digest}.json"


def check_folder(directory: Path) -> None:
    """Refuse (:class:`BadRecord`) a records folder another user owns or others may write:
    its owner, or anyone who may write it, could put a forged record there."""
    try:
        st = os.stat(directory)
    except OSError as exc:
        raise BadRecord(f"calibration folder {directory} cannot be read ({exc.strerror})") from None
    if st.st_uid != os.geteuid():
        raise BadRecord(f"calibration folder {directory} belongs to uid {st.st_uid}, not to the user serving "
                        f"(uid {os.geteuid()}), who could forge a record there; set composition.calibration_dir "
                        "to a folder of your own and run tessera verify --calibrate again")
    if st.st_mode & 0o022:
        raise BadRecord(f"calibration folder {directory} may be written by other users (mode "
                        f"{stat.S_IMODE(st.st_mode):o}), who could forge a record there; run chmod go-w {directory}")


def write_record(directory: Path, fingerprint: Fingerprint, kl: dict[str, float], agreement: dict[str, float],
                 prompts: int, source: str) -> Path:
    """Write (replace) the record of ``fingerprint``: ``kl`` and ``agreement`` are {mean, lo, hi};
    ``source`` (what was scored) is kept as a name, not a path. BadRecord if the folder is one
    the roles would refuse to read."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    check_folder(directory)
    path = directory / record_name(fingerprint)
    body = RecordBody(version=RECORD_VERSION, fingerprint=fingerprint.as_dict(), kl=KLInterval(**kl),
                      agreement=AgreementInterval(**agreement), prompts=prompts,
                      source=Path(source).name[:MAX_SOURCE_CHARS], created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as fh:
        os.fchmod(fd, 0o644)  # whatever the umask: a group-writable record would be refused
        fh.write(json.dumps(body.model_dump(), indent=1))
    tmp.replace(path)
    return path


def _read_trusted(path: Path) -> bytes | None:
    """The bytes of ``path`` if it is a regular file of this user that others may not write and
    of at most MAX_RECORD_BYTES; None if it does not exist; BadRecord otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "is a symbolic link; a record must be a file of its own" if exc.errno == errno.ELOOP else \
            f"cannot be read ({exc.strerror})"
        raise BadRecord(f"calibration record {path} {why}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadRecord(f"calibration record {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise BadRecord(f"calibration record {path} belongs to uid {st.st_uid}, not to the user serving "
                            f"(uid {os.geteuid()}); write it with tessera verify --calibrate")
        if st.st_mode & 0o022:
            raise BadRecord(f"calibration record {path} may be written by other users (mode "
                            f"{stat.S_IMODE(st.st_mode):o}); run chmod go-w {path}")
        data = fh.read(MAX_RECORD_BYTES + 1)
    if len(data) > MAX_RECORD_BYTES:
        raise BadRecord(f"calibration record {path} is larger than {MAX_RECORD_BYTES} bytes: not a record")
    return data


def read_record(directory: Path, fingerprint: Fingerprint) -> dict[str, Any] | None:
    """The record of exactly ``fingerprint``, or None when there is none; :class:`BadRecord`
    (naming the file and why) when there is one that cannot be trusted or does not fit the schema."""
    path = directory / record_name(fingerprint)
    data = _read_trusted(path)
    if data is None:
        return None
    check_folder(directory)
    body = _parse(path, data)
    if body.fingerprint != fingerprint.as_dict():
        raise BadRecord(f"calibration record {path} is the record of another serving fingerprint; "
                        "write it again with tessera verify --calibrate")
    return body.model_dump()


def _parse(path: Path, data: bytes) -> RecordBody:
    """The record schema's reading of ``data`` (the file at ``path``), or :class:`BadRecord`
    naming the file and what does not fit."""
    try:
        return RecordBody.model_validate_json(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the file'}: {e['msg']}"
                             for e in exc.errors(include_url=False)[:5])
        raise BadRecord(f"calibration record {path} does not fit the record schema ({problems}); "
                        "write it again with tessera verify --calibrate") from None


@dataclass(frozen=True)
class Decision:
    """The gate's verdict for one process: what it serves, and why."""

    configured: CompositionConfig
    served: CompositionConfig
    status: str  # exact | calibrated | uncalibrated | below-target | fallback-full
    fingerprint: Fingerprint
    record: dict[str, Any] | None
    reason: str  # what receipts say: no server path
    detail: str = ""  # what only the start-up log adds (where records were looked for, why one was ignored)

    def describe(self) -> dict[str, Any]:
        """What every receipt says about composition: the served policy's knobs and its fidelity."""
        out: dict[str, Any] = {"policy": knobs(self.served), "calibration": self.status}
        if self.served != self.configured:
            out["configured_policy"] = knobs(self.configured)
        if self.record is not None:
            out["fidelity"] = {"record": record_name(self.fingerprint),
                               **{k: self.record[k] for k in ("kl", "agreement", "prompts", "source", "created")}}
        if self.status != "exact":
            out["reason"] = self.reason
        return out

    @property
    def warning(self) -> str | None:
        """What start-up logs: a missing or ignored record, a record below target, or a fallback."""
        if self.status in ("exact", "calibrated"):
            return None
        return f"{self.reason} ({self.detail})" if self.detail else self.reason


def decide(config: CompositionConfig, mode: str, model: str, dtype: str, kv_dtype: str,
           engine: str = DEFAULT_ENGINE) -> Decision:
    """The gate (see the module docstring); reads the record of this fingerprint, if any.

    Raises :class:`BadRecord` (the role does not start) for a record that cannot be trusted or
    does not fit the schema while ``require_calibration`` is on; without it such a record is
    ignored and the decision's warning says why.
    """
    fp = Fingerprint.of(config, model, dtype, kv_dtype, engine)
    if mode != "compose" or config.policy in EXACT_POLICIES:
        return Decision(config, config, "exact", fp, None, "exact: no approximation to calibrate")
    directory = records_dir(config)
    try:
        record = read_record(directory, fp)
        detail = f"records are read from {directory}"
        why_none = f"no calibration record for this serving fingerprint ({record_name(fp)})"
    except BadRecord as exc:
        if config.require_calibration:
            raise
        record, detail = None, str(exc)
        why_none = f"the calibration record {record_name(fp)} was ignored: it cannot be trusted or read"
    fallback = dataclasses.replace(config, policy="full")
    if record is None:
        reason = f"{why_none}; measure it with: tessera verify --calibrate"
        if config.require_calibration:
            return Decision(config, fallback, "fallback-full", fp, None, reason + "; serving full prefill", detail)
        return Decision(config, config, "uncalibrated", fp, None, reason, detail)
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


def calibrated_settings(config: CompositionConfig, model: str, dtype: str, kv_dtype: str,
                        engine: str = DEFAULT_ENGINE) -> tuple[list[Decision], list[str]]:
    """Every setting that a record in ``calibration_dir`` calibrates for this model, engine and
    dtypes, with the configured unit lead and BOS (they change the unit states themselves),
    and that meets ``max_kl`` and ``min_agreement``, as "calibrated" decisions, in file order;
    and why each other record there was passed over (the start-up log says it).

    A record that cannot be trusted or does not fit the schema is passed over, or raises
    :class:`BadRecord` with ``require_calibration`` on, as :func:`decide` does.
    """
    directory = records_dir(config)
    chosen: list[Decision] = []
    passed: list[str] = []
    if not directory.is_dir():
        return chosen, [f"no calibration folder {directory}"]
    for path in sorted(directory.glob("*.json")):
        try:
            decision = _calibrated(path, config, model, dtype, kv_dtype, engine)
        except BadRecord as exc:
            if config.require_calibration:
                raise
            passed.append(str(exc))
            continue
        if isinstance(decision, str):
            passed.append(f"{path.name}: {decision}")
        else:
            chosen.append(decision)
    return chosen, passed


def _calibrated(path: Path, config: CompositionConfig, model: str, dtype: str, kv_dtype: str,
                engine: str) -> Decision | str:
    """The record at ``path`` as a calibrated decision, or why it is not one."""
    data = _read_trusted(path)
    if data is None:
        return "gone"
    body = _parse(path, data)
    fp: dict[str, Any] = dict(body.fingerprint)
    served = {"model": model, "dtype": dtype, "kv_dtype": kv_dtype, "engine": engine,
              "unit_lead": config.unit_lead, "unit_bos": config.unit_bos}
    fp.setdefault("engine", DEFAULT_ENGINE)
    other = [k for k, v in served.items() if fp.get(k) != v]
    if other:
        return f"another {', '.join(other)}"
    policy = fp.get("policy")
    if not isinstance(policy, str) or policy not in POLICIES.names():
        return f"unknown policy {policy!r}"
    try:
        setting = dataclasses.replace(config, policy=policy,
                                      **{k: fp[k] for k in POLICIES.get(policy).knobs if k in fp})
    except (ConfigError, TypeError) as exc:
        return f"not a valid setting ({exc})"
    fingerprint = Fingerprint.of(setting, model, dtype, kv_dtype, engine)
    if record_name(fingerprint) != path.name or fingerprint.as_dict() != body.fingerprint:
        raise BadRecord(f"calibration record {path} is not named by its own fingerprint; write it again with "
                        "tessera verify --calibrate")
    check_folder(path.parent)
    kl, agreement = body.kl.mean, body.agreement.mean
    if kl > config.max_kl or agreement < config.min_agreement:
        return f"misses the targets (KL {kl:.4f}, agreement {agreement:.3f})"
    record = body.model_dump()
    return Decision(setting, setting, "calibrated", fingerprint, record,
                    f"calibrated: KL {kl:.4f} <= {config.max_kl}, agreement {agreement:.3f} >= {config.min_agreement}")
