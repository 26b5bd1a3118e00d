"""The public names and signatures of the published ``roundpipe`` package exist here.

Code written for the published package (GitHub ITcarrot/RoundPipe, PyPI ``RoundPipe``
0.1.1) should run after ``import roundpipe_core as roundpipe``: every name of its
``__all__``, the documented submodules (``optim``, ``timer``, ``batch``) and the
argument names of the documented signatures, in their documented positional order
(users pass ``step(fn, False)`` and ``RoundPipeRunConfig(True, ...)`` positionally).
Deliberate differences are listed in docs/differences.md; none of them is an absent
name or argument. Behaviour is tested where it lives (tests/core/test_*.py).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import roundpipe_core

# The published package's ``roundpipe.__all__`` at release 0.1.1 (roundpipe/__init__.py).
PUBLISHED_ALL = [
    "doing_recompute",
    "OptimizerCtx",
    "get_recompute_data",
    "save_for_recompute",
    "GradScaler",
    "optim",
    "RoundPipe",
    "RoundPipeRunConfig",
    "ModelExecutePlan",
    "wrap_model_to_roundpipe",
]

# Documented beside ``__all__`` and promoted to the top level by this project's design:
# ``__version__`` (the published module defines it), ``AutoRoundPipe`` (what
# ``wrap_model_to_roundpipe`` returns when no Sequential can be made) and
# ``RoundPipePackedData`` (what ``merge_output=False`` returns).
TOP_LEVEL_EXTRAS = ["__version__", "AutoRoundPipe", "RoundPipePackedData"]

# The published ``roundpipe.optim`` ships ``Adam`` only (a C++ kernel); this project
# provides these twelve, all backed by torch's own kernels.
OPTIMIZERS = [
    "Adam",
    "AdamW",
    "SGD",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "ASGD",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "Adafactor",
]


def _params(fn: Any) -> list[inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())
    return params[1:] if params and params[0].name == "self" else params


def _named(fn: Any) -> list[str]:
    """Names of the parameters that can be passed by position or keyword, in order."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    return [p.name for p in _params(fn) if p.kind in kinds]


def _assert_prefix(fn: Any, expected: list[str]) -> None:
    """``fn`` takes ``expected`` first, in this order (positional calls keep working)."""
    got = _named(fn)
    assert got[: len(expected)] == expected, (
        f"{getattr(fn, '__qualname__', fn)} takes {got}; the published signature starts {expected}"
    )


def _has_var(fn: Any, kind: inspect._ParameterKind) -> bool:
    return any(p.kind is kind for p in _params(fn))


