"""The serve control channel (ddtree_rtc.parallel.lockstep) in one process: messages arrive in order,
a follower that closes is named at once with its last error, a silent one after the deadline, and a
follower notices a silent or vanished rank 0."""

from __future__ import annotations

import threading
import time

import pytest

from ddtree_rtc.engine.request import Request
from ddtree_rtc.parallel.comm import DistError
from ddtree_rtc.parallel.launch import RankEnv, free_port
from ddtree_rtc.parallel.lockstep import Follower, Leader
from ddtree_rtc.serve.ranks import decode, encode


def _pair(world: int, deadline: float):
    """A leader and world - 1 followers on a fresh port (the followers connect from threads)."""
    import os

    port = free_port()
    os.environ["DDTREE_RTC_CONTROL_PORT"] = str(port)
    failures = []
    followers = {}

    def join(r):
        followers[r] = Follower(RankEnv(r, world), deadline, 10)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(1, world)]
    for t in threads:
        t.start()
    leader = Leader(RankEnv(0, world), deadline, 10, lambda rank, text: failures.append((rank, text)))
    for t in threads:
        t.join()
    del os.environ["DDTREE_RTC_CONTROL_PORT"]
    return leader, followers, failures


def _wait(cond, timeout):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_messages_arrive_in_order_and_requests_round_trip():
    leader, followers, failures = _pair(3, 2.0)
    req = Request(7, [1, 2, 3], 5, temperature=0.8, top_p=0.9, stop_ids=(4,), seed=-3, budget=2)
    leader.broadcast({"op": "submit", "req": encode(req)})
    leader.broadcast({"op": "cancel", "rid": 7})
    leader.close(failed=False)
    for f in followers.values():
        got = []
        for m in f.messages():
            got.append(m)
            if m["op"] == "stop":
                break
        assert [m["op"] for m in got] == ["submit", "cancel", "stop"]
        assert decode(got[0]["req"]) == req
        f.close()
    assert not failures


def test_a_follower_that_goes_away_is_named_with_its_last_error():
    leader, followers, failures = _pair(3, 2.0)
    followers[2].report("RuntimeError: out of pages")
    t0 = time.monotonic()
    followers[2].close()
    assert _wait(lambda: failures, 1.5), "a closed connection must be noticed at once"
    assert time.monotonic() - t0 < 1.5
    assert failures == [(2, "exited (RuntimeError: out of pages)")]
    leader.close(failed=True)
    followers[1].close()


def test_a_silent_follower_is_named_after_the_deadline():
    leader, followers, failures = _pair(2, 0.6)
    followers[1]._closed.set()  # its heartbeat stops; the connection stays open (a hung process)
    assert _wait(lambda: failures, 3.0)
    assert failures[0][0] == 1 and "no heartbeat" in failures[0][1]
    leader.close(failed=True)
    followers[1].close()


def test_a_follower_notices_rank_0_going_away():
    leader, followers, _ = _pair(2, 0.6)
    leader._closing.set()  # rank 0 hangs: no more ticks
    with pytest.raises(DistError, match="rank 0 sent nothing"):
        next(followers[1].messages())
    followers[1].close()
