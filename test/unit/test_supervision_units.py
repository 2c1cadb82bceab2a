"""Supervision without SGLang, in process: the restart policy, the poison-pill guard, and
SGLang's crashes told from kills.

Children that die with their parent and the reaper's clean-up, with real processes, are
``e2e/test_supervision_processes.py``.
"""

from __future__ import annotations

from banaserve.cluster.poison import PoisonGuard, Retry
from banaserve.cluster.supervisor import crashed_by_itself
from banaserve.config.restart_policy import RestartPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_restarts_back_off_exponentially_and_are_capped_per_minute() -> None:
    policy = RestartPolicy(initial_backoff_s=1, max_backoff_s=8, max_per_minute=3)
    restarts: list[float] = []
    delays = []
    now = 0.0
    for _ in range(6):  # a crash loop: each run dies at once
        at = policy.restart_at(restarts, now)
        delays.append(at - now)
        restarts.append(at)
        now = at
    assert delays[:3] == [1, 2, 4]
    assert delays[3] > 8  # the fourth in a minute waits for the first to leave the minute
    for i in range(len(restarts)):  # never more than 3 in any 60 s
        assert sum(1 for t in restarts if restarts[i] <= t < restarts[i] + 60) <= 3
    # A child that ran calmly for a while starts again from the first delay.
    assert policy.backoff_s(restarts, restarts[-1] + 10_000) == 1


def test_a_request_is_retried_once_then_quarantined() -> None:
    clock = Clock()
    guard = PoisonGuard(clock, quarantine_s=60)
    assert guard.refusal("pill") is None
    # Its instance crashed by itself: back to that instance once it is restarted.
    assert guard.after_death("pill", crashed_by_itself=True) is Retry.SAME_INSTANCE
    assert guard.refusal("pill") is None
    assert guard.after_death("pill", crashed_by_itself=True) is Retry.QUARANTINE
    message = guard.refusal("pill")
    assert message is not None and "crashed 2 instances" in message and "60 s" in message
    assert guard.refusal("innocent") is None
    # Killed from outside (OOM, an operator): says nothing against the request.
    assert guard.after_death("innocent", crashed_by_itself=False) is Retry.ELSEWHERE
    clock.now += 61
    assert guard.refusal("pill") is None  # the quarantine ends
    assert (guard.quarantined, guard.refused) == (1, 1)


def test_sglang_crashes_are_told_from_kills() -> None:
    log = "Scheduler hit an exception: Traceback ... IndexError: index out of range\n"
    assert crashed_by_itself(-9, log)  # SGLang SIGKILLs its own tree after a crash
    assert crashed_by_itself(1, "")
    assert not crashed_by_itself(-9, "INFO: 127.0.0.1 POST /generate 200\n")
