"""The Harbor harness: tbexp's sampler as Harbor's BaseLLM, eval.harness=harbor, and the environment setting.

.venv/bin/python -m pytest tests/test_harbor_harness.py -v

* `TbexpLLM` on the shipped tiny model: a conversation's second prompt is the first prompt, the reply *as
  sampled* and the renderer's continuation; token ids and logprobs come back as rollout details; seeds give
  the same draw; the context limit is model.max_length_tokens.
* `BwrapSessionSandbox`: a background process started by one exec is there at the next (terminus-2's tmux
  server needs that); a time-out ends the command only; stop ends everything.
* `eval.harness=harbor` on three built-in held-out tasks: Harbor's oracle solves them and its nop none, with
  the same metric keys as the native eval; terminus-2 over the tiny model runs real tmux panes in bwrap, and
  the episodes' tokens are Harbor's rollout details.
* `harbor.environment`: a Harbor environment type selects Harbor's class; a missing key is a clear error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from harbor.llms.base import ContextLengthExceededError  # noqa: E402

from tbexp.episodes import harbor_trials  # noqa: E402
from tbexp.episodes.advantages import grpo_datums  # noqa: E402
from tbexp.episodes.harbor_llm import TbexpLLM, episode_seed  # noqa: E402
from tbexp.seeds import stream  # noqa: E402
from tbexp.stages import eval as eval_stage  # noqa: E402
from tests.conftest import compose_config, compose_job, leftover_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Task.checksum:DeprecationWarning")
SMALL = ("tasks.heldout_per_family=1", "tasks.limit=3", "eval.n_runs=1", "eval.concurrency=3")


@pytest.fixture(scope="module")
def runtime():
    job = compose_job("policy=model")
    return job.models.runtime(job.models.sampler(""), job.cfg.sampling, stream(job.cfg.seed, "eval"))


def test_llm_keeps_the_sampled_tokens_and_returns_rollout_details(runtime):
    llm = TbexpLLM(runtime, seed=episode_seed(runtime.seed, "demo", 0))
    first = asyncio.run(llm.call("list the files in /app"))
    history = [{"role": "user", "content": "list the files in /app"}, {"role": "assistant", "content": first.content}]
    second = asyncio.run(llm.call("a.txt b.txt", message_history=history))
    r = runtime.renderer
    assert first.prompt_token_ids == r.initial_tokens("list the files in /app")
    assert len(first.completion_token_ids) == len(first.logprobs) > 0
    assert first.content == r.decode_reply(first.completion_token_ids)
    assert second.prompt_token_ids == (
        first.prompt_token_ids
        + first.completion_token_ids
        + r.continuation_tokens("a.txt b.txt", first.completion_token_ids)
    )
    # The same seed draws the same reply; a history Harbor rewrote is rendered from its text.
    again = TbexpLLM(runtime, seed=episode_seed(runtime.seed, "demo", 0))
    assert asyncio.run(again.call("list the files in /app")).completion_token_ids == first.completion_token_ids
    rewritten = [{"role": "user", "content": "summary"}, {"role": "assistant", "content": "ok"}]
    fresh = asyncio.run(TbexpLLM(runtime).call("go on", message_history=rewritten))
    tokens, _ = r.supervised(rewritten)
    assert fresh.prompt_token_ids[: len(tokens)] == tokens
    assert llm.get_model_context_limit() == compose_config().model.max_length_tokens == runtime.max_context_tokens
    assert llm.get_model_output_limit() == runtime.params.max_tokens


def test_a_prompt_past_the_context_limit_is_harbors_context_error(runtime):
    with pytest.raises(ContextLengthExceededError, match="model.max_length_tokens"):
        asyncio.run(TbexpLLM(runtime).call("word " * 3000))


def test_rollout_details_become_the_episodes_tokens():
    linear = {
        "prompt_token_ids": [[1, 2], [1, 2, 7, 3]],
        "completion_token_ids": [[7], [8]],
        "logprobs": [[-1.0], [-2.0]],
    }
    sampled = harbor_trials.sampled_tokens(linear)
    assert sampled.tokens == [1, 2, 7, 3, 8] and [t.offset for t in sampled.turns] == [2, 4]
    assert sampled.turns[1].logprobs == [-2.0]
    rewritten = {**linear, "prompt_token_ids": [[1, 2], [5, 3]]}  # summarization replaced the history
    assert harbor_trials.sampled_tokens(rewritten) is None


@pytest.mark.sandbox
def test_session_sandbox_keeps_background_processes(sandbox_settings, tmp_path):
    from tbexp.sandboxes.bwrap_session import BwrapSessionSandbox
    from tbexp.tasks import load_task
    from tests.conftest import make_task

    before = leftover_state()["child_processes"]  # an earlier test's process may still be on its way out
    sandbox = BwrapSessionSandbox(sandbox_settings, load_task(make_task(tmp_path)))
    sandbox.start()
    try:
        started = sandbox.exec("tmux new-session -d -s main -x 80 -y 20 'bash --login'; pwd")
        assert started.exit_code == 0 and started.output.strip() == "/app", started.output
        sent = sandbox.exec("tmux send-keys -t main 'echo $((6*7)) > /app/out' Enter; sleep 0.5; cat /app/out")
        assert sent.output.strip() == "42", sent.output
        slow = sandbox.exec("sleep 10", timeout_s=1)
        assert slow.timed_out and slow.exit_code == 124
        assert sandbox.exec("tmux has-session -t main && echo alive").output.strip() == "alive"
    finally:
        sandbox.stop()
    time.sleep(0.2)
    left = leftover_state()
    assert left["work_dirs"] == left["cgroups"] == 0 and left["child_processes"] <= before, left


def _eval(tmp_path: Path, monkeypatch, *overrides: str) -> dict[str, float]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(tmp_path)
    eval_stage.run(compose_job(*SMALL, *overrides))
    return json.loads((tmp_path / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.sandbox
def test_harbor_oracle_and_nop_score_as_the_native_eval(rootfs, tmp_path, monkeypatch):
    native = _eval(tmp_path / "native", monkeypatch, "policy=oracle")
    oracle = _eval(tmp_path / "oracle", monkeypatch, "policy=oracle", "eval.harness=harbor")
    nop = _eval(tmp_path / "nop", monkeypatch, "policy=nop", "eval.harness=harbor")
    assert set(oracle) == set(native)  # the same summary.json metrics
    assert oracle["eval/strict_success"] == native["eval/strict_success"] == 1.0
    assert oracle["eval/invalid_episodes"] == nop["eval/invalid_episodes"] == 0 and oracle["eval/episodes"] == 3
    assert nop["eval/strict_success"] == 0.0
    assert len(list((tmp_path / "oracle" / "trials").glob("*/verifier/reward.txt"))) == 3  # Harbor's verifier ran


@pytest.mark.slow
@pytest.mark.sandbox
def test_terminus_2_samples_from_the_tiny_model_in_tmux(rootfs, tmp_path):
    job = compose_job(*SMALL, "policy=model", "agent=terminus_json", "eval.harness=harbor")
    runtime = job.models.runtime(job.models.sampler(""), job.cfg.sampling, stream(job.cfg.seed, "eval"))
    tasks = job.tasks("heldout")
    episodes = harbor_trials.run_trials(job.cfg, tasks, 1, 3, "model", runtime, tmp_path, "terminus-2")
    assert len(episodes) == 3
    for episode in episodes:
        assert not episode.invalid, episode.invalid
        trial = tmp_path / f"{episode.task.name.replace('/', '_')}__run0"
        assert (trial / "agent" / "terminus_2.pane").is_file()  # the tmux pane was captured: its server lived on
        detail = json.loads((trial / "result.json").read_text())["agent_result"]["rollout_details"][0]
        assert len(episode.turns) == len(detail["completion_token_ids"]) >= 1
        assert episode.sampled.tokens == detail["prompt_token_ids"][-1] + detail["completion_token_ids"][-1]
        assert [t.logprobs for t in episode.sampled.turns] == detail["logprobs"]
        # Harbor's own prompt, not tbexp's terminus_json one, opened the conversation
        assert episode.messages[0]["content"].startswith("You are an AI assistant tasked with solving")
        assert episode.report is not None and not episode.report.strict
    # GRPO's datums are these tokens: one group of the three (rewards 1, 0, 0), advantages on the sampled tokens only
    group = [dataclasses.replace(ep, task=episodes[0].task) for ep in episodes]
    datums, counts = grpo_datums(group, {id(ep): r for ep, r in zip(group, (1.0, 0.0, 0.0))}, False, None, 0.0)
    assert counts["datums"] == 3 and counts["sampled_tokens"] == sum(ep.sampled.n_sampled for ep in group)
    for ep, datum in zip(group, datums):
        assert datum.loss_fn_inputs["target_tokens"].tolist() == ep.sampled.tokens[1:]
        advantaged = [i + 1 for i, a in enumerate(datum.loss_fn_inputs["advantages"].tolist()) if a != 0.0]
        assert advantaged == [t.offset + i for t in ep.sampled.turns for i in range(len(t.tokens))]


@pytest.mark.slow
@pytest.mark.sandbox
def test_raw_command_through_harbor_is_the_native_episode(rootfs, tmp_path):
    """The default job's protocol in Harbor's trials (tbexp's command agent) against tbexp's own loop: same draws,
    so the same messages, commands, exit statuses, tokens and test results, episode for episode."""
    from tbexp.build import run_policy

    job = compose_job(*SMALL, "policy=model", "agent.max_turns=4")
    assert harbor_trials.harbor_agent(job.cfg) == "tbexp-command"
    runtime = job.models.runtime(job.models.sampler(""), job.cfg.sampling, stream(job.cfg.seed, "eval"))
    tasks = job.tasks("heldout")
    # One episode at a time: batched sampling may round a logit's last bit otherwise, and a draw can tip on it.
    native = sorted(
        run_policy(job, tasks, 3, 1, "model", runtime, desc="native"), key=lambda ep: (ep.task.name, ep.run)
    )
    harbor = harbor_trials.run_trials(job.cfg, tasks, 3, 1, "model", runtime, tmp_path, "harbor")
    harbor.sort(key=lambda ep: (ep.task.name, ep.run))

    def commands(ep):
        return [(t.reply, t.action.commands, [(r.output, r.exit_code) for r in t.results]) for t in ep.turns]

    assert len(native) == len(harbor) == 9
    assert sum(len(t.results) for ep in native for t in ep.turns) >= 6  # commands ran, so observations are compared
    for mine, theirs in zip(native, harbor):
        assert not mine.invalid and not theirs.invalid, (mine.invalid, theirs.invalid)
        assert theirs.messages == mine.messages
        assert commands(theirs) == commands(mine)
        assert theirs.sampled.tokens == mine.sampled.tokens
        assert [t.logprobs for t in theirs.sampled.turns] == [t.logprobs for t in mine.sampled.turns]
        assert theirs.report.tests == mine.report.tests and theirs.report.tests
        trial = json.loads(
            (tmp_path / f"{mine.task.name.replace('/', '_')}__run{mine.run}" / "result.json").read_text()
        )
        assert trial["agent_info"]["name"] == "tbexp-command" and trial["verifier_result"] is not None


def test_harbor_environments_are_chosen_by_name_and_need_their_keys(monkeypatch, tmp_path):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(harbor_trials.HarborSetupError, match="harbor.environment=e2b: .*E2B_API_KEY"):
        harbor_trials.environment_config(compose_config("harbor.environment=e2b"))
    monkeypatch.setenv("E2B_API_KEY", "e2b_not_a_real_key")
    assert harbor_trials.environment_config(compose_config("harbor.environment=e2b")).type.value == "e2b"
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.modal.toml
    for key in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(harbor_trials.HarborSetupError, match="harbor.environment=modal: Modal requires authentication"):
        harbor_trials.environment_config(compose_config("harbor.environment=modal"))
    with pytest.raises(harbor_trials.HarborSetupError, match="not a Harbor environment; choose one of"):
        harbor_trials.environment_config(compose_config("harbor.environment=nonsense"))
    with pytest.raises(harbor_trials.HarborSetupError, match="leave harbor.agent unset"):
        harbor_trials.harbor_agent(compose_config("agent=terminus_2", "harbor.agent=tbexp-command"))
    assert harbor_trials.harbor_agent(compose_config("agent=terminus_shell")) == "terminus-2"
    own = harbor_trials.environment_config(compose_config("sandbox=docker"))
    assert own.import_path == "tbexp.sandboxes.harbor_env:DockerEnvironment" and own.type is None
    assert compose_config().eval.harness == "native"  # the default stays tbexp's own loop


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.parametrize("agent", ["terminus_json", "raw_command"])  # Harbor's terminus-2; tbexp's command agent
def test_grpo_takes_its_rollouts_through_harbor(rootfs, tmp_path, monkeypatch, agent):
    from tbexp.stages import grpo as grpo_stage

    monkeypatch.chdir(tmp_path)
    overrides = ["stage=grpo", "policy=model", "task_filter=none", "task_filter.max_tasks=0", "tasks.limit=1"]
    overrides += ["grpo.harness=harbor", "grpo.steps=1", "grpo.groups_per_step=1", "grpo.group_size=2"]
    overrides += ["grpo.eval_every=1", "grpo.eval_n_runs=1", f"agent={agent}", "agent.max_turns=2"]
    grpo_stage.run(compose_job(*overrides))
    (step,) = [
        json.loads(line)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if "rollout/groups" in json.loads(line)
    ]
    assert step["rollout/groups"] == 1 and step["rollout/invalid_episodes"] == 0, step
    assert len(list((tmp_path / "trials").glob("step-*/*/result.json"))) == 2  # Harbor ran the group
