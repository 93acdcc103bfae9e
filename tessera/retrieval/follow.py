"""A replica's ANN index follows the PostgreSQL store's change sequence.

Every retrieval replica searches its own in-memory index; the units are in one database. The
follower reads ``changes`` after its cursor and applies them: an added key is indexed from its
stored embedding (unless it is indexed already, e.g. this replica wrote it, or it was deleted
since), a revoked key leaves the index. Applying a change twice is harmless, so the cursor may
start anywhere at or before the index's true state (0 after a rebuild from the records is fine;
``UnitStore`` opens the index at the records' current state, so the follower starts at the
sequence's end as read *before* the store was opened).

Transactions take their ``seq`` when they insert, but may commit in another order: a gap in
the sequence is either a transaction still committing or one that rolled back. The follower
stops at a gap until it is :data:`~tessera.retrieval.store.postgres.GAP_GRACE_S` old, then steps over it.

Runs on the retrieval worker thread (it uses the store's connection).
"""

from __future__ import annotations

import time

from tessera.retrieval.store.postgres import GAP_GRACE_S, PgUnitRecords
from tessera.retrieval.store.unit_store import UnitStore


class IndexFollower:
    """``step()`` applies the committed changes after ``cursor``; returns how many it applied."""

    def __init__(self, store: UnitStore, cursor: int) -> None:
        assert isinstance(store.records, PgUnitRecords), "only the PostgreSQL store has a change sequence"
        self.store = store
        self.records: PgUnitRecords = store.records
        self.cursor = cursor
        self._gap_since: float | None = None  # when the follower first waited at the gap after cursor

    def step(self) -> int:
        applied = 0
        for seq, scope, key, added, _ in self.records.changes_since(self.cursor):
            if seq != self.cursor + 1:
                now = time.monotonic()
                self._gap_since = self._gap_since or now
                if now - self._gap_since < GAP_GRACE_S:
                    break  # the missing seqs may still commit: wait for them
            self._gap_since = None
            self._apply(scope, key, added)
            self.cursor = seq
            applied += 1
        return applied

    def _apply(self, scope: str, key: int, added: bool) -> None:
        index = self.store.index.scope(scope)
        if added:
            if key in index:
                return
            keys, vectors = self.records.embeddings_of([key], self.store.embedder.dim)
            if not len(keys):
                return  # revoked since; its removal follows in the sequence
            index.add(keys.tolist(), vectors)
        elif key in index:
            index.remove([key])
        else:
            return
        self.store.changed(scope)
