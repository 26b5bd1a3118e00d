"""What a failed upload leaves on a device: nothing (ledger and cached skeletons)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

from roundpipe_core.running.devices.cpu import CPUWorker
from roundpipe_core.running.transfer import upload_stage


class _FailsAtCopy(CPUWorker):
    """A CPU worker whose ``fail_at``-th parameter upload raises (device out of memory)."""

    def __init__(self, index: int, fail_at: int) -> None:
        super().__init__(index)
        self.fail_at = fail_at
        self.copies = 0

    def copy_in(self, tensors: Sequence[torch.Tensor], channel: str) -> list[torch.Tensor]:
        if channel == "param":
            self.copies += 1
            if self.copies == self.fail_at:
                raise torch.OutOfMemoryError("fake: out of device memory")
        return super().copy_in(tensors, channel)


def test_failed_upload_of_layer_k_releases_layers_before_it() -> None:
    layers = [nn.Linear(8, 8) for _ in range(4)]
    worker = _FailsAtCopy(0, fail_at=3)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            worker.submit(upload_stage, worker, layers, range(4)).result(timeout=30)
        assert worker.ledger.current.get("param", 0) == 0
        for _, tree in worker.skeletons.values():
            # a skeleton never filled holds meta placeholders; a filled one, device tensors
            tensors = list(tree.replica.parameters()) + list(tree.replica.buffers())
            held = [t for t in tensors if not t.is_meta]
            assert held == [], "a cached skeleton still holds device tensors"
    finally:
        worker.close()
