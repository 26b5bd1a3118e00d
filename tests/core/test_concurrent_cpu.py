"""CPU workers computing at the same time (``ROUNDPIPE_CPU_CONCURRENT=1``): stages seen
not to draw random numbers overlap, each with its share of the intra-op threads; stages
that draw run alone, so their masks are seeded and replayed exactly; a stage that draws
where it did not before fails loudly, and the next call is exact again."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from _util import assert_close_rel, assert_grads_match, sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, context
from roundpipe_core.context import current_layer, current_microbatch, doing_recompute
from roundpipe_core.planning.planner import _split_or_fewest, split_plan
from roundpipe_core.planning.profile import LayerProfile
from roundpipe_core.planning.simulate import simulated_iteration_ms
from roundpipe_core.running.devices.cpu import ComputeGate, UnexpectedDrawError
from roundpipe_core.running.devices.pool import DevicePool

# The probing layers write shared dicts on purpose; the forward-rule checker rightly warns.
# About CPU workers themselves: under ROUNDPIPE_TEST_DEVICE=fake-cuda they stay CPU workers.
pytestmark = [
    pytest.mark.filterwarnings("ignore:RoundPipe forward rule violated"),
    pytest.mark.cpu_backend,
]


def cpu_ms(plan, prof, n, m, replicated=False):
    """The planner's estimate of a "fused" call on CPU workers that share the cores."""
    return simulated_iteration_ms(
        plan, prof, "fused", n, m, shared_cores=True, replicated=replicated
    )


# fwd [0, 2) on worker 0, fused [2, 4) on worker 1, backward [0, 2) (recomputed) on worker 0
SPLIT = ModelExecutePlan([range(0, 2)], [range(2, 4), range(0, 2)])
# fwd [0, 1) on worker 0, fwd [1, 2) on worker 1, fused [2, 4) on worker 0, backward [0, 2)
# on worker 1: layer 0 is recomputed on another worker than its forward's
CROSS = ModelExecutePlan([range(0, 1), range(1, 2)], [range(2, 4), range(0, 2)])


@pytest.fixture
def concurrent_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", "1")


