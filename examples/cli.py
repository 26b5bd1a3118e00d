"""LightningCLI entry point for the byte-level LM of ``lightning_finetune.py``.

The Trainer -- RoundPipe strategy, its layout string, callbacks, logger -- comes
from a YAML file::

    python examples/cli.py fit --config examples/config.yaml
    python examples/cli.py fit --config examples/config.yaml \\
        --trainer.strategy.init_args.execute_plan "fwd=3,2 bwd=1,1,1,1,1,1"   # override any value
    python examples/cli.py validate --config examples/config.yaml --ckpt_path runs/cli/checkpoints/last.ckpt

``python examples/cli.py fit --help`` lists every option; ``--print_config`` prints
the resolved configuration.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_finetune import ByteCorpus, ByteLM  # noqa: E402

import roundpipe_lightning  # noqa: E402,F401  (registers strategy="roundpipe")


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(
        ByteLM,
        ByteCorpus,
        args=args,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"parser_mode": "omegaconf"} if _has_omegaconf() else None,
    )


def _has_omegaconf() -> bool:
    try:
        import omegaconf  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
