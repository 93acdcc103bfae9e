"""Command line: ``tessera run | up | bench | analyze | eval``."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from tessera.config import ClusterConfig, load_config
from tessera.errors import ConfigError

app = typer.Typer(
    name="tessera",
    help="Tessera: retrieval as the control plane for KV-cache reuse in RAG and agent-memory serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root() -> None:
    """Tessera: retrieval as the control plane for KV-cache reuse."""


class Role(StrEnum):
    retrieval = "retrieval"
    kvpool = "kvpool"
    generation = "generation"


ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="Cluster config (TOML). Default: the embedded single-machine cluster."),
]


def _load(config: Path | None) -> ClusterConfig:
    try:
        return load_config(config)
    except ConfigError as exc:
        typer.echo(f"tessera: config error: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command()
def run(
    role: Annotated[Role, typer.Option("--role", "-r", help="Which role this process plays.")],
    config: ConfigOpt = None,
    node: Annotated[
        str | None,
        typer.Option("--node", "-n", help="Node name from the config ([[kvpools]] or [[generation]] name). "
                     "Required for kvpool and generation roles when the config has several."),
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Run one role (retrieval, kvpool or generation) as a single asyncio process."""
    from tessera.roles import main_for
    from tessera.runtime import configure_logging

    cfg = _load(config)
    configure_logging(log_level)
    raise typer.Exit(main_for(role.value, cfg, node))


def main() -> None:
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