class _Probe(nn.Module):
    """A linear layer that notes how many layers compute at once and with how many
    intra-op threads; with ``draw`` it draws a dropout mask in two halves with a pause
    between (another worker seeding the shared generator in that pause would change the
    second half), logged per (layer, microbatch) and kind, or replayed from ``replay``."""

    def __init__(self, width: int, probe: dict, draw: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.probe, self.draw = probe, draw

    def __deepcopy__(self, memo):  # replicas share the probe
        new = _Probe.__new__(_Probe)
        nn.Module.__init__(new)
        new.lin = copy.deepcopy(self.lin, memo)
        new.probe, new.draw, new.training = self.probe, self.draw, self.training
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.probe
        with p["lock"]:
            p["now"] += 1
            p["peak"] = max(p["peak"], p["now"])
        if current_layer() is not None:  # (a stage; not the first call's measurement)
            p["threads"].append(torch.get_num_threads())
        time.sleep(0.004)
        with p["lock"]:
            p["now"] -= 1
        x = torch.tanh(self.lin(x))
        if not (self.draw and self.training):
            return x
        key = (current_layer(), current_microbatch())
        if "replay" in p:
            return x * p["replay"][key]
        first = torch.rand_like(x[: len(x) // 2])
        time.sleep(0.003)
        second = torch.rand_like(x[len(x) // 2 :])
        mask = (torch.cat([first, second]) >= 0.3).to(x.dtype) / 0.7
        if current_layer() is not None:  # not the first call's activation measurement
            kind = "recompute" if doing_recompute() else "forward"
            p.setdefault(kind, {}).setdefault(key, []).append(mask)
        return x * mask


def _new_probe() -> dict:
    return {"lock": threading.Lock(), "now": 0, "peak": 0, "threads": []}


def _model(probe: dict, draws: tuple[bool, ...] = (False,) * 4) -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(*[_Probe(6, probe, d) for d in draws])


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)


def _call(
    rp: RoundPipe, x: torch.Tensor, y: torch.Tensor, plan: ModelExecutePlan = SPLIT
) -> torch.Tensor:
    for p in rp.optim_parameters():
        p.grad = None
    cfg = RoundPipeRunConfig(num_microbatch=4, execute_plan=plan)
    return rp.forward_backward((x,), label=y, loss_fn=sum_sq, run_config=cfg)


def _reference(model: nn.Module, probe: dict, x, y) -> tuple[torch.Tensor, dict]:
    """Plain PyTorch, microbatch by microbatch, on the masks the forward drew."""
    ref = copy.deepcopy(model)
    replay = {k: v[0] for k, v in probe.get("forward", {}).items()}
    ref_probe = {**_new_probe(), "replay": replay}
    for mod in ref.modules():
        if isinstance(mod, _Probe):
            mod.probe = ref_probe
    total = torch.zeros(())
    for mb, (xm, ym) in enumerate(zip(x.chunk(4), y.chunk(4))):
        h = xm
        for i, layer in enumerate(ref):
            with context.running_layer(i, mb, False, None, torch.device("cpu")):
                h = layer(h)
        part = sum_sq(h, ym)
        part.backward()
        total += part.detach()
    return total, {n: p.grad for n, p in ref.named_parameters()}


def test_the_switch_is_read_when_the_pool_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, sharing in (("", "waited"), ("0", "never"), ("1", "always")):
        monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", value)
        pool = DevicePool("cpu:2")
        try:
            assert pool.cpu_sharing == sharing and pool.cpu_overlap is (sharing != "never")
            assert pool.concurrent is False  # the step and masters stay those of a CPU pool
        finally:
            pool.close()
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", "1")
    one = DevicePool("cpu:1")
    try:
        assert one.cpu_overlap is False  # nothing to overlap with
    finally:
        one.close()
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", "yes")
    with pytest.raises(ValueError, match="ROUNDPIPE_CPU_CONCURRENT='yes' must be 1"):
        DevicePool("cpu:2")


def _overlap_run(
    draws: tuple[bool, ...], plan: ModelExecutePlan = SPLIT
) -> tuple[dict, list[torch.Tensor]]:
    probe = _new_probe()
    model = _model(probe, draws)
    x, y = _data()
    rp = RoundPipe(copy.deepcopy(model), devices="cpu:2")
    losses = []
    try:
        for _ in range(3):
            probe.pop("forward", None)
            probe.pop("recompute", None)
            probe["peak"] = 0
            loss = _call(rp, x, y, plan)
            losses.append(loss)
            ref_loss, ref_grads = _reference(model, probe, x, y)
            assert_close_rel(loss, ref_loss, what="loss")
            assert_grads_match(rp, ref_grads)
    finally:
        rp.close()
    return probe, losses


@pytest.mark.usefixtures("concurrent_env")
def test_stages_that_draw_nothing_compute_side_by_side_and_exactly() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        probe, _ = _overlap_run((False,) * 4)
        assert probe["peak"] == 2, "the forward and the fused stage never computed at once"
        # beside another stage each worker had half of the caller's 2 threads
        assert 1 in probe["threads"]
        assert torch.get_num_threads() == 2  # the caller's own count is what it set
        seen: list[int] = []
        fresh = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        fresh.start()
        fresh.join()
        assert seen == [2], "a thread started after the call inherits a worker's share"
    finally:
        torch.set_num_threads(before)


def test_with_the_switch_off_stages_compute_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", "0")
    probe, _ = _overlap_run((False,) * 4)
    assert probe["peak"] == 1


@pytest.mark.usefixtures("concurrent_env")
@pytest.mark.parametrize(
    ("plan", "draws", "recomputed", "peak"),
    [
        # layer 1 (recomputed on its forward's worker) and layer 2 (fused stage) draw:
        # every stage holds a drawing layer, so none overlapped
        (SPLIT, (False, True, True, False), 1, 1),
        # layer 0 draws and is recomputed on the other worker; the stages of layers 1
        # and 2..3 draw nothing and overlap each other
        (CROSS, (True, False, False, False), 0, 2),
    ],
    ids=["same-worker", "other-worker"],
)
def test_stages_that_draw_run_alone_and_their_recompute_replays_every_mask(
    plan: ModelExecutePlan, draws: tuple[bool, ...], recomputed: int, peak: int
) -> None:
    probe, _ = _overlap_run(draws, plan)
    rec, fwd = probe["recompute"], probe["forward"]
    assert set(rec) == {(recomputed, mb) for mb in range(4)}
    for key, masks in rec.items():
        assert all(torch.equal(m, fwd[key][0]) for m in masks), f"{key} drew a new mask"
    assert probe["peak"] == peak


@pytest.mark.usefixtures("concurrent_env")
def test_a_stage_that_starts_drawing_fails_loudly_and_the_next_call_is_exact() -> None:
    probe = _new_probe()
    model = _model(probe)
    x, y = _data()
    rp = RoundPipe(copy.deepcopy(model), devices="cpu:2")
    try:
        _call(rp, x, y)
        _call(rp, x, y)  # every stage now seen not to draw: they compute side by side
        for mod in list(model.modules()) + list(rp.model.modules()):
            if isinstance(mod, _Probe) and mod is not model[0]:
                mod.draw = mod is model[2] or mod is rp.model[2]
        with pytest.raises(UnexpectedDrawError, match="CPU random generator moved while"):
            _call(rp, x, y)
        probe.pop("forward", None)
        probe.pop("recompute", None)
        loss = _call(rp, x, y)
        ref_loss, ref_grads = _reference(model, probe, x, y)
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref_grads)
    finally:
        rp.close()


def test_the_gate_lets_shared_holders_overlap_and_an_exclusive_one_run_alone() -> None:
    gate = ComputeGate()
    events: list[str] = []
    gate.enter(False)
    assert gate.enter(True) == (False, True)  # nested: the outer mode holds
    gate.exit()
    other = threading.Thread(target=lambda: (gate.enter(False), events.append("s"), gate.exit()))
    other.start()
    other.join(5)
    assert events == ["s"]  # two shared holders at once

    def exclusive() -> None:
        gate.enter(True)
        events.append("x")
        gate.exit()

    waiter = threading.Thread(target=exclusive)
    waiter.start()
    time.sleep(0.05)
    assert events == ["s"]  # waits for the shared holder
    late = threading.Thread(target=lambda: (gate.enter(False), events.append("late"), gate.exit()))
    late.start()
    time.sleep(0.05)
    assert events == ["s"]  # a shared request waits behind the waiting exclusive one
    gate.exit()
    waiter.join(5)
    late.join(5)
    assert events == ["s", "x", "late"]


# -- the planner's device model for such a pool -------------------------------------------
def _uniform(n: int = 16) -> LayerProfile:
    return LayerProfile(fwd_ms=[1.0] * n, bwd_ms=[2.0] * n)


ONE_STAGE = ModelExecutePlan([], [range(0, 16)])


def test_overlapping_workers_split_the_model_only_where_it_pays() -> None:
    prof = _uniform()
    # 4 microbatches: the fill, the drain and the recompute cost more than the overlap gives
    assert _split_or_fewest(ONE_STAGE, prof, 4) == ONE_STAGE
    # 16: the overlap wins; the same plan for the same timings, every time
    split = _split_or_fewest(ONE_STAGE, prof, 16)
    assert split.fwd_plan and split == _split_or_fewest(ONE_STAGE, prof, 16)
    assert cpu_ms(split, prof, 2, 16) < cpu_ms(ONE_STAGE, prof, 2, 16)
    # a stage alone is charged its own time, stages side by side SHARED_CORES_SLOWDOWN more
    assert cpu_ms(ONE_STAGE, prof, 2, 16) == pytest.approx(16 * 48.0)
    # memory forced several stages: they stay as memory allows
    forced = ModelExecutePlan([], [range(8, 16), range(0, 8)])
    assert _split_or_fewest(forced, prof, 16) == forced


def _uniform_rp(buffer: bool = False) -> RoundPipe:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(16)])
    if buffer:  # a layer with a buffer: its one stage cannot be replicated
        model[3].register_buffer("unused", torch.zeros(1), persistent=False)
    return RoundPipe(model, devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=16))


