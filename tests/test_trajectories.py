"""SFT data files: the formats accepted, and bad files refused with the line number."""

from __future__ import annotations

import json

import pytest

from tbexp.episodes.trajectories import DataError, read_conversations, write_conversations


def _write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))
    return path


def test_round_trip_of_the_written_format(tmp_path):
    rows = [
        {
            "task": "t",
            "messages": [
                {"role": "user", "content": "do"},
                {"role": "assistant", "content": "ls"},
                {"role": "user", "content": "[exit 0]"},
                {"role": "assistant", "content": "exit"},
            ],
        }
    ]
    path = write_conversations(tmp_path / "t.jsonl", rows)
    assert read_conversations(path) == [rows[0]["messages"]]


def test_raw_command_rows_and_atif_trajectories(tmp_path):
    atif = {
        "schema_version": "ATIF-v1.4",
        "steps": [
            {"step_id": 1, "source": "system", "message": "You are an agent."},
            {"step_id": 2, "source": "user", "message": "Count the lines."},
            {
                "step_id": 3,
                "source": "agent",
                "message": '{"commands": [{"keystrokes": "wc -l a\\n"}]}',
                "observation": {"results": [{"content": "3 a"}]},
            },
            {"step_id": 4, "source": "agent", "message": [{"type": "text", "text": '{"task_complete": true}'}]},
        ],
    }
    path = _write(tmp_path, [{"prompt": "List files", "completion": "ls -la"}, atif])
    raw, trajectory = read_conversations(path)
    assert raw == [{"role": "user", "content": "List files"}, {"role": "assistant", "content": "ls -la"}]
    assert [m["role"] for m in trajectory] == ["user", "assistant", "user", "assistant"]
    assert trajectory[0]["content"] == "You are an agent.\n\nCount the lines." and trajectory[2]["content"] == "3 a"


@pytest.mark.parametrize(
    "lines,needle",
    [
        (
            [
                {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ls"}]},
                "not json at all\n",
            ],
            "data.jsonl:2: not JSON",
        ),
        ([{"messages": [{"role": "user", "content": "x"}]}], "data.jsonl:1: no assistant message"),
        ([{"prompt": "x"}], "data.jsonl:1: a raw-command row needs"),
        ([{"text": "hello"}], "data.jsonl:1: missing field 'messages'"),
        ([{"messages": [{"role": "assistant", "content": "ls"}]}], "must start with a user message"),
        (
            [
                {
                    "messages": [
                        {"role": "user", "content": "a"},
                        {"role": "user", "content": "b"},
                        {"role": "assistant", "content": "c"},
                    ]
                }
            ],
            "roles must alternate",
        ),
        (["[1, 2]\n"], "data.jsonl:1: expected a JSON object"),
        (["\n\n"], "empty"),
    ],
)
def test_bad_files_are_refused_with_the_line(tmp_path, lines, needle):
    with pytest.raises(DataError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        read_conversations(_write(tmp_path, lines))


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such data file"):
        read_conversations(tmp_path / "nope.jsonl")
