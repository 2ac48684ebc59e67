"""SFT data mixtures (tbexp.episodes.mixture): counts, weights, formats, and sft.data as Hydra composes it."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tbexp.episodes.mixture import mix
from tbexp.episodes.trajectories import DataError
from tests.conftest import compose_job


def _rows(path, tag: str, n: int, chat: bool) -> str:
    with path.open("w") as f:
        for i in range(n):
            messages = [{"role": "user", "content": f"{tag} {i}"}, {"role": "assistant", "content": f"echo {tag}{i}"}]
            row = {"messages": messages} if chat else {"task": f"t/{tag}{i}", "teacher": tag, "messages": messages}
            f.write(json.dumps(row) + "\n")
    return str(path)


def _tags(path) -> Counter[str]:
    return Counter(json.loads(line)["messages"][0]["content"].split()[0] for line in path.read_text().splitlines())


@pytest.fixture
def replay(tmp_path):
    return _rows(tmp_path / "replay.jsonl", "replay", 10, chat=False)  # tbexp rows, as stage=collect writes


@pytest.fixture
def generated(tmp_path):
    return _rows(tmp_path / "generated.jsonl", "generated", 4, chat=True)  # chat rows, as on the Hub


def test_counts_draw_that_many_and_repeat_a_source_that_holds_fewer(replay, generated, tmp_path):
    out = mix([{"path": replay, "count": 6}, {"path": generated, "count": 9}], tmp_path / "m.jsonl", 0, _file)
    assert _tags(out) == {"replay": 6, "generated": 9}
    drawn = Counter(json.loads(line)["messages"][0]["content"] for line in out.read_text().splitlines())
    assert len([c for c in drawn if c.startswith("replay")]) == 6  # without replacement
    assert all(drawn[f"generated {i}"] >= 2 for i in range(4))  # 9 of 4: twice each, then one more
    card = json.loads((tmp_path / "m.json").read_text())
    assert [(s["held"], s["drawn"]) for s in card["sources"]] == [(10, 6), (4, 9)]


def test_weights_share_the_rows_the_weighted_sources_hold(replay, generated, tmp_path):
    out = mix([{"path": replay, "weight": 1}, {"path": generated, "weight": 3}], tmp_path / "m.jsonl", 0, _file)
    assert _tags(out) == {"replay": 4, "generated": 10}  # 14 rows, 1:3 (rounded)
    out = mix([replay, generated], tmp_path / "all.jsonl", 0, _file)
    assert _tags(out) == {"replay": 10, "generated": 4}  # a plain path: all of it


def test_the_mixture_is_the_same_for_the_same_seed(replay, generated, tmp_path):
    spec = [{"path": replay, "count": 5}, {"path": generated, "count": 2}]
    a, b = mix(spec, tmp_path / "a.jsonl", 3, _file), mix(spec, tmp_path / "b.jsonl", 3, _file)
    assert a.read_bytes() == b.read_bytes()
    assert mix(spec, tmp_path / "c.jsonl", 4, _file).read_bytes() != a.read_bytes()


def test_unreadable_sources_are_refused_saying_why(replay, tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match="pyarrow"):
        mix([str(tmp_path / "d.parquet")], tmp_path / "m.jsonl", 0, _file)
    with pytest.raises(DataError, match="pyarrow"):
        mix([str(tmp_path)], tmp_path / "m.jsonl", 0, _file)  # a datasets directory
    with pytest.raises(DataError, match="not both"):
        mix([{"path": replay, "count": 1, "weight": 1}], tmp_path / "m.jsonl", 0, _file)
    with pytest.raises(DataError, match="a source is"):
        mix([{"file": replay}], tmp_path / "m.jsonl", 0, _file)


def test_sft_data_takes_a_list_of_sources_on_the_command_line(replay, generated, tmp_path, monkeypatch):
    from tbexp.stages.sft import data_file

    monkeypatch.chdir(tmp_path)
    job = compose_job(f"sft.data=[{{path:{replay},count:3}},{generated}]")
    path = data_file(job)
    assert path == job.run_dir / "sft_mixture.jsonl" and _tags(path) == {"replay": 3, "generated": 4}
    assert data_file(compose_job(f"sft.data={replay}")) == __import__("pathlib").Path(replay)  # one file: as it is


def _file(path: str):
    from pathlib import Path

    return Path(path)
