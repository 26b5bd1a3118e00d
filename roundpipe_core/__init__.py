"""RoundPipe core: train an nn.Sequential whose state lives in host memory on a
stateless pool of devices (CUDA GPUs, or CPU threads that play devices)."""

from . import optim
from .amp import GradScaler
from .autosplit import AutoRoundPipe
from .base import OptimizerCtx
from .batch import RoundPipePackedData
from .config import RoundPipeRunConfig
from .context import doing_recompute, get_recompute_data, save_for_recompute
from .model import RoundPipe
from .planning.plan import ModelExecutePlan
from .presets import wrap_model_to_roundpipe
from .stepping.pipelined import PendingResult

__version__ = "0.1.0"  # the same as pyproject.toml's [project] version (a test checks)


__all__ = [
    "__version__",
    "AutoRoundPipe",
    "GradScaler",
    "RoundPipePackedData",
    "optim",
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
