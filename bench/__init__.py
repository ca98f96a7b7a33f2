"""Benchmarks (`make bench`); not part of the installed package."""

import json
from collections.abc import Callable
from typing import Any


def emit(report: dict[str, Any], as_json: bool, render: Callable[[dict[str, Any]], None]) -> int:
    """A benchmark's report: one JSON object on stdout (`--json`), else `render`'s table; the
    exit code of a run that measured."""
    if as_json:
        print(json.dumps(report))
    else:
        render(report)
    return 0
