"""``StreamingCheckpointIO``: checkpoints that cost no host memory beyond the state itself.

RoundPipe keeps the whole training state in host memory, so a checkpoint must
not need a second copy of it. Lightning's default ``TorchCheckpointIO`` first
serialises the checkpoint into an in-memory ``BytesIO`` (to write the file in
one go) -- a whole checkpoint's worth of RAM on top of training. This
``CheckpointIO`` instead:

* **saves** with ``torch.save`` into an open temporary file next to the target.
  ``torch.save`` pickles only the (small) object structure into memory; each
  tensor storage is written from its own memory straight into the zip
  archive, so nothing is buffered or cloned. The temporary file is flushed,
  ``fsync``-ed and renamed over the target (``os.replace``), and the directory
  is ``fsync``-ed: the target is always either the previous complete file or
  the new complete file, never a half-written one.
* **loads** with ``torch.load(mmap=True)``: tensors are views of the mapped
  file, read page by page as they are copied into the model, so restoring does
  not hold a second copy of the state in anonymous memory. Because every save
  writes a *new* file and renames it, a mapped checkpoint is never modified in
  place while a run still reads from it. Before loading, every tensor storage is
  checked against the CRC-32 ``torch.save`` wrote for it, and a truncated,
  damaged or foreign file is refused with ``CorruptCheckpointError``
  (:mod:`roundpipe_core.checkpoint_file`).

Files are ordinary ``torch.save`` archives: ``torch.load(path, weights_only=True)``
and ``LightningModule.load_from_checkpoint`` read them. Paths that are not on
the local filesystem (``s3://...``) fall back to Lightning's ``TorchCheckpointIO``.
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


def _fsync_dir(directory: str) -> None:
    """Make the rename durable. Not every platform can open a directory (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _WriteSink:
    """The file ``torch.save`` writes to: passes each chunk (a view of a tensor's memory)
    straight to the file and remembers the first write that failed."""

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


def _remove_stale_temporaries(directory: str, prefix: str) -> None:
    """Temporary files of saves of the same target that were killed (SIGKILL) before
    they could clean up; they can be as large as the checkpoint."""
    pattern = os.path.join(glob.escape(directory), glob.escape(prefix) + "?" * 8 + ".tmp")
    for stale in glob.glob(pattern):
        with contextlib.suppress(OSError):
            os.unlink(stale)
            log.info("Removed the temporary file of an interrupted save: %s", stale)


class StreamingCheckpointIO(TorchCheckpointIO):
    """Atomic, unbuffered checkpoint writes and memory-mapped reads (see the module docstring).

    Args:
        mmap: load checkpoints memory-mapped (``torch.load(mmap=True)``). Files in
            torch's legacy (non-zip) format are read normally.
        fsync: flush the file and its directory to disk before the save returns
            (a crash right after the save then still finds the checkpoint).
        verify: before loading, check every tensor storage against the CRC-32 that
            ``torch.save`` wrote for it (:func:`roundpipe_core.checkpoint_file.verify_archive`):
            a damaged file is refused instead of trained on. One read of the file.
    """

    def __init__(self, mmap: bool = True, fsync: bool = True, verify: bool = True) -> None:
        super().__init__()
        for name, value in (("mmap", mmap), ("fsync", fsync), ("verify", verify)):
            if not isinstance(value, bool):
                raise TypeError(
                    f"StreamingCheckpointIO({name}=...) takes a bool, got {name}={value!r}"
                )
        self.mmap = mmap
        self.fsync = fsync
        self.verify = verify

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` atomically, streaming each tensor to the file.

        Args:
            checkpoint: the checkpoint dict (as Lightning's ``dump_checkpoint`` builds it).
            path: target file; its directory is created if needed.
            storage_options: not supported (as for ``TorchCheckpointIO``).

        Raises:
            TypeError: if ``storage_options`` is given.
        """
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
        _remove_stale_temporaries(directory, prefix)
        if self.fsync:
            _fsync_dir(directory)
        log.debug("Saved checkpoint %s", target)

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint; local zip-format files are memory-mapped.

        Args:
            path: the checkpoint file.
            map_location: as for ``torch.load``.
            weights_only: as for ``torch.load``; ``None`` means ``True`` (only tensors and
                plain containers are unpickled -- a crafted file cannot run code). Pass
                ``False`` only for a trusted file that holds other objects.

        Raises:
            FileNotFoundError: if ``path`` does not exist.
            CorruptCheckpointError: (a ``ValueError``) the file is empty, truncated,
                damaged (a storage fails its checksum) or not a torch file: "not a
                (complete) checkpoint: <path>: <what is wrong>".
        """
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
    """What ``Trainer.fit(ckpt_path=...)`` read from ``path`` is a Lightning checkpoint:
    a dict with the model's ``state_dict`` (else Lightning fails with a bare ``KeyError``).

    Raises:
        CorruptCheckpointError: it is not a dict, or has no ``state_dict``.
    """
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
    """Validate the ``"roundpipe"`` section of a checkpoint before anything is loaded from it.

    Args:
        section: ``checkpoint.get("roundpipe")``; ``None`` (a checkpoint written without
            RoundPipe) is valid and has no masters.
        params: the trainable parameters that have master copies, by LightningModule name.
        strict: as for ``load_state_dict``: masters of names that are not such
            parameters are an error (otherwise ignored).

    Returns:
        The saved master weights by parameter name (possibly empty).

    Raises:
        TypeError: if the section, its ``"masters"`` or a master is of the wrong type.
        ValueError: for an unknown ``"format"`` version, a master whose shape differs
            from its parameter's, or (``strict``) a master of an unknown parameter.
    """
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
    """What a RoundPipe learned while it ran, from a checkpoint's ``"roundpipe"`` section:
    the layer timer (the plans ``auto()`` makes from it) and which stages draw random
    numbers (where CPU workers compute side by side, the stages that share the cores: a resumed run then computes each on the thread count
    the run it continues did, so it continues bit-exactly). A part saved for another
    model is skipped with a warning: the run goes on, re-learning it."""
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
