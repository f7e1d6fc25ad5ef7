"""The docs: generated parts current, citations inside the repository, a README that stays short
and names every module."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from ecd_testing import REPO

DOCS = REPO / "docs"
README = REPO / "README.md"


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def project_files() -> list[Path]:
    """The files of the checkout, committed or not, that git does not ignore (build outputs and
    virtual environments aside); the generated protobuf modules aside."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return [
        REPO / name
        for name in listed
        if (REPO / name).is_file() and not name.startswith("ec_client/_proto/")
    ]


def test_the_generated_parts_of_the_docs_are_current() -> None:
    for path, text in load_generator().expected().items():
        assert path.read_text() == text, f"{path.name} is stale: run `make docs`"


def test_no_file_cites_a_design_or_facts_file_outside_the_repository() -> None:
    outside = re.compile(r"\.\./shared|FACTS\.md|(?<![/\w])DESIGN(\.md)?\b")
    offenders = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in project_files()
        if path != Path(__file__)
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if outside.search(line)
    ]
    assert not offenders, "cite docs/design.md or docs/performance.md instead:\n" + "\n".join(
        offenders
    )


def test_every_citation_of_the_design_names_one_of_its_sections() -> None:
    sections = {
        int(number)
        for number in re.findall(r"^## (\d+)\. ", (DOCS / "design.md").read_text(), re.M)
    }
    cited = re.compile(r"design\.md\)? ((?:§\d+(?:, )?)+)")
    for path in project_files():
        for match in cited.finditer(path.read_text(errors="replace")):
            for number in re.findall(r"§(\d+)", match.group(1)):
                assert int(number) in sections, f"{path.relative_to(REPO)} cites §{number}"


def test_the_readme_is_short_and_its_code_map_names_every_module_under_its_folder() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 400
    assert max(len(line) for line in text.splitlines() if line.startswith("|")) <= 200
    # Each folder's part of the code map runs from the line that opens with its name to the
    # next line that opens with a folder's name.
    parts = re.split(r"^(?=`ec_(?:daemon|client)[\w/]*/`)", text, flags=re.M)
    for package in sorted(
        init.parent.relative_to(REPO)
        for name in ("ec_daemon", "ec_client")
        for init in (REPO / name).rglob("__init__.py")
        if "_proto" not in init.parts
    ):
        part = next((p for p in parts if p.startswith(f"`{package}/`")), "")
        assert part, f"the README's code map has no part for {package}/"
        for module in sorted((REPO / package).glob("*.py")):
            # A sub-package's __init__.py only says what the folder holds, as the map does.
            if module.name != "__init__.py" or len(package.parts) == 1:
                assert f"`{module.name}`" in part, f"the README's code map lacks {module}"
