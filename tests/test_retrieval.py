"""The retrieval pool with the real MiniLM embedder, usearch HNSW and the served model's tokenizer."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tessera.config import RetrievalConfig
from tessera.config_file import load_config
from tessera.engines.checkpoint import resolve
from tessera.engines.tokenizer import load_tokenizer, serving_fingerprint
from tessera.errors import BadRequest, ConfigError
from tessera.retrieval.embedder import Embedder
from tessera.retrieval.store.unit_store import UnitStore
from tessera.units import TokenCache, UnitFactory, unit_id_for

PASSAGES = {
    "eiffel": "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
              "completed in 1889 for the World's Fair.",
    "photosynthesis": "Photosynthesis is the process by which green plants use sunlight, water and "
                      "carbon dioxide to produce glucose and release oxygen.",
    "python": "Python is a high-level programming language known for its readable syntax and "
              "large standard library.",
    "everest": "Mount Everest, on the border of Nepal and China, is the highest mountain above "
               "sea level at about 8,849 metres.",
    "insulin": "Insulin is a hormone made by the pancreas that lets cells absorb glucose from the "
               "blood.",
    "bitcoin": "Bitcoin is a decentralized digital currency that records transactions on a public "
               "ledger called a blockchain.",
}
PARAPHRASES = {
    "eiffel": "Which famous iron landmark in France's capital was built for the 1889 exhibition?",
    "photosynthesis": "How do plants turn light into sugar and give off O2?",
    "python": "What coding language is praised for clean, easy-to-read code?",
    "everest": "What is the tallest peak on Earth, between Nepal and Tibet?",
    "insulin": "Which pancreatic hormone helps the body take up blood sugar?",
    "bitcoin": "What cryptocurrency uses a shared public transaction ledger?",
}


@pytest.fixture(scope="module")
def parts() -> tuple[UnitFactory, Embedder]:
    config = load_config()
    checkpoint = resolve(config.model)
    tokenizer = load_tokenizer(checkpoint)
    factory = UnitFactory(serving_fingerprint(config, checkpoint, tokenizer), TokenCache(tokenizer.encode))
    return factory, Embedder()


@pytest.fixture
def pool(parts: tuple[UnitFactory, Embedder]) -> UnitStore:
    factory, embedder = parts
    return UnitStore(factory, embedder, RetrievalConfig(max_unit_tokens=64))


@pytest.fixture
def docs(pool: UnitStore) -> dict[str, str]:
    """Topic -> unit id of the ingested passages (scope "docs")."""
    done = pool.ingest([("docs", text, {"topic": topic}) for topic, text in PASSAGES.items()]).units
    return {topic: unit.unit_id for topic, (unit, _) in zip(PASSAGES, done, strict=True)}


def test_embeddings_are_unit_norm_and_paraphrases_are_closer_than_unrelated_text(
        parts: tuple[UnitFactory, Embedder]) -> None:
    """MiniLM mean pooling + L2 norm: cosine is a dot product, and it ranks meaning."""
    _, embedder = parts
    v = embedder.embed([PASSAGES["everest"], PARAPHRASES["everest"], PASSAGES["bitcoin"]])
    assert v.shape == (3, 384) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert float(v[0] @ v[1]) > float(v[0] @ v[2]) + 0.2


def test_a_query_retrieves_its_paraphrased_passage_first(pool: UnitStore, docs: dict[str, str]) -> None:
    """Every paraphrase's top hit is the passage it paraphrases."""
    for topic, query in PARAPHRASES.items():
        hits = pool.retrieve("docs", query=query, top_k=3)
        assert hits[0].unit.unit_id == docs[topic], (topic, [h.metadata for h in hits])
        assert hits[0].metadata == {"topic": topic}
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


def test_a_precomputed_embedding_retrieves_like_its_text(pool: UnitStore, docs: dict[str, str],
                                                         parts: tuple[UnitFactory, Embedder]) -> None:
    """query=text and embedding=embed(text) give the same ranking."""
    vector = parts[1].embed_one(PARAPHRASES["insulin"]).tolist()
    by_text = [h.unit.unit_id for h in pool.retrieve("docs", query=PARAPHRASES["insulin"], top_k=4)]
    by_vector = [h.unit.unit_id for h in pool.retrieve("docs", embedding=vector, top_k=4)]
    assert by_text == by_vector and by_text[0] == docs["insulin"]


def test_units_are_identified_by_scope_tokens_and_the_serving_fingerprint(
        pool: UnitStore, docs: dict[str, str]) -> None:
    """The id is unit_id_for(scope, token ids, fingerprint), independent of ingest order."""
    unit = pool.get(docs["python"])
    assert unit is not None
    factory = pool.factory
    assert unit.unit.unit_id == unit_id_for("docs", factory.tokens.tokens(PASSAGES["python"]), factory.fingerprint)
    assert unit.unit.n_tokens == len(unit.unit.token_ids) > 0


def test_reingesting_a_unit_indexes_nothing_new(pool: UnitStore, docs: dict[str, str]) -> None:
    """Same scope and text: same id, new=False, index size unchanged (also within one batch)."""
    before = len(pool.index)
    done = pool.ingest([("docs", PASSAGES["eiffel"], {}), ("docs", "A brand new unit.", {}),
                        ("docs", "A brand new unit.", {})]).units
    assert [(u.unit_id == docs["eiffel"], new) for u, new in done][:1] == [(True, False)]
    assert [new for _, new in done[1:]] == [True, False]
    assert done[1][0].unit_id == done[2][0].unit_id
    assert len(pool.index) == before + 1


