"""The table of what was tried and what held, filled by the fault and security tests themselves.

A test calls `fault_log.check(area, tried, expected, observed, held)`: the row is recorded and the
test fails when `held` is false. At the session's end the rows go to a JSON file
(`$DOCKRL_FAULT_TABLE`, default build/fault_table.json) that `scripts/fault_table.py` renders
into docs/faults.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_PATH = REPO / "build" / "fault_table.json"


@dataclasses.dataclass(frozen=True)
class FaultRow:
    """One thing tried against a real service and how it came out."""

    area: str  # e.g. "rollout gRPC", "dock", "trainer gRPC"
    tried: str
    expected: str
    observed: str
    held: bool
    test: str  # the pytest node id that tried it


class FaultLog:
    """Rows recorded during one pytest session."""

    def __init__(self) -> None:
        self.rows: list[FaultRow] = []
        self.test = ""

    def check(self, area: str, tried: str, expected: str, observed: str, held: bool) -> None:
        """Records one row, then fails the running test unless it held."""
        self.rows.append(FaultRow(area, tried, expected, observed, bool(held), self.test))
        assert held, f"[{area}] {tried}: expected {expected}; observed {observed}"

    def write(self, path: pathlib.Path | None = None) -> pathlib.Path:
        """Writes the rows as a JSON list (to `$DOCKRL_FAULT_TABLE` unless `path`)."""
        out = path or pathlib.Path(os.environ.get("DOCKRL_FAULT_TABLE") or DEFAULT_PATH)  # set but empty: the default
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([dataclasses.asdict(r) for r in self.rows], indent=1))
        return out


SESSION_LOG = FaultLog()
