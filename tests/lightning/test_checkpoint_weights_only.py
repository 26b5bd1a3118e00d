"""``fit(ckpt_path=..., weights_only=...)`` under RoundPipeStrategy reads the file as the
user asked, as plain Lightning does (issue 23 item 10): a trusted checkpoint whose
hyperparameters hold a ``pathlib.Path`` resumes with ``weights_only=False`` and is refused,
as by plain Lightning, with the default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rpl_helpers import SeqModule, loader, params_of, plain_trainer, rp_trainer


class PathModule(SeqModule):
    """A module whose saved hyperparameters hold a ``pathlib.Path`` (not an allow-listed
    type for ``torch.load(weights_only=True)``)."""

    def __init__(self, data_dir: Path = Path("/tmp/data"), **kw: Any) -> None:
        super().__init__(**kw)
        self.save_hyperparameters()


def _checkpoint(tmp_path: Path, trainer: Any) -> Path:
    m = PathModule(data_dir=tmp_path / "data", mode=_mode(trainer))
    trainer.fit(m, loader())
    path = tmp_path / "two_steps.ckpt"
    trainer.save_checkpoint(path)
    return path


def _mode(trainer: Any) -> str:
    return "plain" if type(trainer.strategy).__name__ != "RoundPipeStrategy" else "roundpipe"


def test_trusted_checkpoint_with_a_path_resumes_as_under_plain_lightning(tmp_path: Path) -> None:
    rp_path = _checkpoint(tmp_path / "rp", rp_trainer(max_steps=2))
    plain_path = _checkpoint(tmp_path / "plain", plain_trainer(max_steps=2))
    assert "data_dir" in torch.load(rp_path, weights_only=False)["hyper_parameters"]

    resumed = PathModule(seed=7)  # another init: the weights come from the checkpoint
    t = rp_trainer(max_steps=4)
    t.fit(resumed, loader(), ckpt_path=rp_path, weights_only=False)
    plain = PathModule(seed=7, mode="plain")
    tp = plain_trainer(max_steps=4)
    tp.fit(plain, loader(), ckpt_path=plain_path, weights_only=False)

    assert t.global_step == tp.global_step == 4
    assert len(resumed.losses) == len(plain.losses) == 2
    for a, b in zip(resumed.losses, plain.losses):
        assert a == pytest.approx(b, rel=1e-5)
    pr, pp = params_of(resumed), params_of(plain)
    for k in pr:
        torch.testing.assert_close(pr[k], pp[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weights_only", [None, True], ids=["default", "true"])
def test_untrusted_load_refuses_the_path_as_plain_lightning_does(
    tmp_path: Path, weights_only: bool | None
) -> None:
    path = _checkpoint(tmp_path, rp_trainer(max_steps=2))
    with pytest.raises(Exception, match="Unsupported global.*PosixPath") as plain_err:
        plain_trainer(max_steps=4).fit(
            PathModule(mode="plain"), loader(), ckpt_path=path, weights_only=weights_only
        )
    with pytest.raises(type(plain_err.value), match="Unsupported global.*PosixPath"):
        rp_trainer(max_steps=4).fit(
            PathModule(), loader(), ckpt_path=path, weights_only=weights_only
        )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fabric_load_reads_the_file_as_asked(tmp_path: Path) -> None:
    """The Fabric strategy's ``fabric.load(..., weights_only=...)`` reaches the file too."""
    from lightning.fabric import Fabric
    from rpl_helpers import build_net

    from roundpipe_lightning import RoundPipeFabricStrategy

    def setup() -> tuple[Fabric, Any, Any]:
        fabric = Fabric(
            strategy=RoundPipeFabricStrategy(num_microbatch=3), accelerator="cpu", devices=2
        )
        net = build_net()
        model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        return fabric, model, opt

    fabric, model, opt = setup()
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "data_dir": tmp_path})
    fabric.strategy.teardown()
    fabric, model, opt = setup()
    try:
        with pytest.raises(Exception, match="Unsupported global.*PosixPath"):
            fabric.load(path, {"model": model, "optimizer": opt})
        state = {"model": model, "optimizer": opt, "data_dir": None}
        fabric.load(path, state, weights_only=False)
        assert state["data_dir"] == tmp_path
    finally:
        fabric.strategy.teardown()
