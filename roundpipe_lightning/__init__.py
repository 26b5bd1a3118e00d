"""RoundPipe for PyTorch Lightning: ``Trainer(strategy=RoundPipeStrategy())``.

Importing this package also registers the strategy name ``"roundpipe"``
(``Trainer(strategy="roundpipe")``).
"""

from .callbacks import AutoReplan, StageTimeLogger
from .precision import RoundPipePrecision
from .strategy import RoundPipeStrategy

__all__ = ["RoundPipeStrategy", "RoundPipePrecision", "AutoReplan", "StageTimeLogger"]
