"""``torch.cuda.Stream`` and ``torch.cuda.Event`` on stand-in devices, and each rank's current stream.

CPU work is synchronous, so a stand-in stream never runs ahead: waits return at
once, ``query()`` is always True, an event is complete as soon as it is
recorded, and ``elapsed_time`` measures the wall time between two records.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from tensorplay.distributed.errors import format_message

from simulator.standin.errors import StandInError
from simulator.standin.ranks import initialize, resolve_index, state

__all__ = ["Stream", "Event", "current_stream", "default_stream", "set_stream", "generic_event", "generic_stream"]

_CUDA_TYPE = int(torch._C._autograd.DeviceType.CUDA)

_ids = itertools.count(1)


_LEAST_PRIORITY, _GREATEST_PRIORITY = 0, -5


class Stream(torch.Stream):
    """``torch.cuda.Stream`` on a stand-in device: an ordering that CPU execution always satisfies.

    A ``torch.Stream`` (so ``Tensor.record_stream`` accepts it), with the CUDA
    stream's methods: waits return at once, ``query()`` is always True.
    """

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> "Stream":
        if "stream_id" in kwargs and "device_index" in kwargs:
            sid, idx = kwargs["stream_id"], kwargs["device_index"]
        else:
            sid, idx = next(_ids), resolve_index(device, "torch.cuda.Stream")
        initialize(state())
        s = super().__new__(cls, stream_id=sid, device_index=idx, device_type=_CUDA_TYPE)
        # as CUDA maps a priority outside the device's range to the range's nearest end
        s._priority = min(_LEAST_PRIORITY, max(_GREATEST_PRIORITY, int(priority)))
        return s

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(least, greatest) priority, as a Hopper GPU's CUDA reports them: lower numbers run first."""
        return _LEAST_PRIORITY, _GREATEST_PRIORITY

    def query(self) -> bool:
        """True: all work issued to the stream is done."""
        return True

    def synchronize(self) -> None:
        """Returns at once (the work is done)."""
        return None

    def wait_event(self, event: Any) -> None:
        """Returns at once (the event is complete)."""
        return None

    def wait_stream(self, stream: Any) -> None:
        """Returns at once (the other stream's work is done)."""
        return None

    def record_event(self, event: Any = None) -> "Event":
        """Record ``event`` (a new one if None) on this stream and return it."""
        event = Event() if event is None else event
        event.record(self)
        return event

    @property
    def priority(self) -> int:
        """The priority the stream was made with."""
        return self._priority

    @property
    def cuda_stream(self) -> int:
        """The stream's id (there is no ``cudaStream_t``)."""
        return self.stream_id

    def __enter__(self) -> "Stream":
        # (as torch.Stream's own: the current device and its stream are saved, and put back on exit)
        self._prev = current_stream(None)
        set_stream(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        set_stream(self._prev)

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device={self.device} cuda_stream={self.stream_id:#x}>"


def current_stream(device: Any = None) -> Stream:
    """The calling rank's current stream on ``device`` (its default stream until one is selected)."""
    idx = resolve_index(device, "torch.cuda.current_stream")
    s = state().streams.get(idx)
    return s if s is not None else default_stream(idx)


def default_stream(device: Any = None) -> Stream:
    """The default stream (id 0) of ``device``."""
    idx = resolve_index(device, "torch.cuda.default_stream")
    return Stream(stream_id=0, device_index=idx)


def set_stream(stream: Any) -> None:
    """Make ``stream`` the calling rank's current stream on its device, and its device the current device, as
    CUDA's ``set_stream`` does (None: no-op)."""
    if stream is None:
        return
    idx = stream.device_index
    st = state()
    st.streams[idx] = stream if isinstance(stream, Stream) else Stream(stream_id=stream.stream_id, device_index=idx)
    st.current = idx
    initialize(st)


class Event:
    """``torch.cuda.Event`` on a stand-in device: complete when recorded; ``elapsed_time`` is wall time."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        if interprocess:
            raise StandInError(format_message(
                "torch.cuda.Event", "interprocess events cannot be shared between simulated ranks",
                values={"interprocess": True}, fix="create the event with interprocess=False"))
        self.enable_timing = enable_timing
        self.blocking = blocking
        self._time: float | None = None
        self._device: int | None = None

    def record(self, stream: Any = None) -> None:
        """Record on ``stream`` (the current stream if None): the event completes now."""
        stream = current_stream() if stream is None else stream
        self._device = stream.device_index
        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """Returns at once (the event is complete)."""
        return None

    def query(self) -> bool:
        """True: the event is complete."""
        return True

    def synchronize(self) -> None:
        """Returns at once."""
        return None

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds of wall time between this event's record and ``end_event``'s."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._time is None or end_event._time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._time - self._time) * 1000.0

    def ipc_handle(self) -> Any:
        """Refused: simulated ranks share no GPU memory to hand an IPC handle for."""
        raise StandInError(format_message("torch.cuda.Event.ipc_handle", "stand-in events have no IPC handle",
                                          fix="share data between ranks with collectives"))

    @classmethod
    def from_ipc_handle(cls, device: Any, handle: Any) -> "Event":
        """Refused, as :meth:`ipc_handle` is: no stand-in event has a handle to open."""
        raise StandInError(format_message("torch.cuda.Event.from_ipc_handle", "stand-in events have no IPC handle",
                                          values={"device": str(device)},
                                          fix="share data between ranks with collectives"))

    @property
    def device(self) -> torch.device | None:
        """The device of the stream it was last recorded on (None before)."""
        return None if self._device is None else torch.device("cuda", self._device)

    def __repr__(self) -> str:
        return f"<torch.cuda.Event {'recorded' if self._time is not None else 'uninitialized'}>"


def generic_event(original: type) -> type:
    """``torch.Event``, the device-generic event (``torch.accelerator``-style timing code), while the stand-in is on:
    on the accelerator (a stand-in GPU, ``device`` None or ``"cuda"``) it is a stand-in :class:`Event`, whose
    ``synchronize`` and ``elapsed_time`` work (torch's own reached the stand-in's C++ device, which has neither);
    on another device, torch's own."""

    class AcceleratorEvent(Event):
        def __new__(cls, device: Any = None, *, enable_timing: bool = False, blocking: bool = False,
                    interprocess: bool = False) -> Any:
            dev = torch.device("cuda") if device is None else torch.device(device)
            if dev.type not in ("cuda", "privateuseone"):
                return original(device=dev, enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)
            return super().__new__(cls)

        def __init__(self, device: Any = None, *, enable_timing: bool = False, blocking: bool = False,
                     interprocess: bool = False) -> None:
            super().__init__(enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)
            self._device = resolve_index(device, "torch.Event")  # (its device from the start, as torch's)

    AcceleratorEvent.__name__ = AcceleratorEvent.__qualname__ = "Event"
    AcceleratorEvent.__module__ = "torch"
    return AcceleratorEvent


def generic_stream(original: type) -> type:
    """``torch.Stream``, the device-generic stream, while the stand-in is on: on the accelerator (``device`` None,
    ``"cuda"``, ``"cuda:i"``, an index) a stand-in :class:`Stream` on that device (the calling rank's current one
    without an index), as torch builds a CUDA stream there; on another device, torch's own.  torch's own class
    reached the stand-in's C++ device, which put every stream on device 0.  ``isinstance`` and ``issubclass``
    answer for torch's class (every stand-in stream is one)."""

    class _Generic(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, original)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, original)

        def __call__(cls, device: Any = None, *, priority: int = 0, **kwargs: Any) -> Any:
            if kwargs:  # torch.Stream(stream_id=, device_index=, device_type=): a stream rebuilt from its parts
                if kwargs.get("device_type") == _CUDA_TYPE and device is None:
                    return Stream(stream_id=kwargs["stream_id"], device_index=kwargs["device_index"])
                return original(device, priority=priority, **kwargs)
            dev = device if isinstance(device, int) else torch.device("cuda") if device is None else torch.device(device)
            if not isinstance(dev, int) and dev.type not in ("cuda", "privateuseone"):
                return original(dev, priority=priority)
            return Stream(dev if isinstance(dev, int) or dev.index is not None else None, priority=priority)

    class AcceleratorStream(metaclass=_Generic):
        pass

    AcceleratorStream.__name__ = AcceleratorStream.__qualname__ = "Stream"
    AcceleratorStream.__module__ = "torch"
    AcceleratorStream.__doc__ = original.__doc__
    return AcceleratorStream
