"""Property-based fuzzing of the public API against the OpenAPI document it serves.

schemathesis loads ``GET /openapi.json`` from a running cluster (tiny random Llama, one
generation node) and runs its engine, as its CLI does: explicit examples, boundary values
(coverage), generated requests valid and invalid (fuzzing), then sequences that follow the
document's links (stateful: ingest, then get, delete, retrieve and chat over what was
ingested). Every reply must be a documented status and never a 5xx, with the documented
content type and a body matching its schema; a request the schema forbids must get a 4xx;
a 405 must name the allowed methods; a unit just ingested must be there. With API keys, a
request without one must be refused. The default run sends a few requests per operation;
the ``slow`` runs send many more, as two tenants, and against a cluster without keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import schemathesis
from helpers.cluster import StartCluster, cluster_config
from schemathesis.engine import Status, events, from_schema

from tessera.config import ClusterConfig
from tessera.launcher import LocalCluster
from tessera.retrieval.app import build_retrieval_app
from tessera.retrieval.chat.response import openapi_document

KEYS = {"key-fuzz": ("fuzz", '["*"]', True), "key-narrow": ("narrow", '["docs"]', False)}
KEY = "key-fuzz"  # tenant "fuzz": every scope, admin (reads /metrics)
SEED = 22  # the number: a failure replays with the same seed against a fresh cluster
# positive_data_acceptance is off: the handlers also refuse what a JSON schema cannot say (a unit
# over max_unit_tokens, an embedding of the wrong dimension, retrieval and context_units together)
OFF_ALWAYS = ("positive_data_acceptance",)
# without API keys the declared bearer scheme is not enforced, by design (loopback only)
OFF_WITHOUT_KEYS = ("ignored_auth", "missing_required_header")


def keys_file(directory: Path) -> Path:
    lines = []
    for key, (tenant, scopes, admin) in KEYS.items():
        lines += ["[[tenants]]", f'name = "{tenant}"', f"scopes = {scopes}", f"admin = {str(admin).lower()}",
                  f'keys_sha256 = ["{hashlib.sha256(key.encode()).hexdigest()}"]', ""]
    path = directory / "keys.toml"
    path.write_text("\n".join(lines))
    path.chmod(0o600)  # plain keys: a keys file others may read is refused
    return path


def fuzz_config(model: Path, keys: Path | None = None) -> ClusterConfig:
    """One generation node, units of at most 256 tokens; API keys from ``keys`` when given."""
    cfg = cluster_config(str(model), nodes=1, max_inflight=8)
    cfg = dataclasses.replace(cfg, retrieval=dataclasses.replace(cfg.retrieval, max_unit_tokens=256))
    if keys is None:
        return cfg
    return dataclasses.replace(cfg, security=dataclasses.replace(cfg.security, keys_file=str(keys)))


@dataclass
class FuzzReport:
    failures: list[str] = field(default_factory=list)  # one readable entry per failed check
    tested: set[str] = field(default_factory=set)  # operation labels that got requests
    scenarios: int = 0


def fuzz(url: str, *, key: str | None, max_examples: int, max_steps: int) -> FuzzReport:
    """Run schemathesis' engine on the document served at ``url``, sending ``key``."""
    off = OFF_ALWAYS if key else OFF_ALWAYS + OFF_WITHOUT_KEYS
    config = schemathesis.Config.from_dict({
        "seed": SEED,
        "headers": {"Authorization": f"Bearer {key}"} if key else {},
        "request-timeout": 120,
        # the key is sent with every request; negative cases do not mutate it (ignored_auth checks it)
        "generation": {"max-examples": max_examples, "with-security-parameters": False, "database": "none"},
        "checks": {name: {"enabled": False} for name in off},
        "phases": {"stateful": {"max-steps": max_steps}},
    })
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config,
                                           headers={"Authorization": f"Bearer {key}"} if key else {})
    report = FuzzReport()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished | events.FuzzScenarioFinished):
            report.scenarios += 1
            recorder = event.recorder
            report.tested.update(case.value.operation.label for case in recorder.cases.values())
            for checks in recorder.checks.values():
                report.failures += [f"{recorder.label}: {c.name}: {c.failure_info.failure.title}\n"
                                    f"{c.failure_info.failure}\n{c.failure_info.code_sample}"
                                    for c in checks if c.status == Status.FAILURE and c.failure_info is not None]
        elif isinstance(event, events.NonFatalError | events.FatalError):
            report.failures.append(f"engine error: {event}")  # a connection reset is a crashed handler
        elif isinstance(event, events.EngineFinished):
            report.failures += [f"{f.title}\n{f}" for f in event.failures]
    return report


def assert_clean(report: FuzzReport) -> None:
    # schemathesis leaves out the operation whose URL it loaded the document from; loading it
    # (with the key, from the cluster) is that operation's test
    documented = {f"{method.upper()} {path}" for path, ops in openapi_document("Tessera")["paths"].items()
                  for method in ops} - {"GET /openapi.json"}
    assert not report.failures, f"{len(report.failures)} failed checks:\n\n" + "\n\n".join(report.failures)
    assert report.tested == documented, f"never sent: {sorted(documented - report.tested)}"


@pytest.fixture(scope="module")
def keyed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
          start_module_cluster: StartCluster) -> Iterator[LocalCluster]:
    """A cluster behind API keys: tenant "fuzz" owns every scope, tenant "narrow" only "docs"."""
    directory = tmp_path_factory.mktemp("fuzz-keys")
    yield start_module_cluster(fuzz_config(tiny_model, keys_file(directory)), directory / "logs")


def test_the_document_describes_every_public_route(tiny_model: Path) -> None:
    """Every route the public application serves (but HEAD twins of GETs) is an operation of the document."""
    app = build_retrieval_app(fuzz_config(tiny_model))
    served = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
              if r.resource is not None and r.method != "HEAD"}
    described = {(method, path) for path, ops in openapi_document("Tessera")["paths"].items() for method in ops}
    assert served == described


def test_a_short_fuzz_finds_no_server_error_and_no_undocumented_reply(keyed: LocalCluster) -> None:
    """A few requests per operation and a few short sequences, with an API key: every check holds."""
    assert_clean(fuzz(keyed.config.retrieval_url, key=KEY, max_examples=5, max_steps=4))


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("key", list(KEYS))
def test_a_long_fuzz_with_api_keys_finds_no_server_error(keyed: LocalCluster, key: str) -> None:
    """Hundreds of requests per operation and long sequences, as each tenant: every check holds."""
    assert_clean(fuzz(keyed.config.retrieval_url, key=key, max_examples=300, max_steps=20))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_long_fuzz_without_api_keys_finds_no_server_error(tiny_model: Path, tmp_path: Path,
                                                            start_cluster: StartCluster) -> None:
    """The same against an open (loopback, no keys) cluster, where every request is the open tenant."""
    cluster = start_cluster(fuzz_config(tiny_model), tmp_path / "logs")
    assert_clean(fuzz(cluster.config.retrieval_url, key=None, max_examples=300, max_steps=20))
