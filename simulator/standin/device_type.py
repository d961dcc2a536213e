"""Classes that stand in for torch's own while the stand-in is enabled (``torch.device``, ``torch.Generator``).

``torch.device(i)``: torch reads a bare index as "device ``i`` of the current accelerator", which it finds in C++:
on a CUDA build that is ``cuda:i``; on this CPU build, where the stand-in registers its storage as torch's
``privateuseone`` device, it was ``privateuseone:i``, a name a GPU program never sees. A program that writes
``device = torch.device(local_rank)`` then printed the wrong name, branched wrongly on ``device.type == "cuda"``
and could not load a checkpoint with ``map_location=device``. The replacement builds torch's own ``torch.device``
objects (their type is unchanged, so torch's C++ accepts them everywhere); only a bare index is read as ``cuda:i``.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["replacement_class", "device_class"]


def replacement_class(original: type, make: Callable[..., Any]) -> type:
    """A class named as ``original`` whose calls are ``make(*args, **kwargs)``; ``isinstance`` and ``issubclass``
    answer for ``original`` (its instances keep their own type, which torch's C++ requires)."""

    class _Type(type):
        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            return make(*args, **kwargs)

        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, original)

        def __subclasscheck__(cls, sub: Any) -> bool:
            return isinstance(sub, type) and issubclass(sub, original)

    replacement = _Type(original.__name__, (), {"__doc__": original.__doc__, "__module__": "torch"})
    return replacement


def device_class(original: type) -> type:
    """``torch.device``, reading a bare index as ``cuda:i`` (see the module)."""

    def make(*args: Any, **kwargs: Any) -> Any:
        made = original(*args, **kwargs)
        # only the bare-index form names the current accelerator; "privateuseone" spelt out stays itself
        if made.type == "privateuseone" and len(args) == 1 and not kwargs and not isinstance(args[0], str) \
                and not isinstance(args[0], original):
            return original("cuda", made.index)
        return made

    return replacement_class(original, make)
