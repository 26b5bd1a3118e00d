"""Split / merge specs, the published RoundPipe's split_input contract, packed data,
and the gradient adjoints of splitting and merging (checked against plain autograd)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate

from roundpipe_core.batch import (
    Reducer,
    Replicate,
    RoundPipePackedData,
    avg_reducer,
    check_run_specs,
    flatten,
    merge_outputs,
    merge_outputs_with_grad,
    split_call_inputs,
    split_call_labels,
    sum_reducer,
)
from roundpipe_core.batch import TensorChunkSpec as OurChunk

pytestmark = pytest.mark.host_only


# --------------------------------------------------------------------------- merge rule
@pytest.mark.parametrize("n", [2, 3, 4])
def test_default_merge_averages_scalars_over_microbatches(n):
    out = merge_outputs(None, [torch.tensor(233)] * n)
    assert out.item() == 233  # the published RoundPipe's rule; a sum would give 233 * n
    out = merge_outputs(True, [torch.tensor(float(i)) for i in range(n)])
    assert out.item() == pytest.approx(sum(range(n)) / n)


def test_default_merge_concatenates_and_checks_non_tensors_are_equal():
    outs = [{"h": torch.ones(2, 3), "tag": "x"}, {"h": torch.zeros(1, 3), "tag": "x"}]
    m = merge_outputs(None, outs)
    assert m["h"].shape == (3, 3) and m["tag"] == "x"
    with pytest.raises(ValueError, match="differs between microbatches"):
        merge_outputs(None, [{"tag": "a"}, {"tag": "b"}])


def test_merge_specs_cat_dim_replicate_and_reducers():
    outs = [
        (torch.ones(2, 1), torch.tensor([7.0]), torch.tensor(1.0), torch.tensor(2.0), 5),
        (torch.zeros(2, 2), torch.tensor([7.0]), torch.tensor(3.0), torch.tensor(4.0), 5),
    ]
    prod = _CustomReducer(torch.tensor(1.0), lambda a, b: a * b)
    spec = (TensorChunkSpec(1), _Replicate, avg_reducer, sum_reducer, Replicate())
    h, r, avg, total, k = merge_outputs(spec, outs)
    assert h.shape == (2, 3) and torch.equal(r, torch.tensor([7.0])) and k == 5
    assert avg.item() == 2.0 and total.item() == 6.0
    assert merge_outputs((TensorChunkSpec(1), None, prod, prod, None), outs)[2].item() == 3.0
    with pytest.raises(ValueError, match="differs"):
        merge_outputs((TensorChunkSpec(1), None, None, _Replicate, None), outs)
    with pytest.raises(ValueError, match="2 entries but the value has 5"):
        merge_outputs((None, None), outs)


def test_merge_function_and_false():
    outs = [torch.ones(2), torch.zeros(3)]
    assert merge_outputs(lambda xs: len(xs), outs) == 2
    packed = merge_outputs(False, [(torch.ones(2), "a"), (torch.zeros(3), "a")])
    assert isinstance(packed, tuple) and all(isinstance(p, RoundPipePackedData) for p in packed)
    assert [t.shape[0] for t in packed[0]] == [2, 3] and list(packed[1]) == ["a", "a"]
    packed[0].synchronize()  # nothing in flight on CPU: returns at once


# --------------------------------------------------------------------------- split_input forms
def _upstream_split(args, kwargs, n):
    (x,) = args
    return [(c,) for c in x.chunk(n)], [dict(kwargs) for _ in range(n)]


def _pairs_split(args, kwargs, n):
    (x,) = args
    return [((c,), dict(kwargs)) for c in x.chunk(n)]


def test_split_function_accepts_both_forms_alike():
    x = torch.arange(12.0).reshape(6, 2)
    a = split_call_inputs(_upstream_split, (x,), {"k": 1}, 3).parts
    b = split_call_inputs(_pairs_split, (x,), {"k": 1}, 3).parts
    assert len(a) == len(b) == 3
    for (aa, ak), (ba, bk) in zip(a, b):
        assert torch.equal(aa[0], ba[0]) and ak == bk == {"k": 1}


@pytest.mark.parametrize(
    "fn, err, msg",
    [
        (lambda a, k, n: 3, TypeError, "returned int"),
        (lambda a, k, n: ([(1,)], [{}, {}]), ValueError, "1 args but 2 kwargs"),
        (lambda a, k, n: [((1,), {}), (1, 2)], TypeError, "microbatch 1"),
        (lambda a, k, n: [], ValueError, "no microbatches"),
        (lambda a, k, n: [(1, {})], TypeError, "not a tuple"),
    ],
)
def test_split_function_bad_results_are_named(fn, err, msg):
    with pytest.raises(err, match=msg):
        split_call_inputs(fn, (torch.ones(4),), {}, 2)


def test_split_input_rejects_non_spec_values():
    with pytest.raises(TypeError, match="split_input must be"):
        split_call_inputs(5, (torch.ones(4),), {}, 2)
    with pytest.raises(ValueError, match="num_microbatch"):
        split_call_inputs(None, (torch.ones(4),), {}, 0)


# --------------------------------------------------------------------------- split specs
def test_split_specs_chunk_dim_replicate_and_partial_kwargs():
    x = torch.arange(24.0).reshape(2, 12)
    w = torch.ones(3, 5)
    s = split_call_inputs(
        ((TensorChunkSpec(1), _Replicate), {"m": TensorChunkSpec(0)}),
        (x, w),
        {"m": torch.arange(6), "y": torch.arange(6)},
        3,
    )
    assert len(s.parts) == 3
    for i, (args, kwargs) in enumerate(s.parts):
        assert torch.equal(args[0], x[:, 4 * i : 4 * i + 4]) and args[1] is w
        assert torch.equal(kwargs["m"], torch.arange(6)[2 * i : 2 * i + 2])
        assert torch.equal(kwargs["y"], torch.arange(6)[2 * i : 2 * i + 2])  # automatic


def test_split_spec_errors_name_the_place():
    x = torch.ones(4, 2)
    with pytest.raises(ValueError, match="names keys"):
        split_call_inputs((None, {"nope": _Replicate}), (x,), {"a": x}, 2)
    with pytest.raises(TypeError, match=r"args\[0\]"):
        split_call_inputs(((TensorChunkSpec(0),), None), ("text",), {}, 2)
    with pytest.raises(ValueError, match="only 2 dims"):
        split_call_inputs(((TensorChunkSpec(2),), None), (x,), {}, 2)
    with pytest.raises(TypeError, match="reducers are merge specs"):
        split_call_inputs(((avg_reducer,), None), (x,), {}, 2)


def test_split_label_spec_and_function():
    label = (torch.tensor(1.0), torch.randn(3, 12, 4), 7)
    parts = split_call_labels((_Replicate, TensorChunkSpec(1), _Replicate), label, 3)
    assert len(parts) == 3 and all(p[1].shape == (3, 4, 4) and p[2] == 7 for p in parts)
    assert torch.equal(torch.cat([p[1] for p in parts], 1), label[1])
    fn_parts = split_call_labels(lambda lab, n: list(lab[1].chunk(n, 1)), label, 3)
    assert torch.equal(fn_parts[2], parts[2][1])
    with pytest.raises(ValueError, match="2 label parts for 3"):
        split_call_labels(lambda lab, n: [lab, lab], label, 3)
    with pytest.raises(TypeError, match="one label per microbatch"):
        split_call_labels(lambda lab, n: 5, label, 3)


def test_labels_follow_the_input_rows():
    s = split_call_inputs(None, (torch.ones(7, 2),), {}, 3)
    labels = split_call_labels(None, torch.arange(7), len(s.parts), s.sizes, s.batch_size)
    assert [len(lab) for lab in labels] == [3, 2, 2]


# --------------------------------------------------------------------------- packed data
def test_packed_outputs_feed_the_next_call_as_already_split():
    first = merge_outputs(False, [torch.ones(2, 3), torch.ones(3, 3) * 2])
    ids = torch.arange(5)
    s = split_call_inputs(None, (first,), {"ids": ids}, 4)
    # microbatch count and row sizes follow the packed data, not num_microbatch
    assert len(s.parts) == 2 and s.sizes == [2, 3] and s.batch_size == 5
    assert torch.equal(s.parts[1][0][0], torch.full((3, 3), 2.0))
    assert torch.equal(s.parts[1][1]["ids"], ids[2:])
    labels = split_call_labels(None, RoundPipePackedData(["a", "b"]), 2, s.sizes, s.batch_size)
    assert labels == ["a", "b"]
    with pytest.raises(ValueError, match="different or zero"):
        split_call_inputs(None, (first, RoundPipePackedData([1, 2, 3])), {}, 2)
    custom = split_call_inputs(lambda a, k, n: [(a, k)] * 2, (first,), {}, 9)
    assert torch.equal(custom.parts[1][0][0], first[1])


# --------------------------------------------------------------------------- adjoints
def test_split_and_merge_adjoints_match_autograd():
    torch.manual_seed(0)
    x = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    spec = ((None, _Replicate), None)

    def stage(xi, wi):
        h = torch.tanh(xi @ wi)
        return {"h": h, "loss": (h**2).mean(), "cols": h.t()}

    merge_spec = {"h": None, "loss": None, "cols": TensorChunkSpec(1)}

    def objective(m):
        return (m["h"] * 3).sum() + 5 * m["loss"] + m["cols"].sin().sum()

    # reference: plain autograd straight through split and merge
    s = split_call_inputs(spec, (x, w), {}, 3)
    ref = objective(merge_outputs(merge_spec, [stage(*a) for a, _ in s.parts]))
    gx, gw = torch.autograd.grad(ref, (x, w))

    # pipeline style: detached microbatches, merged-output grads split back by the adjoint
    leaves_in = []
    outs = []
    for a, _ in s.parts:
        xi, wi = (t.detach().requires_grad_(True) for t in a)
        leaves_in.append((xi, wi))
        outs.append(stage(xi, wi))
    detached = [{k: v.detach() for k, v in o.items()} for o in outs]
    merged = merge_outputs_with_grad(merge_spec, detached)
    flat, rebuild = flatten(merged.merged)
    flat = [t.requires_grad_(True) for t in flat]
    g_merged = torch.autograd.grad(objective(rebuild(flat)), flat)
    per_mb = merged.split_output_grads(list(g_merged))
    in_grads = []
    for (xi, wi), o, g in zip(leaves_in, outs, per_mb):
        vals = flatten(o)[0]
        pairs = [(v, gi) for v, gi in zip(vals, g) if gi is not None]
        torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        in_grads.append([xi.grad, wi.grad])
    jx, jw = s.join_input_grads(in_grads)
    torch.testing.assert_close(jx, gx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(jw, gw, rtol=1e-5, atol=1e-6)


def test_custom_functions_have_no_adjoint():
    s = split_call_inputs(_pairs_split, (torch.ones(4),), {}, 2)
    with pytest.raises(ValueError, match="custom split_input"):
        s.join_input_grads([[None], [None]])
    m = merge_outputs_with_grad(lambda xs: xs[0], [torch.ones(1)] * 2)
    with pytest.raises(ValueError, match="custom merge_output"):
        m.split_output_grads([torch.ones(1)])


def test_own_markers_work_like_torchs_and_dataclass_specs_mirror_outputs():
    import dataclasses

    x = torch.arange(12.0).reshape(2, 6)
    ours = split_call_inputs(((OurChunk(1), Replicate), None), (x, "k"), {}, 3).parts
    theirs = split_call_inputs(((TensorChunkSpec(1), _Replicate), None), (x, "k"), {}, 3).parts
    assert all(torch.equal(a[0][0], b[0][0]) and a[0][1] == "k" for a, b in zip(ours, theirs))

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        loss_sum: torch.Tensor
        n: torch.Tensor

    outs = [Out(torch.ones(2, 3), torch.tensor(4.0), torch.tensor(2)) for _ in range(3)]
    prod = Reducer(1, lambda a, b: a * b)
    m = merge_outputs(Out(None, sum_reducer, prod), outs)
    assert m.logits.shape == (6, 3) and m.loss_sum.item() == 12.0 and m.n.item() == 8
    with pytest.raises(TypeError, match="split_dim must be an int"):
        OurChunk("0")


def test_run_specs_are_checked_when_the_config_is_made():
    check_run_specs(None, None, None)
    check_run_specs(_pairs_split, lambda lab, n: [lab] * n, lambda outs: outs[0])
    check_run_specs(((TensorChunkSpec(1), _Replicate), {"m": None}), (Replicate,), False)
    check_run_specs(None, None, {"h": TensorChunkSpec(0), "loss": avg_reducer})
    with pytest.raises(TypeError, match="split_input must be"):
        check_run_specs(split_input=5)
    with pytest.raises(TypeError, match=r"split_input\[0\]\[1\] is 3"):
        check_run_specs(split_input=((None, 3), None))
    with pytest.raises(TypeError, match=r"split_label\[0\]: reducers merge outputs"):
        check_run_specs(split_label=(sum_reducer,))
    with pytest.raises(TypeError, match=r"merge_output\['loss'\] is 'mean'"):
        check_run_specs(merge_output={"loss": "mean"})
