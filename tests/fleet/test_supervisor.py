"""The restart policy shared by the server's engine and the fleet's instances, and the
supervisor that keeps real child processes running under it."""

import logging
import sys
import time

import pytest

from radixserve.fleet.supervisor import INSTANCE_RESTARTS, Supervisor
from radixserve.restart_policy import RestartPolicy, Restarts
from radixserve.server.engine_client import ENGINE_RESTARTS
from testing.fleet import wait_for

log = logging.getLogger("test-restarts")


def test_backoff_doubles_up_to_its_cap_and_a_window_without_restarts_starts_over(caplog):
    restarts = Restarts(RestartPolicy(backoff_s=1, max_backoff_s=5, window_s=100), "thing", log)
    with caplog.at_level(logging.WARNING, "test-restarts"):
        delays = [restarts.schedule(float(t)) for t in range(5)]
    assert delays == [1, 2, 4, 5, 5] and restarts.count == 5 and restarts.gave_up is None
    assert "thing died; restarting thing in 4.0 s (restart 3 within 100 s)" in caplog.text
    # the last restart was due at t=9; a process that lived a whole window after it starts over
    assert restarts.recent(108.9) == 1 and restarts.schedule(109.5) == 1


def test_the_limit_gives_up_naming_its_option_then_frees_up_with_the_window(caplog):
    policy = RestartPolicy(backoff_s=0.5, window_s=600, max_restarts=2, limit_name="--limit")
    restarts = Restarts(policy, "the engine", log)
    assert [restarts.schedule(0.0), restarts.schedule(10.0)] == [0.5, 1.0]
    with caplog.at_level(logging.CRITICAL, "test-restarts"):
        assert restarts.schedule(20.0) is None
    assert restarts.gave_up == (
        "the engine died and 2 restart(s) within 600 s used up the limit (--limit); giving up"
    )
    assert restarts.gave_up in caplog.text and restarts.count == 2
    assert restarts.schedule(700.0) == 0.5  # both restarts left the window
    assert Restarts(RestartPolicy(max_restarts=0), "x", log).schedule(0.0) is None


@pytest.mark.parametrize(
    "options,needle",
    [
        ({"backoff_s": -1}, "backoff_s"),
        ({"backoff_s": 40, "max_backoff_s": 30}, "backoff_s"),
        ({"window_s": 0}, "window_s"),
        ({"max_restarts": -1}, "max_restarts"),
    ],
)
def test_bad_policies_are_refused_naming_the_field(options, needle):
    with pytest.raises(ValueError, match=needle):
        RestartPolicy(**options)


def test_the_server_and_the_fleet_share_the_policy_with_their_own_schedules():
    assert ENGINE_RESTARTS.limit_name == "--engine-restarts" and ENGINE_RESTARTS.backoff_s == 0.5
    assert INSTANCE_RESTARTS.max_restarts is None  # a fleet never gives an instance up
    assert [INSTANCE_RESTARTS.delay(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_dying_child_is_restarted_with_backoff_and_a_live_one_is_left_alone():
    policy = RestartPolicy(backoff_s=0.2, max_backoff_s=0.4, window_s=60)
    sup = Supervisor(
        [(python("import sys; sys.exit(3)"), {}), (python("import time; time.sleep(60)"), {})],
        policy=policy,
        poll_s=0.02,
    )
    sup.start()
    live = sup.children[1].proc
    try:
        started = time.monotonic()
        sup.watch()
        dying = sup.children[0]
        wait_for(lambda: len(dying.exits) >= 4, timeout=30)
        took = time.monotonic() - started
        # waits of 0.2, 0.4, 0.4 s between the four deaths
        assert took >= 1.0 and set(dying.exits) == {3} and dying.restarts.count >= 4
        assert sup.children[1].proc is live and sup.children[1].exits == []
        assert sup.alive()[1]
    finally:
        sup.stop(grace_s=10)
    assert live.poll() is not None and not any(sup.alive())


def test_a_child_past_a_limited_policy_stays_down():
    sup = Supervisor(
        [(python("import sys; sys.exit(5)"), {})],
        policy=RestartPolicy(backoff_s=0.05, max_restarts=2),
        poll_s=0.02,
    )
    sup.start()
    sup.watch()
    try:
        child = sup.children[0]
        wait_for(lambda: child.restarts.gave_up, timeout=30)
        time.sleep(0.3)  # no restart follows
        assert child.exits == [5, 5, 5] and child.proc is None and sup.alive() == [False]
    finally:
        sup.stop(grace_s=5)
