"""Layout specs: plans from layer counts (and owner devices) per stage."""

from __future__ import annotations

import pytest

from roundpipe_core.planning.plan import ModelExecutePlan

pytestmark = pytest.mark.host_only

P = ModelExecutePlan


def test_counts_string_and_list():
    a = P.from_layout(fwd="7,5", run_type="train")
    b = P.from_layout(fwd=[7, 5], run_type="train")
    assert a == b
    assert a.fwd_plan == [range(0, 7), range(7, 12)]
    assert a.bwd_plan == [range(7, 12), range(0, 7)]  # mirrored, deep to shallow
    assert a.fwd_owners is None and a.bwd_owners is None


def test_owner_string_seed_example():
    plan = P.from_layout(fwd="0:4,0:3,1:3,1:2", run_type="infer", num_devices=2)
    assert [len(r) for r in plan.fwd_plan] == [4, 3, 3, 2]
    assert plan.fwd_owners == [0, 0, 1, 1]
    assert plan.fwd_plan[-1] == range(10, 12)
    same = P.from_layout(fwd=[(0, 4), (0, 3), (1, 3), (1, 2)], run_type="infer")
    assert same == plan
    also = P.from_layout(fwd=" 4, 3 ,3,2 ", fwd_owners=[0, 0, 1, 1], run_type="infer")
    assert also == plan


def test_fused_backward_counts_deep_to_shallow():
    plan = P.from_layout(fwd="6,5", bwd="1,1,2,3,5", run_type="fused")
    assert plan.bwd_plan == [range(11, 12), range(10, 11), range(8, 10), range(5, 8), range(0, 5)]
    assert plan.fwd_plan == [range(0, 6), range(6, 11)]
    plan.check_valid(12, "fused")
    mirrored = P.from_layout(bwd="1,1,2,3,5", run_type="fused")
    assert mirrored.fwd_plan == [range(0, 5), range(5, 8), range(8, 10), range(10, 11)]
    from_fwd = P.from_layout(fwd=[4, 4], num_layers=10, run_type="fused")
    assert from_fwd.bwd_plan == [range(8, 10), range(4, 8), range(0, 4)]
    whole = P.from_layout(fwd="", bwd="3", run_type="fused")
    assert whole.fwd_plan == [] and whole.bwd_plan == [range(0, 3)]


def test_ranges_and_single_int_forms():
    plan = P.from_layout(fwd=[range(0, 3), range(3, 5)], run_type="train")
    assert plan.bwd_plan == [range(3, 5), range(0, 3)]
    assert P.from_layout(fwd=5, run_type="infer").fwd_plan == [range(0, 5)]


def test_mixed_owners_between_sides():
    plan = P.from_layout(fwd="8,4", bwd="0:4,1:4,0:4", run_type="train", num_devices=2)
    assert plan.fwd_owners is None
    assert plan.bwd_owners == [0, 1, 0]


