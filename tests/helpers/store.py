"""What the unit-store tests share: four documents, three queries, and the served model's parts."""

from __future__ import annotations

from tessera.config_file import load_config
from tessera.engines.checkpoint import resolve
from tessera.engines.tokenizer import load_tokenizer, serving_fingerprint
from tessera.retrieval.embedder import Embedder
from tessera.units import TokenCache, UnitFactory

DOCS = [
    ("kb", "The Great Barrier Reef is the world's largest coral reef system, off Queensland.", {"topic": "reef"}),
    ("kb", "A transistor is a semiconductor device used to amplify or switch electronic signals.", {"topic": "chip"}),
    ("kb", "Espresso is coffee brewed by forcing hot water through finely ground beans.", {"topic": "coffee"}),
    ("kb", "Mount Everest is the highest mountain above sea level, on the Nepal-China border.", {"topic": "peak"}),
]
QUERIES = ["Where is the biggest coral reef?", "How is espresso made?", "What is the tallest mountain?"]


def store_parts() -> tuple[UnitFactory, Embedder]:
    """The served model's unit factory (its tokenizer, no weights) and the real MiniLM embedder."""
    config = load_config()
    checkpoint = resolve(config.model)
    tokenizer = load_tokenizer(checkpoint)
    return UnitFactory(serving_fingerprint(config, checkpoint, tokenizer), TokenCache(tokenizer.encode)), Embedder()
