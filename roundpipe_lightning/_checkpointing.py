"""The checkpoint half of :class:`~roundpipe_lightning.RoundPipeStrategy`: what a
checkpoint holds beyond Lightning's own (the fp32 master weights of a
half-precision model, the loss scaler, the layer timer) and how it is written and
read (:class:`~roundpipe_lightning.checkpoint_io.StreamingCheckpointIO` by default:
streamed, atomic, memory-mapped on load).

A base class of the strategy, kept apart so each file has one job; the strategy
provides the RoundPipe, the loss scaler and the weight flush it uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from roundpipe_core import AutoRoundPipe, RoundPipe
from roundpipe_core.optim import check_state_matches

from ._private import WrappingCheckpointIO, uncount_saved_steps
from ._run_state import RunState
from ._setup import raw_optimizer, restore_impl_choice
from ._topology import ProcessTopologyStrategy
from .checkpoint_io import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_KEY,
    StreamingCheckpointIO,
    check_lightning_checkpoint,
    check_roundpipe_section,
    restore_learned,
)
from .precision import LossScaler
from .sharded_checkpoint import (
    load_optimizer_states,
    marker,
    remove_shards,
    save_host_shards,
    sharded_masters,
)

__all__ = ["CheckpointingStrategy"]


class CheckpointingStrategy(ProcessTopologyStrategy):
    """Checkpoint save / load of a RoundPipe run (see the module docstring)."""

    _rp: RoundPipe | AutoRoundPipe | None
    _run: RunState
    _user_impl: dict[int, list[dict[str, Any]]]  # per optimizer: fused / foreach as built
    #: a checkpoint's model state read before setup, applied once setup built the masters
    _deferred_model_state: tuple[Mapping[str, Any], bool] | None = None

    @property
    def _loss_scaler(self) -> LossScaler | None:
        raise NotImplementedError

    def _sync_weights(self) -> None:
        """Finish the queued step and put the masters into the model (the strategy's)."""
        raise NotImplementedError

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """Streaming, atomic saves and memory-mapped loads (:class:`StreamingCheckpointIO`)
        unless a ``checkpoint_io`` was passed to the strategy or the Trainer's plugins."""
        if self._checkpoint_io is None:
            self._checkpoint_io = StreamingCheckpointIO()
        elif isinstance(self._checkpoint_io, WrappingCheckpointIO):
            # an AsyncCheckpointIO without its own inner IO (the setter keeps a configured one)
            self._checkpoint_io.checkpoint_io = StreamingCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._sync_weights()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        self._sync_weights()
        shard = self._dp.shard(optimizer)
        if shard is not None:  # each rank writes its own share (save_checkpoint)
            return marker(shard.world_size)
        state = super().optimizer_state(optimizer)
        # the user's fused / foreach, not the fused switch (state_dict() copies the groups)
        restore_impl_choice(state, self._user_impl.get(id(raw_optimizer(optimizer))))
        return state

    def _named_masters(self) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        """(LightningModule parameter name, model parameter, master) for every trainable parameter."""
        rp, lm = self._rp, self.lightning_module
        if rp is None or lm is None:
            return []
        out = []
        for name, p in lm.named_parameters():
            m = rp.master_param(p)
            if m is not None:
                out.append((name, p, m))
        return out

    def roundpipe_state_dict(self) -> dict[str, Any]:
        """What the strategy adds to a checkpoint under ``checkpoint["roundpipe"]``:
        master weights that differ in dtype from the model's (fp32 masters of a
        half-precision model), the loss scaler, the layer timer and which stages draw
        random numbers (``restore_learned``).

        The masters are the live tensors, not copies (host memory holds one of each):
        the step is drained here and nothing updates them until the save returns. Those
        of a sharded optimizer are in its shards instead, each in its owner's."""
        self._sync_weights()
        in_shards = sharded_masters(self._dp, self.optimizers)
        masters = {
            name: m.detach()
            for name, p, m in self._named_masters()
            if m.dtype != p.dtype and id(m) not in in_shards
        }
        state: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "masters": masters}
        if self._loss_scaler is not None:
            state["loss_scaler"] = self._loss_scaler.state_dict()
        if isinstance(self._rp, RoundPipe):  # an AutoRoundPipe's units time themselves
            state["timer"] = self._rp.model_timer.state_dict()
            state["draws"] = self._rp.pool.learned_draws(self._rp.layers)
        return state

    def _user_groups(self, i: int, groups: list[dict[str, Any]]) -> None:
        """Optimizer ``i``'s saved groups get the user's fused / foreach back."""
        choice = self._user_impl.get(id(raw_optimizer(self.optimizers[i])))
        restore_impl_choice({"param_groups": groups}, choice)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        if self._rp is not None:
            checkpoint[CHECKPOINT_KEY] = self.roundpipe_state_dict()
            # shard_host_state: every rank writes its share of the optimizer state
            named = {name: m for name, _, m in self._named_masters()}
            save_host_shards(filepath, self.optimizers, self._dp, named, self._user_groups)
        lm = self.lightning_module
        if lm is not None:
            # steps Lightning counted when queued whose update failed: the weights saved
            # here never received them (read after the weights were flushed above)
            uncount_saved_steps(checkpoint, self._run.steps.lost, lm.automatic_optimization)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """``False``: Lightning reads ``fit(ckpt_path=...)``'s file before setup, with the
        ``weights_only`` the user passed (its after-setup path drops it: ``Trainer._run``
        calls ``_restore_modules_and_callbacks(ckpt_path)`` without it, so a trusted
        checkpoint holding, say, a ``pathlib.Path`` could not be resumed). The model state
        itself waits in :meth:`load_model_state_dict` until setup has built the RoundPipe
        and its masters; optimizer and loop state are restored after setup as always."""
        return False

    def _load_deferred_model_state(self) -> None:
        """End of setup: load the model state of a checkpoint read before it."""
        deferred, self._deferred_model_state = self._deferred_model_state, None
        if deferred is not None:
            self.load_model_state_dict(*deferred)

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        """Remove the checkpoint file and, for a sharded one, its ``.shards/`` directory
        (``ModelCheckpoint(save_top_k=...)`` calls this for the checkpoints it drops).
        Rank 0 removes both, as it wrote the file: the shards live on a file system
        every node sees."""
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            remove_shards(filepath)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._rp is None:  # read before setup: the masters do not exist yet
            self._deferred_model_state = (checkpoint, strict)
            return
        self._sync_weights()
        section = checkpoint.get(CHECKPOINT_KEY)
        # checked before anything is loaded, so a bad file leaves the model as it was
        params = {name: p for name, p, _ in self._named_masters()}
        saved = check_roundpipe_section(section, params, strict=strict)
        state = section or {}
        super().load_model_state_dict(checkpoint, strict=strict)
        released = self._rp.masters.released  # another rank's share: its shard restores it
        with torch.no_grad():
            for name, p, m in self._named_masters():
                src = saved.get(name)
                if id(m) in released:
                    pass
                elif src is not None:
                    m.copy_(src)
                elif m is not p:  # (a shared master is the parameter: loaded already)
                    m.copy_(p)
                m.grad = None
        if self._loss_scaler is not None and "loss_scaler" in state:
            self._loss_scaler.load_state_dict(state["loss_scaler"])
        if isinstance(self._rp, RoundPipe):
            restore_learned(self._rp, state)

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # a sharded optimizer state lives beside the file: remember where that is
        self._loaded_checkpoint_path = checkpoint_path
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        check_lightning_checkpoint(checkpoint, checkpoint_path)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._sync_weights()
        named = {name: m for name, _, m in self._named_masters()}
        load_optimizer_states(
            getattr(self, "_loaded_checkpoint_path", None),
            self.optimizers,
            checkpoint["optimizer_states"],
            self._dp,
            named,
        )
        self._check_optimizer_states()

    def _check_optimizer_states(self) -> None:
        """Every per-parameter state tensor has its parameter's shape (torch's fused
        kernels do not check, and train to NaN or corrupt memory instead)."""
        if self._rp is None:
            return
        names = {id(m): name for name, _, m in self._named_masters()}
        for opt in self.optimizers:
            check_state_matches(raw_optimizer(opt), names)
