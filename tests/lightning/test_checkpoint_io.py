"""StreamingCheckpointIO: the strategy's default checkpoint writer/reader.

Saves stream tensors into a temporary file that is renamed over the target (no
in-memory copy of the checkpoint, no clones of the masters, never a half-written
file); loads are memory-mapped; files stay plain ``torch.save`` archives. The
checkpoint's ``"roundpipe"`` section is validated before anything is loaded.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from rpl_helpers import SeqModule, loader, max_rel_err, params_of, rp_trainer

import roundpipe_lightning.checkpoint_io as cio
from roundpipe_lightning import RoundPipeStrategy
from roundpipe_lightning.checkpoint_io import StreamingCheckpointIO


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fitted(precision: str = "bf16-true", steps: int = 3, **kw: Any) -> tuple[SeqModule, L.Trainer]:
    m = SeqModule(**kw)
    t = rp_trainer(max_steps=steps, precision=precision)
    t.fit(m, loader())
    return m, t


# -- the strategy uses it ------------------------------------------------------------------------
def test_strategy_defaults_to_streaming_io_and_keeps_a_users_own() -> None:
    assert isinstance(RoundPipeStrategy().checkpoint_io, StreamingCheckpointIO)
    mine = TorchCheckpointIO()
    assert RoundPipeStrategy(checkpoint_io=mine).checkpoint_io is mine
    t = L.Trainer(
        strategy=RoundPipeStrategy(), accelerator="cpu", devices=2, plugins=[mine], logger=False
    )
    assert t.strategy.checkpoint_io is mine
    # an AsyncCheckpointIO without an inner IO gets the streaming one inside
    wrapped = RoundPipeStrategy(checkpoint_io=AsyncCheckpointIO()).checkpoint_io
    assert isinstance(wrapped, AsyncCheckpointIO)
    assert isinstance(wrapped.checkpoint_io, StreamingCheckpointIO)


def test_masters_are_saved_without_copies(tmp_path: Path) -> None:
    m, t = _fitted()
    strategy = t.strategy
    assert isinstance(strategy, RoundPipeStrategy)
    # (after fit the RoundPipe is closed; its masters are still the strategy's)
    live = {name: mp for name, _, mp in strategy._session.named_masters()}
    section = strategy.roundpipe_state_dict()
    assert sorted(section["masters"]) == sorted(live)
    for name, saved in section["masters"].items():
        assert saved.untyped_storage().data_ptr() == live[name].untyped_storage().data_ptr(), name


def test_save_streams_into_a_real_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save gets an open file (each storage is written from its own memory), not
    a BytesIO holding the whole checkpoint."""
    targets: list[Any] = []
    real_save = torch.save

    def spy(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        where = (
            Path(os.readlink(f"/proc/self/fd/{f.fileno()}"))
            if os.path.isdir("/proc/self/fd")
            else None
        )
        targets.append((f, where))
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(cio.torch, "save", spy)
    _, t = _fitted()
    t.save_checkpoint(tmp_path / "m.ckpt")
    assert len(targets) == 1
    f, where = targets[0]
    assert not isinstance(f, io.BytesIO)
    if where is not None:  # a temporary file beside the target
        assert where.parent == tmp_path.resolve() and where.name.startswith(".m.ckpt.")


# -- round trip --------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_round_trip_is_exact(tmp_path: Path, precision: str) -> None:
    m, t = _fitted(precision, steps=4)
    path = tmp_path / "m.ckpt"
    t.save_checkpoint(path)
    strategy = t.strategy
    assert isinstance(strategy, RoundPipeStrategy)
    opt = t.optimizers[0]
    masters = {name: mp for name, _, mp in strategy._session.named_masters()}
    for ck in (
        torch.load(path, weights_only=True),  # plain torch
        StreamingCheckpointIO().load_checkpoint(path),  # memory-mapped
    ):
        for k, v in m.state_dict().items():
            assert torch.equal(ck["state_dict"][k], v), k
            assert ck["state_dict"][k].dtype == v.dtype
        saved_masters = ck["roundpipe"]["masters"]
        if precision == "32-true":
            assert saved_masters == {}  # equal to the fp32 weights: not stored twice
        else:
            assert sorted(saved_masters) == sorted(masters)
            for k, v in saved_masters.items():
                assert v.dtype == torch.float32 and torch.equal(v, masters[k]), k
        state = ck["optimizer_states"][0]["state"]
        live = opt.state_dict()["state"]
        assert sorted(state) == sorted(live)
        for i in live:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(state[i][key], live[i][key]), (i, key)


def test_load_is_memory_mapped(tmp_path: Path) -> None:
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc/self/maps to see the mapping")
    _, t = _fitted()
    path = tmp_path / "mapped.ckpt"
    t.save_checkpoint(path)
    ck = StreamingCheckpointIO().load_checkpoint(path)
    assert str(path) in Path("/proc/self/maps").read_text()
    del ck
    plain = StreamingCheckpointIO(mmap=False).load_checkpoint(path)
    assert str(path) not in Path("/proc/self/maps").read_text()
    assert "state_dict" in plain


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_resume_from_mapped_file_continues_exactly_and_never_writes_it(
    tmp_path: Path, optimizer: str
) -> None:
    """The restored optimizer state may alias the mapped file (copy-on-write): training
    after the resume must continue like the straight run and leave the file untouched."""
    kw = dict(precision="bf16-true", async_step=True)
    a = SeqModule(optimizer=optimizer)
    ca = ModelCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=5, save_top_k=-1)
    rp_trainer(max_steps=5, enable_checkpointing=True, callbacks=[ca], **kw).fit(a, loader())
    ckpt = tmp_path / "a" / "epoch=0-step=5.ckpt"
    digest = _sha(ckpt)
    a2 = SeqModule(optimizer=optimizer, seed=77)
    rp_trainer(max_steps=10, **kw).fit(a2, loader(), ckpt_path=ckpt)
    b = SeqModule(optimizer=optimizer)
    cb = ModelCheckpoint(dirpath=tmp_path / "b", every_n_train_steps=5, save_top_k=-1)
    rp_trainer(max_steps=10, enable_checkpointing=True, callbacks=[cb], **kw).fit(b, loader())
    assert a.losses + a2.losses == b.losses
    assert max_rel_err(params_of(a2), params_of(b)) == 0.0
    assert _sha(ckpt) == digest


