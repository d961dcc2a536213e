"""Results, the report (matrix markdown + JSON, failures grouped by cause) and the progress display.

The matrix has one row per (collective, op) and one column per
(world | subgroup) x backend/device; each cell reads ``passed/run``
(``-`` when nothing ran there, ``skip`` when everything there was skipped).
Failures are grouped by cause (stage + reason): each group lists where it
happened and the reproduction of its first case.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, TextIO

from .cases import Case, cell_rows, parse_case_id
from .expect import STAGES, Verdict

__all__ = ["CaseResult", "Progress", "Result", "SCHEMA_VERSION", "repro_command"]

SCHEMA_VERSION = 1


def repro_command(case: Case, config: dict[str, Any]) -> str:
    """The one-line command that reruns exactly ``case`` with ``config``'s backend, device and implementation."""
    parts = ["python -m conformance", f"--backend {config.get('backend', 'sim')}"]
    if config.get("device", "cpu") != "cpu":
        parts.append(f"--device {config['device']}")
    impl = config.get("impl")
    if impl and impl != config.get("default_impl"):
        parts.append(f"--impl {impl}")
    if config.get("dist_module_given"):
        parts.append(f"--dist-module {config['dist_module']}")
    if config.get("timeout_given"):
        parts.append(f"--timeout {config['timeout']:g}")
    if config.get("isolation", "thread") != "thread":
        parts.append(f"--isolation {config['isolation']}")
        if config.get("seed", 0):  # the rank processes' hash seeds derive from the suite's seed
            parts.append(f"--seed {config['seed']}")
    parts.append(f"--case '{case.id()}'")
    return " ".join(parts)