def test_the_default_plan_overlaps_only_on_a_concurrent_pool_of_stages_that_do_not_draw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", "0")
    serial = _uniform_rp()
    try:
        assert serial.plan_for("fused") == ONE_STAGE
    finally:
        serial.close()
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", "1")
    # the one stage as one job per worker at once beats every split plan
    replicable = _uniform_rp()
    try:
        assert replicable.plan_for("fused") == ONE_STAGE
    finally:
        replicable.close()
    rp = _uniform_rp(buffer=True)
    try:
        plan = rp.plan_for("fused")
        assert plan.fwd_plan and plan == split_plan(16, plan.fwd_plan[0].stop)
        # once a stage was seen to draw, overlap would only add recompute: one stage again
        rp.pool.stages_draw = lambda layers: True  # type: ignore[method-assign]
        assert ModelExecutePlan.auto("fused", rp, num_microbatch=16) == ONE_STAGE
    finally:
        rp.close()


class _OtherThreadDraws(nn.Module):
    """A linear layer whose forward, once ``armed``, has another thread (not the pool's)
    draw from torch's CPU generator, and waits until it did: what a shuffling sampler on
    the main thread does during an overlapped call."""

    def __init__(self, width: int, armed: dict) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.armed = armed

    def __deepcopy__(self, memo):
        new = _OtherThreadDraws.__new__(_OtherThreadDraws)
        nn.Module.__init__(new)
        new.lin = copy.deepcopy(self.lin, memo)
        new.armed, new.training = self.armed, self.training
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed["on"] and current_layer() is not None:
            drawer = threading.Thread(target=torch.rand, args=(3,))
            drawer.start()
            drawer.join()
        return torch.tanh(self.lin(x))


