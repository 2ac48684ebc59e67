"""SFT data mixtures: several sources, each with a count or a weight, joined into one jsonl file SFT reads.

`sft.data` is one source, or a list of them (docs/data.md). A source is a path, or `{path, count}` or
`{path, weight}`:
* a path alone: all its conversations;
* `count: N`: N of them, drawn without replacement (seeded); more than it holds repeats it whole, then draws the
  rest (the raw-command recipe's 512 replay rows + 320 generated rows is two counts);
* `weight: w`: the weighted sources share the rows that they hold together, in proportion to their weights
  (A of 100 rows at 0.8 and B of 900 at 0.2 give 800 rows of A, A repeated, and 200 of B).
A path is a jsonl file tbexp reads (tbexp rows, chat rows with `messages`, prompt/completion, ATIF:
tbexp.episodes.trajectories), or `oracle`: the oracle's verified turns on the train tasks (stage=collect's cache).

Parquet files and `datasets` directories (`save_to_disk`) need pyarrow, which tbexp does not install: they are
refused with a message saying so; convert them to jsonl (`Dataset.to_json`) first.

The mixed file is written in the run directory as `sft_mixture.jsonl`, rows in a seeded shuffle, with
`sft_mixture.json` (per source: path, rows held, rows drawn); SFT's content key reads the mixed file's bytes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tbexp.episodes.trajectories import DataError, read_conversations, write_conversations

Conversation = list[dict[str, str]]


def sources(data: Any) -> list[dict[str, Any]]:
    """`sft.data` as a list of {path, count, weight} (0 = not given)."""
    items = [data] if isinstance(data, str) else list(data)
    out = []
    for item in items:
        if isinstance(item, str):
            item = {"path": item}
        item = dict(item)
        unknown = set(item) - {"path", "count", "weight"}
        if "path" not in item or unknown:
            raise DataError(f"sft.data: a source is a path or {{path, count}} or {{path, weight}}; got {item}")
        if item.get("count") and item.get("weight"):
            raise DataError(f"sft.data: {item['path']}: give a count or a weight, not both")
        if float(item.get("count", 0)) < 0 or float(item.get("weight", 0)) < 0:
            raise DataError(f"sft.data: {item['path']}: counts and weights are >= 0")
        out.append(
            {"path": str(item["path"]), "count": int(item.get("count", 0)), "weight": float(item.get("weight", 0))}
        )
    return out


def read_source(path: Path) -> list[Conversation]:
    if path.is_dir() or path.suffix in (".parquet", ".arrow"):
        raise DataError(
            f"{path}: parquet files and datasets directories need pyarrow, which tbexp does not install; "
            "convert to jsonl first (datasets: Dataset.load_from_disk(d).to_json('x.jsonl'))"
        )
    return read_conversations(path)


def mix(data: Any, out: Path, seed: int, resolve: Callable[[str], Path]) -> Path:
    """Writes the mixture `data` describes to `out`; `resolve` turns a source's path (or `oracle`) into a file."""
    chosen = sources(data)
    held = [read_source(resolve(source["path"])) for source in chosen]
    rng = random.Random(seed)
    weighted_total = sum(len(rows) for rows, s in zip(held, chosen) if s["weight"])
    weight_sum = sum(s["weight"] for s in chosen)
    rows: list[Conversation] = []
    card = []
    for source, conversations in zip(chosen, held):
        if source["count"]:
            n = source["count"]
        elif source["weight"]:
            n = round(weighted_total * source["weight"] / weight_sum)
        else:
            n = len(conversations)
        drawn = _draw(conversations, n, rng)
        rows += drawn
        card.append({**source, "held": len(conversations), "drawn": len(drawn)})
    rng.shuffle(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_conversations(out, [{"messages": m} for m in rows])
    out.with_suffix(".json").write_text(json.dumps({"sources": card, "rows": len(rows)}, indent=2) + "\n")
    return out


def _draw(rows: list[Conversation], n: int, rng: random.Random) -> list[Conversation]:
    """n rows: whole copies while n exceeds them, then a sample without replacement."""
    whole, rest = divmod(n, len(rows)) if rows else (0, 0)
    return [*(rows * whole), *rng.sample(rows, rest)]
