"""`kvdir up`'s user-facing output without processes: its progress (live line and plain lines), the log tails
it prints when a process dies, the ports it checks, and the listening sockets it reads from /proc."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from kvdir.cli import main
from kvdir.launcher import UpSettings, up_ports
from kvdir.listeners import listening_inodes
from kvdir.local_cluster import log_tail
from kvdir.progress import Progress, StartState, events, status_line
from kvtransfer.mooncake import mooncake_rpc_ports


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_live_line_shows_each_stage_reached_and_the_one_under_way() -> None:
    s = StartState(replicas=3, workers=4, gateway=True)
    assert status_line(s, 1.25) == "[  1.2s] replicas 0/3 up, electing a leader"
    s.replicas_up, s.leader = 3, "replica 2"
    assert status_line(s, 4.0) == "[  4.0s] replicas 3/3 up, leader replica 2, workers 0/4 registered"
    s.workers_up = 4
    assert status_line(s, 9.96) == "[ 10.0s] replicas 3/3 up, leader replica 2, workers 4/4 registered, gateway starting"
    s.gateway_ready = True
    assert status_line(s, 12.0).endswith("workers 4/4 registered, gateway ready")
    bare = StartState(replicas=1, workers=0, gateway=False, replicas_up=1, leader="replica 1")
    assert status_line(bare, 0.5) == "[  0.5s] replicas 1/1 up, leader replica 1"


def test_plain_events_are_the_changes_in_start_up_order() -> None:
    before = StartState(replicas=3, workers=2, gateway=True, replicas_up=2)
    after = StartState(replicas=3, workers=2, gateway=True, replicas_up=3, leader="replica 1", leader_url="http://h:1")
    assert events(before, after) == ["replicas 3/3 up", "leader elected: replica 1 (http://h:1)"]
    assert events(after, after) == []
    done = StartState(**{**vars(after), "workers_up": 2, "gateway_ready": True})
    assert events(after, done) == ["workers 2/2 registered", "gateway ready"]


def test_off_a_terminal_each_step_is_one_stamped_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvdir.up")
    clock, stream = Clock(), io.StringIO()
    p = Progress(StartState(replicas=3, workers=1, gateway=False), stream, live=False, clock=clock)
    p.note("starting 3 directory replicas")
    clock.now += 2.0
    p.update(replicas_up=1)
    p.update(replicas_up=1)  # no change, no line
    clock.now += 1.5
    p.update(replicas_up=3, leader="replica 3", leader_url="http://127.0.0.1:8103")
    clock.now += 0.25
    p.close("cluster ready in 3.8s")
    assert caplog.messages == [
        "[  0.0s] starting 3 directory replicas",
        "[  2.0s] replicas 1/3 up",
        "[  3.5s] replicas 3/3 up",
        "[  3.5s] leader elected: replica 3 (http://127.0.0.1:8103)",
        "[  3.8s] cluster ready in 3.8s",
    ]
    assert stream.getvalue() == ""  # the live line's stream is untouched


def test_on_a_terminal_one_line_is_rewritten_in_place(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvdir.up")
    clock, stream = Clock(), io.StringIO()
    p = Progress(StartState(replicas=3, workers=0, gateway=False), stream, live=True, clock=clock)
    p.update(replicas_up=1)
    p.update()  # same tenth of a second: nothing written
    clock.now += 0.5
    p.update()  # the clock ticks on the line alone
    assert stream.getvalue() == (
        "\r[  0.0s] replicas 1/3 up, electing a leader\x1b[K\r[  0.5s] replicas 1/3 up, electing a leader\x1b[K"
    )
    stream.truncate(0)
    stream.seek(0)
    p.note("a stage begins")  # cleared, said through the logger, then the live line is drawn again
    assert stream.getvalue() == "\r\x1b[K[  0.5s] replicas 1/3 up, electing a leader"
    assert caplog.messages == ["[  0.5s] a stage begins"]
    p.close()
    assert stream.getvalue().endswith("\n")  # the last state stays on screen; what follows starts a new line


def test_log_tail_shows_the_last_lines_indented(tmp_path: Path) -> None:
    log = tmp_path / "replica1.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert log_tail(log, 3) == "  | line 97\n  | line 98\n  | line 99"
    log.write_text("")
    assert log_tail(log) == "  (the log is empty)"
    assert log_tail(tmp_path / "gone.log").startswith(f"  (cannot read {tmp_path / 'gone.log'}:")


def test_up_checks_every_port_it_binds() -> None:
    ports = dict(up_ports(UpSettings(base_port=9000, replicas=3, workers=2)))
    assert ports == {
        9000: "gateway",
        9001: "replica 1 HTTP",
        9002: "replica 2 HTTP",
        9003: "replica 3 HTTP",
        9101: "replica 1 Raft",
        9102: "replica 2 Raft",
        9103: "replica 3 Raft",
        9011: "worker-1 HTTP",
        9012: "worker-2 HTTP",
    }
    assert 9000 not in dict(up_ports(UpSettings(base_port=9000, gateway=False)))


def test_mooncake_binds_in_its_rpc_range_set_as_mooncake_reads_it() -> None:
    assert mooncake_rpc_ports({}) == range(15000, 17001)
    assert mooncake_rpc_ports({"MC_MIN_RPC_PORT": "20000", "MC_MAX_RPC_PORT": "20100"}) == range(20000, 20101)
    assert mooncake_rpc_ports({"MC_MIN_PRC_PORT": "18000", "MC_MAX_PRC_PORT": "18010"}) == range(18000, 18011)
    assert mooncake_rpc_ports({"MC_MIN_RPC_PORT": "x"}) == range(15000, 17001)
    assert mooncake_rpc_ports({"MC_MIN_RPC_PORT": "17500"}) == range(15000, 17001)  # min above max: the default


def test_up_refuses_a_base_port_whose_ports_a_workers_mooncake_engine_may_take() -> None:
    with pytest.raises(ValueError, match=r"replica 1 Raft on port 15001, in the range .* \(15000-17000\)"):
        UpSettings(base_port=14900)
    assert UpSettings(base_port=14900, worker_transfer="tcp").base_port == 14900
    assert UpSettings(base_port=14900, workers=0).base_port == 14900


# /proc/net/tcp as Linux writes it: 127.0.0.1:8101 listening (0A) as inode 5001, a connection to it, and
# 0.0.0.0:8102 listening as inode 5003.
TCP_TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1FA5 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 5001 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1FA5 0100007F:A2C4 01 00000000:00000000 00:00000000 00000000  1000        0 5002 1 0000000000000000 20 4 30 10 -1
   2: 00000000:1FA6 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 5003 1 0000000000000000 100 0 0 10 0
"""


def test_listening_sockets_are_read_from_the_proc_table() -> None:
    assert listening_inodes(TCP_TABLE, 8101) == {5001}  # not the established connection on the same port
    assert listening_inodes(TCP_TABLE, 8102) == {5003}
    assert listening_inodes(TCP_TABLE, 8103) == set()


def test_kvdir_up_with_an_unknown_policy_says_so_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--policy", "foo"]) == 2
    err = capsys.readouterr().err
    assert "kvdir up: invalid setting --policy (got 'foo'): Input should be 'kvdir', 'round_robin'" in err, err
