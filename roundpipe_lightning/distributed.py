"""Re-export of :mod:`roundpipe_core.distributed` (data parallel RoundPipe over
``torch.distributed``), which needs no Lightning; import it from there in code
that does not use Lightning."""

from roundpipe_core.distributed import *  # noqa: F403
from roundpipe_core.distributed import __all__ as __all__  # noqa: F401