@pytest.mark.usefixtures("concurrent_env")
@pytest.mark.parametrize(
    ("plan", "overlap"),
    [(ModelExecutePlan([], [range(0, 4)]), False), (ModelExecutePlan([], [range(0, 4)]), True)]
    + [(SPLIT, True)],
    ids=["one-alone", "one-replicated", "split"],
)
def test_another_thread_drawing_stops_only_a_call_whose_stages_overlap(
    plan: ModelExecutePlan, overlap: bool
) -> None:
    armed = {"on": False}
    torch.manual_seed(3)
    model = nn.Sequential(*[_OtherThreadDraws(6, armed) for _ in range(4)])
    if not overlap:
        # a buffer (unused) keeps the one stage one job (test_replicated_stage.py): alone
        model[1].lin.register_buffer("unused", torch.zeros(1), persistent=False)
    x, y = _data()
    rp = RoundPipe(copy.deepcopy(model), devices="cpu:2")
    try:
        _call(rp, x, y, plan)
        _call(rp, x, y, plan)  # every stage seen not to draw
        assert (len(rp.last_call.schedule) > 1) is overlap
        armed["on"] = True
        if overlap:  # stages side by side: the draw is seen and stops the call
            with pytest.raises(UnexpectedDrawError):
                _call(rp, x, y, plan)
            return
        # one job: it computes alone, seeded, and gives the generator back as always
        loss = _call(rp, x, y, plan)
        armed["on"] = False
        ref_loss, ref_grads = _reference(model, {}, x, y)
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref_grads)
    finally:
        rp.close()


