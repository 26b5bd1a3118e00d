"""A damaged checkpoint given to ``Trainer.fit(ckpt_path=...)`` under RoundPipeStrategy is
refused before anything loads, with "not a (complete) checkpoint: <path>: <what>"
(issue 23 item 12); the file-level cases are in tests/core/test_checkpoint_file.py."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from rpl_helpers import SeqModule, loader, rp_trainer

from roundpipe_lightning.checkpoint_io import CorruptCheckpointError, StreamingCheckpointIO


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    m = SeqModule()
    t = rp_trainer(max_steps=2, precision="bf16-true")
    t.fit(m, loader())
    path = tmp_path / "ok.ckpt"
    t.save_checkpoint(path)
    return path


def _fit_from(path: Path) -> SeqModule:
    m = SeqModule(seed=31)
    rp_trainer(max_steps=4, precision="bf16-true").fit(m, loader(), ckpt_path=path)
    return m


def _master_record(path: Path) -> tuple[int, int]:
    """(first byte, size) of the largest storage: a master weight or an optimizer moment."""
    with zipfile.ZipFile(path) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = path.read_bytes()
    start = info.header_offset
    skip = int.from_bytes(raw[start + 26 : start + 28], "little") + int.from_bytes(
        raw[start + 28 : start + 30], "little"
    )
    return start + 30 + skip, info.file_size


def test_a_flipped_bit_in_a_saved_tensor_stops_the_resume(saved: Path) -> None:
    begin, size = _master_record(saved)
    raw = bytearray(saved.read_bytes())
    raw[begin + size // 3] ^= 0x04
    saved.write_bytes(bytes(raw))
    fresh = SeqModule(seed=31)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(
        CorruptCheckpointError, match=r"not a \(complete\) checkpoint: .*ok\.ckpt.*CRC-32"
    ):
        rp_trainer(max_steps=4, precision="bf16-true").fit(fresh, loader(), ckpt_path=saved)
    for k, v in fresh.state_dict().items():  # nothing was loaded
        assert torch.equal(v.float(), before[k].float()), k


@pytest.mark.parametrize("keep", [0, 100, 0.5, -1], ids=["empty", "head", "half", "last-byte-cut"])
def test_a_truncated_checkpoint_stops_the_resume(saved: Path, keep: float) -> None:
    raw = saved.read_bytes()
    cut = int(len(raw) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(raw) - 1)
    saved.write_bytes(raw[:cut])
    with pytest.raises(
        CorruptCheckpointError, match=r"not a \(complete\) checkpoint: .*ok\.ckpt"
    ) as info:
        _fit_from(saved)
    assert "weights_only=False" not in str(info.value)


def test_a_checkpoint_without_state_dict_is_named(tmp_path: Path, saved: Path) -> None:
    ck = torch.load(saved, weights_only=True)
    del ck["state_dict"]
    bad = tmp_path / "no_weights.ckpt"
    torch.save(ck, bad)
    with pytest.raises(
        CorruptCheckpointError,
        match=r"no_weights\.ckpt: it has no 'state_dict'.*'optimizer_states'",
    ):
        _fit_from(bad)


def test_a_file_that_is_no_dict_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "list.ckpt"
    torch.save([torch.zeros(2)], bad)
    with pytest.raises(CorruptCheckpointError, match=r"list\.ckpt: it holds a list"):
        _fit_from(bad)


def test_the_io_can_skip_the_check_and_takes_only_bools(saved: Path) -> None:
    begin, _ = _master_record(saved)
    raw = bytearray(saved.read_bytes())
    raw[begin] ^= 0x01
    saved.write_bytes(bytes(raw))
    assert "state_dict" in StreamingCheckpointIO(verify=False).load_checkpoint(saved)
    with pytest.raises(CorruptCheckpointError):
        StreamingCheckpointIO().load_checkpoint(saved)
    with pytest.raises(TypeError, match="verify=1"):
        StreamingCheckpointIO(verify=1)  # type: ignore[arg-type]
