"""torchrun's output options on simulated ranks: ``--redirects``, ``--tee``, ``--local-ranks-filter``, ``--log-dir``.

torchrun's agent decides where each worker's ``stdout`` and ``stderr`` go, by local rank:

* ``--redirects M`` (``3``, or per local rank ``0:1,1:2``; 1 = stdout, 2 = stderr, 3 = both) writes the streams
  into ``<log dir>/<run id>_<random>/attempt_<restart>/<local rank>/stdout.log`` (and ``stderr.log``);
* ``--tee M`` writes them there too and copies each line to the console behind a header ``[<role><local
  rank>]:`` (``--role rank --tee 3`` gives torchtitan's ``[rank0]:`` lines);
* ``--local-ranks-filter 0,1`` shows only those local ranks on the console: the others' tee'd streams go to
  their files alone, and their other streams nowhere;
* ``--log-dir D`` is where the run's folder is made (default: a fresh temporary folder);
* every worker's ``TORCHELASTIC_ERROR_FILE`` names ``error.json`` in its folder, where torch's ``@record``
  (``torch.distributed.elastic.multiprocessing.errors``) writes the exception that ends the worker.

:class:`RankOutput` does the same for each simulated rank: it replaces the rank's own ``sys.stdout`` and
``sys.stderr`` (each thread rank has its own, :mod:`simulator.adapters.per_rank_streams`; a rank process has
its own anyway) for the rank's run, and puts them back after; it sets the rank's ``TORCHELASTIC_ERROR_FILE``.  With ``--nnodes`` above 1 every node's folders
are under ``node<group rank>/`` (a real job has one machine, and one folder tree, per node).  What the program
writes to the file descriptors themselves (C++ warnings) is not redirected.

Example: ``python -m simulator --nproc-per-node 4 --role rank --tee 3 --local-ranks-filter 0 train.py`` prints
rank 0's lines as ``[rank0]:...`` and keeps every rank's in its files.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys
import tempfile
import threading
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing import Std, to_map

from simulator.core.tracebacks import format_rank_traceback

__all__ = ["RankOutput", "parse"]


def _mask(text: str | None, flag: str) -> Any:
    try:
        return Std.from_str(text or "0")
    except (ValueError, KeyError):
        raise ValueError(f"{flag} must be 0-3 for every local rank, or local_rank:mask pairs such as 0:1,1:2; got "
                         f"{text!r}") from None


def parse(redirects: str | None, tee: str | None, ranks_filter: str | None, log_dir: str | None, role: str,
          run_id: str, nproc: int, nodes: int) -> "RankOutput | None":
    """The output plan of torchrun's options; ValueError for a value torchrun would refuse.  Makes the run's log
    folder, as torchrun's agent does for every run (its workers' error files are there)."""
    red, t = _mask(redirects, "--redirects"), _mask(tee, "--tee")
    try:
        shown = None if not ranks_filter else frozenset(int(x) for x in ranks_filter.split(","))
    except ValueError:
        raise ValueError(f"--local-ranks-filter must be local ranks separated by commas, such as 0,1; got "
                         f"{ranks_filter!r}") from None
    red_map, tee_map = to_map(red, nproc), to_map(t, nproc)
    base = log_dir or tempfile.mkdtemp(prefix="torchelastic_")
    os.makedirs(base, exist_ok=True)
    folder = tempfile.mkdtemp(prefix=f"{run_id}_", dir=base)
    return RankOutput(redirects={k: int(v) for k, v in red_map.items()}, tee={k: int(v) for k, v in tee_map.items()},
                      shown=shown, folder=folder, role=role, nodes=nodes)


class _Tee(io.TextIOBase):
    """A stream that writes into its file and copies each whole line to the console behind a header (torchrun's
    tail of a tee'd log, without the polling)."""

    def __init__(self, file: Any, console: Any, header: str) -> None:
        self._file, self._console, self._header, self._part = file, console, header, ""
        self._lock = threading.Lock()  # (the rank's threads share it)

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            self._file.write(text)
            lines = (self._part + text).split("\n")
            self._part = lines.pop()
            if lines:
                self._console.write("".join(f"{self._header}{line}\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if not self._file.closed:  # (io's close() flushes once more, after the file's close)
            self._file.flush()
            self._console.flush()

    def close(self) -> None:
        if self.closed:
            return
        with self._lock:
            if self._part:  # (as torchrun's tail: the last, unfinished line without a newline)
                self._console.write(f"{self._header}{self._part}")
                self._part = ""
        self.flush()
        self._file.close()
        super().close()


@dataclasses.dataclass(frozen=True)
class _Undo:
    """Put ``sys.<name>`` back to ``console`` and close the rank's ``stream``."""

    name: str
    console: Any
    stream: Any

    def __call__(self) -> None:
        setattr(sys, self.name, self.console)
        self.stream.close()


@dataclasses.dataclass(frozen=True)
class RankOutput:
    """Where each local rank's streams go (see the module); picklable, for rank processes."""

    redirects: dict[int, int]
    tee: dict[int, int]
    shown: frozenset[int] | None
    folder: str  # the run's log folder
    role: str
    nodes: int

    def worker_folder(self, attempt: int, node: int, local: int) -> str:
        """The folder of one worker's files (torchrun's ``attempt_<k>/<local rank>``, under ``node<n>/`` when
        the job has several nodes)."""
        return os.path.join(self.folder, f"attempt_{attempt}", *([f"node{node}"] if self.nodes > 1 else []),
                            str(local))

    def error_files(self, attempt: int) -> list[str]:
        """The error files the attempt's workers wrote (``@record`` writes one when a worker fails)."""
        top = os.path.join(self.folder, f"attempt_{attempt}")
        return sorted(os.path.join(d, "error.json") for d, _, names in os.walk(top) if "error.json" in names)

    def install(self, attempt: int) -> Callable[..., None]:
        """Point the calling rank's ``sys.stdout`` and ``sys.stderr`` where its local rank's go (``LOCAL_RANK``
        and ``GROUP_RANK`` from its environment) and its ``TORCHELASTIC_ERROR_FILE`` into its folder; returns
        what puts the streams back (flushing and closing files), which takes the exception the rank ended with,
        if any (its traceback goes to the rank's redirected stderr)."""
        local, node = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("GROUP_RANK", "0"))
        hidden = self.shown is not None and local not in self.shown
        where = self.worker_folder(attempt, node, local)
        os.makedirs(where, exist_ok=True)  # (torchrun's agent makes every worker's, redirected or not)
        os.environ["TORCHELASTIC_ERROR_FILE"] = os.path.join(where, "error.json")  # (the rank's own environment)
        undo: list[_Undo] = []
        for std, name in ((int(Std.OUT), "stdout"), (int(Std.ERR), "stderr")):
            console = getattr(sys, name)  # (the rank's own: the process's until the rank sets one)
            if self.redirects.get(local, 0) & std or self.tee.get(local, 0) & std:
                file = open(os.path.join(where, f"{name}.log"), "w", buffering=1)
                teed = self.tee.get(local, 0) & std and not hidden
                stream: Any = _Tee(file, console, f"[{self.role}{local}]:") if teed else file
            elif hidden:
                stream = open(os.devnull, "w")
            else:
                continue
            setattr(sys, name, stream)
            undo.append(_Undo(name, console, stream))

        def restore(failure: BaseException | None = None) -> None:
            # a process that dies of an exception prints its traceback to its stderr: the rank's log file too
            if failure is not None and not isinstance(failure, SystemExit) and any(u.name == "stderr" for u in undo):
                with contextlib.suppress(Exception):
                    sys.stderr.write(format_rank_traceback(failure))
            for step in reversed(undo):
                step()

        return restore
