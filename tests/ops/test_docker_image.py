"""deploy/docker/Dockerfile, checked statically (no Docker engine here): a non-root runtime image
whose entrypoint is `ecd serve`, whose settings put the socket where clients and the health check
look, and whose build copies only what exists and what the ignore file lets through."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ecd_testing import REPO

from ec_daemon.server.config import Config

DOCKER = REPO / "deploy" / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str

    def exec_form(self) -> list[str]:
        parsed: list[str] = json.loads(self.value)
        return parsed


def instructions(text: str) -> list[Instruction]:
    """Instructions with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n(\s*#.*\n)*", " ", text)
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, value = line.partition(" ")
            found.append(Instruction(keyword.upper(), value.strip()))
    return found


def final_stage() -> list[Instruction]:
    steps = instructions(DOCKERFILE.read_text())
    last_from = max(i for i, step in enumerate(steps) if step.keyword == "FROM")
    return steps[last_from:]


def env_of(steps: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for step in steps:
        if step.keyword == "ENV":
            env.update(word.partition("=")[::2] for word in shlex.split(step.value))
    return env


def test_runtime_image_is_slim_python_and_runs_as_non_root() -> None:
    steps = final_stage()
    assert steps[0].value == "python:3.11-slim"
    [user] = [s.value for s in steps if s.keyword == "USER"]
    uid, _, gid = user.partition(":")
    # Numeric, so that Kubernetes can enforce runAsNonRoot; and not root.
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit()
    # The user is created before USER switches to it, with the same number.
    created = " ".join(s.value for s in steps[: steps.index(Instruction("USER", user))])
    assert f"--uid {uid}" in created


def test_entrypoint_is_ecd_serve(serve_config: Callable[..., Config]) -> None:
    steps = final_stage()
    [entrypoint] = [s.exec_form() for s in steps if s.keyword == "ENTRYPOINT"]
    assert entrypoint == ["ecd", "serve"]
    env = env_of(steps)
    config = serve_config([], env)
    # The daemon listens where the health check (ECD_ADDRESS) and the k8s manifests look.
    assert config.socket == Path("/run/ecd/ecd.sock")
    assert env["ECD_ADDRESS"] == f"unix://{config.socket}"
    [healthcheck] = [s.value for s in steps if s.keyword == "HEALTHCHECK"]
    assert json.loads(healthcheck.split("CMD", 1)[1]) == ["ecd", "health"]
    # The socket directory exists and belongs to the image's user.
    user = next(s.value for s in steps if s.keyword == "USER")
    uid, _, gid = user.partition(":")
    run = " ".join(s.value for s in steps if s.keyword == "RUN")
    assert f"install -d -o {uid} -g {gid}" in run and str(config.socket.parent) in run


def test_the_image_installs_no_torch() -> None:
    """The daemon never imports torch, and the project's distribution with the extras the image
    names (mooncake) requires none: the image installs neither torch nor an extra that brings it."""
    steps = final_stage()
    assert not [s.value for s in steps if "torch" in s.value.lower()]
    [project] = [s.value for s in steps if s.keyword == "RUN" and "/wheels/" in s.value]
    extras = re.search(r"\[([\w,]+)\]", project)
    named = extras.group(1).split(",") if extras else []
    required = PYPROJECT["dependencies"] + [
        r for extra in named for r in PYPROJECT["optional-dependencies"][extra]
    ]
    assert not [r for r in required if re.match(r"(torch|vllm|numpy)\b", r)]


def test_build_copies_only_existing_files_that_the_ignore_file_admits() -> None:
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copies = [
        s.value.split()
        for s in instructions(DOCKERFILE.read_text())
        if s.keyword == "COPY" and not s.value.startswith("--from")
    ]
    sources = {source for words in copies for source in words[:-1]}
    assert sources == admitted
    # README.md is written by the project's docs; everything else must be there now.
    assert all((REPO / s).exists() for s in sources - {"README.md"})


def test_the_image_installs_the_mooncake_extra_which_ships_the_store_client_and_master() -> None:
    """The store (ecd serve --store-master) and the master of deploy/k8s/mooncake-master.yaml,
    which runs from this image, both come with the mooncake extra."""
    runs = [s.value for s in final_stage() if s.keyword == "RUN"]
    [project] = [r for r in runs if "/wheels/" in r]
    assert "[mooncake]" in project
    assert any("libibverbs1" in r for r in runs)  # the transfer engine's library loads it
