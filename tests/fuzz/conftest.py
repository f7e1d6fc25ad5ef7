"""The hostile-input suite: prints the cases it sent (and writes them to ECD_FUZZ_JSON if set)."""

from __future__ import annotations

import json
import os
from typing import Any

from fuzz_testing import ANSWERS, CASES, PROFILE


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not CASES:
        return
    terminalreporter.section("hostile input")
    terminalreporter.write_line(f"profile {PROFILE}: {sum(CASES.values())} cases sent")
    for kind, count in sorted(CASES.items()):
        terminalreporter.write_line(f"{kind:<32} {count:>7}")
    terminalreporter.write_line("answers (whole-request codes and per-item statuses):")
    for answer, count in sorted(ANSWERS.items()):
        terminalreporter.write_line(f"  {answer:<44} {count:>7}")
    path = os.environ.get("ECD_FUZZ_JSON")
    if path:
        with open(path, "w") as f:
            report = {"profile": PROFILE, "total": sum(CASES.values()), "cases": CASES}
            json.dump({**report, "answers": ANSWERS}, f, indent=2)