@pytest.mark.parametrize("run_type", ["infer", "train", "fused"])
def test_round_trip(run_type):
    plans = [
        P.uniform(9, 3, run_type),
        P.from_layout(fwd="0:2,1:3,0:4", bwd="1:1,0:8", num_layers=9, run_type="train"),
    ]
    if run_type == "fused":
        plans.append(P.from_layout(fwd="1,1", bwd="1:7,0:1,1:1", run_type="fused"))
    for plan in plans:
        if run_type == "fused" and plan.fwd_plan and plan.fwd_plan[-1].stop == 9:
            continue  # a train plan is not a fused one
        lay = plan.to_layout()
        again = P.from_layout(**lay, num_layers=9, run_type=run_type)
        if run_type == "infer":
            assert again.fwd_plan == plan.fwd_plan and again.fwd_owners == plan.fwd_owners
        else:
            assert again == plan
        text = plan.to_layout_string()
        assert P.from_layout_string(text, num_layers=9, run_type=run_type).fwd_plan == plan.fwd_plan


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(fwd="7,x", run_type="infer"), r"fwd item 1 \('x'\).*integer"),
        (dict(fwd="7,0", run_type="infer"), r"fwd item 1 \('0'\) has 0 layers"),
        (dict(fwd="7,-2", run_type="infer"), r"fwd item 1 \('-2'\) has -2 layers"),
        (dict(fwd="7,,5", run_type="infer"), r"fwd item 1 \(''\) is empty"),
        (dict(fwd=[7, 2.5], run_type="infer"), r"fwd item 1 \(2.5\).*integer"),
        (dict(fwd=[7, True], run_type="infer"), r"fwd item 1 \(True\).*integer"),
        (dict(fwd="0:4,3", run_type="infer"), r"mixes forms: item 0 \('0:4'\).*item 1 \('3'\)"),
        (dict(fwd=[range(0, 3), 3], run_type="infer"), r"mixes forms"),
        (dict(fwd="1:2:3", run_type="infer"), r"fwd item 0.*more than one ':'"),
        (dict(fwd="a:3", run_type="infer"), r"fwd item 0 \('a:3'\): the device must be an integer"),
        (dict(fwd="-1:3", run_type="infer"), r"fwd item 0 \('-1:3'\) names device -1"),
        (
            dict(fwd="0:4,2:3", num_devices=2, run_type="infer"),
            r"fwd item 1 \('2:3'\) names device 2.*only 2",
        ),
        (
            dict(fwd="7,5", num_layers=13, run_type="train"),
            r"fwd counts add up to 12 \(7\+5\).*13 layers",
        ),
        (
            dict(fwd="3,3", bwd="1,1,1,1", run_type="fused"),
            r"fwd counts add up to 6.*before the fused stage.*3 layers",
        ),
        (
            dict(bwd="4,4", num_layers=9, run_type="train"),
            r"bwd stages cover 8 layers \(4\+4\).*9 layers",
        ),
        (
            dict(fwd="0:4,1:3", fwd_owners=[0, 1], run_type="infer"),
            r"owners for fwd are given twice",
        ),
        (dict(fwd="4,3", fwd_owners=[0], run_type="infer"), r"fwd_owners has 1 entries.*2 stages"),
        (
            dict(fwd="4,3", fwd_owners=[0, 5], num_devices=2, run_type="infer"),
            r"fwd item 1.*names device 5",
        ),
        (dict(bwd="", run_type="fused"), r"bwd layout is empty"),
        (dict(fwd="3", run_type="fused"), r"needs num_layers"),
        (dict(fwd="5", num_layers=5, run_type="fused"), r"at least the last layer"),
        (dict(run_type="train"), r"at least one of fwd= and bwd="),
        (dict(bwd="3,3", run_type="infer"), r"'infer' plan needs fwd="),
        (dict(fwd="3", run_type="bogus"), r"run_type must be one of"),
        (dict(fwd=[range(0, 3), range(4, 6)], run_type="infer"), r"does not cover layer 3"),
        (dict(fwd=[(0, 1, 2)], run_type="infer"), r"fwd item 0.*\(device, count\) pair"),
        (dict(fwd="3", num_layers=0, run_type="infer"), r"num_layers must be an int >= 1"),
    ],
)
def test_bad_layouts_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        P.from_layout(**kwargs)


def test_bad_types():
    with pytest.raises(TypeError, match="fwd layout must be a string"):
        P.from_layout(fwd=3.5, run_type="infer")
    with pytest.raises(TypeError, match="layout string must be a str"):
        P.from_layout_string(7)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fwd=3 fwd=3", "fwd= twice"),
        ("forward=3", "not 'fwd=...'"),
        ("fwd:3", "not 'fwd=...'"),
    ],
)
def test_bad_layout_strings(text, message):
    with pytest.raises(ValueError, match=message):
        P.from_layout_string(text, run_type="infer")


