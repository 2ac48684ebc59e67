"""tbexp's command protocols as a Harbor agent, so Harbor's own trials can score what `agent=raw_command` trains.

`TbexpCommandAgent` is a Harbor `BaseAgent` that plays one of tbexp's command
protocols (the job's `agent` node: `raw_command`, or `terminus_shell`) inside a
Harbor `Trial`. Harbor starts the environment, sets the agent's user, times the
agent out, runs the verifier and grades; this agent only talks. Each turn:

* the reply is sampled through `TbexpLLM` (the job's sampler, token-exact
  across turns, reply k of run r seeded as tbexp's own model policy seeds it);
* the reply is parsed by the protocol, and each command runs with Harbor's
  `environment.exec`, wrapped in the script tbexp's `ShellSession` uses (the
  working directory and exports carried from the previous command), limited to
  the larger of the command's own time-out and `sandbox.command_timeout_s`;
* the protocol's observation of the results is the next prompt.

A prompt that leaves no room for a reply ends the episode with the protocol's
"done" reply, as `ModelPolicy` ends a native episode. So where the seeds line
up, a Harbor trial and a native episode of one checkpoint send the model the
same messages and run the same commands (tests/test_harbor_harness.py holds
them side by side).

What it reads from Harbor's `ExecResult`: tbexp's environments put stdout and
stderr interleaved in `stdout` and report a time-out as exit 124 and too much
output as exit 125 (`tbexp.sandboxes.base`), which the observation turns back
into "(timed out)" and "(output cut: too much)"; so a command that itself exits
124 reads as timed out here. Harbor's other environments return stderr apart:
it is shown after stdout. The turns, with their exit statuses, are kept in the
trial's `Conversation` (`harbor_llm.conversation`), so `eval/valid_command_rate`
is the native one; the tokens go to the trial's rollout details, which
`grpo.harness=harbor` trains on.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # harbor imports litellm, which goes online otherwise

from harbor.agents.base import BaseAgent  # noqa: E402
from harbor.llms.base import ContextLengthExceededError  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from tbexp.agents.base import NUL_COMMAND, Turn, make_agent, shell_script  # noqa: E402
from tbexp.episodes.harbor_llm import TbexpLLM, claim  # noqa: E402
from tbexp.sandboxes.base import OUTPUT_LIMIT_EXIT, TIMEOUT_EXIT, ExecResult  # noqa: E402

NAME = "tbexp-command"  # harbor.agent's value for this agent


class TbexpCommandAgent(BaseAgent):
    """kwargs: `tbexp_policy` (harbor_llm.serve), `tbexp_trial`, `tbexp_seed`, `tbexp_agent` (the agent node),
    `tbexp_workdir` (the task's), `tbexp_command_timeout_s` (the sandbox node's)."""

    def __init__(
        self,
        *args: Any,
        tbexp_policy: str,
        tbexp_agent: dict[str, Any],
        tbexp_workdir: str = "/app",
        tbexp_command_timeout_s: float = 30.0,
        tbexp_trial: str = "",
        tbexp_seed: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        runtime, record = claim(tbexp_policy, tbexp_trial)
        self.llm = TbexpLLM(runtime, tbexp_seed, record)
        self.protocol = make_agent(OmegaConf.create(tbexp_agent))
        self.max_turns = int(tbexp_agent["max_turns"])
        self.workdir = tbexp_workdir
        self.command_timeout_s = float(tbexp_command_timeout_s)

    @staticmethod
    def name() -> str:
        return NAME

    def version(self) -> str:
        return "1"

    async def setup(self, environment: Any) -> None:
        pass

    async def set_web_tools_disabled(self, disabled: bool, environment: Any) -> None:
        """Nothing to disable: the protocol has no web tools (Harbor's base logs an ERROR saying so every trial)."""

    async def run(self, instruction: str, environment: Any, context: Any) -> None:
        record = self.llm.record
        prompt = self.protocol.prompt(SimpleNamespace(instruction=instruction, workdir=self.workdir))
        history: list[dict[str, str]] = []
        try:
            for _ in range(self.max_turns):
                try:
                    reply = (await self.llm.call(prompt, history)).content
                except ContextLengthExceededError:  # as ModelPolicy: end the episode rather than cut what it saw
                    reply = self.protocol.format([], done=True)
                history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
                turn = Turn(reply, self.protocol.parse(reply, record.turns))
                record.turns.append(turn)
                # Before the commands run: an agent time-out during them still leaves this reply's tokens to train on.
                context.rollout_details = [
                    {
                        "prompt_token_ids": record.prompts,
                        "completion_token_ids": record.replies,
                        "logprobs": record.logprobs,
                    }
                ]
                await self._run_commands(turn, environment)
                if turn.action.done:
                    return
                prompt = self.protocol.observe(turn)
        finally:
            record.messages = history  # the whole conversation, the last reply included

    async def _run_commands(self, turn: Turn, environment: Any) -> None:
        timeouts = turn.action.timeouts_s or [None] * len(turn.action.commands)
        for command, timeout_s in zip(turn.action.commands, timeouts):
            if "\x00" in command:
                turn.results.append(NUL_COMMAND)
                continue
            limit_s = max(timeout_s or 0.0, self.command_timeout_s)
            result = await environment.exec(shell_script(command, self.workdir), timeout_sec=limit_s)
            turn.results.append(_exec_result(result))


def _exec_result(result: Any) -> ExecResult:
    """Harbor's ExecResult as tbexp's (its time-out and output-limit exits, stderr after stdout).

    >>> from harbor.environments.base import ExecResult as HarborResult
    >>> _exec_result(HarborResult(stdout="a\\n", stderr="", return_code=124))
    ExecResult(output='a\\n', exit_code=124, timed_out=True, output_truncated=False, duration_s=0.0)
    """
    output = (result.stdout or "") + (result.stderr or "")
    code = result.return_code
    return ExecResult(output, code, timed_out=code == TIMEOUT_EXIT, output_truncated=code == OUTPUT_LIMIT_EXIT)
