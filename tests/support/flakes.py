"""`make flakes`: `make test`'s parallel pass run N times, each in another test order and with another seed
(pytest-randomly), naming every test that failed in any run with the seeds that made it fail.

A test that fails one run in fifty blocks every change at random in CI; this finds it before CI does. Rerun
one failure exactly with `pytest -p randomly -p no:cacheprovider --randomly-seed SEED TEST_ID`, and fix it at
its cause: nothing here retries a test.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def failed_ids(junit: Path) -> list[str]:
    """The ids (`path::name`) of the tests a JUnit XML report lists as failed or errored."""
    if not junit.is_file():
        return []
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            path = case.get("classname", "").replace(".", "/")
            out.append(f"{path}.py::{case.get('name', '')}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="how many runs (default 5)")
    p.add_argument("--workers", type=int, default=2, help="pytest-xdist workers per run (default 2, as make test)")
    p.add_argument("--marks", required=True, help="the -m expression of make test's parallel pass")
    p.add_argument("--seed", type=int, help="the first run's seed (default: random); run i uses SEED + i")
    p.add_argument("pytest_args", nargs="*", help="more pytest arguments (e.g. a subset of files)")
    args = p.parse_args(argv)
    first = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    failures: dict[str, list[int]] = defaultdict(list)
    broken: list[tuple[int, int]] = []
    with tempfile.TemporaryDirectory(prefix="kvdir-flakes-") as tmp:
        for i in range(args.runs):
            seed = first + i
            junit = Path(tmp) / f"run{i}.xml"
            cmd = [
                sys.executable, "-m", "pytest", "-q", "-n", str(args.workers), "--dist", "loadfile", "-m", args.marks,
                "-p", "randomly", "--randomly-seed", str(seed), "--junitxml", str(junit), *args.pytest_args,
            ]  # fmt: skip
            print(f"== flakes: run {i + 1} of {args.runs}, seed {seed}", flush=True)
            rc = subprocess.run(cmd, check=False).returncode
            ids = failed_ids(junit)
            for test in ids:
                failures[test].append(seed)
            if rc not in (0, 1, 5) or (rc == 1 and not ids):
                broken.append((seed, rc))  # interrupted, or an error pytest could not attribute to a test
    print(f"== flakes: {args.runs} runs, seeds {first}..{first + args.runs - 1}")
    for test, seeds in sorted(failures.items()):
        print(f"FLAKY {test}: failed in {len(seeds)} of {args.runs} runs (seeds {', '.join(map(str, seeds))})")
    for seed, rc in broken:
        print(f"BROKEN run with seed {seed}: pytest exited {rc} without naming a failed test")
    if not failures and not broken:
        print("== flakes: no test failed in any run")
    return 1 if failures or broken else 0


if __name__ == "__main__":
    sys.exit(main())
