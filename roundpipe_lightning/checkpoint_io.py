"""``StreamingCheckpointIO``: checkpoints that cost no host memory beyond the state itself
(Lightning's ``TorchCheckpointIO`` serialises into a ``BytesIO`` first: a second copy of
the host-resident state). How it saves, checks and loads: docs/host-memory.md,
"Checkpoints"; non-local paths (``s3://...``) fall back to ``TorchCheckpointIO``.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, cast

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from roundpipe_core.checkpoint_file import CorruptCheckpointError, read_checkpoint
from roundpipe_core.kinds import check_flag

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_KEY",
    "CorruptCheckpointError",
    "StreamingCheckpointIO",
    "check_lightning_checkpoint",
    "check_roundpipe_section",
    "restore_learned",
]

log = logging.getLogger(__name__)

#: Key of the strategy's own section in a Lightning checkpoint.
CHECKPOINT_KEY = "roundpipe"
#: Version of that section's layout; a file with another version is refused, not guessed at.
CHECKPOINT_FORMAT = 1


def _is_local(path: str | Path) -> bool:
    protocol = get_filesystem(path).protocol
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    return "file" in protocols or "local" in protocols


class _WriteSink:
    """The file ``torch.save`` writes to; remembers the first write that failed."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()


def _file_mode(target: str) -> int:
    """The mode a checkpoint file gets: the replaced file's, else ``0666 & ~umask``."""
    try:
        return os.stat(target).st_mode & 0o777
    except OSError:
        mask = os.umask(0)  # the only way to read the umask; set back at once
        os.umask(mask)
        return 0o666 & ~mask


