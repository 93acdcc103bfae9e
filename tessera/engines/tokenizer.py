"""Tokenizer and chat template of the served model (transformers' tokenizer, wrapped).

Both the retrieval role (unit identity, prompt layout) and the generation role use it, so it
loads without the weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from tessera.config import ClusterConfig
from tessera.engines.checkpoint import Checkpoint
from tessera.errors import ModelLoadError
from tessera.units import ServingFingerprint, TokenCache, UnitFactory


class Tokenizer:
    def __init__(self, hf: Any) -> None:
        self.hf = hf
        vocab = sorted(hf.get_vocab().items())
        self.identity = hashlib.blake2b(repr(vocab).encode(), digest_size=16).hexdigest()
        self.bos_token_id: int | None = hf.bos_token_id
        eos: set[int] = set()
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        # chat models end a turn with a template token that is not always the tokenizer's eos
        for tok in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"):
            tid = hf.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid >= 0 and tid != hf.unk_token_id:
                eos.add(tid)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of trusted text (templates, config): special-token markers become control tokens."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of untrusted text (user content, unit text): ``<|im_start|>`` and the like are
        encoded as the plain characters they are, never as control tokens (no role injection)."""
        return list(self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(token_ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.has_chat_template:
            raise ModelLoadError("this model's tokenizer has no chat template; send a plain prompt instead")
        return str(self.hf.apply_chat_template(list(messages), tokenize=False,
                                               add_generation_prompt=add_generation_prompt))


class Tokenized:
    """An engine's tokenizer methods (``eos_token_ids``, ``encode``, ``decode_tokens``) from its
    ``tokenizer``; listed before :class:`~tessera.engines.base.EngineAdapter` in the bases."""

    tokenizer: Tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_token_ids

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode_tokens(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids)


def load_tokenizer(checkpoint: Checkpoint) -> Tokenizer:
    try:
        from transformers import AutoTokenizer

        return Tokenizer(AutoTokenizer.from_pretrained(str(checkpoint.path)))
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {checkpoint.path}: {exc}") from exc


def serving_fingerprint(config: ClusterConfig, checkpoint: Checkpoint, tokenizer: Tokenizer) -> ServingFingerprint:
    """Fingerprint shared by every role of one deployment: what changes a unit's reusable KV."""
    return ServingFingerprint(
        model=f"{checkpoint.name}:{checkpoint.identity}",
        tokenizer=tokenizer.identity,
        kv_dtype=config.kv_dtype,
        unit_bos=config.composition.unit_bos,
    )


def unit_factory(config: ClusterConfig, fingerprint: ServingFingerprint, tokenizer: Tokenizer,
                 tokens: TokenCache | None = None) -> UnitFactory:
    """The deployment's unit factory: identity from the fingerprint, ``composition.unit_lead`` first.

    The lead comes from the config (trusted: its special tokens are meant, e.g. ``<|endoftext|>``);
    unit text comes from users and is encoded as plain text.
    """
    lead = tuple(tokenizer.encode(config.composition.unit_lead)) if config.composition.unit_lead else ()
    return UnitFactory(fingerprint, tokens or TokenCache(tokenizer.encode_plain), lead)
