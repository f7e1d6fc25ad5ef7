"""The distribution's requirements (pyproject.toml): the daemon installs without torch or vLLM,
the tensor side comes with the `torch` extra, and `make install` installs every extra."""

from __future__ import annotations

import re
import tomllib

from ecd_testing import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_distribution_with_no_extra_requires_neither_torch_nor_vllm() -> None:
    """A daemon for a systemd service or a sidecar: what `pip install .` brings."""
    assert not names(PYPROJECT["dependencies"]) & {"torch", "vllm", "numpy"}


def test_the_torch_extra_brings_what_the_tensor_side_imports() -> None:
    """ec_client.data imports torch, and numpy for small copies (ec_client/data/mover.py)."""
    assert names(PYPROJECT["optional-dependencies"]["torch"]) == {"torch", "numpy"}


def test_make_install_installs_every_extra() -> None:
    """The tests and the benches run the tensor side, the store and the tools alike."""
    makefile = (REPO / "Makefile").read_text()
    [extras] = re.findall(r"pip install --quiet -e '\.\[([\w,]+)\]'", makefile)
    assert set(extras.split(",")) == set(PYPROJECT["optional-dependencies"])