class StreamingCheckpointIO(TorchCheckpointIO):
    """Atomic, unbuffered checkpoint writes and memory-mapped reads.

    Args:
        mmap: load memory-mapped (legacy non-zip files are read normally).
        fsync: flush the file and its directory to disk before the save returns.
        verify: before loading, check every tensor storage against its CRC-32
            (:func:`roundpipe_core.checkpoint_file.verify_archive`): one read of the file.
    """

    def __init__(self, mmap: bool = True, fsync: bool = True, verify: bool = True) -> None:
        super().__init__()
        for name, value in (("mmap", mmap), ("fsync", fsync), ("verify", verify)):
            check_flag(value, f"StreamingCheckpointIO({name}={value!r}): {name}")
        self.mmap = mmap
        self.fsync = fsync
        self.verify = verify

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` (its directory created) atomically, streaming
        each tensor; ``storage_options`` is refused (a TypeError), as by ``TorchCheckpointIO``."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint does not take storage_options "
                f"(got {storage_options!r}); pass a CheckpointIO of your own that uses them"
            )
        if not _is_local(path):
            super().save_checkpoint(checkpoint, path)
            return
        # through a symlink: write (and atomically replace) the file it points to
        target = os.path.realpath(os.path.abspath(os.fspath(path)))
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        # Same directory as the target: os.replace is then a rename within one filesystem.
        prefix = f".{os.path.basename(target)}."
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
        try:
            # mkstemp's 0600 would hide the file from the group: the mode a plain save gives
            os.fchmod(fd, _file_mode(target))
            with os.fdopen(fd, "wb") as f:
                sink = _WriteSink(f)
                try:
                    torch.save(checkpoint, cast(IO[bytes], sink))
                except BaseException as exc:
                    # torch's zip writer turns a failed write into a RuntimeError while closing
                    # the archive; the caller should see what failed (disk full, Ctrl-C)
                    if sink.error is not None and sink.error is not exc:
                        raise sink.error from exc
                    raise
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        # the temporaries of killed saves of the same target (each as large as a checkpoint)
        pattern = os.path.join(glob.escape(directory), glob.escape(prefix) + "?" * 8 + ".tmp")
        for stale in glob.glob(pattern):
            with contextlib.suppress(OSError):
                os.unlink(stale)
                log.info("Removed the temporary file of an interrupted save: %s", stale)
        if self.fsync:  # the rename, durable (not every platform can open a directory)
            with contextlib.suppress(OSError):
                fd = os.open(directory, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        log.debug("Saved checkpoint %s", target)

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint; local zip-format files are memory-mapped. ``weights_only=None``
        means ``True`` (a crafted file cannot run code; pass ``False`` only for a trusted
        file). A damaged file raises ``CorruptCheckpointError`` (a ``ValueError``)."""
        if weights_only is None:
            weights_only = True
        if not _is_local(path):
            return super().load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
        return read_checkpoint(
            path,
            map_location=map_location,
            weights_only=weights_only,
            mmap=self.mmap,
            verify=self.verify,
        )


def check_lightning_checkpoint(checkpoint: Any, path: str | Path) -> None:
    """``CorruptCheckpointError`` unless ``checkpoint`` is a dict with a ``state_dict``
    (else Lightning fails with a bare ``KeyError``)."""
    if not isinstance(checkpoint, Mapping):
        raise CorruptCheckpointError(
            path, f"it holds a {type(checkpoint).__name__}, not a Lightning checkpoint dict"
        )
    if not isinstance(checkpoint.get("state_dict"), Mapping):
        keys = sorted(map(str, checkpoint))[:8]
        raise CorruptCheckpointError(
            path,
            f"it has no 'state_dict' (the model's weights; its keys: {keys}); a file "
            "Trainer.save_checkpoint or ModelCheckpoint wrote has one",
        )


def check_roundpipe_section(
    section: Any, params: Mapping[str, torch.Tensor], strict: bool = True
) -> dict[str, torch.Tensor]:
    """The saved masters by name of a ``"roundpipe"`` section (``None``: a checkpoint
    written without RoundPipe), checked against ``params`` (the parameters with masters)
    before anything is loaded; ``strict``: a master of another name is an error."""
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise TypeError(
            f"checkpoint[{CHECKPOINT_KEY!r}] must be a dict (RoundPipe's master weights, loss scaler and "
            f"timings), got {type(section).__name__}; remove the key to load the model weights only"
        )
    version = section.get("format")
    if version != CHECKPOINT_FORMAT:
        raise ValueError(
            f"checkpoint[{CHECKPOINT_KEY!r}] has format {version!r}; this roundpipe_lightning reads format "
            f"{CHECKPOINT_FORMAT}. Load it with the version that wrote it, or remove the key to load the "
            "model weights only"
        )
    masters = section.get("masters", {})
    if not isinstance(masters, Mapping):
        raise TypeError(
            f"checkpoint[{CHECKPOINT_KEY!r}]['masters'] must be a dict of parameter name -> tensor, "
            f"got {type(masters).__name__}"
        )
    out: dict[str, torch.Tensor] = {}
    for name, saved in masters.items():
        if not isinstance(saved, torch.Tensor):
            raise TypeError(
                f"checkpoint[{CHECKPOINT_KEY!r}]['masters'][{name!r}] must be a tensor, got {type(saved).__name__}"
            )
        param = params.get(name)
        if param is None:
            if strict:
                raise ValueError(
                    f"checkpoint[{CHECKPOINT_KEY!r}]['masters'] holds {name!r}, which is not a trainable "
                    "parameter of this LightningModule; load with strict=False to ignore it"
                )
            continue
        if saved.shape != param.shape:
            raise ValueError(
                f"master weight {name!r} in the checkpoint has shape {tuple(saved.shape)}, but the "
                f"parameter has shape {tuple(param.shape)}; the checkpoint was written for another model"
            )
        out[name] = saved
    return out


def restore_learned(rp: Any, section: Mapping[str, Any]) -> None:
    """The layer timer and which stages draw random numbers (so a resumed run computes
    each on the thread count it had: bit-exact), from a ``"roundpipe"`` section. A part
    saved for another model is skipped with a warning and re-learned."""
    for key, what, load in (
        ("timer", "layer timings", rp.model_timer.load_state_dict),
        ("draws", "learned stage draws", lambda rows: rp.pool.restore_draws(rp.layers, rows)),
    ):
        if key not in section:
            continue
        try:
            load(section[key])
        except ValueError as exc:
            rank_zero_warn(f"RoundPipe {what} in the checkpoint were not restored: {exc}")