def test_what_the_gate_learned_travels_to_a_fresh_one_and_bad_rows_change_nothing() -> None:
    """``learned`` / ``relearn``: a checkpoint's rows make a fresh gate (a resumed process)
    share or isolate exactly the stages the saving one did; rows of another model fail
    before anything changes."""
    layers = [nn.Linear(2, 2) for _ in range(4)]
    gate = ComputeGate()
    gate.record(layers[0], ("forward", 0, 2, True), False)
    gate.record(layers[0], ("forward", 0, 2, True), False)
    gate.record(layers[2], ("fused", 2, 4, True), True)
    gate.record(layers[2], ("fused", 2, 4, False), False)
    rows = gate.learned(layers)
    assert rows == [
        ["forward", 0, 2, True, 2],
        ["fused", 2, 4, False, 1],
        ["fused", 2, 4, True, -1],
    ]
    fresh = ComputeGate()
    fresh.record(layers[1], ("backward", 1, 2, True), True)  # learned since: replaced
    fresh.relearn(layers, rows)
    assert fresh.learned(layers) == rows
    assert fresh.runs_without_draw(layers[0], ("forward", 0, 2, True)) == 2
    assert fresh.draws_seen(layers[2:3]) and not fresh.draws_seen(layers[:2])
    for bad in (
        [["forward", 0, 5, True, 2]],  # past the model's 4 layers
        [["forward", 0, 2, 1, 2]],  # train mode not a bool
        [["forward", 0, 2, True, -2]],
        [["forward", 0, 2, True]],
        "rows",
    ):
        with pytest.raises(ValueError, match="learned stage draws: row"):
            fresh.relearn(layers, bad)
        assert fresh.learned(layers) == rows


def test_the_pool_hands_a_models_learned_draws_to_a_new_model_of_the_same_layers(
    concurrent_env: None,
) -> None:
    """``pool.learned_draws`` / ``restore_draws``: a model that learned its stages' draws
    (two calls), and a fresh copy of it given those rows, compute alike: the copy shares
    the cores, on half of the caller's threads, from its first microbatch on (re-learning,
    its first microbatches of each stage would run alone on both threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _learned_draws_restored()
    finally:
        torch.set_num_threads(before)


def _learned_draws_restored() -> None:
    probe = _new_probe()
    model = _model(probe)
    x, y = _data()
    rp = RoundPipe(model, devices="cpu:2")
    try:
        _call(rp, x, y)
        _call(rp, x, y)
        rows = rp.pool.learned_draws(rp.layers)
        assert rows and all(runs >= 2 for *_, runs in rows)
        assert 2 in probe["threads"]  # (its first microbatches ran alone)
    finally:
        rp.close()
    probe2 = _new_probe()
    twin = RoundPipe(_model(probe2), devices="cpu:2")
    try:
        assert twin.pool.learned_draws(twin.layers) == []
        twin.pool.restore_draws(twin.layers, rows)
        _call(twin, x, y)
        assert probe2["peak"] == 2 and set(probe2["threads"]) == {1}, probe2["threads"]
    finally:
        twin.close()


def test_by_default_only_a_stages_replicas_in_a_blocking_call_share_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ROUNDPIPE_CPU_CONCURRENT`` unset: the one-stage plan's replicas (one job per
    worker) compute side by side in a blocking call once seen not to draw; the stages of
    a split plan compute one at a time (each waits for the other's activations: on half
    of the threads each would leave half idle); a non-blocking call's replicas compute
    one at a time, so the caller's own draws meanwhile (every ``DataLoader`` iterator
    draws its base seed) stop nothing and take nothing from the stages' streams."""
    monkeypatch.delenv("ROUNDPIPE_CPU_CONCURRENT", raising=False)
    probe, _ = _overlap_run((False,) * 4)  # three blocking calls of the split plan
    assert probe["peak"] == 1
    probe = _new_probe()
    model = _model(probe)
    x, y = _data()
    one = ModelExecutePlan([], [range(0, 4)])
    rp = RoundPipe(copy.deepcopy(model), devices="cpu:2")
    try:
        for _ in range(3):
            _call(rp, x, y, one)  # learned: the stage draws nothing
        assert len(rp.last_call.schedule) == 2 and probe["peak"] == 2  # its replicas at once
        probe["peak"] = 0
        for p in rp.optim_parameters():
            p.grad = None
        cfg = RoundPipeRunConfig(num_microbatch=4, execute_plan=one)
        pending = rp.forward_backward((x,), label=y, loss_fn=sum_sq, run_config=cfg, blocking=False)
        drawn = [torch.rand(3) for _ in range(20)]  # the caller goes on, and draws
        loss = pending.result()
        assert drawn and len(rp.last_call.schedule) == 2 and probe["peak"] == 1
        ref_loss, ref_grads = _reference(model, probe, x, y)
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref_grads)
    finally:
        rp.close()
