"""``Fabric(strategy="roundpipe")``: set-up, the optimizer on the masters, the same
weights as plain Fabric, checkpoints that resume exactly, ``fabric.backward`` and
the errors a user can cause."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from rpl_helpers import IN_DIM, OUT_DIM, build_net
from torch import nn

from roundpipe_core import RoundPipe
from roundpipe_lightning import RoundPipeFabricStrategy
from roundpipe_lightning.checkpoint_io import CHECKPOINT_KEY

BATCH = 10  # over 3 microbatches: 4, 3, 3 (uneven)
STEPS = 4

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _data(steps: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, IN_DIM, generator=g), torch.randn(BATCH, OUT_DIM, generator=g))
        for _ in range(steps)
    ]


def sum_normalised_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each microbatch's squared error over the full batch's element count: under
    ``loss_reduction="sum"`` the microbatch losses add up to the batch's ``F.mse_loss``."""
    return ((out - y) ** 2).sum() / (BATCH * OUT_DIM)


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def _fabric(**strategy_kw: Any) -> Fabric:
    kw = {"num_microbatch": 3, **strategy_kw}
    return Fabric(strategy=RoundPipeFabricStrategy(**kw), accelerator="cpu", devices=2)


@pytest.fixture
def teardown() -> Any:
    """Tear down the Fabric strategies a test made (stops their RoundPipes' threads)."""
    made: list[Fabric] = []
    yield made.append
    for fabric in made:
        fabric.strategy.teardown()


def _plain_weights(
    kind: str, data: list, seed: int = 0, precision: Any = "32-true"
) -> dict[str, torch.Tensor]:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    net = build_net(seed)
    model, opt = fabric.setup(net, _optimizer(kind, net.parameters()))
    for x, y in data:
        opt.zero_grad()
        fabric.backward(F.mse_loss(model(x), y))
        opt.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


def _train(
    model: Any, opt: Any, fabric: Fabric, data: list, mode: str, loss_fn: Any = F.mse_loss
) -> list[float]:
    """Plain Fabric's loop; ``forward_backward`` with a batch-mean ``loss_fn`` (the
    strategy's default ``loss_reduction="mean"``) or ``model(x)`` + ``fabric.backward``."""
    losses = []
    for x, y in data:
        opt.zero_grad()
        if mode == "forward_backward":
            loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        else:
            loss = F.mse_loss(model(x), y)
            fabric.backward(loss)
        opt.step()
        losses.append(float(loss))
    return losses


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        err = (got[k] - want[k]).abs().max().item()
        scale = want[k].abs().max().item() + 1e-12
        assert err <= tol * scale, f"{k}: max error {err:.3g} (relative {err / scale:.3g})"


# -- set-up ----------------------------------------------------------------------------------


def test_the_name_resolves_to_the_strategy_with_the_pool_of_fabric_devices(teardown) -> None:
    fabric = Fabric(strategy="roundpipe", accelerator="cpu", devices=3)
    teardown(fabric)
    assert isinstance(fabric.strategy, RoundPipeFabricStrategy)
    assert len(fabric.strategy.compute_devices) == 3
    net = build_net()
    model, _ = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(model.roundpipe, RoundPipe) and model.roundpipe.num_devices == 3
    assert fabric.device == torch.device("cpu")  # batches and state stay on the host


