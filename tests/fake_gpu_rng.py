"""Random numbers of the fake-CUDA mode's GPUs: one generator per fake GPU, seeded from its
index, whose draws depend on the GPU's SM count, as a CUDA kernel's do.

A CUDA kernel's random draws follow its launch grid, which follows the SM count: two GPUs
of different models given the same seed and offset produce other numbers (dropout
masks). Here every random operation (tagged ``nondeterministic_seeded``) inside a fake
worker's ``compute()`` that names no generator (``torch.rand``, dropout's
``bernoulli_``, ...) draws from its fake GPU's generator, after skipping as many
numbers as the GPU has SMs. A draw that names a generator itself
(``generator=torch.default_generator``: a CPU draw inside a layer) is left alone, so a
test can tell the two apart.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class FakeGpuProps:
    """What ``torch.cuda.get_device_properties`` reports of a fake GPU."""

    def __init__(self, name: str, sms: int, total_memory: int = 24 << 30) -> None:
        self.name, self.multi_processor_count, self.total_memory = name, sms, total_memory


class FakeGpuRng:
    """The generators of the fake GPUs (``sm_counts[i]``: GPU ``i``'s SM count)."""

    def __init__(self, sm_counts: list[int]) -> None:
        self.sm_counts = list(sm_counts)
        self.generators = [torch.Generator().manual_seed(1000 + i) for i in range(len(sm_counts))]
        self.draws = [0] * len(sm_counts)  # random operations run per GPU
        self._lock = threading.Lock()

    def props(self, index: Any) -> FakeGpuProps:
        i = int(index.index if isinstance(index, torch.device) else index)
        return FakeGpuProps(f"fake GPU with {self.sm_counts[i]} SMs", self.sm_counts[i])

    def get_state(self, gpu: int) -> torch.Tensor:
        return self.generators[gpu].get_state()

    def set_state(self, gpu: int, state: torch.Tensor) -> None:
        self.generators[gpu].set_state(state)

    def mode(self, gpu: int) -> TorchDispatchMode:
        return _DrawsOnGpu(self, gpu)


#: the process's generator is swapped for a fake GPU's around one operation at a time
_SWAP_LOCK = threading.Lock()


class _DrawsOnGpu(TorchDispatchMode):
    def __init__(self, rng: FakeGpuRng, gpu: int) -> None:
        super().__init__()
        self.rng, self.gpu = rng, gpu

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags or kwargs.get("generator"):
            return func(*args, **kwargs)  # not random, or a draw from a named generator
        gen = self.rng.generators[self.gpu]
        with _SWAP_LOCK:
            # the launch grid: how many numbers the kernel's threads skip depends on the SMs
            torch.empty(self.rng.sm_counts[self.gpu]).uniform_(generator=gen)
            host = torch.default_generator.get_state()
            torch.default_generator.set_state(gen.get_state())
            try:
                out = func(*args, **kwargs)
            finally:
                gen.set_state(torch.default_generator.get_state())
                torch.default_generator.set_state(host)
            self.rng.draws[self.gpu] += 1
        return out
