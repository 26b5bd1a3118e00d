"""The planner's memory model: tied parameters, saved activations, refusing plans that
cannot fit, and the simulator's per-device memory report."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from roundpipe_core import ModelExecutePlan
from roundpipe_core.planning.planner import auto
from roundpipe_core.planning.profile import (
    LayerProfile,
    check_plan_fits,
    layer_sizes,
    measure_activation_bytes,
    profile_of,
    scale_activation_bytes,
    stage_memory,
)
from roundpipe_core.planning.simulate import simulate

pytest.importorskip("transformers")

from roundpipe_core.presets import convert_to_sequential, wrap_model_to_roundpipe  # noqa: E402
from tests.presets.hf_tiny import make_model  # noqa: E402

# -- tied parameters ----------------------------------------------------------------------


class _Head(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.proj = nn.Linear(emb.embedding_dim, emb.num_embeddings, bias=False)
        self.proj.weight = emb.weight  # tied, as in small LMs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_tied_weight_is_uploaded_by_both_layers():
    emb = nn.Embedding(1000, 16)
    seq = nn.Sequential(emb, nn.Linear(16, 16), _Head(emb))
    sizes = layer_sizes(seq)
    table = 1000 * 16 * 4
    assert sizes.upload_bytes == [table, (16 * 16 + 16) * 4, table]
    # A lookup reads a few rows; the head multiplies by the whole matrix.
    assert sizes.compute_bytes == [0, (16 * 16 + 16) * 4, table]


def test_cheap_tied_embedding_gets_no_backward_stage_of_its_own():
    """Qwen3-0.6B's shape in miniature: a tied table ten times a decoder layer."""
    model = make_model("qwen3", vocab_size=2904, num_hidden_layers=28)
    rp = wrap_model_to_roundpipe(model, devices=3)
    try:
        prof = profile_of(rp)
        assert prof.fwd_ms[0] < min(prof.fwd_ms[1:-1])  # the lookup is the cheapest layer
        assert prof.fwd_ms[-1] > 5 * max(prof.fwd_ms[1:-1])  # the head is not
        assert prof.param_bytes is not None and prof.param_bytes[0] > 5 * prof.param_bytes[1]
        for run_type in ("fused", "train"):
            plan = ModelExecutePlan.auto(run_type, rp)
            assert range(0, 1) not in plan.bwd_plan, (run_type, plan)
    finally:
        rp.close()


# -- saved activations --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_activation_estimate_within_15_percent_of_measured(kind):
    seq = convert_to_sequential(make_model(kind))
    gen = torch.Generator().manual_seed(0)
    small = measure_activation_bytes(seq, torch.randint(0, 97, (1, 8), generator=gen))
    estimate = scale_activation_bytes(small, measured_tokens=8, tokens=4 * 64)
    measured = measure_activation_bytes(seq, torch.randint(0, 97, (4, 64), generator=gen))
    assert len(measured) == len(seq)
    for i, (est, got) in enumerate(zip(estimate, measured)):
        assert got > 0
        assert abs(est - got) <= 0.15 * got, f"layer {i}: estimate {est:.0f}, measured {got}"


def test_activation_bytes_match_a_hand_count():
    """Linear saves its input; GELU saves its input; parameters are not activations."""
    seq = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(5, 8)
    got = measure_activation_bytes(seq, x)
    assert got == [5 * 8 * 4, 5 * 32 * 4, 5 * 32 * 4]


