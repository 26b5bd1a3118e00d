"""QLoRA through CUDAWorker's code on fake CUDA: a 4-bit layer's replica holds its packed
weight and its quant state (absmax, code, nested state) as uploaded device tensors --
none of them a host tensor -- the copies land late into poisoned buffers (so a missing
wait shows as wrong gradients), and the bytes uploaded per frozen weight are the packed
ones (about 0.56 for NF4), not a dequantized copy (2 for bf16, 4 for fp32)."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from qlora_tiny import load_qlora, make_batch, reference_grads, save_tiny_llama  # noqa: E402

from roundpipe_core import ModelExecutePlan, RoundPipeRunConfig, wrap_model_to_roundpipe  # noqa: E402
from roundpipe_core.presets import causal_lm_loss_fn  # noqa: E402
from roundpipe_core.running.devices import memory  # noqa: E402

pytestmark = pytest.mark.skipif(
    memory.cuda_available(), reason="fake CUDA is for machines without a GPU"
)

PLAN = ModelExecutePlan(
    fwd_plan=[range(0, 2), range(2, 3)],
    bwd_plan=[range(3, 4), range(2, 3), range(1, 2), range(0, 1)],
)


def _tensors_of(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a quantized linear's forward reads: its parameters, what their
    Python attributes hold, and what its own plain attributes hold (quant state)."""
    out: list[tuple[str, torch.Tensor]] = []

    def walk(value: Any, where: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            out.append((where, value))
            if depth < 3:
                for k, v in vars(value).items():
                    if not isinstance(v, nn.Module):
                        walk(v, f"{where}.{k}", depth + 1)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]", depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)):
            if depth < 3 and type(value).__module__.startswith("bitsandbytes"):
                for k, v in vars(value).items():
                    walk(v, f"{where}.{k}", depth + 1)

    for name, p in module.named_parameters(recurse=False):
        walk(p, name, 0)
    for k, v in vars(module).items():
        if not k.startswith("_"):
            walk(v, k, 0)
    return out


@pytest.mark.parametrize("quant", ["nf4", "fp4-dq", "int8"])
def test_quantized_replicas_hold_only_uploaded_tensors(
    tmp_path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, quant: str
) -> None:
    path = save_tiny_llama(tmp_path)
    ids, mask, labels = make_batch()
    ref_loss, ref = reference_grads(path, quant, ids, mask, labels)
    pm = load_qlora(path, quant)
    # only now: loading a quantized model asks CUDA where to put it
    fake_cuda: type = request.getfixturevalue("fake_cuda")
    # the live uploads by storage: a Params4bit around an upload, or a view of one (an
    # 8-bit weight's CB), shares its storage; a host tensor never does
    uploaded: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
    make = fake_cuda._new_device_tensor

    def tagged(self: Any, like: torch.Tensor) -> torch.Tensor:
        t = make(self, like)
        uploaded[t.untyped_storage().data_ptr()] = t
        return t

    monkeypatch.setattr(fake_cuda, "_new_device_tensor", tagged)

    quantized = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    host = {id(m) for m in pm.modules()}
    problems: list[str] = []
    packed_ratio: list[float] = []

    def check(module: nn.Module, args: Any) -> None:
        if id(module) in host:  # a host forward (the plan check's measurement)
            return
        seen: dict[int, int] = {}
        for where, t in _tensors_of(module):
            if t.numel() and uploaded.get(t.untyped_storage().data_ptr()) is None:
                problems.append(f"{type(module).__name__}.{where} was not uploaded")
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        packed_ratio.append(sum(seen.values()) / (module.in_features * module.out_features))

    for m in pm.modules():
        if isinstance(m, quantized):
            m.register_forward_pre_hook(check)  # replicas are copies: they keep the hook

    rp = wrap_model_to_roundpipe(
        pm,
        devices=["cuda:0"] * 2,
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=PLAN),
    )
    try:
        assert all(isinstance(w, fake_cuda) for w in rp.pool.workers)
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask},
            label=labels,
            loss_fn=causal_lm_loss_fn(labels),
        )
        rp.synchronize()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
        for n, p in pm.named_parameters():
            if p.requires_grad:
                g = rp.master_param(p).grad
                err = ((g - ref[n]).norm() / ref[n].norm()).item()
                assert err <= 1e-5, f"{n}: relative error {err:.2e}"
        for w in rp.pool.workers:
            assert w.ledger.current.get("param", 0) == 0  # every upload released
    finally:
        rp.close()
    assert packed_ratio, "no quantized replica ran"
    assert not problems, sorted(set(problems))
    if quant == "nf4":
        # 0.5 B packed + 4 B absmax per 64 weights + the 16-entry code book
        assert max(packed_ratio) <= 0.6, max(packed_ratio)
    elif quant == "int8":
        assert max(packed_ratio) <= 1.1, max(packed_ratio)
