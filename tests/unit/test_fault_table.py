"""scripts/fault_table.py renders recorded rows: a summary per area and a table per area, pipes escaped."""
import json
import subprocess
import sys

import pytest

from tests.fault_log import FaultLog


def test_recorded_rows_render_into_the_page(tmp_path):
    log = FaultLog()
    log.check("rollout", "a | b", "refused", "INVALID_ARGUMENT", True)
    with pytest.raises(AssertionError, match=r"\[dock\] put: expected nothing written; observed 1 row"):
        log.check("dock", "put", "nothing written", "1 row", False)
    source = log.write(tmp_path / "rows.json")
    assert [r["held"] for r in json.loads(source.read_text())] == [True, False]
    out = tmp_path / "faults.md"
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- fault-summary:start -->\nold rows\n<!-- fault-summary:end -->\nafter\n")
    run = subprocess.run([sys.executable, "scripts/fault_table.py", "--json", str(source), "--out", str(out), "--readme", str(readme)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    page = out.read_text()
    assert "1 of 2 held." in page and "| rollout | 1 | 1 |" in page and "| dock | 1 | 0 |" in page
    block = readme.read_text()
    assert block.startswith("intro\n") and block.endswith("\nafter\n") and "old rows" not in block
    assert "1 of 2 held." in block and "| dock | 1 | 0 |" in block and "| a \\| b |" not in block
    assert "| a \\| b | refused | INVALID_ARGUMENT | yes |" in page and "| put | nothing written | 1 row | **NO** |" in page


def test_rows_of_several_sessions_render_together(tmp_path):
    first, second = FaultLog(), FaultLog()
    first.check("rollout", "a", "refused", "refused", True)
    second.check("whole loop", "b", "held", "held", True)
    out, readme = tmp_path / "faults.md", tmp_path / "README.md"
    readme.write_text("<!-- fault-summary:start -->\n<!-- fault-summary:end -->\n")
    run = subprocess.run([sys.executable, "scripts/fault_table.py", "--json", str(first.write(tmp_path / "one.json")),
                          "--json", str(second.write(tmp_path / "two.json")), "--out", str(out), "--readme", str(readme)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    page = out.read_text()
    assert "2 of 2 held." in page and page.index("| rollout | 1 | 1 |") < page.index("| whole loop | 1 | 1 |")


def test_the_hand_written_sections_after_the_tables_are_kept(tmp_path):
    log = FaultLog()
    log.check("dock", "put", "refused", "refused", True)
    out, readme = tmp_path / "faults.md", tmp_path / "README.md"
    readme.write_text("<!-- fault-summary:start -->\n<!-- fault-summary:end -->\n")
    prose = "<!-- written by hand below: scripts/fault_table.py keeps it -->\n\n## Redis failover\n\nWhat can be lost.\n"
    out.write_text("# old page\n\n| old | table |\n\n" + prose)
    run = subprocess.run([sys.executable, "scripts/fault_table.py", "--json", str(log.write(tmp_path / "rows.json")),
                          "--out", str(out), "--readme", str(readme)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    page = out.read_text()
    assert "| old | table |" not in page and "1 of 1 held." in page and page.endswith("| put | refused | refused | yes |\n\n" + prose)
