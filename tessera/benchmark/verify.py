"""``tessera verify``: how closely composed prefill follows full prefill, per setting, with intervals.

For every prompt of a sample, full prefill of the plain prompt (units without any lead) is the
reference: its greedy answer of up to N tokens is fixed, then each setting (policy, k,
recompute fraction, unit lead) composes the same request from independently prefilled unit
states (:func:`tessera.engines.offline.compose`, the serving path's oracle, after the policy's
:meth:`~tessera.composition.policies.CompositionPolicy.inline`) and is teacher-forced on that
answer. From the logits before each answer token:

* ``kl``: mean KL(full || composed) over the first ``kl_positions`` answer tokens;
* ``prefix``: share of the reference answer reproduced before the first differing greedy
  token (teacher forcing is exact up to there, so this is the composed greedy agreement);
* ``exact``: the whole answer reproduced;
* ``top1``: the first answer token reproduced;
* ``cost``: unit tokens recomputed per prompt (what the setting pays, the calibration's price);
* ``f1_ratio``: on prompts with gold answers (a workload's questions), the setting's own greedy
  answer's word F1 (:mod:`tessera.benchmark.quality`) over full prefill's, summed over prompts.

Each mean comes with a bootstrap 95% interval over prompts; each setting's label names every
knob that shaped it (policy, k, fraction, inline share, lead). This module never talks to a server.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera.benchmark.quality import best_f1
from tessera.benchmark.traffic import UnitTexts, is_trace_not_request, parse_line
from tessera.benchmark.workloads import BenchRequest, Workload
from tessera.composition.calibration import knobs, setting_label
from tessera.composition.layout import text_ranges
from tessera.composition.policies import POLICIES, CompositionPolicy, policy_from_config
from tessera.config import ClusterConfig, CompositionConfig
from tessera.engines.base import EngineAdapter, UnitState, load_engine
from tessera.engines.checkpoint import resolve
from tessera.engines.offline import compose, prefill_units
from tessera.engines.tokenizer import Tokenizer, load_tokenizer, unit_factory
from tessera.errors import BadRequest, ConfigError
from tessera.retrieval.chat.request import parse_chat_request
from tessera.retrieval.prompt import PromptBuilder
from tessera.retrieval.prompt_path import Built, PromptPath
from tessera.units import TokenCache

LEAD = "<|endoftext|>"  # the sink token the default config leads units with


@dataclass(frozen=True)
class Setting:
    """One composition setting to score (the ``[composition]`` keys it stands for)."""

    policy: str
    recompute_tokens: int = 0
    recompute_fraction: float = 1.0
    unit_lead: str = ""
    inline_share: float = 1.0  # epic only: other policies inline nothing
    # units prefilled behind BOS: the engine's, so one value for every setting of a run (the
    # config's); named in the label, since it changes every unit's state and so the score
    unit_bos: bool = False
    recompute_budget: float = 0.0  # policies that read the model only

    @property
    def label(self) -> str:
        """Every knob that shapes what this setting serves, named."""
        return setting_label(self.composition(CompositionConfig()))

    def composition(self, base: CompositionConfig) -> CompositionConfig:
        return dataclasses.replace(base, policy=self.policy, recompute_tokens=self.recompute_tokens,
                                   recompute_fraction=self.recompute_fraction, unit_lead=self.unit_lead,
                                   inline_share=self.inline_share, unit_bos=self.unit_bos,
                                   recompute_budget=self.recompute_budget)

    @classmethod
    def of(cls, config: CompositionConfig) -> Setting:
        read = POLICIES.get(config.policy).knobs
        if "recompute_tokens" not in read:
            return cls(config.policy, unit_lead=config.unit_lead, unit_bos=config.unit_bos)
        return cls(config.policy, config.recompute_tokens, config.recompute_fraction, config.unit_lead,
                   config.inline_share, config.unit_bos,
                   config.recompute_budget if "recompute_budget" in read else 0.0)


def settings_grid(policies: Iterable[str], ks: Iterable[int], fractions: Iterable[float],
                  leads: Iterable[str], inline_shares: Iterable[float] = (1.0,),
                  unit_bos: bool = False, budgets: Iterable[float] = (0.1,)) -> list[Setting]:
    """Every policy × lead; a policy with EPIC's knobs (epic, query, deviation) also × k ×
    fraction × inline share, one that reads the model also × budget; all with ``unit_bos``
    (the engine's). Duplicates dropped, order kept."""
    out: dict[Setting, None] = {}
    shares, per_prompt = list(inline_shares), list(budgets)
    for lead in leads:
        for policy in policies:
            read = POLICIES.get(policy).knobs
            if "recompute_tokens" in read:
                for k in ks:
                    for f in fractions:
                        for share in shares:
                            for budget in (per_prompt if "recompute_budget" in read else [0.0]):
                                out[Setting(policy, k, f, lead, share, unit_bos, budget)] = None
            else:
                out[Setting(policy, unit_lead=lead, unit_bos=unit_bos)] = None
    return list(out)


@dataclass(frozen=True)
class Prompt:
    """One request to score: its messages, where its units go, and the units as (scope, text)."""

    messages: tuple[dict[str, str], ...]
    placement: str
    units: tuple[tuple[str, str], ...]
    answers: tuple[str, ...] = ()  # gold answers (a workload's questions): the answer F1 is scored against them


def prompts_from_file(path: Path, config: ClusterConfig) -> list[Prompt]:
    """The prompts of a JSONL file, one a line: a chat request in the API's format (its
    ``context_units``) or a line of the traffic trace format (its ``units``; docs/bench/traces.md).

    A trace unit given as ``{id, tokens}`` (private text) is scored on the stand-in text that
    ``tessera bench --trace`` sends for it (:func:`~tessera.benchmark.traffic.synthetic_text`),
    and verify says how many were. A prompt without units is refused naming its line: there
    is nothing to compose in it, and its score would be exact by construction.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--prompts {path}: cannot be read ({exc.strerror or exc})") from None
    traced = _TraceTexts(config)
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON: {exc}") from None
        try:
            if is_trace_not_request(rec):
                prompt = traced.prompt(rec, where)
            else:
                prompt = _request_prompt(rec, where, config)
        except BadRequest as exc:  # the trace reader names the line itself
            raise ConfigError(f"{exc} (read as a trace line: docs/bench/traces.md)" if is_trace_not_request(rec)
                              else f"{where}: not a valid chat request: {exc}") from None
        if not prompt.units:
            raise ConfigError(f"{where}: the prompt brings no units, so there is nothing to compose and its score "
                              "would be exact by construction; give it context_units (a chat request) or units "
                              "(a trace line)")
        out.append(prompt)
    if not out:
        raise ConfigError(f"{path} holds no chat requests")
    if traced.stand_ins:
        print(f"[verify] {path}: {traced.stand_ins} units are private (an id and a length): scored on the "
              "stand-in text tessera bench --trace sends for them", file=sys.stderr)
    return out


def _request_prompt(rec: Any, where: str, config: ClusterConfig) -> Prompt:
    """A chat request in the API's format; its unknown fields are refused, as the API refuses them."""
    chat = parse_chat_request(rec, default_top_k=config.retrieval.top_k,
                              default_placement=config.retrieval.unit_placement, served_model=config.model.served_name)
    if chat.retrieval is not None:
        raise ConfigError(f"{where}: verify scores the units a request brings; send them as context_units "
                          "(retrieval needs the cluster's unit store)")
    return Prompt(tuple(chat.messages), chat.placement, tuple((u.scope, u.text) for u in chat.units))


class _TraceTexts:
    """Trace lines as prompts; the served tokenizer is loaded only if a private unit needs its stand-in text."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.texts: UnitTexts | None = None
        self.stand_ins = 0

    def prompt(self, rec: Any, where: str) -> Prompt:
        req = parse_line(rec, where)
        private = sum(u.text is None for u in req.units)
        if private and self.texts is None:
            self.texts = UnitTexts(load_tokenizer(resolve(self.config.model)).encode_plain)
        self.stand_ins += private
        units = self.texts.pairs(req) if self.texts is not None else [(u.scope, u.text or "") for u in req.units]
        return Prompt(req.messages, req.placement, tuple(units))


def prompts_from_workload(config: ClusterConfig, workload: Workload, tokenizer: Tokenizer) -> list[Prompt]:
    """The workload's distinct requests with the units the retrieval role would give them."""
    distinct: dict[Any, BenchRequest] = {}
    for r in workload.requests:
        key = (r.scope, r.retrieval["query"]) if r.retrieval is not None else (
            r.scope, json.dumps(r.messages), r.context_units)
        distinct.setdefault(key, r)
    requests = list(distinct.values())
    if any(r.retrieval is not None for r in requests):
        from tessera.benchmark.render import PromptRenderer

        renderer = PromptRenderer(config, tokenizer)
        renderer.ingest(workload)
        units = [renderer.units(r) for r in requests]
        return [Prompt(r.messages, r.placement, tuple((u.scope, u.text) for u in us), r.answers)
                for r, us in zip(requests, units, strict=True)]
    return [Prompt(r.messages, r.placement, tuple((r.scope, t) for t in r.context_units), r.answers)
            for r in requests]


def sample(prompts: Sequence[Prompt], n: int, seed: int = 0) -> list[Prompt]:
    if n <= 0 or n >= len(prompts):
        return list(prompts)
    return random.Random(seed).sample(list(prompts), n)


class Layouts:
    """Builds a prompt through the server's own prompt path (:class:`PromptPath`), for any unit lead:
    unit and message text encoded as plain text, the API's unit checks, the policy's inlining and
    the context limit, exactly as the retrieval role builds what it serves."""

    def __init__(self, engine: EngineAdapter, tokenizer: Tokenizer, config: ClusterConfig) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.fingerprint = engine.fingerprint
        self.max_context = engine.geometry.max_context
        self.tokens = TokenCache(tokenizer.encode_plain)
        self._paths: dict[str, PromptPath] = {}

    def path(self, lead: str) -> PromptPath:
        found = self._paths.get(lead)
        if found is None:
            c = self.config
            led = dataclasses.replace(c, composition=dataclasses.replace(c.composition, unit_lead=lead))
            factory = unit_factory(led, self.fingerprint, self.tokenizer, self.tokens)
            found = self._paths[lead] = PromptPath(PromptBuilder(self.tokenizer, self.tokens), factory,
                                                   c.retrieval.max_unit_tokens, self.max_context)
        return found

    def build(self, prompt: Prompt, lead: str, policy: CompositionPolicy | None = None,
              max_tokens: int = 1) -> Built:
        path = self.path(lead)
        return path.build(list(prompt.messages), path.units(prompt.units), prompt.placement, policy, max_tokens)


@dataclass
class Scores:
    """Per-prompt values of one setting."""

    kl: list[float] = field(default_factory=list)
    prefix: list[float] = field(default_factory=list)
    exact: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # composed prefill wall time (``timed`` only)
    # answer F1 against the gold answers of the prompts that have some: the setting's own greedy
    # answer, and full prefill's on the same prompts (paired, for the ratio)
    f1: list[float] = field(default_factory=list)
    full_f1: list[float] = field(default_factory=list)


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    p = torch.log_softmax(ref.float(), -1)
    q = torch.log_softmax(got.float(), -1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


def score(ref_logits: Sequence[torch.Tensor], answer: Sequence[int], logits: Sequence[torch.Tensor],
          kl_positions: int) -> tuple[float, float, float, float]:
    """(mean KL, prefix agreement, exact, top-1) of teacher-forced ``logits`` against the reference."""
    n = len(answer)
    kl = float(np.mean([_kl(r, g) for r, g in zip(ref_logits[:kl_positions], logits[:kl_positions], strict=True)]))
    same = 0
    for token, row in zip(answer, logits, strict=True):
        if int(row.argmax()) != token:
            break
        same += 1
    return kl, same / n, float(same == n), float(int(logits[0].argmax()) == answer[0])


def _cost(computed: Sequence[tuple[int, int]], text_tokens: int) -> float:
    """Unit tokens recomputed (inlined units count whole; the text is the same for every lead)."""
    return float(sum(b - a for a, b in computed) - text_tokens)


def verify(engine: EngineAdapter, tokenizer: Tokenizer, config: ClusterConfig, prompts: Sequence[Prompt],
           settings: Sequence[Setting], *, answer_tokens: int = 16, kl_positions: int = 8,
           progress: bool = False, timed: bool = False) -> dict[Setting, Scores]:
    """Score every setting on every prompt against full prefill of the plain prompt.

    ``timed``: also time each setting's composed prefill alone (placement + final extend, unit
    states ready: the warm serving path without transfers), for the speed–fidelity frontier.
    """
    assert answer_tokens > 0 and kl_positions > 0, (answer_tokens, kl_positions)
    mixed = [s.label for s in settings if s.unit_bos != config.composition.unit_bos]
    if mixed:  # the engine prefills units as the config says: a setting cannot change it
        raise ConfigError(f"settings {mixed} ask for unit_bos = {not config.composition.unit_bos}, but the engine "
                          f"prefills units with unit_bos = {config.composition.unit_bos} (the config's); "
                          "score each unit_bos value in a run of its own")
    layouts = Layouts(engine, tokenizer, config)
    policies = {s: policy_from_config(s.composition(config.composition)) for s in settings}
    full = policy_from_config(Setting("full", unit_bos=config.composition.unit_bos).composition(config.composition))
    stops = tokenizer.eos_token_ids
    out = {s: Scores() for s in settings}
    for i, prompt in enumerate(prompts):
        try:
            _score_prompt(engine, layouts, prompt, policies, full, out, answer_tokens, kl_positions, stops, timed)
        except BadRequest as exc:  # what the API would refuse, verify refuses: it never scores it
            raise BadRequest(f"prompt {i + 1}: the API refuses it: {exc}") from None
        if progress:
            print(f"\r[verify] {i + 1}/{len(prompts)} prompts", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return out


def _score_prompt(engine: EngineAdapter, layouts: Layouts, prompt: Prompt, policies: dict[Setting, CompositionPolicy],
                  full: CompositionPolicy, out: dict[Setting, Scores], answer_tokens: int, kl_positions: int,
                  stops: Sequence[int], timed: bool) -> None:
    """Score every setting on one prompt, each built as the server builds it."""
    plain = layouts.build(prompt, "", full, answer_tokens).served
    greedy = compose(engine, plain, full, {}, max_new_tokens=answer_tokens, stop_ids=stops, use_prefix_cache=False)
    answer = greedy.generated
    full_f1 = _answer_f1(layouts.tokenizer, answer, stops, prompt.answers)
    ref = compose(engine, plain, full, {}, forced=answer, use_prefix_cache=False).forced_logits
    text_tokens = sum(b - a for a, b in text_ranges(plain))
    states: dict[str, dict[str, UnitState]] = {}
    for s, policy in policies.items():
        built = layouts.build(prompt, s.unit_lead, policy, answer_tokens)
        layout = built.served
        if s.unit_lead not in states:
            states[s.unit_lead] = prefill_units(engine, built.rendered)
        comp = compose(engine, layout, policy, states[s.unit_lead], forced=answer, use_prefix_cache=False)
        kl, prefix, exact, top1 = score(ref, answer, comp.forced_logits, kl_positions)
        sc = out[s]
        sc.kl.append(kl)
        sc.prefix.append(prefix)
        sc.exact.append(exact)
        sc.top1.append(top1)
        sc.cost.append(_cost(comp.computed, text_tokens))
        if full_f1 is not None:
            # teacher forcing reproduced the whole answer: the setting's greedy answer is full's
            own = answer if exact == 1.0 else compose(engine, layout, policy, states[s.unit_lead],
                                                      max_new_tokens=answer_tokens, stop_ids=stops,
                                                      use_prefix_cache=False).generated
            sc.f1.append(_answer_f1(layouts.tokenizer, own, stops, prompt.answers) or 0.0)
            sc.full_f1.append(full_f1)
        if timed:
            t0 = time.perf_counter()
            compose(engine, layout, policy, states[s.unit_lead], use_prefix_cache=False)
            sc.seconds.append(time.perf_counter() - t0)


def _answer_f1(tokenizer: Tokenizer, tokens: Sequence[int], stops: Sequence[int],
               golds: Sequence[str]) -> float | None:
    """Word F1 of the greedy answer against its best gold answer (None: the prompt has none)."""
    if not golds:
        return None
    return best_f1(tokenizer.decode([t for t in tokens if t not in stops]), golds)


@dataclass(frozen=True)
class Interval:
    mean: float
    lo: float
    hi: float

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.lo:.3f}, {self.hi:.3f}]"


def bootstrap(values: Sequence[float], n_boot: int = 1000, seed: int = 0) -> Interval:
    """Mean with a percentile bootstrap 95% interval over the values (prompts)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return Interval(math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return Interval(float(x.mean()), float(lo), float(hi))


def ratio_interval(values: Sequence[float], reference: Sequence[float], n_boot: int = 1000,
                   seed: int = 0) -> Interval:
    """Mean of ``values`` over mean of ``reference`` (paired per prompt), with a percentile
    bootstrap 95% interval over prompts; NaN where the reference's mean is 0 or there is none."""
    x, y = np.asarray(values, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    assert x.shape == y.shape, (x.shape, y.shape)
    if x.size == 0 or y.sum() == 0:
        return Interval(math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    num, den = x[idx].sum(axis=1), y[idx].sum(axis=1)
    ratios = np.divide(num, den, out=np.full(n_boot, np.nan), where=den > 0)
    lo, hi = np.nanpercentile(ratios, [2.5, 97.5])
    return Interval(float(x.sum() / y.sum()), float(lo), float(hi))


@dataclass(frozen=True)
class Row:
    setting: Setting
    kl: Interval
    prefix: Interval
    exact: Interval
    top1: Interval
    cost: float  # mean unit tokens recomputed per prompt
    seconds: float = math.nan  # mean composed prefill time (``timed`` runs)
    # the setting's mean answer F1 over full prefill's, on the prompts with gold answers (NaN: none)
    f1_ratio: Interval = Interval(math.nan, math.nan, math.nan)
    f1: float = math.nan  # the setting's mean answer F1 on those prompts

    def as_dict(self) -> dict[str, Any]:
        return {"setting": self.setting.label, "composition": dataclasses.asdict(self.setting), "cost": self.cost,
                "prefill_s": self.seconds, "f1": self.f1,
                **{k: dataclasses.asdict(getattr(self, k)) for k in ("kl", "prefix", "exact", "top1", "f1_ratio")}}

    def meets(self, max_kl: float | None, min_agreement: float | None) -> bool:
        return (max_kl is None or self.kl.mean <= max_kl) and (min_agreement is None or
                                                                self.prefix.mean >= min_agreement)


def summarize(scores: dict[Setting, Scores]) -> list[Row]:
    return [Row(s, bootstrap(v.kl), bootstrap(v.prefix), bootstrap(v.exact), bootstrap(v.top1),
                float(np.mean(v.cost)) if v.cost else math.nan,
                float(np.mean(v.seconds)) if v.seconds else math.nan,
                ratio_interval(v.f1, v.full_f1), float(np.mean(v.f1)) if v.f1 else math.nan)
            for s, v in scores.items()]


def cheapest(rows: Sequence[Row], max_kl: float | None, min_agreement: float | None) -> Row | None:
    """The passing row that recomputes the fewest unit tokens (ties: lower KL)."""
    passing = [r for r in rows if r.meets(max_kl, min_agreement)]
    return min(passing, key=lambda r: (r.cost, r.kl.mean)) if passing else None


def format_rows(rows: Sequence[Row], marked: Setting | None = None) -> list[str]:
    timed = any(not math.isnan(r.seconds) for r in rows)
    graded = any(not math.isnan(r.f1_ratio.mean) for r in rows)
    lines = ["| setting | recomputed unit tokens |" + (" composed prefill (s) |" if timed else "") +
             " mean KL [95% CI] | greedy prefix agreement | exact answer | first-token top-1 |" +
             (" answer F1 / full's [95% CI] |" if graded else ""),
             "|---|---|" + ("---|" if timed else "") + "---|---|---|---|" + ("---|" if graded else "")]
    for r in rows:
        name = r.setting.label + (" (configured)" if r.setting == marked else "")
        secs = f" {r.seconds:.3f} |" if timed else ""
        f1 = f" {r.f1_ratio} |" if graded else ""
        lines.append(f"| {name} | {r.cost:.1f} |{secs} {r.kl} | {r.prefix} | {r.exact} | {r.top1} |{f1}")
    return lines


def configured_engine(config: ClusterConfig) -> tuple[EngineAdapter, Tokenizer]:
    """The configured engine (``model.engine``: a score is valid for it alone) and the model's tokenizer."""
    return load_engine(config, 0), load_tokenizer(resolve(config.model))


def measured_fidelity(config: ClusterConfig, workload: Workload, n: int, warmup_frac: float, *, seed: int = 0,
                      answer_tokens: int = 16, kl_positions: int = 8) -> dict[str, Any]:
    """``tessera bench --fidelity N``: the configured composition scored on N measured requests."""
    split = int(len(workload.requests) * warmup_frac)
    measured = Workload(workload.name, workload.corpus, workload.requests[split:], workload.notes)
    engine, tokenizer = configured_engine(config)
    prompts = sample(prompts_from_workload(config, measured, tokenizer), n, seed)
    setting = Setting.of(config.composition)
    (row,) = summarize(verify(engine, tokenizer, config, prompts, [setting], answer_tokens=answer_tokens,
                              kl_positions=kl_positions, progress=True))
    return {"prompts": len(prompts), "answer_tokens": answer_tokens, "kl_positions": kl_positions, **row.as_dict()}


def format_fidelity(fid: dict[str, Any]) -> str:
    def iv(key: str) -> str:
        v = fid[key]
        return f"{v['mean']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}]"

    return (f"fidelity of the composed requests ({fid['setting']}) vs full prefill on {fid['prompts']} measured "
            f"requests: mean KL {iv('kl')}, greedy agreement {iv('prefix')}, exact {iv('exact')}, "
            f"first-token top-1 {iv('top1')}")


def overlay_toml(setting: Setting, base: str = "default") -> str:
    """A config overlay that selects ``setting`` on top of ``base`` (``tessera.config_file``)."""
    lines = [f"base = {json.dumps(base)}", "", "[composition]", f"policy = {json.dumps(setting.policy)}"]
    named = knobs(setting.composition(CompositionConfig()))
    lines += [f"{key} = {value!r}" for key, value in named.items() if key not in ("policy", "unit_lead", "unit_bos")]
    lines.append(f"unit_lead = {json.dumps(setting.unit_lead)}")
    lines.append(f"unit_bos = {json.dumps(setting.unit_bos)}")
    return "\n".join(lines) + "\n"
