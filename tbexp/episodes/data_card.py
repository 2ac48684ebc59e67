"""The data card stage=collect writes beside every data file: what is in it, where it came from, what was left out.

`<stem>.card.json` (the numbers), `<stem>.card.md` (the same, for a reader) and `<stem>.lengths.png` (a histogram
of the kept rows' lengths):
* kept rows per source (the policy: oracle, model, teacher), per family, per teacher;
* the teacher's solve rate per task: verified episodes / episodes entered (from the ledger, so a resumed
  collection's earlier episodes count);
* lengths: each kept conversation's message texts joined and counted with the model's tokenizer
  (`model.path` or the shipped model); where it cannot be loaded offline, in words, and the card says which;
* dropped rows, counted by why (not verified, duplicate trajectory, over max_per_task, overlaps a held-out or
  named task), and each decontamination overlap: task, reference, check, evidence.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def card_paths(data: Path) -> tuple[Path, Path, Path]:
    stem = data.with_name(data.name.removesuffix(".jsonl"))
    return (
        stem.with_name(stem.name + ".card.json"),
        stem.with_name(stem.name + ".card.md"),
        stem.with_name(stem.name + ".lengths.png"),
    )


def write_card(
    data: Path,
    rows: list[Row],
    kept: list[Row],
    dropped: list[Row],
    overlaps: list[dict[str, str]],
    count: Callable[[str], int],
    unit: str,
    verified: Callable[[Row], bool],
) -> dict[str, Any]:
    """Writes the card of `data` (kept rows `kept` of the ledger's `rows`); `count` measures a text in `unit`."""
    episodes: dict[str, list[bool]] = defaultdict(list)
    for row in rows:
        episodes[row["task"]].append(verified(row))
    lengths = [count("\n".join(m["content"] for m in row["messages"])) for row in kept]
    card = {
        "data": data.name,
        "rows": len(kept),
        "episodes": len(rows),
        "per_source": dict(Counter(row["policy"] for row in kept)),
        "per_family": dict(sorted(Counter(row["family"] for row in kept).items())),
        "per_teacher": dict(Counter(row["teacher"] for row in kept)),
        "solve_rate": {task: sum(v) / len(v) for task, v in sorted(episodes.items())},
        "length_unit": unit,
        "lengths": {"min": min(lengths, default=0), "max": max(lengths, default=0), "mean": _mean(lengths)},
        "dropped": dict(Counter(row["dropped"] for row in dropped)),
        "overlaps": overlaps,
    }
    card_json, card_md, png = card_paths(data)
    card_json.write_text(json.dumps(card, indent=2) + "\n")
    _histogram(lengths, unit, png, data.name)
    card_md.write_text(_markdown(card, png.name))
    return card


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def _histogram(lengths: list[int], unit: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(lengths, bins=min(30, max(len(set(lengths)), 1)))
    ax.set_xlabel(f"conversation length ({unit})")
    ax.set_ylabel("rows")
    ax.set_title(f"{title}: {len(lengths)} rows")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _markdown(card: dict[str, Any], png: str) -> str:
    def table(title: str, counts: dict[str, Any], header: str) -> list[str]:
        lines = [f"## {title}", "", f"| {header} | rows |", "|---|---|"]
        return [*lines, *(f"| {k} | {v} |" for k, v in counts.items()), ""]

    lines = [f"# Data card: {card['data']}", "", f"{card['rows']} rows kept of {card['episodes']} episodes.", ""]
    lines += table("Per source", card["per_source"], "policy")
    lines += table("Per family", card["per_family"], "family")
    lines += table("Per teacher", card["per_teacher"], "teacher")
    lines += ["## Teacher solve rate per task", "", "| task | verified / episodes |", "|---|---|"]
    lines += [f"| {task} | {rate:.2f} |" for task, rate in card["solve_rate"].items()] + [""]
    lengths = card["lengths"]
    lines += [
        f"## Lengths ({card['length_unit']})",
        "",
        f"min {lengths['min']}, mean {lengths['mean']:.1f}, max {lengths['max']}",
        "",
        f"![lengths]({png})",
        "",
    ]
    lines += table("Dropped", card["dropped"], "why")
    if card["overlaps"]:
        lines += ["## Decontamination overlaps", "", "| task | reference | check | evidence |", "|---|---|---|---|"]
        lines += [f"| {o['task']} | {o['reference']} | {o['why']} | {o['evidence']} |" for o in card["overlaps"]]
    return "\n".join(lines) + "\n"


def length_counter(model_settings: Any) -> tuple[Callable[[str], int], str]:
    """(a text's length, its unit): the model's tokenizer where it loads offline, else words."""
    try:
        from transformers import AutoTokenizer

        from tbexp.models import resolve_model_path

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model_settings), local_files_only=True)
    except Exception:  # not in the local cache, or no model at all: words say something still
        return (lambda text: len(text.split())), "words"
    return (lambda text: len(tokenizer.encode(text, add_special_tokens=False))), f"{model_settings.name} tokens"
