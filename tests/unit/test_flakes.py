"""`make flakes` names the tests that failed or errored in a run's JUnit report, as pytest ids."""

from __future__ import annotations

from pathlib import Path

from tests.support.flakes import failed_ids

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1" tests="3">
<testcase classname="tests.integration.test_gateway" name="test_ok" time="0.1"/>
<testcase classname="tests.integration.test_gateway" name="test_spreads[4]" time="2.0"><failure message="x">...</failure></testcase>
<testcase classname="tests.unit.test_pool" name="test_fixture" time="0.0"><error message="y">...</error></testcase>
</testsuite></testsuites>"""


def test_failures_and_errors_are_named_by_their_pytest_ids(tmp_path: Path) -> None:
    (tmp_path / "run.xml").write_text(REPORT)
    assert failed_ids(tmp_path / "run.xml") == [
        "tests/integration/test_gateway.py::test_spreads[4]",
        "tests/unit/test_pool.py::test_fixture",
    ]
    assert failed_ids(tmp_path / "absent.xml") == []  # a run killed before it wrote one: reported as broken instead
