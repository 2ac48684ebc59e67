"""SFT data: conversations in a jsonl file, one verified episode per line.

The format tbexp writes (`stage=collect`), one JSON object per line:

    {"task": "tbexp/log-errors-0003", "agent": "raw_command", "reward": 1.0,
     "messages": [{"role": "user", "content": "<instruction + protocol>"},
                  {"role": "assistant", "content": "grep -c ' ERROR auth:' app.log > /app/n.txt"},
                  {"role": "user", "content": "[exit 0]"},
                  {"role": "assistant", "content": "exit"}]}

Only `messages` is required. Also accepted, and converted to messages:
* raw-command rows: `{"prompt": str, "completion": str}` (one turn), as in
  the raw-command recipe's generated rows;
* Harbor / terminus-2 trajectories in ATIF (`{"schema_version": "ATIF-…",
  "steps": [{"source": "user"|"agent"|"system", "message": …,
  "observation": {"results": [{"content": …}]}}]}`): user steps and
  observations become user messages, agent steps assistant messages.

A bad file (not jsonl, empty, a row without what it needs) is refused with
the line number, before any training starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tbexp.errors import TbexpError


class DataError(TbexpError, ValueError):
    """An unusable SFT data file; the message names the file and line."""


def read_conversations(path: str | Path) -> list[list[dict[str, str]]]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    conversations = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not JSON ({err.msg}); expected one JSON object per line") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            try:
                conversations.append(_messages(row))
            except DataError as err:
                raise DataError(f"{path}:{lineno}: {err}") from None
    if not conversations:
        raise DataError(f"{path}: empty; expected one conversation per line")
    return conversations


def write_conversations(path: Path, rows: list[dict[str, Any]]) -> Path:
    tmp = path.with_suffix(f".jsonl.{os.getpid()}.tmp")  # two jobs filling one cache must not write into one file
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path


def _messages(row: dict[str, Any]) -> list[dict[str, str]]:
    if "messages" in row:
        messages = row["messages"]
    elif "prompt" in row or "completion" in row:
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str):
            raise DataError("a raw-command row needs string fields 'prompt' and 'completion'")
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
    elif "steps" in row:
        messages = _from_atif(row["steps"])
    else:
        raise DataError("missing field 'messages' (or 'prompt'/'completion', or ATIF 'steps')")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ("user", "assistant", "system")
        for m in messages
    ):
        raise DataError("'messages' must be a list of {role: user|assistant|system, content: str}")
    if messages and messages[0]["role"] == "system":
        messages = _fold_system(messages)
    messages = [m for m in messages if m["role"] != "system"]
    if not messages or messages[0]["role"] != "user":
        raise DataError("a conversation must start with a user message")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("no assistant message: nothing to train on")
    for a, b in zip(messages, messages[1:]):
        if a["role"] == b["role"]:
            raise DataError(f"two {a['role']} messages in a row: roles must alternate")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _fold_system(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """terminus-2 sends no system message; fold one into the first user turn rather than lose it."""
    system, rest = messages[0]["content"], messages[1:]
    if rest and rest[0]["role"] == "user":
        return [{"role": "user", "content": f"{system}\n\n{rest[0]['content']}"}, *rest[1:]]
    return [{"role": "user", "content": system}, *rest]


def _from_atif(steps: Any) -> list[dict[str, str]]:
    if not isinstance(steps, list):
        raise DataError("ATIF 'steps' must be a list")
    messages: list[dict[str, str]] = []

    def add(role: str, text: str) -> None:
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n" + text  # consecutive same-role steps merge
        else:
            messages.append({"role": role, "content": text})

    for step in steps:
        if not isinstance(step, dict) or step.get("source") not in ("user", "agent", "system"):
            raise DataError("each ATIF step needs 'source' of user, agent or system")
        text = _text(step.get("message", ""))
        add({"agent": "assistant", "user": "user", "system": "system"}[step["source"]], text)
        results = (step.get("observation") or {}).get("results") or []
        observed = "\n".join(_text(r.get("content") or "") for r in results if isinstance(r, dict))
        if observed:
            add("user", observed)
    return messages


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # ATIF content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise DataError(f"unreadable message content of type {type(content).__name__}")
