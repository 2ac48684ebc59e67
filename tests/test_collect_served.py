"""policy=teacher against a real OpenAI-compatible endpoint: `python -m tbexp.serve` of the shipped tiny model
(`base`: tbexp/models/tiny, pretrained on raw_command episodes) and of tiny_terminus, on 127.0.0.1.

Nothing is stood in here: litellm calls the server as Harbor does (`hosted_vllm/<name>`), the agent builds the
prompts and parses the replies (raw_command; terminus-2 with its JSON parser and tmux pane), the episodes run in
bwrap sandboxes and the verifier scores them. The tiny models rarely solve a task, so what is checked is the
pipeline: every episode entered with its verdict and the server's token counts, in the agent's protocol.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import compose_job, make_task
from tests.services import tbexp_serve


@pytest.fixture(scope="module", params=[("raw_command", "tiny"), ("terminus_2", "tiny_terminus")])
def served(request, tmp_path_factory):
    """(agent, model, base URL) of `python -m tbexp.serve base model=<model>` on a free port."""
    agent, model = request.param
    with tbexp_serve(tmp_path_factory.mktemp("serve") / "stderr.txt", "base", f"model={model}") as url:
        yield agent, model, url


@pytest.mark.sandbox
def test_a_collection_from_the_served_model_enters_every_episode(served, rootfs, tmp_path, monkeypatch):
    from tbexp.stages import collect

    agent, model, url = served
    for i in range(2):
        make_task(tmp_path / "tasks", name=f"t{i}")
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data.jsonl"
    job = compose_job(
        "stage=collect",
        "policy=teacher",
        f"agent={agent}",
        "agent.max_turns=3",
        "tasks.source=dir",
        f"tasks.path={tmp_path / 'tasks'}",
        "collect.n_runs=2",
        "collect.concurrency=2",
        f"collect.teacher_url={url}",
        f"collect.teacher_model=hosted_vllm/{model}",
        "collect.teacher_max_tokens=64",
        "collect.teacher_key_env=",
        f"collect.data={data}",
    )
    metrics = collect.run(job)
    assert metrics["collect/episodes"] == 4 and metrics["collect/teacher_failed_episodes"] == 0
    rows = [json.loads(line) for line in (tmp_path / "data.ledger.jsonl").read_text().splitlines()[1:]]
    assert len(rows) == 4
    for row in rows:
        assert row["teacher"] == f"hosted_vllm/{model}@{url}" and row["agent"] == agent
        assert not row["verdict"]["invalid"] and row["verdict"]["tests"] == 3
        replies = [m for m in row["messages"] if m["role"] == "assistant"]
        assert row["tokens"]["calls"] == len(replies) >= 1  # every reply came from the server
        assert row["tokens"]["prompt"] > 0 and row["tokens"]["completion"] > 0
        first_prompt = row["messages"][0]["content"]
        assert ("JSON" in first_prompt) == (agent == "terminus_2")  # the agent's own protocol
    assert data.is_file()  # written, though a tiny model may have solved nothing
