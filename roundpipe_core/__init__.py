"""RoundPipe core: train an nn.Sequential whose state lives in host memory on a
stateless pool of devices (CUDA GPUs, or CPU threads that play devices)."""

from .autosplit import AutoRoundPipe
from .config import RoundPipeRunConfig
from .context import doing_recompute, get_recompute_data, save_for_recompute
from .model import OptimizerCtx, RoundPipe
from .pipelined import PendingResult
from .plan import ModelExecutePlan
from .presets import wrap_model_to_roundpipe

__version__ = "0.1.0"  # the same as pyproject.toml's [project] version (a test checks)


__all__ = [
    "__version__",
    "AutoRoundPipe",
    "PendingResult",
    "RoundPipe",
    "RoundPipeRunConfig",
    "ModelExecutePlan",
    "OptimizerCtx",
    "wrap_model_to_roundpipe",
    "save_for_recompute",
    "doing_recompute",
    "get_recompute_data",
]