def test_layout_string_separators():
    a = P.from_layout_string("fwd=2,2;bwd=1:1,0:3", run_type="train", num_devices=2)
    assert a.fwd_plan == [range(0, 2), range(2, 4)]
    assert a.bwd_owners == [1, 0]
    assert a.to_layout_string() == "fwd=2,2 bwd=1:1,0:3"


# -- hostile input: named errors, nothing huge built ------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(fwd="7,+-2", run_type="infer"), r"fwd item 1 \('\+-2'\).*digits 0-9"),
        (dict(fwd="7,+2", run_type="infer"), r"fwd item 1 \('\+2'\).*digits 0-9"),
        (dict(fwd="\u00b2", run_type="infer"), r"fwd item 0 \('\u00b2'\).*digits 0-9"),
        (dict(fwd="\u0663", run_type="infer"), r"fwd item 0 \('\u0663'\).*digits 0-9"),
        (dict(fwd="\u0663:2", run_type="infer"), r"fwd item 0 .*the device.*digits 0-9"),
        (dict(fwd="01:2,1:2", run_type="infer"), r"fwd item 0 \('01:2'\): the device.*1 without"),
        (dict(fwd="2,07", run_type="infer"), r"fwd item 1 \('07'\).*7 without leading zeros"),
        (
            dict(fwd="4,3", fwd_owners=["01", 1], run_type="infer"),
            r"fwd_owners\[0\] must be an int",
        ),
        (dict(fwd="4,3", fwd_owners=[0, 1.0], run_type="infer"), r"fwd_owners\[1\] must be an int"),
        (dict(fwd="4,3", fwd_owners="01", run_type="infer"), r"fwd_owners must be a list"),
        (dict(fwd="4", num_devices=-1, run_type="infer"), r"num_devices must be an int >= 1.*-1"),
        (dict(fwd="0:4", num_devices=0, run_type="infer"), r"num_devices must be an int >= 1"),
        (
            dict(fwd="10000000", num_layers=12, run_type="train"),
            r"fwd counts add up to 10000000.*12 layers",
        ),
    ],
)
def test_hostile_layout_items_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        P.from_layout(**kwargs)


def test_check_valid_rejects_negative_pool():
    with pytest.raises(ValueError, match=r"num_devices must be an int >= 1.*-1"):
        P.uniform(4, 2, "fused").check_valid(4, "fused", num_devices=-1)


def test_huge_counts_build_nothing_per_layer():
    """A layout claiming a million layers is checked from its stage ends, not layer by layer."""
    import tracemalloc

    tracemalloc.start()
    try:
        plan = P.from_layout(fwd="1000000", run_type="infer")
        P([range(0, 10**6)], [range(0, 10**6)]).check_valid(10**6, "train")
        with pytest.raises(ValueError, match="does not cover layer 999999"):
            P([range(0, 10**6 - 1)], []).check_valid(10**6, "infer")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert plan.fwd_plan == [range(0, 10**6)]
    assert peak < 1_000_000, f"validating one stage allocated {peak} bytes"


def test_parse_layout_is_public_and_round_trips_with_format_layout():
    from roundpipe_core.planning.layout import format_layout, parse_layout

    owned = parse_layout(" 0:4, 1:3 ", "fwd")
    assert (owned.counts, owned.owners, owned.items) == ([4, 3], [0, 1], ["0:4", "1:3"])
    assert owned.describe() == "4+3" and owned.num_layers_covered() == 7
    assert format_layout([range(0, 4), range(4, 7)], owned.owners) == "0:4,1:3"
    plain = parse_layout([7, 5])
    assert plain.owners is None and format_layout([range(0, 7), range(7, 12)], None) == "7,5"
    ranges = parse_layout([range(0, 3), range(3, 5)])
    assert ranges.counts is None and ranges.num_layers_covered() == 5
    with pytest.raises(ValueError, match=r"layout item 0 \(range\(3, 3\)\).*non-empty"):
        parse_layout([range(3, 3)])
