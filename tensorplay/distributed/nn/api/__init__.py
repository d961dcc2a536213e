"""Remote modules: :class:`RemoteModule` and the :func:`interface` decorator that restricts one.

See :mod:`.remote_module` and :mod:`.interface`; the guide is docs/rpc.md.
"""
from __future__ import annotations

from .interface import InterfaceError, check_implements, interface, interface_methods, is_interface
from .remote_module import RemoteModule

__all__ = ["InterfaceError", "RemoteModule", "check_implements", "interface", "interface_methods", "is_interface"]
