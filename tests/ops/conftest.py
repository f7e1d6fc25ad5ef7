"""Shared by the ops tests: what `ecd serve` makes of a deployment's command line."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import pytest

from ec_daemon.cli import build_parser
from ec_daemon.server import config


def serve_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> config.Config:
    """The configuration `ecd serve ARGV` would run with under `environ`: the daemon's own parser
    and loader, so a flag a deployment file misspells fails here as it would in production."""
    args = build_parser().parse_args(["serve", *argv])
    loaded, _ = config.load(vars(args), environ or {}, args.config)
    return loaded


@pytest.fixture(name="serve_config")
def serve_config_fixture() -> Callable[..., config.Config]:
    return serve_config
