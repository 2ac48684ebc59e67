"""Parity, byte for byte: Harbor's own `Terminus2` and tbexp's `agent=terminus_2`, same replies, same messages.

Both agents get the same scripted model replies on the same task in the same kind of sandbox (bwrap: Harbor's
agent through `tbexp.sandboxes.harbor_env.BwrapEnvironment`, tbexp's through its own episode loop), and every
message list each sends to the model is compared whole. The script covers plain commands, a batch of several,
a control key that interrupts a running command (`C-c`), a parse error, a reply with a parser warning, a first
`task_complete` that is withdrawn, and the double confirmation that ends the episode; in JSON and in XML.

Timing. The pane is read after each command's `duration` has passed, so its contents depend on the command
having finished by then. Every command here finishes in milliseconds and is given 1 s (the sandbox's execs, ~0.1
s each, come on top; 0.3 s once fell short on a machine busy with a whole test suite's image builds), and the
one long command (`sleep 30`) is interrupted before it could print anything, so what each pane capture shows is
fixed. One read is not bounded by a duration: the first, made right after the tmux session starts, may come
before bash has drawn its prompt. Both agents then show an empty screen where the other could show `root@...# `;
the test allows exactly that difference in the first message (and what follows from it: nothing, since the next
capture's new output is the whole buffer either way) and nowhere else.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before harbor: its offline import is slow otherwise

from harbor.agents.terminus_2 import Terminus2  # noqa: E402
from harbor.llms.base import BaseLLM, LLMResponse  # noqa: E402
from harbor.models.agent.context import AgentContext  # noqa: E402
from harbor.models.task.config import NetworkMode, NetworkPolicy  # noqa: E402
from harbor.models.task.task import Task as HarborTask  # noqa: E402
from harbor.models.trial.paths import TrialPaths  # noqa: E402

from tbexp.agents.base import make_agent  # noqa: E402
from tbexp.episodes.rollout import run_episode  # noqa: E402
from tbexp.sandboxes.harbor_env import BwrapEnvironment  # noqa: E402
from tbexp.tasks import load_task  # noqa: E402
from tests.conftest import compose_config, make_task  # noqa: E402

pytestmark = [pytest.mark.sandbox, pytest.mark.filterwarnings("ignore:Task.checksum:DeprecationWarning")]


def _json(commands: list[tuple[str, float]], done: bool = False, extra: str = "") -> str:
    body = {
        "analysis": "Looking at the terminal.",
        "plan": "Type the next keys.",
        "commands": [{"keystrokes": keys, "duration": duration} for keys, duration in commands],
        "task_complete": done,
    }
    return extra + json.dumps(body, indent=2)


def _xml(commands: list[tuple[str, float]], done: bool = False, extra: str = "") -> str:
    keys = "".join(f'<keystrokes duration="{duration}">{k}</keystrokes>\n' for k, duration in commands)
    return (
        f"{extra}<response>\n<analysis>Looking at the terminal.</analysis>\n<plan>Type the next keys.</plan>\n"
        f"<commands>\n{keys}</commands>\n<task_complete>{str(done).lower()}</task_complete>\n</response>"
    )


WAIT_S = 1.0  # each command's `duration`: milliseconds of work, with room for a machine under load


def script(parser: str) -> list[str]:
    reply = _json if parser == "json" else _xml
    return [
        # No times in the listing: the two episodes run a minute apart at times, and `ls -l` would show it.
        reply([("ls -la --time-style=+ /app\n", WAIT_S), ("cat input.txt\n", WAIT_S)]),
        reply([("sleep 30\n", WAIT_S), ("C-c", WAIT_S)]),  # a control key, sent as tmux's key name
        "this is not a reply in either format",  # a parse error: nothing runs
        reply([("echo done > /app/out.txt\n", WAIT_S)], extra="Here is my answer:\n"),  # a warning: text before it
        reply([("cat out.txt\n", WAIT_S)], done=True),  # a first completion: asked to confirm
        reply([("wc -c out.txt\n", WAIT_S)]),  # withdrawn: the next completion must be confirmed again
        reply([], done=True),
        reply([("pwd\n", WAIT_S)], done=True),  # confirmed: runs, then the episode ends
    ]


class ScriptedLLM(BaseLLM):
    """A Harbor model that answers from a script and records every message list it is sent."""

    def __init__(self, replies: list[str]):
        super().__init__()
        self.replies, self.sent = list(replies), []

    async def call(self, prompt: str, message_history: list | None = None, **kwargs) -> LLMResponse:
        self.sent.append(copy.deepcopy(list(message_history or [])) + [{"role": "user", "content": prompt}])
        return LLMResponse(content=self.replies.pop(0))

    def get_model_context_limit(self) -> int:
        return 1_000_000

    def get_model_output_limit(self) -> int | None:
        return None


class ScriptedPolicy:
    """The same script as a tbexp policy, recording what the episode loop shows the model."""

    def __init__(self, replies: list[str]):
        self.uploads, self.replies, self.sent = {}, list(replies), []

    def act(self, messages: list[dict[str, str]]) -> str:
        self.sent.append(copy.deepcopy(messages))
        return self.replies.pop(0)


def harbor_messages(task_dir: Path, parser: str, rootfs: Path, tmp_path: Path) -> list[list[dict]]:
    task = HarborTask(task_dir)
    env = BwrapEnvironment(
        environment_dir=task.paths.environment_dir,
        environment_name=task.name,
        session_id="terminus-2-parity",
        trial_paths=TrialPaths(tmp_path / "trial"),
        task_env_config=task.config.environment,
        network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK),
        sandbox={"rootfs": str(rootfs)},
    )
    (tmp_path / "agent-logs").mkdir()
    agent = Terminus2(
        logs_dir=tmp_path / "agent-logs",
        model_name="scripted",
        parser_name=parser,
        enable_summarize=False,
        record_terminal_session=False,
        max_turns=20,
        suppress_max_turns_warning=True,
    )
    agent._llm = llm = ScriptedLLM(script(parser))

    async def trial() -> None:
        await env.start(force_build=False)
        try:
            await agent.setup(env)
            await agent.run(task.instruction, env, AgentContext())
        finally:
            await env.stop(delete=True)

    asyncio.run(trial())
    return llm.sent


def tbexp_messages(task_dir: Path, parser: str) -> tuple[list[list[dict]], object]:
    cfg = compose_config("agent=terminus_2", f"agent.parser={parser}")
    policy = ScriptedPolicy(script(parser))
    episode = run_episode(load_task(task_dir), 0, make_agent(cfg.agent), lambda t, a: policy, cfg.sandbox, 20)
    assert not episode.invalid, episode.invalid
    return policy.sent, episode


_FIRST_SCREEN = re.compile(r"(Current Terminal Screen:\n)(root@[^\n]*# ?)?(\n*)\Z")


def _first_screen_unbounded(messages: list[list[dict]]) -> list[list[dict]]:
    """The one timing-dependent read (module docstring): the first screen, with or without bash's prompt."""
    out = copy.deepcopy(messages)
    for conversation in out:
        first = conversation[0]
        first["content"] = _FIRST_SCREEN.sub(r"\1<first screen>", first["content"])
    return out


