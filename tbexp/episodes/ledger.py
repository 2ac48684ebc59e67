"""A collection's ledger: one line per finished episode, written as it ends, so a killed collection resumes.

`<data>.ledger.jsonl` lies beside the data file it feeds. Its first line names the collection (`identity`: the
policy, teacher model (not its URL: a teacher served elsewhere is the same teacher), agent, sandbox, … that
decide what an episode is); each further line is one finished episode
as a row (`episode_row`): task, run, teacher, sandbox, verdict, turns, tokens, messages. The data file, its
card and the metrics are computed from the ledger alone, so a resumed run gives the file an uninterrupted one
would. A run re-opens the ledger, skips the (task, run) pairs it holds and appends the rest: no episode is run,
or paid for, twice. An episode whose teacher call failed for good is not entered (it has no verdict), so a
resumed run tries it again. A line cut short by a kill is dropped on reading (its episode runs again).

A ledger of another collection (another identity) is refused: delete it or choose another `collect.data`.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from tbexp.errors import TbexpError


class LedgerError(TbexpError, ValueError):
    """A ledger that belongs to another collection."""


def ledger_path(data: Path) -> Path:
    return data.with_name(data.name.removesuffix(".jsonl") + ".ledger.jsonl")


class Ledger:
    def __init__(self, path: Path, identity: dict[str, Any]):
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        if path.is_file():
            self._read(identity)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w") as f:
                f.write(json.dumps({"ledger": identity}) + "\n")
        self.resumed = len(self.rows)  # episodes found from an earlier run

    def done(self) -> set[tuple[str, int]]:
        return {(row["task"], row["run"]) for row in self.rows}

    def append(self, row: dict[str, Any]) -> None:
        """Enters one finished episode; the line is on disk (flushed) before this returns."""
        line = json.dumps(row) + "\n"
        with self._lock, self.path.open("a") as f:
            f.write(line)
            f.flush()
            self.rows.append(row)

    def _read(self, identity: dict[str, Any]) -> None:
        lines = self.path.read_text().splitlines()
        header = _parse(lines[0]) if lines else None
        if header is None or header.get("ledger") != identity:
            found = header.get("ledger") if header else None
            raise LedgerError(
                f"{self.path}: the ledger of another collection ({found}, not {identity}); delete it to start "
                "afresh, or choose another collect.data"
            )
        seen = set()
        for line in lines[1:]:
            row = _parse(line)
            if row is None or (row["task"], row["run"]) in seen:  # a line a kill cut short
                continue
            seen.add((row["task"], row["run"]))
            self.rows.append(row)
        # rewrite without the torn lines, so that appending starts on a fresh line
        self.path.write_text("".join(json.dumps(x) + "\n" for x in [{"ledger": identity}, *self.rows]))


def _parse(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def episode_row(
    episode: Any, policy: str, teacher: str, agent: str, sandbox: str, tokens: dict[str, int]
) -> dict[str, Any]:
    """What the ledger and every kept row record of one finished episode."""
    report = episode.report
    verdict = {
        "strict": bool(report is not None and report.strict),
        "pass_fraction": report.fraction_passed if report is not None else 0.0,
        "passed": report.n_passed if report is not None else 0,
        "tests": report.n_total if report is not None else 0,
        "invalid": episode.invalid.splitlines()[0] if episode.invalid else "",
        "tamper": list(episode.tamper),
    }
    return {
        "task": episode.task.name,
        "family": episode.task.family,
        "run": episode.run,
        "policy": policy,
        "teacher": teacher,
        "agent": agent,
        "sandbox": f"{sandbox}:{episode.environment}" if episode.environment else sandbox,
        "verdict": verdict,
        "turns": len(episode.turns),
        "tokens": tokens,
        "messages": episode.messages,
    }
