"""A damaged checkpoint file is refused with one clear error, never loaded and trained on
(issue 23 item 12): ``roundpipe_core.checkpoint_file`` and the host-state shards."""

from __future__ import annotations

import random
import zipfile
from pathlib import Path

import pytest
import torch
import torch.utils.serialization as torch_serialization

from roundpipe_core import distributed as D
from roundpipe_core.checkpoint_file import CorruptCheckpointError, read_checkpoint, verify_archive

pytestmark = pytest.mark.host_only


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "state_dict": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)},
        "epoch": 3,
    }


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "good.ckpt"
    torch.save(_state(), path)
    return path


def _storage_offset(path: Path, member_suffix: str = "data/0") -> tuple[int, int]:
    """Where the bytes of a tensor storage record lie in the archive (begin, size)."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(member_suffix))
    raw = path.read_bytes()
    start = info.header_offset
    name_len = int.from_bytes(raw[start + 26 : start + 28], "little")
    extra_len = int.from_bytes(raw[start + 28 : start + 30], "little")
    return start + 30 + name_len + extra_len, info.file_size


def _refused(path: Path, *why: str) -> CorruptCheckpointError:
    with pytest.raises(CorruptCheckpointError) as info:
        read_checkpoint(path)
    text = str(info.value)
    assert text.startswith(f"not a (complete) checkpoint: {path}: "), text
    for w in why:
        assert w in text, text
    assert "weights_only=False" not in text  # never advise unsafe loading
    assert isinstance(info.value, ValueError)
    return info.value


def test_a_complete_file_loads_and_every_storage_is_checked(good: Path) -> None:
    got = read_checkpoint(good)
    assert torch.equal(got["state_dict"]["w"], _state()["state_dict"]["w"])
    assert verify_archive(good) >= 3  # data.pkl and both storages, at least


@pytest.mark.parametrize("fraction", [0.001, 0.1, 0.5, 0.9, 0.999])
def test_a_truncated_file_is_refused(good: Path, fraction: float) -> None:
    raw = good.read_bytes()
    good.write_bytes(raw[: max(1, int(len(raw) * fraction))])
    _refused(good, "truncated")


def test_one_byte_cut_from_the_end_is_refused(good: Path) -> None:
    good.write_bytes(good.read_bytes()[:-1])
    _refused(good)


def test_a_flipped_byte_inside_a_tensor_storage_is_detected(good: Path) -> None:
    begin, size = _storage_offset(good)
    raw = bytearray(good.read_bytes())
    raw[begin + size // 2] ^= 0x01  # one bit
    good.write_bytes(bytes(raw))
    err = _refused(good, "data/0", "CRC-32", "damaged")
    assert err.path == str(good) and err.rank is None


def test_a_flipped_byte_in_the_object_structure_is_detected(good: Path) -> None:
    begin, size = _storage_offset(good, "data.pkl")
    raw = bytearray(good.read_bytes())
    raw[begin + size // 2] ^= 0xFF
    good.write_bytes(bytes(raw))
    _refused(good, "data.pkl", "CRC-32")


def test_an_empty_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.ckpt"
    path.write_bytes(b"")
    _refused(path, "empty (0 bytes)")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_bytes_are_refused(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "random.ckpt"
    path.write_bytes(random.Random(seed).randbytes(4096))
    _refused(path, "neither a torch.save zip archive nor a legacy torch file")


def test_a_text_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.ckpt"
    path.write_text("epoch=3 step=10\n")
    _refused(path, "b'epoch=3 '")


def test_a_truncated_legacy_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save(_state(), path, _use_new_zipfile_serialization=False)
    assert torch.equal(read_checkpoint(path)["state_dict"]["b"], _state()["state_dict"]["b"])
    raw = path.read_bytes()
    for cut in (20, len(raw) // 2, len(raw) - 1):
        path.write_bytes(raw[:cut])
        _refused(path, "torch.load could not read it")


def test_files_without_checksums_still_load(tmp_path: Path) -> None:
    """Records written with ``compute_crc32=False`` carry no checksum: loaded unchecked."""
    config = torch_serialization.config.save
    before, config.compute_crc32 = config.compute_crc32, False
    try:
        path = tmp_path / "no_crc.ckpt"
        torch.save(_state(), path)
    finally:
        config.compute_crc32 = before
    with zipfile.ZipFile(path) as zf:
        assert all(i.CRC == 0 for i in zf.infolist())
    assert verify_archive(path) == 0
    assert torch.equal(read_checkpoint(path)["state_dict"]["w"], _state()["state_dict"]["w"])


def test_verify_false_skips_the_check(good: Path) -> None:
    begin, size = _storage_offset(good)
    raw = bytearray(good.read_bytes())
    raw[begin] ^= 0x01
    good.write_bytes(bytes(raw))
    assert read_checkpoint(good, verify=False)["epoch"] == 3  # the caller chose not to check
    with pytest.raises(CorruptCheckpointError):
        read_checkpoint(good)


def test_a_complete_file_with_a_foreign_type_keeps_torchs_weights_only_error(
    tmp_path: Path,
) -> None:
    """Not damage but trust: torch's own error, as under plain Lightning."""
    path = tmp_path / "path.ckpt"
    torch.save({"where": tmp_path}, path)
    with pytest.raises(Exception, match="Unsupported global") as info:
        read_checkpoint(path)
    assert not isinstance(info.value, CorruptCheckpointError)
    assert read_checkpoint(path, weights_only=False)["where"] == tmp_path