def _first_difference(ours: list[list[dict]], theirs: list[list[dict]]) -> str:
    """Where the two agents' messages first differ (after the first screen's allowance), both sides in full."""
    for i, (a, b) in enumerate(zip(_first_screen_unbounded(ours), _first_screen_unbounded(theirs))):
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"conversation {i}, message {j}:\n--- tbexp\n{x['content']}\n--- Harbor\n{y['content']}"
        if len(a) != len(b):
            return f"conversation {i}: tbexp sent {len(a)} messages, Harbor {len(b)}"
    return "the conversations differ in number"


@pytest.mark.parametrize("parser", ["json", "xml"])
def test_every_message_matches_harbors_terminus_2(parser, rootfs, tmp_path):
    task_dir = make_task(tmp_path / "tasks")
    theirs = harbor_messages(task_dir, parser, rootfs, tmp_path)
    ours, episode = tbexp_messages(task_dir, parser)
    assert len(theirs) == len(ours) == len(script(parser))
    assert _first_screen_unbounded(ours) == _first_screen_unbounded(theirs), _first_difference(ours, theirs)
    if [c[0] for c in ours] == [c[0] for c in theirs]:  # usually byte for byte from the first message too
        assert ours == theirs
    # what the messages say happened did happen, and the episode ended as Harbor's did
    final = ours[-1]
    assert "Previous response had parsing errors:" in final[6]["content"]
    assert "Previous response had warnings:" in final[8]["content"]
    assert final[10]["content"].count("Are you sure you want to mark the task as complete?") == 1
    assert "^C" in final[4]["content"] and "hello" in final[2]["content"]
    assert episode.report is not None and episode.report.rewards["reward"] == 1.0
