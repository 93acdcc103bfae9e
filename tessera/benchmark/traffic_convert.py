"""Converters into the traffic trace format (:mod:`tessera.benchmark.traffic`).

* :func:`from_workload`: a bench workload's requests (``rag``, ``locomo``, ``synthetic``),
  with the units the retrieval role would retrieve for them, optionally with Poisson
  arrival times;
* :func:`from_rendered`: Tessera's own rendered traces (``tessera bench --trace-only`` /
  ``--dump-trace``, ``return_layout``'s ``tessera_layout``): the chat template is matched
  against the prompt's tokens to recover the messages, the units and their placement, and
  every converted line is rendered again and compared token for token.

With ``private`` every unit becomes ``{id, tokens}``: its id a digest of its scope and text,
its length in the served tokenizer's tokens, so the trace keeps reuse and lengths, not text.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tessera.benchmark.traffic import TraceRequest, TraceUnit
from tessera.benchmark.workloads import Workload
from tessera.engines.tokenizer import Tokenizer
from tessera.errors import BadRequest
from tessera.retrieval.prompt import MEMORY_CLOSE, MEMORY_OPEN, UNIT_SEPARATOR, PromptBuilder
from tessera.units import ContextUnit, TokenCache, UnitFactory


def private_unit(scope: str, text: str, n_tokens: int) -> TraceUnit:
    digest = hashlib.blake2b(f"{scope}\x1f{text}".encode(), digest_size=8).hexdigest()
    return TraceUnit(scope, id=f"u-{digest}", tokens=n_tokens)


def _units(units: Sequence[ContextUnit], private: bool) -> tuple[TraceUnit, ...]:
    return tuple(private_unit(u.scope, u.text, u.n_tokens) if private else TraceUnit(u.scope, text=u.text)
                 for u in units)


def from_workload(workload: Workload, units_of: Any, *, private: bool = False, rate: float = 0.0,
                  seed: int = 0) -> Iterator[TraceRequest]:
    """The workload's requests as trace lines; ``units_of(request)`` gives each one's units
    (:meth:`tessera.benchmark.render.PromptRenderer.units`); ``rate > 0``: Poisson arrivals."""
    rng = random.Random(seed)
    at = 0.0
    for req in workload.requests:
        yield TraceRequest(req.messages, _units(units_of(req), private), req.placement, req.scope,
                           max_tokens=req.max_tokens, arrival_s=at if rate > 0 else None, stream=req.stream)
        if rate > 0:
            at += rng.expovariate(rate)


# role sequences tried when matching a rendered prompt: what Tessera's workloads and most
# agent traces send (an optional system prompt, then alternating turns ending with the user)
# (no system message first: a template's default system prompt then reads as none)
_ROLES = [tuple(["system"] * s + ["user", "assistant"] * t + ["user"]) for t in range(4) for s in (0, 1)]
_UNIT = "\x00{}\x00"
_CONTROL = "\ue010{}\ue011"  # a control token in matched text: never the characters of one


@dataclass
class RenderedConverter:
    """Recovers trace requests from rendered prompts of one tokenizer's chat template."""

    tokenizer: Tokenizer
    factory: UnitFactory

    def __post_init__(self) -> None:
        self.builder = PromptBuilder(self.tokenizer, TokenCache(self.tokenizer.encode_plain))
        hf = self.tokenizer.hf
        self.control = {int(i) for i, t in hf.added_tokens_decoder.items() if t.special} | set(hf.all_special_ids)
        self.patterns = [(roles, self._pattern(roles)) for roles in _ROLES]
        self.mismatched = 0  # converted lines whose prompt does not render back to the same tokens

    def _pattern(self, roles: tuple[str, ...]) -> re.Pattern[str]:
        marked = self.tokenizer.render_chat([{"role": r, "content": f"\ue002{i}\ue003"} for i, r in enumerate(roles)])
        parts = [self._text(self.tokenizer.encode(p)) for p in re.split("\ue002[0-9]+\ue003", marked)]
        return re.compile("([^\ue010]*?)".join(re.escape(p) for p in parts), re.DOTALL)

    def _text(self, ids: Sequence[int]) -> str:
        """Decoded text in which control tokens are markers, so ``<|im_start|>`` typed by a user
        (plain characters) never reads as the template's own."""
        out: list[str] = []
        run: list[int] = []
        for t in ids:
            if t in self.control:
                out += [self.tokenizer.hf.decode(run), _CONTROL.format(t)]
                run = []
            else:
                run.append(t)
        out.append(self.tokenizer.hf.decode(run))
        return "".join(out)

    def convert(self, rec: dict[str, Any], where: str, private: bool = False) -> TraceRequest:
        tokens, ranges = rec["tokens"], [tuple(u) for u in rec["units"]]
        pieces, unit_texts, at = [], [], 0
        for i, (start, end) in enumerate(ranges):
            pieces.append(self._text(tokens[at:start]) + _UNIT.format(i))
            unit_texts.append(self.tokenizer.decode(tokens[start:end]))  # without a unit lead's control tokens
            at = end
        text = "".join(pieces) + self._text(tokens[at:])
        for roles, pattern in self.patterns:  # noqa: B007 (the matching roles are used below)
            m = pattern.fullmatch(text)
            if m is not None:
                break
        else:
            raise BadRequest(f"{where}: the prompt does not match this tokenizer's chat template")
        messages, placement = self._messages(roles, list(m.groups()), len(ranges), where)
        scope = str(rec.get("stream") or "default")
        units = [self.factory.make(scope, t) for t in unit_texts]
        req = TraceRequest(tuple(messages), _units(units, private), placement, scope, stream=rec.get("stream"))
        if self.builder.build(messages, units, placement).token_ids() != list(tokens):
            self.mismatched += 1
        return req

    @staticmethod
    def _messages(roles: tuple[str, ...], contents: list[str], n_units: int,
                  where: str) -> tuple[list[dict[str, str]], str]:
        block = "".join(_UNIT.format(i) + UNIT_SEPARATOR for i in range(n_units))
        messages = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
        if not n_units:
            return messages, "system"
        for m in messages:
            if m["role"] == "system" and m["content"] == block:
                messages.remove(m)  # the builder added this system message for the units
                return messages, "system"
            if m["role"] == "system" and m["content"].endswith("\n\n" + block):
                m["content"] = m["content"][: -len(block) - 2]
                return messages, "system"
            memory = MEMORY_OPEN + block + MEMORY_CLOSE
            if m["role"] == "user" and m["content"].startswith(memory):
                m["content"] = m["content"][len(memory):]
                return messages, "user"
        raise BadRequest(f"{where}: the units are not where Tessera's prompt builder places them")
