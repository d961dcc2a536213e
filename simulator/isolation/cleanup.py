"""What a process-isolated run leaves behind when its coordinator is killed, and how it is cleaned up.

A run's shared memory is a directory ``tp-sim-ranks-<coordinator pid>-*`` in
``/dev/shm`` (see :func:`arena_dir`), and its rank processes run in sessions of
their own.  A normal end removes both (``ProcessRanks.close``).  When the
coordinator is killed instead:

* **SIGTERM**: :func:`install` puts a handler in place while runs are live; it
  kills every live run's rank processes (with what they started) and removes
  their arenas, then does what the signal would have done (the previous
  handler, or the default: the process ends by SIGTERM).
* **SIGKILL** (nothing runs in the coordinator): its warm interpreters get
  SIGTERM from the kernel (their parent-death signal) and kill their rank
  processes' sessions and remove the arenas of their coordinator
  (:func:`on_parent_death`, armed by :mod:`.child`'s ``serve``).
* Whatever is still left (a coordinator whose rank processes were spawned
  afresh, a machine that lost power): the next run of any coordinator removes
  the arena directories whose owner has died (:func:`sweep`).
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Any, Callable

__all__ = ["PREFIX", "arena_dir", "sweep", "install", "register", "unregister", "on_parent_death", "drop_locals"]

PREFIX = "tp-sim-ranks-"

_lock = threading.Lock()
_live: dict[int, tuple[str, Callable[[], list[int]]]] = {}  # id -> (arena dir, the rank processes' pids)
_previous: Any = None  # the SIGTERM handler ours replaced (None: ours is not installed)


def shm_root() -> str | None:
    """``/dev/shm`` when it is usable (else the arenas go to the default temporary directory)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def arena_dir() -> str:
    """A new arena directory of this process's run, named after this process (see :func:`sweep`)."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=shm_root())


def _owner(name: str) -> int | None:
    """The coordinator pid in an arena directory's name (None: not one of ours, or an older name)."""
    if not name.startswith(PREFIX):
        return None
    pid, sep, _ = name[len(PREFIX):].partition("-")
    return int(pid) if sep and pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, and not ours to judge
    try:  # a zombie has ended: its arenas are garbage
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def sweep(root: str | None = None) -> list[str]:
    """Remove the arena directories (of this user) whose coordinator has died; return their paths."""
    root = root or shm_root() or tempfile.gettempdir()
    gone = []
    try:
        names = os.listdir(root)
    except OSError:
        return gone
    uid = os.getuid()
    for name in names:
        pid = _owner(name)
        if pid is None or _alive(pid):
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone


def _kill_all() -> None:
    """Kill every live run's rank processes (their sessions) and remove its arenas (any thread, a signal handler)."""
    for adir, pids in list(_live.values()):
        try:
            for pid in pids():
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        except Exception:  # noqa: BLE001  (a handle half built when the signal came)
            pass
        shutil.rmtree(adir, ignore_errors=True)


def _on_sigterm(signum: int, frame: Any) -> None:
    _kill_all()
    prev = _previous
    if callable(prev):
        prev(signum, frame)
        return
    # the default: end by SIGTERM, as without this handler
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def install() -> None:
    """Handle SIGTERM while runs are live (from the main thread only: elsewhere Python cannot set a handler)."""
    global _previous
    if _previous is not None or threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current in (signal.SIG_IGN, None):  # ignored (the process lives on), or set outside Python
        return
    _previous = current
    signal.signal(signal.SIGTERM, _on_sigterm)


def _uninstall() -> None:
    global _previous
    if _previous is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:  # (a handler the program set since stays)
        signal.signal(signal.SIGTERM, _previous)
    _previous = None


def register(key: object, adir: str, pids: Callable[[], list[int]]) -> None:
    """A run started: ``adir`` is its arena directory, ``pids()`` its rank processes (each leads a session)."""
    with _lock:
        _live[id(key)] = (adir, pids)
    install()


def unregister(key: object) -> None:
    with _lock:
        _live.pop(id(key), None)
        last = not _live
    if last:
        _uninstall()


def on_parent_death(coordinator: int, children: Callable[[], set[int]]) -> None:
    """In a warm interpreter: when its coordinator dies (SIGTERM, its parent-death signal), kill the rank
    processes' sessions, remove the coordinator's arenas and exit."""
    def handler(signum: int, frame: Any) -> None:
        # the signal may come while the coordinator is still exiting (it is sent when the thread that started
        # this interpreter ends): wait, bounded, for it to be gone; a SIGTERM from someone else ends this
        # interpreter as by default and leaves the living coordinator's arenas alone
        deadline = time.monotonic() + 2.0
        while os.getppid() == coordinator and _alive(coordinator):
            if time.monotonic() > deadline:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)
        for pid in list(children()):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        root = shm_root() or tempfile.gettempdir()
        try:
            names = os.listdir(root)
        except OSError:
            names = []
        for name in names:
            if _owner(name) == coordinator:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, handler)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: SIGTERM (handled) instead of SIGKILL
    except Exception:  # noqa: BLE001  (the end of the control socket ends it too)
        pass
    if os.getppid() != coordinator:  # it died while the signal was being re-armed
        handler(signal.SIGTERM, None)


def drop_locals(excs: list[Any]) -> None:
    """Clear the locals of the finished frames in the tracebacks of ``excs`` (and their causes and contexts).

    The simulator's frames of a failed process-isolated run hold views of the run's arenas (the tensors of the
    call that failed); an exception the caller keeps would keep every arena of the run mapped, deleted files and
    all.  The frames keep their code and line numbers (tracebacks print as before); only their locals go.
    """
    import traceback

    seen: set[int] = set()
    todo = [e for e in excs if isinstance(e, BaseException)]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # (a frame still running is skipped)
        todo.extend(x for x in (e.__cause__, e.__context__, *getattr(e, "exceptions", ())) if x is not None)