def test_scopes_are_isolated(pool: UnitStore, docs: dict[str, str]) -> None:
    """The same text in another scope is another unit, and queries never cross scopes."""
    ((other, _),) = pool.ingest([("tenant-b", PASSAGES["eiffel"], {})]).units
    assert other.unit_id != docs["eiffel"]
    hits = pool.retrieve("tenant-b", query=PARAPHRASES["eiffel"], top_k=5)
    assert [h.unit.unit_id for h in hits] == [other.unit_id]
    assert other.unit_id not in {h.unit.unit_id for h in pool.retrieve("docs", query="Paris", top_k=6)}


def test_brought_units_get_the_same_identity_without_being_indexed(pool: UnitStore,
                                                                   docs: dict[str, str]) -> None:
    """identify() is what requests that bring their own units use: same id, nothing indexed."""
    before = len(pool.index)
    assert pool.identify("docs", PASSAGES["bitcoin"]).unit_id == docs["bitcoin"]
    memory = pool.identify("agent-7", "User prefers window seats.")
    assert len(pool.index) == before and pool.get(memory.unit_id) is None


@pytest.mark.parametrize(
    ("call", "needle", "status"),
    [
        (lambda p: p.ingest([("docs", "   ", {})]), "units[0].text is empty", 400),
        (lambda p: p.ingest([("docs", "ok", {}), ("docs", "word " * 200, {})]), "max_unit_tokens = 64", 413),
        (lambda p: p.ingest([("bad scope!", "text", {})]), "units[0].scope = 'bad scope!'", 400),
        (lambda p: p.retrieve("nowhere", query="x"), "unknown scope 'nowhere'", 404),
        (lambda p: p.retrieve("docs", query="x", embedding=[0.1] * 384), "exactly one of", 400),
        (lambda p: p.retrieve("docs"), "exactly one of", 400),
        (lambda p: p.retrieve("docs", embedding=[0.1] * 3), "3 dimensions", 400),
        (lambda p: p.retrieve("docs", embedding=[0.0] * 384), "non-zero", 400),
        (lambda p: p.retrieve("docs", query="x", top_k=5000), "top_k = 5000", 400),
    ],
)
def test_bad_input_is_refused_with_a_message_and_indexes_nothing(pool: UnitStore, docs: dict[str, str],
                                                                  call, needle: str, status: int) -> None:
    """Bad requests raise BadRequest naming what to fix; a refused batch leaves the index as it was."""
    before = len(pool.index)
    with pytest.raises(BadRequest) as info:
        call(pool)
    assert needle in str(info.value) and info.value.status == status
    assert len(pool.index) == before


def test_top_k_defaults_to_the_config(parts: tuple[UnitFactory, Embedder]) -> None:
    """top_k = 0 (or omitted) uses retrieval.top_k."""
    factory, embedder = parts
    pool = UnitStore(factory, embedder, dataclasses.replace(RetrievalConfig(), top_k=2))
    pool.ingest([("s", text, {}) for text in PASSAGES.values()])
    assert len(pool.retrieve("s", query="mountain")) == 2
    assert len(pool.retrieve("s", query="mountain", top_k=0)) == 2


def test_precomputed_unit_embeddings_are_indexed_as_given(pool: UnitStore,
                                                         parts: tuple[UnitFactory, Embedder]) -> None:
    """A unit ingested with its own vector is found by that vector (here: another text's embedding)."""
    decoy = parts[1].embed_one(PASSAGES["everest"]).tolist()
    [(unit, new)] = pool.ingest([("own", "an unrelated note about kettles", {})], [decoy]).units
    assert new
    hits = pool.retrieve("own", query=PASSAGES["everest"], top_k=1)
    assert hits[0].unit.unit_id == unit.unit_id and hits[0].score > 0.99
    with pytest.raises(BadRequest, match="dimensions"):
        pool.ingest([("own", "another note", {})], [[1.0, 2.0]])
    with pytest.raises(BadRequest, match="2 embeddings for 1 units"):
        pool.ingest([("own", "a third note", {})], [None, None])


def test_an_index_built_by_one_thread_answers_every_query_the_same_way_every_time() -> None:
    """``retrieval.index_threads = 1``: two indexes of the same vectors inserted in the same
    batches give the same neighbours for every query (several inserting threads build a
    different HNSW graph each time; the workload renderer of bench and verify uses one)."""
    from tessera.retrieval.store.index import ScopeIndex

    rng = np.random.default_rng(0)
    centres = rng.standard_normal((40, 384)).astype(np.float32)  # clustered: many near ties
    vectors = centres[rng.integers(0, 40, 3000)] + 0.3 * rng.standard_normal((3000, 384)).astype(np.float32)
    queries = rng.standard_normal((200, 384)).astype(np.float32)

    def answers() -> list[list[int]]:
        index = ScopeIndex(384, 16, 64, threads=1)
        for i in range(0, len(vectors), 256):
            index.add(list(range(i, min(i + 256, len(vectors)))), vectors[i:i + 256])
        return [[key for key, _ in index.search(q, 6)] for q in queries]

    first = answers()
    assert all(answers() == first for _ in range(2))
    with pytest.raises(ConfigError, match="index_threads"):
        RetrievalConfig(index_threads=-1)