def test_a_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        read_checkpoint(tmp_path / "nope.ckpt")


# -- host-state shards: the damaged one is named by its rank --------------------------------------
def _two_shards(
    tmp_path: Path,
) -> tuple[Path, dict[str, torch.nn.Parameter], torch.optim.Optimizer]:
    params = {f"p{i}": torch.nn.Parameter(torch.randn(32, 32)) for i in range(4)}
    opt = torch.optim.Adam(params.values(), lr=0.1)
    for p in params.values():
        p.grad = torch.ones_like(p)
    opt.step()
    directory = tmp_path / "shards"
    names = list(params)
    for rank in range(2):
        mine = {id(params[n]) for n in names[rank * 2 : rank * 2 + 2]}
        D.save_shard(directory, params, opt, lambda p, mine=mine: id(p) in mine, rank, 2)
    return directory, params, opt


def test_a_flipped_byte_in_a_shard_names_its_rank(tmp_path: Path) -> None:
    directory, params, opt = _two_shards(tmp_path)
    assert len(D.merge_shards(directory)["masters"]) == 4
    shard = directory / "shard-00001-of-00002.pt"
    begin, size = _storage_offset(shard)
    raw = bytearray(shard.read_bytes())
    raw[begin + size - 1] ^= 0x80
    shard.write_bytes(bytes(raw))
    for load in (
        lambda: D.merge_shards(directory),
        lambda: D.load_shards(directory, params, opt),
    ):
        with pytest.raises(CorruptCheckpointError, match="shard of rank 1.*CRC-32") as info:
            load()
        assert info.value.rank == 1 and info.value.path == str(shard)


@pytest.mark.parametrize("damage", ["truncate", "empty", "random"])
def test_a_truncated_or_foreign_shard_names_its_rank(tmp_path: Path, damage: str) -> None:
    directory, params, opt = _two_shards(tmp_path)
    shard = directory / "shard-00000-of-00002.pt"
    raw = shard.read_bytes()
    shard.write_bytes(
        {"truncate": raw[: len(raw) // 3], "empty": b"", "random": random.Random(5).randbytes(999)}[
            damage
        ]
    )
    with pytest.raises(
        CorruptCheckpointError, match=r"not a \(complete\) checkpoint: .*shard of rank 0"
    ):
        D.load_shards(directory, params, opt)