class _KeepOutput(nn.Module):
    """A layer whose autograd saves its own output (sigmoid does), and that lets a test
    see whether that output outlives the measurement."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[weakref.ref] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(x)
        self.outputs.append(weakref.ref(y))
        return y


def test_activation_measurement_leaves_no_graph_alive():
    """A pack hook that saves the tensor itself makes a node that saves its output hold
    that output (and with it the whole measured graph) from C++: a cycle the collector
    cannot free, which kept a forward's activations for the life of the process."""
    keep = _KeepOutput()
    seq = nn.Sequential(nn.Linear(8, 16), keep, nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    assert measure_activation_bytes(seq, x)[1] == 5 * 16 * 4
    gc.collect()
    assert [ref() is None for ref in keep.outputs] == [True]


def _profile(act: float) -> LayerProfile:
    return LayerProfile(
        fwd_ms=[1.0] * 4,
        bwd_ms=[2.0] * 4,
        param_bytes=[1 << 20] * 4,
        grad_bytes=[1 << 20] * 4,
        act_bytes=[act] * 4,
    )


def test_auto_keeps_activations_under_the_memory_cap():
    gb = 1024**3
    limit = 16 * (1 << 20) / gb  # 16 MiB: 8 MiB per stage
    lean = auto("fused", _profile(0.0), min_stages=1, model_memory_limit=limit)
    assert lean.bwd_plan == [range(0, 4)]  # 4 x (1 + 1) MiB fits one stage
    heavy = auto("fused", _profile(3 * (1 << 20)), min_stages=1, model_memory_limit=limit)
    # 5 MiB per layer with its activations: one layer per backward stage.
    assert all(len(r) == 1 for r in heavy.bwd_plan), heavy
    for s in stage_memory(heavy, _profile(3 * (1 << 20)), "fused"):
        assert s.total_bytes <= limit * gb / 2


def test_check_plan_fits_names_the_stage_and_the_bytes():
    prof = _profile(3 * (1 << 20))
    plan = ModelExecutePlan.from_layout(fwd="2", bwd="2,2", run_type="fused")
    check_plan_fits(plan, prof, "fused", capacity_bytes=64 * (1 << 20))
    # 2 x (1 + 1 + 3) MiB, a layer's gradient being accumulated, the prefetch of 2 layers
    with pytest.raises(ValueError, match=r"fused stage 0 \(layers 2\.\.3\) needs 13 MiB") as err:
        check_plan_fits(plan, prof, "fused", capacity_bytes=12 * (1 << 20))
    assert "activations of one microbatch 6 MiB" in str(err.value)
    assert "one being accumulated 1 MiB" in str(err.value)
    assert "the device has 12 MiB" in str(err.value)
    with pytest.raises(ValueError, match="capacity_bytes must be > 0"):
        check_plan_fits(plan, prof, "fused", capacity_bytes=0)


def test_simulator_reports_peak_memory_per_device():
    prof = _profile(3.0)
    plan = ModelExecutePlan.from_layout(fwd="1,1", bwd="2,1,1", run_type="fused")
    mib = 1 << 20
    res = simulate(
        plan,
        prof.fwd_ms,
        prof.bwd_ms,
        num_devices=2,
        num_microbatch=2,
        param_bytes=[mib] * 4,
        grad_bytes=[mib] * 4,
        act_bytes=[3 * mib] * 4,
    )
    # Jobs: 0F0 1F1 0X0 1B1 2B0. Device 0 runs F(layer 0) then X(layers 2-3) then B(layer 0):
    # the fused stage holds 2 x (1 + 1 + 3) MiB while layer 0's parameters are prefetched.
    # Device 1's backward stage of layer 1 holds 1 + 1 + 3 MiB and nothing comes after it.
    assert [str(j) for j in res.jobs] == ["0F0", "1F1", "0X0", "1B1", "2B0"]
    assert res.peak_bytes == [11 * mib, 5 * mib]
    assert simulate(plan, prof.fwd_ms, prof.bwd_ms, 2, 2).peak_bytes == []


def test_auto_reads_activation_bytes_a_model_records():
    """A RoundPipe model (or its timer) that records saved-activation bytes per layer
    gets them counted in auto()'s per-stage memory cap."""
    from roundpipe_core import RoundPipe

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    rp = RoundPipe(model, devices="cpu:2")
    # workers that copy, as a device with its own memory does (CPU workers lend the host's
    # parameters, and the cap differs: see test_lent_parameters_cost_a_cpu_stage_nothing)
    for w in rp.pool.workers:
        w.lends_host_tensors = False
    try:
        assert not rp.uploads_lend_parameters
        layer = (64 * 64 + 64) * 4
        limit_gb = 2 * 6 * 2 * layer / 1024**3  # every layer's params + grads fit one stage
        assert profile_of(rp).act_bytes is None
        rp.layer_activation_bytes = [5 * layer] * 6
        assert profile_of(rp).act_bytes == [5 * layer] * 6
        heavy = ModelExecutePlan.auto("train", rp, model_memory_limit=limit_gb, min_stages=1)
        # 1 + 1 + 5 layers' worth per layer: two layers no longer fit half the limit.
        half = limit_gb * 1024**3 / 2
        assert [len(r) for r in heavy.bwd_plan] == [1] * 6
        for s in stage_memory(heavy, profile_of(rp), "train"):
            assert s.total_bytes <= half, (s, heavy)
    finally:
        rp.close()


@pytest.mark.cpu_backend  # about CPU workers themselves: under fake CUDA they stay CPU workers
def test_lent_parameters_cost_a_cpu_stage_nothing():
    """CPU workers compute on the host's parameters (no copy, nothing to prefetch): the
    planner counts only gradients and activations per stage, under the whole limit.
    Workers that copy (a device with memory of its own) count parameters too, and the
    prefetched next stage's."""
    from roundpipe_core import RoundPipe

    torch.manual_seed(0)
    layer = (64 * 64 + 64) * 4
    # gradients + activations of all six layers: 6 x (1 + 1) layers' worth; with the
    # parameters and the prefetch half it would take 4x that
    limit_gb = 6 * 2 * layer * 1.01 / 1024**3
    plans = {}
    for lends in (True, False):
        rp = RoundPipe(nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]), devices="cpu:2")
        for w in rp.pool.workers:
            w.lends_host_tensors = lends
        try:
            assert rp.uploads_lend_parameters is lends
            rp.layer_activation_bytes = [layer] * 6
            prof = profile_of(rp)
            assert list(prof.param_bytes) == ([0] * 6 if lends else [layer] * 6)
            assert list(prof.grad_bytes) == [layer] * 6  # gradients are real memory
            plans[lends] = ModelExecutePlan.auto("fused", rp, model_memory_limit=limit_gb)
        finally:
            rp.close()
    assert plans[True].bwd_plan == [range(0, 6)], plans[True]  # one fused stage
    assert len(plans[False].bwd_plan) > 2, plans[False]
