"""The planning modules' shape: jobs print and parse as text, plans round-trip through
plain dicts (their import direction: ``test_layering.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import roundpipe_core
from roundpipe_core import ModelExecutePlan
from roundpipe_core.kinds import JobKind
from roundpipe_core.planning.planner import auto
from roundpipe_core.planning.schedule import (
    Job,
    build_schedule,
    format_schedule,
    parse_job_code,
    parse_schedule,
)

pytestmark = pytest.mark.host_only

CORE = Path(roundpipe_core.__file__).parent


def test_auto_is_the_planners():
    assert ModelExecutePlan._planner is auto


def test_job_codes_round_trip():
    plan = ModelExecutePlan.from_layout(
        fwd="2,1", bwd="1:1,0:2,1:1", run_type="fused", num_devices=2
    )
    jobs = build_schedule(plan, "fused", num_devices=2, num_microbatch=3)
    text = format_schedule(jobs)
    assert text == "0F0 1F1 0X1 1B0 2B1"
    assert [str(j) for j in jobs] == text.split()
    assert parse_schedule(text, plan, 3) == jobs
    assert parse_job_code("12B3") == (12, JobKind.BACKWARD, 3)
    assert jobs[2].kind is JobKind.FUSED and jobs[2].kind == "fused"


@pytest.mark.parametrize("bad", ["F0", "2Q0", "2F", "2f0", "+2F0", "2F0x", ""])
def test_bad_job_codes_are_named(bad):
    with pytest.raises(ValueError, match="job"):
        parse_job_code(bad)


def test_parse_schedule_rejects_unknown_stage():
    plan = ModelExecutePlan.uniform(4, 2, "fused")
    with pytest.raises(ValueError, match=r"job 1 \('1F0'\) names stage 1 but fwd_plan has 1"):
        parse_schedule("0F0 1F0", plan, 2)


def test_plan_dict_round_trip_through_json():
    plan = ModelExecutePlan.from_layout(fwd="0:2,1:3", bwd="1,4", run_type="train", num_devices=2)
    data = json.loads(json.dumps(plan.to_dict()))
    assert ModelExecutePlan.from_dict(data) == plan
    assert ModelExecutePlan.from_dict(ModelExecutePlan.uniform(5, 2).to_dict()) == (
        ModelExecutePlan.uniform(5, 2)
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"fwd": [[0, 2]], "bogus": 1}, "unknown keys"),
        ({"fwd": [[0, 2, 3]]}, r"fwd\[0\].*\[start, stop\]"),
        ({"fwd": [["0", 2]]}, r"fwd\[0\]"),
        ({"fwd_owners": "01"}, "fwd_owners must be a list"),
    ],
)
def test_bad_plan_dicts(data, message):
    with pytest.raises(ValueError, match=message):
        ModelExecutePlan.from_dict(data)


def test_job_is_plain_data():
    job = Job(0, JobKind.FORWARD, range(0, 2), 1, range(3), 0)
    assert job.code == "0F1" and str(job) == "0F1"
