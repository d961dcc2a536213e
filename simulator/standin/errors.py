"""The error the CUDA stand-in raises for what it cannot do faithfully, or cannot do on this torch build."""
from __future__ import annotations

from simulator.core.errors import SimError

__all__ = ["StandInError"]


class StandInError(SimError):
    """A CUDA feature the CPU stand-in refuses (``torch.compile``, CUDA graphs, a kernel with no CPU
    implementation, ...), or a torch build it cannot attach to; the message names the fix."""
