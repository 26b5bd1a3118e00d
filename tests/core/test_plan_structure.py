"""The planning modules' shape: imports point one way, jobs print and parse as text,
plans round-trip through plain dicts."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import roundpipe_core
from roundpipe_core import ModelExecutePlan
from roundpipe_core.kinds import JobKind
from roundpipe_core.planner import auto
from roundpipe_core.schedule import (
    Job,
    build_schedule,
    format_schedule,
    parse_job_code,
    parse_schedule,
)

CORE = Path(roundpipe_core.__file__).parent

#: Which engine modules each planning module may import. Lower layers first:
#: nothing here may import a module listed after it.
ALLOWED = {
    "kinds": set(),
    "layout": {"kinds"},
    "plan": {"kinds", "layout"},
    "partition": set(),
    "schedule": {"kinds", "plan"},
    "simresult": {"kinds", "schedule"},
    "baseline": {"kinds", "partition", "simresult"},
    "simulate": {"baseline", "kinds", "plan", "schedule", "simresult"},
    "profile": {"kinds", "plan"},
    "search": {"kinds", "partition", "plan", "profile", "simulate"},
    "planner": {"kinds", "plan", "profile", "search"},
}


def _imports(module: str) -> tuple[set[str], list[int]]:
    """Sibling modules imported by ``module``, and lines of imports inside functions."""
    tree = ast.parse((CORE / f"{module}.py").read_text())
    found: set[str] = set()
    nested: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("roundpipe_core"):
            found.add((node.module or "").split(".")[1])
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nested += [
                n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))
            ]
    return found, nested


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_imports_point_down_and_stay_at_module_level(module):
    found, nested = _imports(module)
    assert found <= ALLOWED[module], f"{module} imports {sorted(found - ALLOWED[module])}"
    assert not nested, f"{module} imports inside a function at lines {nested}"


@pytest.mark.parametrize("module", [*sorted(ALLOWED), "verify"])
def test_modules_stay_short(module):
    lines = (CORE / f"{module}.py").read_text().count("\n")
    assert lines < 600, f"{module}.py has {lines} lines"


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