@dataclass
class CaseResult:
    """One case's verdict on one backend/device."""

    case: Case
    verdict: Verdict
    label: str                      # "sim/cpu", "gloo/cpu", ...
    seconds: float = 0.0
    repro: str = ""

    @property
    def status(self) -> str:
        return self.verdict.status

    def describe(self) -> str:
        """The failure text: cause, detail, the case's ranks and shapes, and the command that reruns it."""
        v = self.verdict
        head = f"{v.status.upper()} [{self.label}] {self.case.id()}"
        lines = [head, f"  cause: {v.cause}" if v.stage else f"  reason: {v.reason}"]
        if v.detail:
            dl = _trim_traceback(v.detail.splitlines())
            lines += ["  detail: " + dl[0]] + ["    " + d for d in dl[1:]]
        lines += ["  case: " + ln if i == 0 else "    " + ln for i, ln in enumerate(self.case.describe().splitlines())]
        if self.repro:
            lines.append(f"  rerun: {self.repro}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        v = self.verdict
        return {"id": self.case.id(), "collective": self.case.collective, "op": self.case.op,
                "world_size": self.case.world_size, "group": list(self.case.group) if self.case.group else None,
                "group_kind": self.case.group_kind, "root": self.case.root, "dtype": self.case.dtype,
                "backend": self.label, "status": v.status, "stage": v.stage, "reason": v.reason, "also": v.also,
                "detail": v.detail, "seconds": round(self.seconds, 4), "repro": self.repro}


@dataclass
class Result:
    """What :func:`conformance.check` returns.

    ``passed`` is true when no case failed or errored and at least one ran.
    ``exit_code``: 0 passed, 1 failures, 5 nothing ran (everything skipped).
    """

    config: dict[str, Any]
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0

    # -- summary -------------------------------------------------------------------------
    def counts(self) -> Counter:
        return Counter(r.status for r in self.results)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.status in ("failed", "error")]

    @property
    def passed(self) -> bool:
        c = self.counts()
        return not self.failures and c["passed"] > 0

    @property
    def exit_code(self) -> int:
        if self.failures:
            return 1
        return 0 if self.counts()["passed"] else 5

    def summary(self) -> str:
        c = self.counts()
        labels = ", ".join(sorted({r.label for r in self.results})) or self.config.get("label", "")
        text = (f"{len(self.results)} cases on {labels}: {c['passed']} passed, {c['failed']} failed"
                f"{', %d errors' % c['error'] if c['error'] else ''}"
                f"{', %d skipped' % c['skipped'] if c['skipped'] else ''} in {self.seconds:.1f}s")
        if c["skipped"] and not c["passed"] and not self.failures:
            reasons = sorted({r.verdict.reason for r in self.results if r.status == "skipped"})
            text += " (skipped: " + "; ".join(reasons) + ")"
        return text

    def causes(self) -> list[dict[str, Any]]:
        """Failures grouped by cause, most frequent first."""
        groups: dict[tuple[str, str, str], list[CaseResult]] = defaultdict(list)
        for r in self.failures:
            groups[(r.verdict.status, r.verdict.stage or "", r.verdict.reason)].append(r)
        out = []
        for (status, stage, reason), rs in groups.items():
            where = Counter(f"{r.case.collective}{'/' + r.case.op if r.case.op else ''} ({r.case.group_kind})"
                            for r in rs)
            also = Counter(r.verdict.also for r in rs if r.verdict.also)
            out.append({"status": status, "stage": stage, "reason": reason, "count": len(rs),
                        "also": dict(also.most_common()),
                        "where": dict(sorted(where.items())), "world_sizes": sorted({r.case.world_size for r in rs}),
                        "example": rs[0].describe(), "example_id": rs[0].case.id(), "repro": rs[0].repro})
        out.sort(key=lambda g: (-g["count"], STAGES.index(g["stage"]) if g["stage"] in STAGES else 9, g["reason"]))
        return out

    def matrix(self) -> dict[tuple[str, str | None], dict[str, Counter]]:
        """{(collective, op): {"world gloo/cpu": Counter(status), ...}}."""
        m: dict[tuple[str, str | None], dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
        for r in self.results:
            m[(r.case.collective, r.case.op)][f"{r.case.group_kind} {r.label}"][r.status] += 1
        return m

    # -- rendering ----------------------------------------------------------------------------
    def report_markdown(self, title: str = "Conformance report", max_examples: int = 50) -> str:
        cfg = self.config
        lines = [f"# {title}", ""]
        lines.append(f"- command: `{cfg.get('command', '')}`")
        lines.append(f"- implementation: `{cfg.get('impl')}` (process groups: `{cfg.get('dist_module')}`)")
        lines.append(f"- backend/device: {cfg.get('label')}; world sizes {cfg.get('world_sizes')}; "
                     f"{cfg.get('examples')} examples per (collective, op, world size, group kind); seed {cfg.get('seed')}")
        lines.append(f"- result: **{'PASSED' if self.passed else 'FAILED' if self.failures else 'NOTHING RAN'}**, "
                     f"{self.summary()}")
        lines.append("")
        lines.append("## Matrix")
        lines.append("")
        lines.append("Each cell: cases passed / cases run (`-`: none drawn, `skip`: all skipped). "
                     "Bold cells have failures.")
        lines.append("")
        m = self.matrix()
        labels = sorted({r.label for r in self.results}) or [cfg.get("label", "")]
        cols = [f"{kind} {lab}" for lab in labels for kind in ("world", "subgroup")]
        lines.append("| collective | op | " + " | ".join(cols) + " |")
        lines.append("|---|---|" + "---|" * len(cols))
        rows = cell_rows(tuple(cfg.get("collectives") or ()), tuple(cfg.get("ops") or ())) if cfg.get("collectives") \
            else sorted(m, key=lambda k: (k[0], k[1] or ""))
        for key in rows:
            if key not in m and cfg.get("hide_empty_rows", True):
                continue
            cells = []
            for col in cols:
                cnt = m.get(key, {}).get(col, Counter())
                ran = cnt["passed"] + cnt["failed"] + cnt["error"]
                if ran == 0:
                    cells.append("skip" if cnt["skipped"] else "-")
                elif ran == cnt["passed"]:
                    cells.append(f"{cnt['passed']}/{ran}")
                else:
                    cells.append(f"**{cnt['passed']}/{ran}**")
            lines.append(f"| {key[0]} | {key[1] or '-'} | " + " | ".join(cells) + " |")
        lines.append("")
        causes = self.causes()
        if causes:
            lines.append("## Failures by cause")
            lines.append("")
            lines.append("| # | stage | cause | cases | where |")
            lines.append("|---|---|---|---|---|")
            for i, g in enumerate(causes, 1):
                where = ", ".join(f"{k} x{v}" for k, v in g["where"].items())
                lines.append(f"| {i} | {g['stage']} | {_md_escape(g['reason'])} | {g['count']} | {_md_escape(where)} |")
            lines.append("")
            for i, g in enumerate(causes[:max_examples], 1):
                lines.append(f"### {i}. {g['stage']}: {_md_escape(g['reason'])} ({g['count']} cases)")
                lines.append("")
                if g["also"]:
                    later = "; ".join(f"{k} ({v} cases)" for k, v in g["also"].items())
                    lines.append(f"Later stages fail too: {_md_escape(later)}.")
                    lines.append("")
                lines.append(f"World sizes: {g['world_sizes']}. First case:")
                lines.append("")
                lines.append("```text")
                lines.append(_trim_example(g["example"]))
                lines.append("```")
                lines.append("")
        skipped = Counter(r.verdict.reason for r in self.results if r.status == "skipped")
        if skipped:
            lines.append("## Skipped")
            lines.append("")
            for reason, n in skipped.most_common():
                lines.append(f"- {n} cases: {reason}")
            lines.append("")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        m = self.matrix()
        cells = []
        for (coll, op), cols in sorted(m.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
            for col, cnt in sorted(cols.items()):
                kind, label = col.split(" ", 1)
                cells.append({"collective": coll, "op": op, "group_kind": kind, "backend": label,
                              "passed": cnt["passed"], "failed": cnt["failed"], "error": cnt["error"],
                              "skipped": cnt["skipped"]})
        c = self.counts()
        return {
            "schema_version": SCHEMA_VERSION,
            "config": {k: v for k, v in self.config.items() if _jsonable(v)},
            "passed": self.passed,
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 3),
            "totals": {"cases": len(self.results), "passed": c["passed"], "failed": c["failed"],
                       "error": c["error"], "skipped": c["skipped"]},
            "matrix": cells,
            "causes": [{k: v for k, v in g.items() if k != "example"} | {"example": g["example"]}
                       for g in self.causes()],
            "cases": [r.to_json() for r in self.results],
        }

    def write(self, path: str) -> list[str]:
        """Write the report: ``x.md`` -> markdown, ``x.json`` -> JSON, any other name -> both ``x.md`` and ``x.json``."""
        root, ext = os.path.splitext(path)
        targets = {".md": [path], ".json": [path]}.get(ext.lower(), [path + ".md", path + ".json"])
        written = []
        for t in targets:
            d = os.path.dirname(os.path.abspath(t))
            os.makedirs(d, exist_ok=True)
            with open(t, "w", encoding="utf-8") as f:
                if t.endswith(".json"):
                    json.dump(self.to_json(), f, indent=1)
                    f.write("\n")
                else:
                    f.write(self.report_markdown())
                    f.write("\n")
            written.append(t)
        return written

    def raise_for_failures(self) -> None:
        """Raise ``AssertionError`` with every failure's reproduction when a case failed."""
        if self.failures:
            text = "\n\n".join(r.describe() for r in self.failures[:20])
            more = len(self.failures) - 20
            raise AssertionError(f"{self.summary()}\n\n{text}" + (f"\n\n... and {more} more" if more > 0 else ""))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Result":
        """Rebuild a result from :meth:`to_json` output (the cases are re-parsed from their ids)."""
        res = cls(config=dict(data.get("config", {})), seconds=float(data.get("seconds", 0.0)))
        for c in data.get("cases", []):
            v = Verdict(c["status"], c.get("stage"), c.get("reason", ""), c.get("detail", ""), c.get("also", ""))
            res.results.append(CaseResult(parse_case_id(c["id"]), v, c["backend"], c.get("seconds", 0.0),
                                          c.get("repro", "")))
        return res


def _trim_traceback(lines: list[str], keep: int = 6) -> list[str]:
    """Keep the head of a detail and only the last ``keep`` lines of its traceback."""
    if "--- first traceback:" not in lines:
        return lines
    i = lines.index("--- first traceback:")
    tb = lines[i + 1:]
    if len(tb) <= keep + 1:
        return lines
    return lines[:i + 1] + [tb[0], f"  ... ({len(tb) - keep - 1} lines)"] + tb[-keep:]


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _trim_example(text: str, max_lines: int = 40) -> str:
    lines = text.splitlines()
    if len(lines) <= max_lines:
        return text
    return "\n".join(lines[:max_lines - 1] + [f"    ... ({len(lines) - max_lines + 1} more lines)"])


class Progress:
    """One updating line on a terminal; a line every ``every`` seconds otherwise.

    ``Progress(total, stream=sys.stderr)``; call :meth:`update` after each case
    and :meth:`close` at the end.  ``enabled=False`` keeps it silent.
    """

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None, enabled: bool = True,
                 every: float = 10.0) -> None:
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every
        self.done = 0
        self.failed = 0
        self.skipped = 0
        self.t0 = time.perf_counter()
        self._last = float("-inf")  # the first case always shows
        self._width = 0

    def update(self, result: CaseResult) -> None:
        self.done += 1
        if result.status in ("failed", "error"):
            self.failed += 1
        elif result.status == "skipped":
            self.skipped += 1
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last < 0.1 and self.done < self.total:
                return
            self._last = now
            text = self._line(result.case.id())
            text = text[: max(20, self._columns() - 1)]
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
            self.stream.flush()
        elif now - self._last >= self.every or self.done == self.total:
            self._last = now
            self.stream.write(self._line(f"{result.case.collective} W={result.case.world_size}") + "\n")
            self.stream.flush()

    def _columns(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            return 120

    def _line(self, current: str) -> str:
        el = time.perf_counter() - self.t0
        pct = 100.0 * self.done / max(self.total, 1)
        fails = f", {self.failed} failed" if self.failed else ""
        skips = f", {self.skipped} skipped" if self.skipped else ""
        return (f"[{self.label}] {self.done}/{self.total} ({pct:3.0f}%){fails}{skips}, {el:5.1f}s  {current}")

    def close(self) -> None:
        if self.enabled and self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
