"""The docs: generated parts current, citations inside the repository, a README that stays short
and names every module, install hints that install what they say."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from ecd_testing import REPO

from ec_daemon.cluster import mooncake

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
        if (REPO / name).is_file() and not name.startswith("ec_protocol/_proto/")
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
    parts = re.split(r"^(?=`ec_(?:daemon|client|protocol|bench)[\w/]*/`)", text, flags=re.M)
    for package in sorted(
        init.parent.relative_to(REPO)
        for name in ("ec_daemon", "ec_client", "ec_protocol", "ec_bench")
        for init in (REPO / name).rglob("__init__.py")
        if "_proto" not in init.parts
    ):
        part = next((p for p in parts if p.startswith(f"`{package}/`")), "")
        assert part, f"the README's code map has no part for {package}/"
        for module in sorted((REPO / package).glob("*.py")):
            # A sub-package's __init__.py only says what the folder holds, as the map does.
            if module.name != "__init__.py" or len(package.parts) == 1:
                assert f"`{module.name}`" in part, f"the README's code map lacks {module}"


PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# pip's options that take a value (an index's URL, a requirements file, a folder).
VALUED = {"-r", "--requirement", "-c", "--constraint", "--index-url", "--target", "-d"}


def install_hints() -> list[tuple[str, str]]:
    """Each `pip install` argument in the checkout that names something to install (options and
    their values aside), with where it is; quotes stripped."""
    found = []
    for path in project_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in re.finditer(r"pip install ([^`#&|;\n]*)", line):
                words = [w.strip("'\"") for w in match.group(1).split()]
                skip = False
                for word in words:
                    if skip or word.startswith("-"):
                        skip = not skip and word in VALUED
                        continue
                    found.append((word, f"{path.relative_to(REPO)}:{number}"))
    return found


def test_an_install_hint_with_an_extra_installs_the_checkout_never_a_name_from_the_index() -> None:
    """The project is installed from its checkout (`pip install '.[mooncake]'`): a hint naming
    it, or a distribution with an extra, by a name (`ecd[mooncake]`) has pip fetch whatever the
    package index holds under that name, and `ecd` there is another project."""
    ours = {PYPROJECT["name"], "ecd"}  # the distribution's name, and its old one
    offenders = [
        f"{where}: {word}"
        for word, where in install_hints()
        if (requirement := re.fullmatch(r"([A-Za-z0-9][\w.-]*)(\[[\w,]+\])?(==\S+)?", word))
        and (requirement.group(2) or requirement.group(1) in ours)
    ]
    assert not offenders, "install hints naming a distribution from the index:\n" + "\n".join(
        offenders
    )
    assert PYPROJECT["name"] != "ecd", "`ecd` on the package index is another project"


def test_every_install_hint_of_a_pinned_dependency_pins_what_pyproject_pins() -> None:
    pins = dict(
        requirement.split("==")
        for requirements in PYPROJECT["optional-dependencies"].values()
        for requirement in requirements
        if "==" in requirement
    )
    offenders = [
        f"{where}: {word} (pyproject.toml pins {pins[name]})"
        for word, where in install_hints()
        if "==" in word
        for name, version in [word.split("==", 1)]
        if name in pins and version != pins[name]
    ]
    assert not offenders, "\n".join(offenders)


def test_the_daemons_hint_for_the_store_client_is_the_wheel_the_mooncake_extra_pins() -> None:
    assert PYPROJECT["optional-dependencies"]["mooncake"] == [mooncake.MOONCAKE_WHEEL]
    assert f"pip install '{mooncake.MOONCAKE_WHEEL}'" in mooncake.INSTALL_HINT
