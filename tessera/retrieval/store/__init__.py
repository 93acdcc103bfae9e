"""The retrieval role's store: durable unit records, the per-scope ANN indexes cached from them,
and the pool that ingests into and retrieves from both.

* :mod:`.records`: the contract every unit-record store implements, and its row types;
* :mod:`.sql`: the SQL the two stores share; :mod:`.sqlite` (embedded, the default) and
  :mod:`.postgres` (shared by replicas) add what their database does differently;
* :mod:`.backends`: which store ``retrieval.store`` opens;
* :mod:`.index`: one HNSW index per scope, a cache of the records;
* :mod:`.unit_store`: :class:`~tessera.retrieval.store.unit_store.UnitStore`, the pool.

Nothing here knows HTTP or the control plane.
"""
