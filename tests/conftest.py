"""What every test directory shares: under pytest-xdist (`make test` runs two workers), each worker picks
server ports from a range of its own (kvdir.launcher.PORT_RANGE), so two workers never start servers on
the same port."""

from __future__ import annotations

import os

from kvdir import launcher

_LOW, _HIGH = 10000, 32000  # below Linux's ephemeral range (32768-60999)


def pytest_configure() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... under xdist; unset otherwise
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and count > 1:
        i = int(worker[2:])
        width = (_HIGH - _LOW) // count
        launcher.PORT_RANGE = (_LOW + i * width, _LOW + (i + 1) * width)
