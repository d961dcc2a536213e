"""tensorplay.distributed.nn: autograd-aware collectives (:mod:`.functional`)."""
from . import functional  # noqa: F401
