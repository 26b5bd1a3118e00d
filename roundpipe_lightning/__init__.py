"""RoundPipe for PyTorch Lightning: ``Trainer(strategy=RoundPipeStrategy())`` and
``Fabric(strategy=RoundPipeFabricStrategy())``.

Importing this package also registers the strategy name ``"roundpipe"`` with both
(``Trainer(strategy="roundpipe")``, ``Fabric(strategy="roundpipe")``).
"""

from .callbacks import AutoReplan, StageTimeLogger
from .fabric import RoundPipeFabricStrategy
from .precision import RoundPipePrecision
from .strategy import RoundPipeStrategy

__all__ = [
    "RoundPipeStrategy",
    "RoundPipeFabricStrategy",
    "RoundPipePrecision",
    "AutoReplan",
    "StageTimeLogger",
]
