"""tensorplay.distributed.nn: autograd-aware collectives (:mod:`.functional`)."""
from . import functional  # noqa: F401
from .api.remote_module import RemoteModule  # noqa: E402
