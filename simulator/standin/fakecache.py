"""torch's fake-tensor dispatch cache, keyed by the calling rank's current CUDA device while a stand-in is on.

DTensor derives every operator's output shape by running it on fake tensors that it makes with
``torch.empty_strided(..., device=mesh.device_type)``: a bare ``"cuda"``, which fake mode resolves to
the current device.  ``FakeTensorMode.cache`` is one dict per process, and its key records the
``device=`` argument as given (``cuda``, no index), so the first rank to cache such a factory would hand
its own ``cuda:i`` to every other rank (a process on a real node has one current device, so it never
notices).  :class:`DeviceKeyedCache` replaces the dict while a stand-in is enabled: an entry belongs to
the current device it was made under; eviction (torch evicts keys whose objects died, from whichever
thread collects them) drops the key under every device.
"""
from __future__ import annotations

from typing import Any

from simulator.standin.ranks import state

__all__ = ["DeviceKeyedCache"]

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
