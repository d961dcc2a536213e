"""torch's fake tensors and the stand-in: the dispatch cache keyed by the calling rank's current CUDA device, and
a stand-in fakified as the CUDA tensor it stands for.

DTensor derives every operator's output shape by running it on fake tensors that it makes with
``torch.empty_strided(..., device=mesh.device_type)``: a bare ``"cuda"``, which fake mode resolves to
the current device.  ``FakeTensorMode.cache`` is one dict per process, and its key records the
``device=`` argument as given (``cuda``, no index), so the first rank to cache such a factory would hand
its own ``cuda:i`` to every other rank (a process on a real node has one current device, so it never
notices).  :class:`DeviceKeyedCache` replaces the dict while a stand-in is enabled: an entry belongs to
the current device it was made under; eviction (torch evicts keys whose objects died, from whichever
thread collects them) drops the key under every device.

``torch.export`` (and pipelining's tracer, ``pipeline()``) fakify a module's parameters and inputs with
``FakeTensorMode.from_tensor``.  A stand-in follows torch's wrapper-subclass protocol (``__tensor_flatten__``,
which ``Module.to`` needs to swap parameters in place), so torch's meta converter would fakify its inner CPU
tensor and rebuild the wrapper over it, and refuse the storage it shares with that inner tensor.  A GPU's tensor
is no subclass: :func:`plain_to_fakes` has the converter see a stand-in as a plain dense tensor on ``cuda:i``
(its sizes, strides, storage, autograd view and ``requires_grad``), so its fake is a ``FakeTensor`` on
``cuda:i``, as a GPU tensor's is.
"""
from __future__ import annotations

from typing import Any, Callable

from simulator.standin.ranks import state
from simulator.standin.tensor import StandInTensor

__all__ = ["DeviceKeyedCache", "plain_to_fakes"]


def plain_to_fakes(is_subclass: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """torch's ``is_traceable_wrapper_subclass`` as the meta converter (``torch._subclasses.meta_utils``) asks it:
    false for a stand-in (see the module docstring)."""

    def is_traceable_wrapper_subclass(t: Any) -> bool:
        return not isinstance(t, StandInTensor) and is_subclass(t)

    return is_traceable_wrapper_subclass

_MISSING = object()


class DeviceKeyedCache(dict):
    """A dict of ``key -> {current device: entry}`` behind the mapping interface torch's fake mode uses."""

    def get(self, key: Any, default: Any = None) -> Any:
        per_device = dict.get(self, key)
        return default if per_device is None else per_device.get(state().current, default)

    def __getitem__(self, key: Any) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        per_device = dict.get(self, key)
        if per_device is None:
            per_device = {}
            dict.__setitem__(self, key, per_device)
        per_device[state().current] = value

    def pop(self, key: Any, *default: Any) -> Any:
        """Evict ``key`` under every device (returns this device's entry)."""
        per_device = dict.pop(self, key, None)
        if per_device is None:
            if default:
                return default[0]
            raise KeyError(key)
        return per_device.get(state().current, default[0] if default else None)