def test_load_from_checkpoint_reads_a_streamed_file(tmp_path: Path) -> None:
    m, t = _fitted("bf16-true")
    t.save_checkpoint(tmp_path / "m.ckpt")
    back = SeqModule.load_from_checkpoint(tmp_path / "m.ckpt", mode="plain", weights_only=True)
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


# -- atomicity ---------------------------------------------------------------------------------
class _FailingFile:
    """A file whose writes fail after ``limit`` bytes (a full disk, a killed NFS mount)."""

    def __init__(self, f: Any, limit: int, exc: BaseException) -> None:
        self._f, self._left, self._exc = f, limit, exc

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n > self._left:
            raise self._exc
        self._left -= n
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _FailingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


@pytest.mark.parametrize(
    "exc",
    [OSError(28, "No space left on device"), KeyboardInterrupt()],
    ids=["disk_full", "interrupt"],
)
def test_failure_mid_write_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    _, t = _fitted(steps=2)
    path = tmp_path / "last.ckpt"
    t.save_checkpoint(path)
    before = _sha(path)
    real_fdopen = os.fdopen
    monkeypatch.setattr(
        cio.os, "fdopen", lambda fd, mode: _FailingFile(real_fdopen(fd, mode), 4096, exc)
    )
    with pytest.raises(type(exc)):
        t.save_checkpoint(path)
    assert _sha(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary left


def test_save_replaces_atomically_and_refuses_storage_options(tmp_path: Path) -> None:
    sio = StreamingCheckpointIO()
    path = tmp_path / "sub" / "c.ckpt"
    sio.save_checkpoint({"a": torch.arange(4)}, path)
    sio.save_checkpoint({"a": torch.arange(6)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.arange(6))
    assert os.listdir(path.parent) == ["c.ckpt"]
    with pytest.raises(TypeError, match="storage_options"):
        sio.save_checkpoint({"a": 1}, path, storage_options={"x": 1})
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        sio.load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(TypeError, match="mmap"):
        StreamingCheckpointIO(mmap="yes")  # type: ignore[arg-type]


def test_load_defaults_to_weights_only(tmp_path: Path) -> None:
    path = tmp_path / "obj.ckpt"
    torch.save({"obj": _Unsafe()}, path)
    with pytest.raises(Exception, match="weights_only|Unsupported global"):
        StreamingCheckpointIO().load_checkpoint(path)
    assert isinstance(
        StreamingCheckpointIO().load_checkpoint(path, weights_only=False)["obj"], _Unsafe
    )


class _Unsafe:
    """Not an allow-listed type: ``weights_only`` loading must refuse it."""


# -- the "roundpipe" section is validated before anything loads ---------------------------------------
def _corrupt(tmp_path: Path, edit: Any) -> tuple[SeqModule, Path]:
    m, t = _fitted("bf16-true", steps=2)
    path = tmp_path / "ok.ckpt"
    t.save_checkpoint(path)
    ck = torch.load(path, weights_only=True)
    edit(ck)
    bad = tmp_path / "bad.ckpt"
    torch.save(ck, bad)
    return m, bad


def _resume(path: Path) -> SeqModule:
    m = SeqModule(seed=31)
    rp_trainer(max_steps=4, precision="bf16-true").fit(m, loader(), ckpt_path=path)
    return m


def test_wrong_shaped_master_names_the_parameter_and_both_shapes(tmp_path: Path) -> None:
    def edit(ck: dict) -> None:
        ck["roundpipe"]["masters"]["net.0.weight"] = torch.zeros(3, 5)

    _, bad = _corrupt(tmp_path, edit)
    with pytest.raises(ValueError, match=r"'net\.0\.weight'.*\(3, 5\).*\(16, 8\)"):
        _resume(bad)


def test_non_dict_section_is_a_type_error(tmp_path: Path) -> None:
    def edit(ck: dict) -> None:
        ck["roundpipe"] = [1, 2, 3]

    _, bad = _corrupt(tmp_path, edit)
    with pytest.raises(TypeError, match=r"checkpoint\['roundpipe'\] must be a dict.*list"):
        _resume(bad)


def test_unknown_format_version_is_refused(tmp_path: Path) -> None:
    def edit(ck: dict) -> None:
        ck["roundpipe"]["format"] = 99

    _, bad = _corrupt(tmp_path, edit)
    with pytest.raises(ValueError, match="format 99.*format 1"):
        _resume(bad)


def test_section_checks_leave_the_model_untouched() -> None:
    params = {"w": torch.zeros(2, 3)}
    check = cio.check_roundpipe_section
    assert check(None, params) == {}
    with pytest.raises(TypeError, match="masters'\\] must be a dict"):
        check({"format": 1, "masters": [torch.zeros(2, 3)]}, params)
    with pytest.raises(TypeError, match=r"\['w'\] must be a tensor, got str"):
        check({"format": 1, "masters": {"w": "x"}}, params)
    with pytest.raises(ValueError, match="'other'.*strict=False"):
        check({"format": 1, "masters": {"other": torch.zeros(1)}}, params)
    assert check({"format": 1, "masters": {"other": torch.zeros(1)}}, params, strict=False) == {}
    with pytest.raises(ValueError, match="format None"):
        check({"masters": {}}, params)


def test_bad_section_leaves_the_running_model_as_it_was(tmp_path: Path) -> None:
    """The check runs before the model's weights are loaded: a refused file changes nothing."""

    def edit(ck: dict) -> None:
        ck["roundpipe"]["masters"]["net.6.weight"] = torch.zeros(1)
        for k in ck["state_dict"]:
            ck["state_dict"][k] = torch.full_like(ck["state_dict"][k], 7.0)

    m, bad = _corrupt(tmp_path, edit)
    fresh = SeqModule(seed=31)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match="net.6.weight"):
        rp_trainer(max_steps=4, precision="bf16-true").fit(fresh, loader(), ckpt_path=bad)
    # (bf16-true cast the module at setup, before the failed restore)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k].to(v.dtype)), k


def test_legacy_format_file_loads_without_mmap(tmp_path: Path) -> None:
    path = tmp_path / "legacy.ckpt"
    torch.save({"a": torch.arange(5)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(StreamingCheckpointIO().load_checkpoint(path)["a"], torch.arange(5))


def test_host_memory_budget_from_a_callback_as_documented() -> None:
    """docs/host-memory.md: the budget read at on_fit_start counts the optimizer's masters."""
    from roundpipe_core.running.host_memory import check_host_memory, estimate_host_memory

    seen = {}

    class Budget(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            budget = estimate_host_memory(pl_module.roundpipe, optimizer=list(trainer.optimizers))
            check_host_memory(budget)
            seen["budget"] = budget

    m = SeqModule()
    rp_trainer(max_steps=1, callbacks=[Budget()]).fit(m, loader())
    n = sum(p.numel() for p in m.parameters())
    b = seen["budget"]
    assert b.num_params == n and b.optimizer_state == 8 * n
    # async_step=False: the fp32 parameters are their own masters, counted once (as weights)
    assert b.masters == 0 and b.weights == 4 * n and b.gradients == 4 * n
