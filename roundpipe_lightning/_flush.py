"""The callback the strategy installs for the asynchronous step: weights are flushed
into the module before every hook where users read them.

Kept apart from ``callbacks.py`` (the user-facing callbacks, which import the
strategy) so that the strategy does not import the callbacks back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

__all__ = ["FlushWeights"]


class FlushWeights(Callback):
    """Calls ``flush`` (the strategy's: finish the queued optimizer step and copy its
    weights into the module) before each hook where users read weights.

    RoundPipeStrategy with ``async_step=True`` puts it first in ``trainer.callbacks``:
    callback hooks run before the LightningModule's and the strategy's own, so every
    user callback and module hook then sees the weights of every step taken so far.
    """

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()

    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._flush()
