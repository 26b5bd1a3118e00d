"""RoundPipe core: train an nn.Sequential whose state lives in host memory on a
stateless pool of devices (CUDA GPUs, or CPU threads that play devices)."""

from .context import doing_recompute, get_recompute_data, save_for_recompute
from .model import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from .plan import ModelExecutePlan
from .planner import auto as _auto_planner

# The planner sits above plan.py (it runs the simulator, which reads plans), so the
# package, not plan.py, connects the published spelling ModelExecutePlan.auto to it.
ModelExecutePlan.install_planner(_auto_planner)


def wrap_model_to_roundpipe(
    model, use_sequential_preset=True, model_run_config=None, optim_dtype=None, **roundpipe_kwargs
):
    """Wrap a Hugging Face model (via a preset) or any model into RoundPipe; see ``roundpipe_core.presets``."""
    from .presets import wrap_model_to_roundpipe as _wrap

    return _wrap(
        model,
        use_sequential_preset=use_sequential_preset,
        model_run_config=model_run_config,
        optim_dtype=optim_dtype,
        **roundpipe_kwargs,
    )


__all__ = [
    "RoundPipe",
    "RoundPipeRunConfig",
    "ModelExecutePlan",
    "OptimizerCtx",
    "wrap_model_to_roundpipe",
    "save_for_recompute",
    "doing_recompute",
    "get_recompute_data",
]
