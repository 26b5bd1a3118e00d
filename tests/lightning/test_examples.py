"""The README's example (a byte-level LM fine-tune) and the LightningCLI config run end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from rpl_helpers import roundpipe_threads
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from roundpipe_lightning import RoundPipeStrategy

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))


def _scalars(log_dir: Path) -> set[str]:
    files = sorted(log_dir.rglob("events.out.tfevents.*"))
    tags: set[str] = set()
    for f in files:
        acc = EventAccumulator(str(f))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


def test_finetune_example_trains_with_falling_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import lightning_finetune

    res = lightning_finetune.main(
        [
            "--out-dir",
            str(tmp_path),
            "--max-steps",
            "40",
            "--d-model",
            "32",
            "--n-layers",
            "2",
            "--n-heads",
            "2",
            "--seq-len",
            "32",
            "--batch-size",
            "8",
            "--val-every",
            "20",
            "--generate",
            "20",
            "--no-progress-bar",
            "--lr",
            "1e-2",
        ]
    )
    losses = res["losses"]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert res["val_loss"] < 5.0  # below uniform over bytes (ln 256 = 5.55)
    assert list((tmp_path / "checkpoints").glob("*.ckpt"))
    tags = _scalars(tmp_path)
    assert {"train_loss", "val_loss", "roundpipe/stage/fused0_ms", "roundpipe/tokens_per_s"} <= tags
    out = capsys.readouterr().out
    assert "sample:\nThe river " in out and "trained 40 steps" in out
    assert roundpipe_threads() == []


def test_finetune_example_resume_and_init_from(tmp_path: Path) -> None:
    import lightning_finetune

    small = [
        "--d-model",
        "32",
        "--n-layers",
        "2",
        "--n-heads",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "8",
        "--val-every",
        "10",
        "--generate",
        "0",
        "--no-progress-bar",
    ]
    lightning_finetune.main(["--out-dir", str(tmp_path / "a"), "--max-steps", "10", *small])
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    res = lightning_finetune.main(
        ["--out-dir", str(tmp_path / "a"), "--max-steps", "14", "--resume", str(last), *small]
    )
    assert res["trainer"].global_step == 14 and len(res["losses"]) == 4
    res = lightning_finetune.main(
        [
            "--out-dir",
            str(tmp_path / "b"),
            "--max-steps",
            "3",
            "--init-from",
            str(last),
            "--layout",
            "fwd=1,1 bwd=2,1,1",
            "--precision",
            "bf16-true",
            *small,
        ]
    )
    assert len(res["losses"]) == 3


def test_cli_config_sets_strategy_layout_and_callbacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("jsonargparse")
    import cli

    from roundpipe_lightning import AutoReplan, StageTimeLogger

    monkeypatch.chdir(tmp_path)
    run = cli.main(
        [
            "fit",
            "--config",
            str(EXAMPLES / "config.yaml"),
            "--data.path",
            str(EXAMPLES / "data" / "tiny_corpus.txt"),
            "--trainer.max_steps",
            "6",
            "--trainer.val_check_interval",
            "3",
            "--trainer.enable_progress_bar",
            "false",
            "--model.d_model",
            "32",
            "--model.n_heads",
            "2",
            "--model.seq_len",
            "32",
            "--data.seq_len",
            "32",
            "--data.batch_size",
            "8",
        ]
    )
    trainer = run.trainer
    assert isinstance(trainer.strategy, RoundPipeStrategy)
    assert trainer.strategy.execute_plan == "fwd=2,2 bwd=2,1,1,1,1"
    assert trainer.strategy.num_microbatch == 4 and trainer.num_devices == 2
    rp = trainer.strategy.roundpipe
    assert rp.plan_for("fused").to_layout_string() == "fwd=2,2 bwd=2,1,1,1,1"
    kinds = {type(c) for c in trainer.callbacks}
    assert {AutoReplan, StageTimeLogger} <= kinds
    assert trainer.global_step == 6
    assert (tmp_path / "runs" / "cli" / "checkpoints" / "last.ckpt").exists()
    assert "val_loss" in _scalars(tmp_path / "runs" / "cli")
    assert roundpipe_threads() == []


class _RunsCode:
    """Unpickling this calls ``Path.touch(marker)``: what a crafted checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_finetune_example_init_from_runs_no_code(tmp_path: Path) -> None:
    import pickle

    import lightning_finetune
    import torch

    marker = tmp_path / "code_ran"
    crafted = tmp_path / "crafted.ckpt"
    torch.save({"state_dict": {}, "payload": _RunsCode(marker)}, crafted)
    with pytest.raises(pickle.UnpicklingError):
        lightning_finetune.main(["--out-dir", str(tmp_path), "--init-from", str(crafted)])
    assert not marker.exists()


# The example loads its model quantized through transformers, which asks CUDA for a
# device whenever it reports one; under fake CUDA (a torch without CUDA) that fails
# before RoundPipe runs. What the fake GPU sees of a 4-bit model is tested in
# tests/presets/test_qlora_on_the_wire.py; this test is about the example training.
@pytest.mark.cpu_backend
def test_qlora_example_trains_adapters_over_an_unchanged_4bit_base(
    capsys: pytest.CaptureFixture,
) -> None:
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    import qlora_finetune

    res = qlora_finetune.main(
        [
            "--steps",
            "8",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--seq",
            "32",
            "--batch",
            "4",
            "--lr",
            "2e-2",
        ]
    )
    losses = res["losses"]
    assert len(losses) == 8
    assert sum(losses[-3:]) / 3 < losses[0]
    assert res["base_unchanged"]
    assert "4-bit base unchanged: True" in capsys.readouterr().out
    assert roundpipe_threads() == []
