"""A rank's traceback as its program would show it: the simulator's, runpy's and multiprocessing's frames left out.

Used by the launcher (``mp.spawn``'s ``ProcessRaisedException`` text), the CLI and a rank process that sends its
error back.
"""
from __future__ import annotations

import os
import traceback

__all__ = ["format_rank_traceback"]


def format_rank_traceback(exc: BaseException) -> str:
    """``exc``'s traceback without the simulator's and runpy's frames: the rank's (or launcher's) own code.

    An exception raised in a rank process carries that process's traceback: it is the one shown.
    """
    remote = getattr(exc, "_tp_rank_traceback", None)
    if isinstance(remote, str):
        notes = [n for n in getattr(exc, "__notes__", ()) if remote.rstrip() not in n]
        return remote + "".join(n + "\n" for n in notes)
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    seen: set[int] = set()
    todo = [te]
    while todo:  # the exception and its causes/contexts, each once
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        kept = [f for f in t.stack if not _internal_file(f.filename)]
        if kept:  # a traceback entirely inside the simulator is shown as it is
            t.stack = traceback.StackSummary.from_list(kept)
        todo += [c for c in (t.__cause__, t.__context__) if c is not None]
    return "".join(te.format())


#: the simulator package (this file is in core/): its frames are not the program's
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _internal_file(path: str) -> bool:
    if path.startswith("<frozen runpy"):
        return True
    path = os.path.abspath(path)
    return (path.startswith(_HERE + os.sep) or os.path.basename(path) == "runpy.py"
            or path.endswith(os.path.join("multiprocessing", "process.py")))
