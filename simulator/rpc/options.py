"""What ``init_rpc`` is given for the simulator's transport: its options and seeded message faults.

**Faults by seed.**  :class:`MessageFaults` drops or delays messages; a
drop surfaces as the :class:`~tensorplay.distributed.rpc.errors.RpcTimeoutError`
the caller would see after ``timeout``, a delay advances the rank's virtual
clock.  The same seed gives the same faults (the agent draws them,
:meth:`simulator.rpc.agent.SimAgent._fault`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.rpc as trpc

from tensorplay.distributed.errors import DistTypeError, DistValueError
from tensorplay.distributed.rpc.errors import rpc_message

__all__ = ["MessageFaults", "SimRpcBackendOptions", "options_from"]


@dataclass(frozen=True)
class MessageFaults:
    """Seeded message faults for the messages a worker *sends* (requests and answers).

    Args:
        drop: probability that a message is lost (the caller gets :class:`RpcTimeoutError`).
        delay: probability that a message is late by up to ``max_delay_s`` (virtual time).
        max_delay_s: upper bound of a delay, seconds.
        seed: the fault stream's seed; ``None`` derives it from the world's seed and the rank.
    """

    drop: float = 0.0
    delay: float = 0.0
    max_delay_s: float = 0.01
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("drop", "delay"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise DistValueError(rpc_message("MessageFaults", f"{name} must be a probability in [0, 1]",
                                                 values={name: p}, fix=f"pass e.g. {name}=0.1"))
        if self.max_delay_s < 0:
            raise DistValueError(rpc_message("MessageFaults", "max_delay_s must be >= 0",
                                             values={"max_delay_s": self.max_delay_s}, fix="pass e.g. 0.01"))


@dataclass
class SimRpcBackendOptions:
    """Options of the simulator's transport (the counterpart of ``TensorPipeRpcBackendOptions``).

    Args:
        rpc_timeout: default per-call timeout in seconds (the handler's run time plus injected delays).
        faults: :class:`MessageFaults` for the messages this worker sends, or ``None``.
        device_maps: ``{worker name: {local device: remote device}}``, as in TensorPipe: a tensor this
            worker sends to that worker on a mapped device arrives on the remote device (answers
            travel back through the inverse map).  Tensors on unmapped devices keep their device.
    """

    rpc_timeout: float = 60.0
    faults: MessageFaults | None = None
    init_method: str = field(default="sim://", repr=False)
    device_maps: dict[str, dict[torch.device, torch.device]] = field(default_factory=dict)


def options_from(options: Any) -> SimRpcBackendOptions:
    """The simulator's options for what ``init_rpc`` was given inside a simulated rank.

    ``SimRpcBackendOptions`` pass through; a ``TensorPipeRpcBackendOptions``
    (torch's class, which tensorplay re-exports) written for a real run is
    mapped: ``rpc_timeout`` is kept (``0``, torch's "no timeout", becomes
    unbounded: the run's own timeout and deadlock detection still apply) and
    ``device_maps`` are applied to tensors crossing between workers.
    ``init_method`` is not used (every worker is in this process),
    ``num_worker_threads``, ``devices`` and the transport/channel lists have
    no meaning here (every handler gets a thread of its own on the callee's rank).
    """
    if options is None or isinstance(options, SimRpcBackendOptions):
        return options or SimRpcBackendOptions()
    if not isinstance(options, trpc.RpcBackendOptions):
        raise DistTypeError(rpc_message(
            "init_rpc", "rpc_backend_options must be TensorPipeRpcBackendOptions or SimRpcBackendOptions",
            values={"rpc_backend_options": type(options).__name__},
            fix="pass rpc.TensorPipeRpcBackendOptions(rpc_timeout=...) (mapped inside the simulator), "
                "SimRpcBackendOptions(...), or None"))
    timeout = float(options.rpc_timeout)
    if timeout == 0:
        timeout = float("inf")
    maps: dict[str, dict[torch.device, torch.device]] = {}
    for worker, m in dict(getattr(options, "device_maps", {}) or {}).items():
        maps[str(worker)] = {torch.device(k): torch.device(v) for k, v in dict(m).items()}
    return SimRpcBackendOptions(rpc_timeout=timeout, device_maps=maps)