# --------------------------------------------------------------------------- names
@pytest.fixture(scope="module")
def fresh_top_level() -> set[str]:
    """The names ``roundpipe_core`` defines right after ``import roundpipe_core``.

    Read in a fresh interpreter: in this one another test may have imported a
    submodule (``roundpipe_core.optim``), which makes it an attribute of the package
    whether or not the package exports it.
    """
    code = "import json, roundpipe_core; print(json.dumps(sorted(vars(roundpipe_core))))"
    # the same copy of the package as this process imported, whatever is installed
    root = str(Path(roundpipe_core.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("name", PUBLISHED_ALL + TOP_LEVEL_EXTRAS)
def test_name_defined_by_import_roundpipe_core(name: str, fresh_top_level: set[str]) -> None:
    where = "in the published roundpipe.__all__" if name in PUBLISHED_ALL else "top level by design"
    assert name in fresh_top_level, f"`import roundpipe_core` does not define {name!r} ({where})"


@pytest.mark.parametrize("name", PUBLISHED_ALL)
def test_published_name_in_all(name: str) -> None:
    # `from roundpipe import *` code must get the same names
    assert name in roundpipe_core.__all__, f"{name!r} missing from roundpipe_core.__all__"


def test_all_lists_only_existing_names() -> None:
    missing = [n for n in roundpipe_core.__all__ if not hasattr(roundpipe_core, n)]
    assert not missing, f"roundpipe_core.__all__ lists names it does not define: {missing}"


def test_version_is_a_release_string() -> None:
    version = roundpipe_core.__version__
    assert isinstance(version, str) and re.fullmatch(r"\d+\.\d+\.\d+\S*", version), version


def test_top_level_objects_are_the_submodule_ones() -> None:
    # one class per concept: the top-level name and the submodule name are the same object
    from roundpipe_core import amp, batch, optim

    assert roundpipe_core.GradScaler is amp.GradScaler
    assert roundpipe_core.optim is optim
    assert roundpipe_core.RoundPipePackedData is batch.RoundPipePackedData


# --------------------------------------------------------------------------- submodules
def test_optim_has_the_twelve_optimizers() -> None:
    from roundpipe_core import optim

    for name in OPTIMIZERS:
        cls = getattr(optim, name, None)
        assert isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer), name
        assert name in optim.__all__, name
        # a drop-in for torch's class of the same name: isinstance checks keep working
        assert issubclass(cls, getattr(torch.optim, name)), name


def test_optim_adam_takes_the_published_arguments() -> None:
    from roundpipe_core import optim

    published = [
        "params",
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "amsgrad",
        "foreach",
        "maximize",
        "capturable",
        "differentiable",
        "fused",
        "decoupled_weight_decay",
    ]
    names = [p.name for p in _params(optim.Adam)]
    assert [n for n in names if n in published] == published
    p = nn.Parameter(torch.ones(3))
    opt = optim.Adam([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.01, decoupled_weight_decay=True)
    assert opt.param_groups[0]["decoupled_weight_decay"] is True


def test_timer_verbose_flag() -> None:
    from roundpipe_core.timer import ModelTimer

    assert ModelTimer.VERBOSE is False  # published default: no per-layer printing


def test_documented_module_paths_are_the_engines_objects() -> None:
    """The public spellings ``roundpipe_core.timer`` and ``roundpipe_core.simulate``
    re-export the objects the engine uses, so ``ModelTimer.VERBOSE = True`` there
    switches the runtime's timer."""
    from roundpipe_core.planning import simulate as planning_simulate
    from roundpipe_core.running import timer as running_timer
    from roundpipe_core.simulate import simulate
    from roundpipe_core.timer import ModelTimer

    assert ModelTimer is running_timer.ModelTimer
    assert simulate is planning_simulate.simulate


def test_packed_data_is_a_list_with_synchronize() -> None:
    from roundpipe_core.batch import RoundPipePackedData

    packed = RoundPipePackedData([torch.zeros(1), torch.ones(1)], [(None, None), (None, None)])
    assert isinstance(packed, list) and len(packed) == 2
    packed.synchronize()  # CPU values: nothing in flight, returns at once


def test_grad_scaler_constructor_and_methods() -> None:
    from roundpipe_core.amp import GradScaler

    _assert_prefix(
        GradScaler,
        ["init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"],
    )
    scaler = GradScaler()
    assert scaler.get_scale() == 2.0**16  # published default init_scale
    for method in (
        "scale",
        "unscale_",
        "step",
        "update",
        "get_scale",
        "get_growth_factor",
        "set_growth_factor",
        "get_backoff_factor",
        "set_backoff_factor",
        "get_growth_interval",
        "set_growth_interval",
        "state_dict",
        "load_state_dict",
    ):
        assert callable(getattr(scaler, method, None)), method
    _assert_prefix(GradScaler.step, ["optimizer"])
    assert _has_var(GradScaler.step, inspect.Parameter.VAR_POSITIONAL)
    assert _has_var(GradScaler.step, inspect.Parameter.VAR_KEYWORD)
    for getter in ("get_growth_factor", "get_backoff_factor", "get_growth_interval"):
        _assert_prefix(getattr(GradScaler, getter), ["up_to_date"])
    # 0.1.1: update(new_scale=None); 0.1.2 added is_async=True (False: wait for the update)
    _assert_prefix(GradScaler.update, ["new_scale", "is_async"])
    assert inspect.signature(GradScaler.update).parameters["is_async"].default is True


# --------------------------------------------------------------------------- signatures
def test_roundpipe_constructor() -> None:
    _assert_prefix(
        roundpipe_core.RoundPipe,
        ["model", "optim_dtype", "name", "model_run_config", "pin_model"],
    )
    pin = inspect.signature(roundpipe_core.RoundPipe).parameters["pin_model"].default
    assert pin == "alloc"


def test_run_config_fields_in_published_order() -> None:
    fields = [
        "requires_grad",
        "output_device",
        "preserve_rng_state",
        "recompute_grain",
        "num_microbatch",
        "split_input",
        "split_label",
        "merge_output",
        "execute_plan",
    ]
    _assert_prefix(roundpipe_core.RoundPipeRunConfig, fields)
    cfg = roundpipe_core.RoundPipeRunConfig()
    assert all(getattr(cfg, f) is None for f in fields)  # unset = fall back to the model's


def test_run_config_takes_the_published_spec_forms() -> None:
    # split_input=(args_spec, kwargs_spec), split_label=spec, merge_output=True/False
    from roundpipe_core.batch import Replicate, TensorChunkSpec

    cfg = roundpipe_core.RoundPipeRunConfig(
        split_input=((TensorChunkSpec(0), Replicate), None),
        split_label=TensorChunkSpec(0),
        merge_output=False,
    )
    # the engine validates a config when it meets one: these forms must pass
    rp = roundpipe_core.RoundPipe(nn.Sequential(nn.Linear(2, 2)), model_run_config=cfg, devices=1)
    rp.close()


def test_forward_takes_run_config_keyword() -> None:
    params = inspect.signature(roundpipe_core.RoundPipe.forward).parameters
    assert params["roundpipe_run_config"].kind is inspect.Parameter.KEYWORD_ONLY
    assert _has_var(roundpipe_core.RoundPipe.forward, inspect.Parameter.VAR_POSITIONAL)
    assert _has_var(roundpipe_core.RoundPipe.forward, inspect.Parameter.VAR_KEYWORD)


def test_forward_backward_signature() -> None:
    fb = roundpipe_core.RoundPipe.forward_backward
    _assert_prefix(
        fb, ["input_args", "input_kwargs", "label", "loss_fn", "return_outputs", "run_config"]
    )
    # published default: the model's output is the loss (`lambda outputs, labels: outputs`)
    default = inspect.signature(fb).parameters["loss_fn"].default
    assert callable(default), f"loss_fn default is {default!r}; published: the output itself"
    out = torch.tensor(2.5)
    assert default(out, None) is out


def test_step_signature() -> None:
    step = roundpipe_core.RoundPipe.step
    _assert_prefix(step, ["step_fn", "is_async"])
    assert inspect.signature(step).parameters["is_async"].default is True
    # published: step(step_fn, is_async=True, *args, **kwargs) forwards to step_fn
    assert _has_var(step, inspect.Parameter.VAR_POSITIONAL), "step() takes no *args for step_fn"
    assert _has_var(step, inspect.Parameter.VAR_KEYWORD), "step() takes no **kwargs for step_fn"


def test_parameter_methods() -> None:
    rp_cls = roundpipe_core.RoundPipe
    _assert_prefix(rp_cls.optim_named_parameters, ["prefix", "remove_duplicate"])
    defaults = inspect.signature(rp_cls.optim_named_parameters).parameters
    assert defaults["prefix"].default == "" and defaults["remove_duplicate"].default is True
    assert _named(rp_cls.optim_parameters) == []
    assert _named(rp_cls.synchronize) == []
    _assert_prefix(rp_cls.set_original_model, ["original_model"])


def test_wrap_model_to_roundpipe_signature() -> None:
    wrap = roundpipe_core.wrap_model_to_roundpipe
    _assert_prefix(
        wrap,
        [
            "model",
            "use_sequential_preset",
            "lower_threshold",
            "upper_threshold",
            "skip_modules",
            "override_config",
            "model_run_config",
            "name",
        ],
    )
    params = inspect.signature(wrap).parameters
    # None = use a preset if there is one, else the automatic split; thresholds in bytes
    assert params["use_sequential_preset"].default is None
    assert params["lower_threshold"].default == 16 * 1024
    assert params["upper_threshold"].default is None
    assert _has_var(wrap, inspect.Parameter.VAR_KEYWORD)  # more RoundPipe(...) arguments


def test_model_execute_plan() -> None:
    plan = roundpipe_core.ModelExecutePlan()
    assert plan.fwd_plan == [] and plan.bwd_plan == []
    plan.fwd_plan = [range(0, 2)]
    plan.bwd_plan = [range(1, 2), range(0, 1)]
    plan.check_valid(2, "train")
    assert callable(roundpipe_core.ModelExecutePlan.auto)


def test_model_execute_plan_auto_takes_the_published_keywords() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    rp = roundpipe_core.RoundPipe(model, devices="cpu:2")
    try:
        for run_type in ("infer", "train", "fused"):
            plan = roundpipe_core.ModelExecutePlan.auto(
                run_type, rp, min_stages=2, upper_threshold=1.1, model_memory_limit=1.0
            )
            plan.check_valid(rp.num_layers, run_type)
        plans = roundpipe_core.ModelExecutePlan.auto("fused", rp, rp)
        assert isinstance(plans, list) and len(plans) == 2  # several models: one plan each
    finally:
        rp.close()


def test_context_functions() -> None:
    assert roundpipe_core.doing_recompute() is False  # outside any RoundPipe call
    roundpipe_core.save_for_recompute(torch.ones(1))  # a no-op outside a forward
    with roundpipe_core.OptimizerCtx():
        pass