def test_setup_gives_the_roundpipe_calls_and_points_the_optimizer_at_the_masters(
    teardown,
) -> None:
    fabric = _fabric()
    teardown(fabric)
    net = build_net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    rp = model.roundpipe
    assert callable(model.forward_backward) and callable(model.synchronize)
    masters = {id(m) for m in rp.optim_parameters()}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == masters
    x, y = _data(1)[0]
    with torch.no_grad():
        assert torch.allclose(model(x), build_net()(x), atol=1e-6)  # pipelined forward
    # the RoundPipe is not a submodule: the state dict keeps the network's own names
    assert model.state_dict().keys() == build_net().state_dict().keys()

    before = {k: v.clone() for k, v in net.state_dict().items()}
    model.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    assert all(m.grad is not None for m in rp.optim_parameters())
    opt.step()
    assert all(m.grad is None for m in rp.optim_parameters())  # the step cleared them
    opt.zero_grad()
    model.synchronize()
    assert any(not torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_teardown_takes_the_calls_off_and_leaves_the_trained_weights() -> None:
    fabric = _fabric(async_step=True)
    net = build_net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    _train(model, opt, fabric, _data(2), "forward_backward")
    rp = model.roundpipe
    fabric.strategy.teardown()
    assert not any(hasattr(net, name) for name in ("forward_backward", "synchronize", "roundpipe"))
    assert "zero_grad" not in vars(opt.optimizer)
    # the step queued last (asynchronous) reached the module's own weights
    masters = rp.optim_parameters()
    assert masters[0] is not next(net.parameters())
    assert all(torch.equal(p, m) for p, m in zip(net.parameters(), masters))


# -- the same numbers as plain Fabric ----------------------------------------------------


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", ["forward_backward", "forward"])
def test_training_gives_plain_fabrics_weights(kind: str, mode: str, teardown) -> None:
    data = _data()
    want = _plain_weights(kind, data)
    fabric = _fabric(fuse_optimizer=False)
    teardown(fabric)
    net = build_net()
    model, opt = fabric.setup(net, _optimizer(kind, net.parameters()))
    _train(model, opt, fabric, data, mode)
    model.synchronize()
    _assert_same(net.state_dict(), want, 1e-5)


def _plain_output(precision: str, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    model = fabric.setup(build_net())
    with torch.no_grad():
        out = model(x)
    return out, F.mse_loss(out, y)


def test_bf16_mixed_runs_the_layers_under_autocast(teardown) -> None:
    ((x, y),) = _data(1)
    want_out, want_loss = _plain_output("bf16-mixed", x, y)
    fp32_out, fp32_loss = _plain_output("32-true", x, y)
    assert (want_out - fp32_out).abs().max() > 5e-4  # bf16 rounding shows at this size
    fabric = Fabric(
        strategy=RoundPipeFabricStrategy(num_microbatch=3),
        accelerator="cpu",
        devices=2,
        precision="bf16-mixed",
    )
    teardown(fabric)
    net = build_net()
    model, opt = fabric.setup(net, _optimizer("sgd", net.parameters()))
    with torch.no_grad():
        out = model(x)
    assert out.dtype == torch.float32  # Fabric's output conversion
    assert (out - want_out).abs().max() < 1e-4  # plain bf16-mixed's numbers, not fp32's
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    assert abs(float(loss) - float(want_loss)) < abs(float(want_loss) - float(fp32_loss)) / 4
    opt.step()


def test_a_module_that_is_not_a_sequential_runs_split_automatically(teardown) -> None:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inp, self.mid, self.out = (
                nn.Linear(IN_DIM, 16),
                nn.Linear(16, 16),
                nn.Linear(16, OUT_DIM),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.inp(x))
            return self.out(h + torch.tanh(self.mid(h)))

    data = _data(2)
    plain = Fabric(accelerator="cpu", devices=1)
    ref_net = Residual()
    ref, ref_opt = plain.setup(ref_net, torch.optim.SGD(ref_net.parameters(), lr=0.1))
    for x, y in data:
        ref_opt.zero_grad()
        plain.backward(F.mse_loss(ref(x), y))
        ref_opt.step()

    fabric = _fabric()
    teardown(fabric)
    net = Residual()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = data[0]
    with pytest.raises(TypeError, match=r"no forward_backward.*fabric\.backward\(loss\)"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    _train(model, opt, fabric, data, "forward")
    model.synchronize()
    _assert_same(net.state_dict(), ref_net.state_dict(), 1e-5)


def test_the_published_sum_is_one_argument_away(teardown) -> None:
    data = _data()
    want = _plain_weights("sgd", data)
    fabric = _fabric(loss_reduction="sum")
    teardown(fabric)
    net = build_net()
    model, opt = fabric.setup(net, _optimizer("sgd", net.parameters()))
    _train(model, opt, fabric, data, "forward_backward", loss_fn=sum_normalised_mse)
    model.synchronize()
    _assert_same(net.state_dict(), want, 1e-5)


def test_default_arguments_and_the_name_give_plain_fabrics_weights(teardown) -> None:
    """Fabric(strategy="roundpipe") as a user writes it: default arguments (3 devices: 4
    microbatches, 3, 3, 2, 2 rows of a batch of 10), launch(), a batch-mean loss."""
    data = _data()
    want = _plain_weights("adamw", data)
    fabric = Fabric(strategy="roundpipe", accelerator="cpu", devices=3)
    teardown(fabric)
    fabric.launch()
    net = build_net()
    model, opt = fabric.setup(net, _optimizer("adamw", net.parameters()))
    losses = _train(model, opt, fabric, data, "forward_backward")
    assert all(isinstance(v, float) for v in losses)
    _assert_same(model.state_dict(), want, 1e-5)  # state_dict() synchronizes


def test_state_dict_holds_the_last_queued_step(teardown) -> None:
    fabric = _fabric(async_step=True)
    teardown(fabric)
    net = build_net()
    model, opt = fabric.setup(net, _optimizer("sgd", net.parameters()))
    _train(model, opt, fabric, _data(2), "forward_backward")
    state = net.state_dict()  # no synchronize() first: the pre-hook does it
    masters = dict(model.roundpipe.optim_named_parameters())
    assert masters["0.weight"] is not net[0].weight
    for name, m in masters.items():
        assert torch.equal(state[name], m), name


def test_zero_grad_without_a_step_discards_the_gradients(teardown) -> None:
    data = _data(2)
    want = _plain_weights("sgd", data[1:])  # only the second batch's gradients count
    fabric = _fabric()
    teardown(fabric)
    net = build_net()
    model, opt = fabric.setup(net, _optimizer("sgd", net.parameters()))
    (x0, y0), (x1, y1) = data
    model.forward_backward(input_args=(x0,), label=y0, loss_fn=F.mse_loss)
    opt.zero_grad()  # nothing queued will clear these: cleared now
    model.forward_backward(input_args=(x1,), label=y1, loss_fn=F.mse_loss)
    opt.step()
    model.synchronize()
    _assert_same(net.state_dict(), want, 1e-5)


class _GatedSGD(torch.optim.SGD):
    """An SGD whose step waits until the test opens the gate: a queued step still in
    flight while the training loop goes on."""

    gate = threading.Event()

    def step(self, closure: Any = None) -> Any:
        assert self.gate.wait(timeout=20), "the test never opened the gate"
        return super().step(closure)


def test_zero_grad_while_a_queued_step_waits_leaves_its_gradients(teardown) -> None:
    """``opt.zero_grad()`` right after ``opt.step()`` -- through Fabric's optimizer wrapper,
    which calls the class's ``zero_grad`` -- must not clear the gradients the queued step
    has not read yet."""
    data = _data(1)
    want = _plain_weights("sgd", data)
    fabric = _fabric(async_step=True)
    teardown(fabric)
    net = build_net()
    model, opt = fabric.setup(net, _GatedSGD(net.parameters(), lr=0.05, momentum=0.9))
    _GatedSGD.gate.clear()
    try:
        ((x, y),) = data
        model.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        opt.step()  # queued on the optimizer thread, waiting at the gate
        opt.zero_grad()
        assert all(m.grad is not None for m in model.roundpipe.optim_parameters())
    finally:
        _GatedSGD.gate.set()
    model.synchronize()
    _assert_same(net.state_dict(), want, 1e-5)


# -- fabric.backward -----------------------------------------------------------------------


def test_backward_of_a_forward_backward_loss_does_nothing(teardown) -> None:
    fabric = _fabric()
    teardown(fabric)
    net = build_net()
    model, _ = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _data(1)[0]
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    grads = [m.grad.clone() for m in model.roundpipe.optim_parameters()]
    fabric.backward(loss)  # already backpropagated: not a second time
    assert all(torch.equal(g, m.grad) for g, m in zip(grads, model.roundpipe.optim_parameters()))


def test_backward_of_a_tensor_without_a_graph_says_what_to_call(teardown) -> None:
    fabric = _fabric()
    teardown(fabric)
    net = build_net()
    model, _ = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _data(1)[0]
    with torch.no_grad():
        loss = F.mse_loss(model(x), y)
    with pytest.raises(RuntimeError, match=r"model\.forward_backward\(input_args"):
        fabric.backward(loss)


def test_backward_of_a_loss_from_the_unwrapped_network_is_refused(teardown) -> None:
    fabric = _fabric()
    teardown(fabric)
    net = build_net()
    model, _ = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _data(1)[0]
    loss = F.mse_loss(net(x), y)  # bypasses RoundPipe: the masters would get nothing
    with pytest.raises(RuntimeError, match="the module fabric.setup\\(\\) returned"):
        fabric.backward(loss)


# -- checkpoints ---------------------------------------------------------------------------


def _resume_run(
    tmp_path: Path,
    make_net: Callable[[], nn.Module],
    kind: str,
    dtype: torch.dtype = torch.float32,
    **strategy_kw: Any,
) -> None:
    """Train 2 steps, save, train 3 more; a fresh run (another init) that loads the file
    and trains the same 3 steps ends with exactly the same weights and optimizer state."""
    data = [(x.to(dtype), y.to(dtype)) for x, y in _data(5)]
    path = tmp_path / "ckpt.pt"

    fabric = _fabric(**strategy_kw)
    net = make_net()
    model, opt = fabric.setup(net, _optimizer(kind, net.parameters()))
    _train(model, opt, fabric, data[:2], "forward_backward")
    fabric.save(path, {"model": model, "optimizer": opt, "step": 2})
    _train(model, opt, fabric, data[2:], "forward_backward")
    model.synchronize()
    want = {k: v.clone() for k, v in net.state_dict().items()}
    want_masters = [m.detach().clone() for m in model.roundpipe.optim_parameters()]
    want_state = opt.state_dict()["state"]
    fabric.strategy.teardown()

    fabric = _fabric(**strategy_kw)
    net = make_net()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)  # another starting point: everything must come from the file
    model, opt = fabric.setup(net, _optimizer(kind, net.parameters()))
    state = {"model": model, "optimizer": opt, "step": 0}
    remainder = fabric.load(path, state)
    assert state["step"] == 2 and CHECKPOINT_KEY not in remainder
    _train(model, opt, fabric, data[2:], "forward_backward")
    model.synchronize()
    for k, v in net.state_dict().items():
        assert torch.equal(v, want[k]), k
    for m, w in zip(model.roundpipe.optim_parameters(), want_masters):
        assert m.dtype == w.dtype and torch.equal(m, w)
    got_state = opt.state_dict()["state"]
    for i, s in want_state.items():
        for key, value in s.items():
            assert torch.equal(torch.as_tensor(got_state[i][key]), torch.as_tensor(value)), key
    fabric.strategy.teardown()


@pytest.mark.parametrize("async_step", [False, True])
def test_save_and_load_continue_exactly(tmp_path: Path, async_step: bool) -> None:
    _resume_run(tmp_path, build_net, "adamw", async_step=async_step)


def test_fp32_masters_of_a_bf16_module_are_saved_and_restored(tmp_path: Path) -> None:
    _resume_run(tmp_path, lambda: build_net().to(torch.bfloat16), "sgd", torch.bfloat16)
    sections = torch.load(tmp_path / "ckpt.pt", weights_only=True)[CHECKPOINT_KEY]
    masters = sections["model"]["masters"]
    assert masters and all(m.dtype == torch.float32 for m in masters.values())


def test_a_plain_fabric_checkpoint_loads_into_roundpipe(tmp_path: Path, teardown) -> None:
    data = _data(3)
    plain = Fabric(accelerator="cpu", devices=1)
    net = build_net()
    model, opt = plain.setup(net, _optimizer("adamw", net.parameters()))
    for x, y in data[:1]:
        opt.zero_grad()
        plain.backward(F.mse_loss(model(x), y))
        opt.step()
    plain.save(tmp_path / "plain.pt", {"model": model, "optimizer": opt})
    for x, y in data[1:]:
        opt.zero_grad()
        plain.backward(F.mse_loss(model(x), y))
        opt.step()
    want = {k: v.clone() for k, v in net.state_dict().items()}

    fabric = _fabric(fuse_optimizer=False)
    teardown(fabric)
    net = build_net(seed=5)
    model, opt = fabric.setup(net, _optimizer("adamw", net.parameters()))
    fabric.load(tmp_path / "plain.pt", {"model": model, "optimizer": opt})
    _train(model, opt, fabric, data[1:], "forward")
    model.synchronize()
    _assert_same(net.state_dict(), want, 1e-5)


def test_loading_optimizer_state_of_other_parameters_raises(tmp_path: Path, teardown) -> None:
    """Fused kernels do not check state shapes: an optimizer saved while it listed the
    parameters in another order is refused at fabric.load(), naming the parameter."""
    fabric = _fabric()
    teardown(fabric)
    net = build_net()
    model, opt = fabric.setup(net, _optimizer("adamw", list(net.parameters())[::-1]))
    _train(model, opt, fabric, _data(1), "forward_backward")
    fabric.save(tmp_path / "reversed.pt", {"model": model, "optimizer": opt})

    fabric = _fabric()
    teardown(fabric)
    net = build_net()
    model, opt = fabric.setup(net, _optimizer("adamw", net.parameters()))
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter '\d+\.\w+' has shape"):
        fabric.load(tmp_path / "reversed.pt", {"model": model, "optimizer": opt})


def test_a_roundpipe_checkpoint_loads_into_plain_fabric(tmp_path: Path, teardown) -> None:
    fabric = _fabric()
    teardown(fabric)
    net = build_net()
    model, opt = fabric.setup(net, _optimizer("adamw", net.parameters()))
    _train(model, opt, fabric, _data(2), "forward_backward")
    fabric.save(tmp_path / "rp.pt", {"model": model, "optimizer": opt})
    model.synchronize()

    plain = Fabric(accelerator="cpu", devices=1)
    other = build_net(seed=3)
    pmodel, popt = plain.setup(other, _optimizer("adamw", other.parameters()))
    remainder = plain.load(tmp_path / "rp.pt", {"model": pmodel, "optimizer": popt})
    assert set(remainder) == {CHECKPOINT_KEY}
    for k, v in net.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    assert popt.state_dict()["state"][0]["exp_avg"].shape == net[0].weight.shape


def test_clip_gradients_clips_the_masters_as_plain_fabric(teardown) -> None:
    data = _data(3)
    plain = Fabric(accelerator="cpu", devices=1)
    ref_net = build_net()
    ref, ref_opt = plain.setup(ref_net, _optimizer("sgd", ref_net.parameters()))
    fabric = _fabric()
    teardown(fabric)
    net = build_net()
    model, opt = fabric.setup(net, _optimizer("sgd", net.parameters()))
    for x, y in data:
        plain.backward(F.mse_loss(ref(x), y))
        want = plain.clip_gradients(ref, ref_opt, max_norm=0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        model.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        norm = fabric.clip_gradients(model, opt, max_norm=0.05)
        assert torch.allclose(norm, want, rtol=1e-5)
        opt.step()
        opt.zero_grad()
    model.synchronize()
    _assert_same(net.state_dict(), ref_net.state_dict(), 1e-5)


# -- errors a user can cause -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_microbatch": 0}, ValueError, r"RoundPipeFabricStrategy\(num_microbatch=0\)"),
        ({"async_step": "yes"}, TypeError, r"RoundPipeFabricStrategy\(async_step='yes'\)"),
        ({"pin_model": "pinned"}, ValueError, "pin_model must be one of"),
        ({"recompute_grain": "block"}, ValueError, "recompute_grain must be one of"),
        ({"optim_dtype": "int8"}, ValueError, "optim_dtype='int8'"),
        ({"execute_plan": 3}, TypeError, "execute_plan must be None or 'auto'"),
        (
            {"model_run_config": {}},
            TypeError,
            "model_run_config must be None or a RoundPipeRunConfig",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        RoundPipeFabricStrategy(**kwargs)


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_unsupported_precision_is_refused_when_fabric_is_made(precision: str) -> None:
    with pytest.raises(ValueError, match=r"precision='32-true'\) or 'bf16-mixed'.*net\.to"):
        Fabric(strategy="roundpipe", accelerator="cpu", devices=2, precision=precision)


def test_several_processes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # what torchrun --nproc-per-node 2 sets: Fabric picks its TorchElastic environment
    env = {"RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    env.update({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"})
    env["TORCHELASTIC_RUN_ID"] = "test"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    fabric = Fabric(strategy="roundpipe", accelerator="cpu", devices=2)
    net = build_net()
    assert type(fabric.strategy.cluster_environment).__name__ == "TorchElasticEnvironment"
    with pytest.raises(ValueError, match="one process per node.*LOCAL_WORLD_SIZE=2.*no torchrun"):
        fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))


def test_an_optimizer_of_other_parameters_is_refused(teardown) -> None:
    fabric = _fabric()
    teardown(fabric)
    model = fabric.setup(build_net())
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="holds none of the parameters"):
        fabric.setup_optimizers(other)
    assert isinstance(model.roundpipe, RoundPipe)


def test_lbfgs_and_a_step_closure_are_refused(teardown) -> None:
    fabric = _fabric()
    teardown(fabric)
    net = build_net()
    model = fabric.setup(net)
    with pytest.raises(TypeError, match="LBFGS"):
        fabric.setup_optimizers(torch.optim.LBFGS(net.parameters()))
    opt = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _data(1)[0]
    model.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    with pytest.raises(TypeError, match="closure"):
        opt.step(closure=lambda: 0.0)


def test_a_module_with_a_roundpipe_call_name_is_refused(teardown) -> None:
    class Net(nn.Sequential):
        def synchronize(self) -> None:
            pass

    fabric = _fabric()
    teardown(fabric)
    with pytest.raises(ValueError, match="already has 'synchronize'"):
        fabric.setup(Net(nn.Linear(2, 2)))


def test_a_module_set_up_twice_is_refused(teardown) -> None:
    fabric = _fabric()
    teardown(fabric)
    net = build_net()
    fabric.setup(net)
    with pytest.raises(ValueError, match="set each module up once"):
        fabric.setup(net)
