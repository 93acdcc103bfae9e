"""Traffic trace requests as the server renders them, without a server.

:class:`TraceRenderer` holds one deployment's tokenizer, unit factory and limits and builds
each request through :class:`~tessera.retrieval.prompt_path.PromptPath`, the chat API's own
steps (plain-text units, the API's unit checks, chat template, inlining, context limit). It
also renders a request's units into plain chat messages (:func:`inline_messages`), the prompt
an OpenAI-compatible server without Tessera is sent: the same text, where Tessera's prompt
builder places it. Loads the tokenizer only, never weights.
"""

from __future__ import annotations

from typing import Any

from tessera.benchmark.traffic import TraceRequest, UnitTexts
from tessera.composition.policies import policy_from_config
from tessera.config import ClusterConfig
from tessera.engines.checkpoint import resolve
from tessera.engines.geometry import geometry_from_checkpoint
from tessera.engines.tokenizer import Tokenizer, load_tokenizer, serving_fingerprint, unit_factory
from tessera.retrieval.prompt import PromptBuilder, text_placement, trace_record
from tessera.retrieval.prompt_path import Built, PromptPath


class TraceRenderer:
    """Renders trace requests for ``config``'s model, exactly as its retrieval role would."""

    def __init__(self, config: ClusterConfig, tokenizer: Tokenizer | None = None) -> None:
        checkpoint = resolve(config.model)
        self.tokenizer = tokenizer or load_tokenizer(checkpoint)
        factory = unit_factory(config, serving_fingerprint(config, checkpoint, self.tokenizer), self.tokenizer)
        max_context = geometry_from_checkpoint(checkpoint, config.kv_dtype, config.model.max_context).max_context
        self.path = PromptPath(PromptBuilder(self.tokenizer, factory.tokens), factory,
                               config.retrieval.max_unit_tokens, max_context)
        self.texts = UnitTexts(self.tokenizer.encode_plain)
        self.policy = policy_from_config(config.composition) if config.control.mode == "compose" else None

    def build(self, req: TraceRequest) -> Built:
        units = self.path.units(self.texts.pairs(req), req.tenant)
        return self.path.build(list(req.messages), units, req.placement, self.policy, req.max_tokens or 1)

    def record(self, req: TraceRequest) -> dict[str, Any]:
        """The request as one rendered-trace line ({stream, tokens, units}); every unit counted."""
        return trace_record(self.build(req).rendered, req.history)


def inline_messages(req: TraceRequest, texts: UnitTexts) -> list[dict[str, str]]:
    """The request's messages with its units as text, where Tessera's prompt builder places them."""
    return text_placement(list(req.messages), [t for _, t in texts.pairs(req)], req.placement)
