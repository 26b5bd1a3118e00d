"""A call's timing record (``CallTiming``): its workers' clocks hand their jobs, transfers
and layer sums over once, and the sums reach the layer timer as the records one by one
would, once per call."""

from __future__ import annotations

import pytest
from torch import nn

from roundpipe_core import ModelExecutePlan
from roundpipe_core.planning.schedule import build_schedule
from roundpipe_core.running.timer import CallTiming, JobClock, JobTiming, ModelTimer

pytestmark = pytest.mark.host_only


def _layers() -> list[nn.Module]:
    return [nn.Linear(4, 4), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)]


def test_record_sums_equals_one_record_each() -> None:
    sums = {("fwd", 0, 1): 2.0, ("bwd", 0, 3): 9.0, ("re", 1, 3): 4.0, ("fwd", 3, 4): 0.5}
    a, b = ModelTimer(_layers()), ModelTimer(_layers())
    for _ in range(3):
        for (k, s, e), ms in sums.items():
            a.record(k, range(s, e), ms)
        b.record_sums(sums)
        a.end_iteration()
        b.end_iteration()
    assert a.state_dict() == b.state_dict()
    assert b.has_measurements("bwd")
    # a stage's time split over its layers without loss
    assert sum(b.bwd_ms[:3]) == pytest.approx(9.0)


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
    index = 1
    time_points_are_seconds = True

    def time_point(self) -> float:
        return 0.0


JOBS = build_schedule(ModelExecutePlan([range(0, 1)], [range(0, 1)]), "train", 2, 2)


def test_a_clock_sums_its_jobs_per_microbatch_and_notes_each_job() -> None:
    timer = ModelTimer(_layers())
    for _ in range(2):  # the first measured iteration is the dropped warm-up
        timing, clock = CallTiming(), JobClock(_Worker())  # type: ignore[arg-type]
        clock.marks += [("fwd", 0, 1, 0.0, 0.002), ("fwd", 0, 1, 0.0, 0.004)]  # two microbatches
        first = clock.end_job(JOBS[0], 2, start=5.0)
        assert first == JobTiming(JOBS[0], 1, 5.0, first.end_s, pytest.approx(6.0))
        assert first.end_s > first.start_s  # ends at the clock's now, a perf_counter time
        clock.marks.append(("fwd", 0, 1, 0.0, 0.001))  # a later job, one microbatch
        clock.end_job(JOBS[1], 1, start=first.end_s)
        clock.transfer("upload", "0F1 params", 4.0)
        timing.add(clock)
        assert clock.jobs == clock.transfers == [] and clock.sums == {}  # handed over
        assert [t.job for t in timing.jobs] == JOBS[:2]
        (up,) = timing.transfers
        assert (up.lane, up.device, up.name, up.start_s) == ("upload", 1, "0F1 params", 4.0)
        assert up.end_s >= up.start_s
        timing.commit(timer)
    assert timer.fwd_ms[0] == pytest.approx(3.0 + 1.0)  # per microbatch, summed over jobs


def test_a_call_gives_its_sums_to_the_timer_only_at_commit_and_once() -> None:
    """Overlapping calls must not mix their records within one timer iteration: the
    workers' sums wait in the call's record until the call is done; a run executed in
    two parts (``forward()`` then its backward) commits each part's sums once."""
    sums = {("fwd", 0, 1): 2.0, ("bwd", 0, 3): 9.0, ("re", 1, 3): 4.0}
    direct, committed = ModelTimer(_layers()), ModelTimer(_layers())
    for _ in range(3):  # the timer counts a layer as measured after its warm-up
        timing = CallTiming()
        for part in ({k: v / 2 for k, v in sums.items()}, {k: v / 2 for k, v in sums.items()}):
            clock = JobClock(None)  # type: ignore[arg-type]  # no marks to convert: no worker needed
            clock.sums = dict(part)
            timing.add(clock)
        assert committed.state_dict() == direct.state_dict()  # nothing lands before commit
        timing.commit(committed)
        direct.record_sums(sums)
        direct.end_iteration()
        timing.commit(committed)  # the second part: nothing new added, nothing re-recorded
        direct.end_iteration()
    assert direct.state_dict() == committed.state_dict()
    assert committed.has_measurements("bwd")


def test_busy_time_per_device_and_the_bubble_ratio() -> None:
    timing = CallTiming()
    assert timing.bubble_ratio(2) is None  # nothing ran
    timing.jobs += [JobTiming(JOBS[0], 0, 0.0, 0.01, 6.0), JobTiming(JOBS[1], 1, 0.0, 0.01, 2.0)]
    timing.jobs.append(JobTiming(JOBS[0], 0, 0.01, 0.02, 4.0))
    assert timing.device_busy_ms(2) == [10.0, 2.0]
    assert timing.bubble_ratio(2) is None  # no wall time: the call has not returned
    timing.wall_ms = 20.0
    assert timing.bubble_ratio(2) == pytest.approx(1.0 - 12.0 / 40.0)
    timing.wall_ms = 5.0  # busier than the wall (clock noise): never below 0
    assert timing.bubble_ratio(2) == 0.0
