"""What every test directory shares: how `make test` splits the suite.

`make test` runs the suite in two passes: most files in four pytest-xdist workers (a file each at
a time: the tests mostly wait on real processes, which start cheaply forked (below), so four overlap
well on 2 cores), then the tests marked `serial` alone. Serial tests assert timing a saturated
machine can break: that a stalled or restarted follower, a hostile client or an oversized body
causes *no* election, or that something happens within a bound of about a second. Next to another
worker's clusters on 2 cores, a leader can miss its heartbeats for CPU, not for the fault under test.

Directory replicas, worker stubs and gateways are forked from an interpreter that imported them once
(tests/support/forked.py): starting one the plain way spends more CPU on imports than most tests spend
on what they test. `--exec-services` starts them the plain way, to tell a fault of the forking from one
of the code under test.

Under xdist each worker picks server ports from a range of its own (kvdir.local_cluster.PORT_RANGE),
so a port one worker picked but has not bound yet is never another's pick.
"""

from __future__ import annotations

import os

import pytest

from kvdir import local_cluster
from tests.support import forked

_LOW, _HIGH = 10000, 32000  # below Linux's ephemeral range (32768-60999)

# file, or file::test (with all its parameters) -> why it runs alone. A whole file only where its tests all assert
# such timing: the rest (no bound, or one many times what they take, like a refused transfer failing in
# milliseconds against 3-6 s) run in the parallel pass.
SERIAL = {
    "tests/integration/test_replication.py": "a stalled or restarted follower must not cause an election",
    "tests/integration/test_raft_read_first.py": "a follower stalled in its tick must not cause an election",
    "tests/integration/test_raft_security.py::test_a_pickled_command_sent_to_the_raft_port_runs_nothing": (
        "a pickled command sent to the Raft port must not move the leader or the term"
    ),
    "tests/integration/test_raft_security.py::test_a_forged_vote_does_not_move_a_cluster_with_a_password": (
        "a forged vote must not move the leader or the term"
    ),
    "tests/integration/test_raft_security.py::test_hostile_connections_neither_stall_writes_nor_force_an_election": (
        "hostile Raft connections: no write waits 2 s, no election"
    ),
    "tests/integration/test_directory_bounds.py::test_oversized_bodies_are_refused_without_an_election": (
        "an oversized request must not cause an election"
    ),
    "tests/integration/test_hostile.py::test_deeply_nested_json_is_a_fast_400": "each deeply nested body refused within 2 s",
    "tests/integration/test_hostile.py::test_slow_clients_do_not_block_other_requests": (
        "normal requests answered within 1 s while slow clients hold connections"
    ),
    "tests/integration/test_transfer.py::test_stalled_peer_fails_within_bound": "a stalled transfer ends within its bound",
    "tests/integration/test_transfer.py::test_stalled_peer_on_first_contact_fails_within_bound": "a stalled first contact ends within its bound",
    "tests/integration/test_watch.py": "a stalled watch is noticed within 1.5 s",
    "tests/integration/test_header_limit.py::test_a_multi_megabyte_header_is_refused_fast_by_every_server": (
        "an oversized header is refused within 1 s"
    ),
    "tests/integration/test_gateway_mirror.py": "a stalled mirror is noticed and recovers within its bounds",
    "tests/integration/test_events.py::test_a_burst_arrives_whole_and_full_rounds_do_not_wait_for_the_window": (
        "a burst arrives within 8 s"
    ),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--exec-services",
        action="store_true",
        help="start each directory replica, worker stub and gateway with `python -m kvdir`, as `kvdir up` does, "
        "instead of forking it from the preloaded interpreter (tests/support/forked.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "serial: run alone, after the parallel pass (tests/conftest.py says why)")
    config.addinivalue_line("markers", "scale: production-sized state, minutes on 2 cores: `make test-scale`, not `make test`")
    config.addinivalue_line("markers", "browser: needs Debian's chromium: `make test-browser`, not `make test`")
    config.addinivalue_line(
        "markers", "faults: the fault harness's runs (tests/faults), minutes of replicas under faults: `make test-faults`"
    )
    config.addinivalue_line(
        "markers", "peers: the real peers in their own venv (tests/peers, `make test-peers`: Dynamo's simulator)"
    )
    if not config.getoption("--exec-services"):
        local_cluster.spawn = forked.spawn
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... under xdist; unset otherwise
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and count > 1:
        i = int(worker[2:])
        width = (_HIGH - _LOW) // count
        local_cluster.PORT_RANGE = (_LOW + i * width, _LOW + (i + 1) * width)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::")[0]
        if path.startswith("tests/faults/"):
            item.add_marker(pytest.mark.faults)
        if path.startswith("tests/peers/"):
            item.add_marker(pytest.mark.peers)
        if path in SERIAL or item.nodeid in SERIAL or item.nodeid.split("[")[0] in SERIAL:  # every parameter
            item.add_marker(pytest.mark.serial)
