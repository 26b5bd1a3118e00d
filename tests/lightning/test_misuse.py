"""What a Lightning user can get wrong, or that used to go silently wrong under the
strategy (issue 23): each case either gives the right numbers or a clear error."""

from __future__ import annotations

from typing import Any

import pytest
from rpl_helpers import SeqModule, loader, max_rel_err, params_of, rp_trainer

TOL = 1e-6


class ZeroGradFirst(SeqModule):
    """Manual optimization in the order Lightning's docs show: ``zero_grad()`` before
    the backward, then ``step()``."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.roundpipe.forward_backward(input_args=(x,), label=y, loss_fn=self.loss_fn)
        self.losses.append(float(loss))
        opt.step()
        return loss


@pytest.mark.parametrize("module", [SeqModule, ZeroGradFirst])
def test_manual_optimization_with_async_step_equals_automatic(module: type) -> None:
    """opt.step(); opt.zero_grad() (or zero_grad() first) with the asynchronous step: the
    user's zero_grad runs after the queued step instead of clearing the gradients it
    still reads, so manual optimization trains exactly as automatic does."""
    auto = SeqModule(optimizer="sgd")
    rp_trainer(max_steps=6, async_step=True).fit(auto, loader())
    manual = module(manual=True, optimizer="sgd")
    rp_trainer(max_steps=6, async_step=True).fit(manual, loader())
    assert max_rel_err(params_of(manual), params_of(auto)) <= TOL
    assert manual.losses == pytest.approx(auto.losses, rel=1e-6)
    # and the optimizers got their own zero_grad back at teardown
    assert "zero_grad" not in vars(manual.trainer.optimizers[0])
    assert max_rel_err(params_of(manual), params_of(SeqModule())) > 1e-2


def test_manual_zero_grad_still_clears_unstepped_gradients() -> None:
    """A zero_grad() after a forward_backward that no step consumed clears them (as in
    plain PyTorch): the ordered zero_grad is not a no-op."""

    class DiscardOdd(SeqModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            opt = self.optimizers()
            # gradients of a throw-away pass, cleared before the real one
            self.roundpipe.forward_backward(input_args=(x * 3,), label=y, loss_fn=self.loss_fn)
            opt.zero_grad()
            loss = self.roundpipe.forward_backward(input_args=(x,), label=y, loss_fn=self.loss_fn)
            self.losses.append(float(loss))
            opt.step()
            return loss

    auto = SeqModule(optimizer="sgd")
    rp_trainer(max_steps=4, async_step=True).fit(auto, loader())
    manual = DiscardOdd(manual=True, optimizer="sgd")
    rp_trainer(max_steps=4, async_step=True).fit(manual, loader())
    assert max_rel_err(params_of(manual), params_of(auto)) <= TOL
