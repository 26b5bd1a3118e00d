"""A worker clock's summed records reach the timer as the records one by one would."""

from __future__ import annotations

import pytest
from torch import nn

from roundpipe_core.running.timer import JobClock, ModelTimer

pytestmark = pytest.mark.host_only


def _layers() -> list[nn.Module]:
    return [nn.Linear(4, 4), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)]


def test_record_sums_equals_record_many() -> None:
    sums = {("fwd", 0, 1): 2.0, ("bwd", 0, 3): 9.0, ("re", 1, 3): 4.0, ("fwd", 3, 4): 0.5}
    a, b = ModelTimer(_layers()), ModelTimer(_layers())
    for _ in range(3):
        a.record_many([(k, range(s, e), ms) for (k, s, e), ms in sums.items()])
        b.record_sums(sums)
        a.end_iteration()
        b.end_iteration()
    assert a.state_dict() == b.state_dict()
    assert b.has_measurements("bwd")


@pytest.mark.parametrize(
    "bad, match",
    [
        (("fwd", 0, 5), "layer 4 is outside"),
        (("forward", 0, 1), "timing kind"),
        (("re", 1, 2, float("nan")), "finite"),
    ],
)
def test_record_sums_refuses_bad_entries_and_keeps_none(bad: tuple, match: str) -> None:
    timer = ModelTimer(_layers())
    key, ms = bad[:3], (bad[3] if len(bad) > 3 else 1.0)
    with pytest.raises(ValueError, match=match):
        timer.record_sums({("fwd", 0, 1): 1.0, key: ms})
    timer.end_iteration()
    timer.record_sums({("fwd", 0, 1): 1.0})
    timer.end_iteration()
    assert not timer.has_measurements("fwd")  # the refused call's good entry never landed


class _Worker:
    index = 0
    time_points_are_seconds = True

    def time_point(self) -> float:
        return 0.0


def test_a_clock_sums_its_jobs_per_microbatch_and_commits_once() -> None:
    clock = JobClock(_Worker())  # type: ignore[arg-type]
    timer = ModelTimer(_layers())
    for _ in range(2):  # the first measured iteration is the dropped warm-up
        clock.marks += [("fwd", 0, 1, 0.0, 0.002), ("fwd", 0, 1, 0.0, 0.004)]  # two microbatches
        assert clock.end_job(2) == pytest.approx(6.0)  # busy ms of the job
        clock.marks.append(("fwd", 0, 1, 0.0, 0.001))  # a later job, one microbatch
        clock.end_job(1)
        clock.commit(timer)
        timer.end_iteration()
    assert timer.fwd_ms[0] == pytest.approx(3.0 + 1.0)  # per microbatch, summed over jobs


def test_a_pipelined_run_defers_the_sums_and_replays_them_as_given() -> None:
    """A non-blocking run's worker clocks commit into its DeferredTimer; replayed at the
    end of the run, the sums land in the model timer as a blocking run's would."""
    from roundpipe_core.stepping.pipelined import DeferredTimer

    sums = {("fwd", 0, 1): 2.0, ("bwd", 0, 3): 9.0, ("re", 1, 3): 4.0}
    direct, replayed = ModelTimer(_layers()), ModelTimer(_layers())
    deferred = DeferredTimer()
    clock = JobClock(None)  # type: ignore[arg-type]  # no marks to convert: no worker needed
    for _ in range(3):  # the timer counts a layer as measured after its warm-up
        clock.sums = dict(sums)
        clock.commit(deferred)
        assert replayed.state_dict() == direct.state_dict()  # nothing lands before replay
        deferred.replay(replayed)
        direct.record_sums(sums)
        direct.end_iteration()
        replayed.end_iteration()
    assert direct.state_dict() == replayed.state_dict()
    assert replayed.has_measurements("bwd")
