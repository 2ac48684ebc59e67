"""Typed schemas for every config group, registered in Hydra's ConfigStore.

Values live in `conf/`; this module only says which keys exist and their
types, so `model.lora_rnak=8` fails with "Key 'lora_rnak' not in
'ModelConfig'" instead of being silently ignored. Checks that need more than
a type (ranges, bounds that must be ordered) run in `check()`, which the entry
point calls right after composition, before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from tbexp.errors import TbexpError


# The string choices. A StrEnum compares equal to its value and formats as it, so `cfg.policy == "model"` and
# f"{cfg.stage.name}" read as before; OmegaConf refuses any other value, naming the key and the choices.
class Stage(StrEnum):
    eval = "eval"
    collect = "collect"
    sft = "sft"
    filter = "filter"
    grpo = "grpo"
    pipeline = "pipeline"
    check = "check"  # a task set's manifest: oracle and do-nothing once each (tbexp.stages.check)


class Policy(StrEnum):
    oracle = "oracle"
    nop = "nop"
    model = "model"
    teacher = "teacher"  # an OpenAI-compatible endpoint (collect.teacher_*; tbexp.episodes.teacher)


class DataFormat(StrEnum):
    tbexp = (
        "tbexp"  # tbexp's rows: task, family, teacher, verdict, turns, tokens, messages (tbexp.episodes.trajectories)
    )
    chat = "chat"  # {"messages": [...]} and nothing else, the format chat datasets on the Hub use


class Split(StrEnum):
    train = "train"
    heldout = "heldout"


class TaskSource(StrEnum):
    builtin = "builtin"
    dir = "dir"


class FilterName(StrEnum):
    solve_rate = "solve_rate"
    none = "none"


class Harness(StrEnum):
    native = "native"  # tbexp's own agent loop (tbexp.episodes.rollout)
    harbor = "harbor"  # Harbor's own trials (tbexp.episodes.harbor_trials)


class Isolation(StrEnum):
    shared = "shared"  # the tests run in the agent's sandbox, as Harbor runs them, hardened (docs/verdicts.md)
    fresh = "fresh"  # in a fresh sandbox of the task's environment, the agent's work copied in


class TamperPolicy(StrEnum):
    zero = "zero"  # scored 0 (and counted)
    drop = "drop"  # not scored, like an invalid episode (and counted)
    keep = "keep"  # scored as the verifier found it (and counted)


class LoggerName(StrEnum):
    none = "none"
    wandb = "wandb"
    trackio = "trackio"


class Schedule(StrEnum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class Overlong(StrEnum):
    drop = "drop"
    truncate = "truncate"


class RLLoss(StrEnum):  # definitions and parameters: tbexp/backends/rl_losses.py, the comparison: docs/losses.md
    importance_sampling = "importance_sampling"
    ppo = "ppo"
    cispo = "cispo"
    gspo = "gspo"
    dppo = "dppo"  # backend=local only


class Normalize(StrEnum):
    token = "token"
    episode = "episode"


class PipelinePart(StrEnum):
    collect = "collect"
    sft = "sft"
    filter = "filter"
    grpo = "grpo"
    eval = "eval"


@dataclass
class ModelConfig:
    name: str = "tiny"
    path: str = ""  # HF Hub id or local directory; "" = the built-in tiny model
    renderer: str = "plain"  # chat template that turns messages into tokens
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    lora_target_parameters: list[str] = field(
        default_factory=list
    )  # raw parameters (MoE experts' 3-D weights) for peft's target_parameters
    logit_scale: bool = False  # a trainable scalar on the logits that GRPO learns (backends/logit_scale.py says why); local backend only
    max_length_tokens: int = 2048


@dataclass
class StageConfig:
    name: Stage = Stage.eval  # which stage `python -m tbexp` runs


# The parts that plug in (reward, backend, sandbox, agent) are chosen by `_target_`, the class or function that
# implements them, and each option's settings are its own dataclass: the base holds what every option reads, a
# subclass adds its own keys, and `conf/<group>/<option>.yaml` starts from it (`register` stores it as
# `schema/<group>/<option>`), so a key of another option or a misspelt one is refused naming the option's schema.
# `name` is a label (metric keys, log lines); choosing by it is refused in `check()`.
@dataclass
class RewardConfig:
    _target_: str = "tbexp.episodes.rewards.per_test"  # a function (reports, turns, **the other fields but name)
    name: str = "per_test"
    task_reward: str = "reward"  # the named reward of reward.json read without per-test results (task_reward: always)


@dataclass
class BinaryRewardConfig(RewardConfig):
    _target_: str = "tbexp.episodes.rewards.binary"
    name: str = "binary"


@dataclass
class PerTestEfficiencyRewardConfig(RewardConfig):
    _target_: str = "tbexp.episodes.rewards.per_test_efficiency"
    name: str = "per_test_efficiency"
    tests_weight: float = 0.8  # weight of the per-test fraction
    efficiency_weight: float = 0.2  # weight of the bonus for faster successes


@dataclass
class TaskRewardConfig(RewardConfig):
    _target_: str = "tbexp.episodes.rewards.task_reward"
    name: str = "task_reward"


@dataclass
class TaskFilterConfig:
    name: FilterName = FilterName.solve_rate
    lower: float = 0.1  # keep tasks with strict solve rate >= lower
    upper: float = 0.8  # ... and <= upper
    k: int = 8  # samples per candidate task
    split: Split = Split.train  # where the candidate RL tasks come from
    max_tasks: int = 0  # sample only this many candidates (seeded, across families); 0 = all


@dataclass
class BackendConfig:
    _target_: str = "tbexp.build.LocalHost"  # the model host: loads the weights, hands out trainers and samplers
    name: str = "local"
    # This process's torch threads (every backend's: a sweep sets them whatever the backend; on tinker no model runs
    # here, so they change nothing).
    threads: int = 1  # torch threads while sampling; the sandboxes need the other cores. 0 = torch's default
    train_threads: int = 0  # torch threads during updates, when no sandbox runs; 0 = as `threads`


@dataclass
class LocalBackendConfig(BackendConfig):
    device: str = "auto"  # cpu | cuda | auto
    # on CPU: at most the job's share of its cores (affinity, cgroup quota, cpus_per_task) among the tbexp jobs
    # running on them, re-read before each update (tbexp/jobs/cpu_share.py); false = `threads`/`train_threads` as given
    share_cores: bool = True
    # on GPU (see docs/gpu.md): all off by default, so CPU runs are unchanged
    dtype: str = ""  # "bfloat16": frozen weights in bf16, passes under autocast, trainable weights fp32
    compile: str = ""  # "inductor": torch.compile each decoder layer for training passes
    packing: bool = False  # datums joined into one row instead of padded micro-batches
    # per decoder layer; null = on a GPU, where the memory plan needs it (without it a micro-batch's training pass
    # would leave the KV pool under a quarter of the budget: docs/gpu-sampling.md), never on a CPU
    gradient_checkpointing: bool | None = None
    microbatch_tokens: int = 8192  # padded (or packed) tokens per forward pass
    cuda_graph_sampling: bool = False  # replay one CUDA graph per sampled token
    continuous_batching: bool = False  # requests share one running batch, paged KV cache (docs/gpu-sampling.md)
    kv_cache_tokens: int = 0  # continuous_batching: cache tokens; 0 = what the memory plan leaves on a GPU (64k on CPU)
    # on a GPU: the share of its memory the whole job may plan for (weights, a training pass, the KV pool); a job
    # that cannot fit is refused before its first step, with the figures (tbexp/backends/memory_plan.py)
    gpu_memory_fraction: float = 0.85


@dataclass
class TinkerBackendConfig(BackendConfig):
    _target_: str = "tbexp.build.TinkerHost"
    name: str = "tinker"
    base_url: str = ""  # a Tinker-compatible server; "" = the SDK's default
    # How long the service keeps each saved checkpoint (hosted Tinker bills stored ones): 0 = until deleted (the
    # SDK's default), else 3,600 s (an hour) to 315,360,000 s (ten years), the service's range.
    checkpoint_ttl_s: int = 0


@dataclass
class TasksConfig:
    source: TaskSource = TaskSource.builtin  # dir: a Harbor dataset directory
    path: str = ""  # source=dir: directory of task directories
    cache_dir: str = "${cache_dir}/tasks"  # where the built-in suite is written
    seed: int = 0  # builtin: generation seed
    train_per_family: int = 40
    heldout_per_family: int = 4
    split: Split = Split.heldout  # builtin
    families: list[str] = field(default_factory=list)  # [] = all
    limit: int = 0  # first N tasks after sorting; 0 = all
    rl_share: float = (
        0.0  # builtin: share of each family's train tasks kept for RL only; SFT never sees their solutions
    )
    strict: bool = False  # true: a task that cannot be loaded is fatal; false: it is listed and the rest runs
    manifest: str = ""  # a check.json (stage=check): only the tasks it calls usable; "" = every task


@dataclass
class SandboxConfig:
    _target_: str = "tbexp.sandboxes.bwrap.BwrapSandbox"  # the Sandbox class, built once per episode
    name: str = "bwrap"
    rootfs: str = "${cache_dir}/rootfs"  # the root file system of base_image (bwrap's root; scripts/build_rootfs.sh)
    base_image: str = "tbexp-base:bookworm"  # the tag the task Dockerfiles start FROM
    command_timeout_s: float = 30.0  # one exec; the command is killed after this
    output_limit_bytes: int = 65536  # one exec's stdout+stderr; beyond it the command is killed
    pids_limit: int = 128  # processes and threads in one sandbox
    memory_mb: int = 512
    disk_mb: int = 256  # writable space: /app, /tmp, /logs together
    # A task whose task.toml asks for the network (network_mode = "public") gets the host's only when this is on;
    # off, agents and verifiers run offline whatever the task says (the verifier's downloads are provisioned).
    allow_network: bool = False


@dataclass
class BwrapSandboxConfig(SandboxConfig):
    # roots of environments other than base_image: from docker | debootstrap | auto (docker if an engine answers and
    # holds the FROM image, else debootstrap)
    environment_source: str = "auto"


@dataclass
class DockerSandboxConfig(SandboxConfig):
    _target_: str = "tbexp.sandboxes.docker.DockerSandbox"
    name: str = "docker"
    cpus: float = 1.0  # CPU quota
    max_lifetime_s: float = 3600.0  # a container removes itself after this, even if tbexp died


@dataclass
class AgentConfig:
    _target_: str = "tbexp.agents.raw_command.RawCommandAgent"
    name: str = "raw_command"
    max_turns: int = 8
    observation_limit_chars: int = 2000  # output shown back to the model per turn (terminus_2: Harbor's 10,000 bytes)
    parser: str = "json"  # terminus_2: json | xml, Harbor's two templates and parsers
    summarize: bool = False  # terminus_2: Harbor's context summarization; refused (docs/terminus-2.md says why)
    pane_width: int = 160  # terminus_2: the tmux pane's columns (Harbor's tmux_pane_width)
    pane_height: int = 40  # terminus_2: its rows (Harbor's tmux_pane_height)


@dataclass
class LoggerConfig:
    name: LoggerName = LoggerName.none  # metrics.jsonl in the run directory is always written
    project: str = "tbexp"
    group: str = ""  # "" = the study's name in a sweep, else the experiment's, else the stage's
    entity: str = ""  # wandb: team or user; "" = the account's default
    mode: str = ""  # wandb: offline | online | disabled; "" = $WANDB_MODE, else offline (no account needed)
    dir: str = ""  # wandb: where its files go, "" = the run directory; trackio: its database, "" = $TRACKIO_DIR or ~/.cache/huggingface/trackio


@dataclass
class EvalConfig:
    n_runs: int = 3  # attempts per task; pass@1 is averaged over them
    concurrency: int = 4  # episodes at once
    save_episodes: int = 20  # transcripts kept under episodes/; 0 = none
    candidates: list[str] = field(
        default_factory=list
    )  # compare these (policy names or checkpoints), the first being the incumbent
    promote_by: str = "eval/strict_success"  # the metric a challenger must beat the incumbent on
    promote_margin: float = 0.0  # ... by more than this
    harness: Harness = Harness.native  # harbor: Harbor's trials, agent and verifier (the `harbor` node)
    promote_z: float = 1.96  # ... plus this many paired standard errors (1.96: the 95% interval above it; 0 = off)
    incumbent: str = ""  # pipeline: the checkpoint the last row must beat; "" = the row before it (SFT)
    tamper: TamperPolicy = TamperPolicy.zero  # an episode that touched what the verifier reads: zero | drop | keep


@dataclass
class VerifierConfig:
    """How the task's tests are run after the agent (tbexp.episodes.integrity, docs/verdicts.md)."""

    # shared: in the agent's sandbox, after every process it left is gone and what it planted where the verifier
    # reads is set aside; fresh: in a fresh sandbox of the same environment with the agent's work copied in
    # (the task's declared artifacts, else its working directory); it cannot serve tests that look at processes
    isolation: Isolation = Isolation.shared


@dataclass
class HarborConfig:
    """The Harbor harness (eval.harness=harbor): which Harbor agent and environment run the trials."""

    # policy=model's agent: "" = the one that speaks agent='s protocol: Harbor's terminus-2 for terminus_2 and
    # terminus_shell, tbexp-command (tbexp's raw_command as a Harbor agent) for raw_command; both sample from tbexp's
    # backend. Any other Harbor agent name brings its own model connection. oracle/nop are Harbor's.
    agent: str = ""
    agent_kwargs: dict[str, Any] = field(default_factory=dict)  # the agent's own options, e.g. parser_name: xml
    summarize: bool = False  # terminus-2's context summarization (off: a known source of degenerate episodes)
    # "" = tbexp's own sandbox (sandbox=bwrap|docker) as a Harbor environment; else a Harbor environment type:
    # daytona, modal, e2b, runloop, ... (they need their accounts; see docs/harbor-harness.md)
    environment: str = ""
    environment_kwargs: dict[str, Any] = field(default_factory=dict)  # that environment's own options


@dataclass
class SamplingConfig:
    temperature: float = 0.7  # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 96  # per reply
    # Concurrent episodes' replies batched all at once, in seed order, so a run's results depend on its seeds alone
    # (batch_sampling.BatchQueue); false: whatever is waiting, the sampler busier, last bits that follow thread timing
    lockstep: bool = True


@dataclass
class SFTConfig:
    # a jsonl file (tbexp.episodes.trajectories), or a list of sources, each a path or {path, count} or {path, weight}
    # (a mixture: tbexp.episodes.mixture, docs/data.md); "" or "oracle" = the oracle's verified turns on the train tasks
    data: Any = ""
    steps: int = 150  # optimizer steps
    batch_size: int = 16  # conversations per step
    learning_rate: float = 3e-3
    lr_schedule: Schedule = Schedule.cosine  # after warmup
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0  # 0 = off
    max_length_tokens: int = 0  # longer conversations are dropped or truncated; 0 = model.max_length_tokens
    overlong: Overlong = Overlong.drop
    val_fraction: float = 0.1  # share of conversations held out for eval NLL
    eval_every: int = 25  # steps between held-out NLL evaluations (each saves a checkpoint)
    patience: int = 3  # stop after this many evaluations without improvement; 0 = never stop early
    save_every: int = 0  # extra checkpoints every N steps; 0 = only at evaluations
    eval_after: bool = False  # then score the base model and the chosen checkpoint with the eval stage


@dataclass
class GRPOConfig:
    tasks_file: str = ""  # kept_tasks.json from the filter stage; "" = every task of task_filter.split
    steps: int = 20  # optimizer steps
    groups_per_step: int = 4  # tasks per step, each sampled group_size times
    group_size: int = 16  # episodes per task, each in a fresh sandbox
    temperature: float = 0.7  # rollouts; eval uses sampling.temperature
    learning_rate: float = 1.0e-3
    lr_schedule: Schedule = Schedule.constant  # after warmup
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0  # 0 = off
    loss_fn: RLLoss = RLLoss.importance_sampling
    clip_low_threshold: float = 0.8  # ppo, cispo: token-ratio bounds
    clip_high_threshold: float = 1.2
    gspo_clip_low_threshold: float = 0.9997  # gspo: sequence-ratio bounds (the GSPO paper's 3e-4 / 4e-4)
    gspo_clip_high_threshold: float = 1.0004
    dppo_mask_low: float = 0.2  # dppo: a token whose probability fell by more than this (A < 0) is dropped
    dppo_mask_high: float = 0.2  # ... or rose by more than this (A > 0)
    dppo_kl_tau: float = 0.0  # dppo: weight of the (logp - logp_sampler)^2 penalty on sampled tokens
    scale_by_std: bool = False  # advantage = (reward - group mean) / group std
    negative_weight: float = (
        1.0  # scales below-mean advantages; 1 = plain GRPO, 0 = learn from above-mean episodes only
    )
    logit_scale_lr_factor: float = (
        100.0  # with model.logit_scale: its lr = learning_rate x this (one number moves ~lr an Adam step)
    )
    updates_per_step: int = 1  # optimizer steps on each step's samples (use ppo for more than 1)
    normalize: Normalize = (
        Normalize.token
    )  # token: loss = mean over the step's sampled tokens | episode: mean over episodes of their token means
    kl_coef: float = 0.0  # penalty on log(pi/pi_start) of the sampled tokens; 0 = off
    # with model.logit_scale: the KL's reference is the starting weights at the policy's current logit scale, so the
    # penalty holds the LoRA's drift but not the sharpening the scale learns (docs/experiments.md)
    kl_scaled_reference: bool = False
    concurrency: int = 8  # episodes at once
    eval_every: int = 5  # steps between held-out evals (each keeps its checkpoint); the start is evaluated too
    eval_n_runs: int = 2  # runs per held-out task in those evals
    harness: Harness = Harness.native  # harbor: rollouts are Harbor trials (the `harbor` node), trained on their tokens
    eval_at_start: bool = True  # score the starting weights as step 0, so "peak" can be "no RL step helped"
    # Pipelined rollouts and online difficulty control (docs/grpo.md); all 0 = the synchronous loop of every step's
    # groups_per_step groups, flat groups skipped.
    max_off_policy_steps: int = 0  # k: step t's rollouts are sampled from the weights of step t-k while it trains
    max_replaced_groups: int = 0  # a step samples at most this many fresh groups in place of ones that do not spread
    retire_after: int = 0  # an RL task's groups in a row all solved or all unsolved before it is retired; 0 = never
    # an episode that touched what the verifier reads (Episode.tamper): zero = scored 0 | drop = not trained on |
    # keep = scored as verified; counted in rollout/tamper_episodes whichever
    tamper: TamperPolicy = TamperPolicy.zero


@dataclass
class PipelineConfig:
    stages: list[PipelinePart] = field(default_factory=lambda: list(PipelinePart))
    cache_sft: bool = True  # SFT results are shared by content hash (a sweep's trials with one SFT setting train once)
    cache_evals: bool = True  # so are the base and SFT rows' held-out evals (scored once per SFT setting)


@dataclass
class CheckConfig:
    """stage=check: every task once with the oracle and once with the do-nothing policy (tbexp.stages.check)."""

    n_runs: int = 1  # episodes of each policy per task
    concurrency: int = 4  # episodes at once
    manifest: str = ""  # where check.json goes; "" = the run directory


@dataclass
class CollectConfig:
    split: Split = Split.train  # which built-in split to collect on
    n_runs: int = 1  # episodes per task; only verified successes are kept
    concurrency: int = 4
    data: str = ""  # where to write the jsonl; "" = trajectories.jsonl in the run directory
    # policy=teacher: an OpenAI-compatible chat endpoint, called through litellm (docs/data.md)
    teacher_url: str = ""  # its base URL, e.g. http://127.0.0.1:8000/v1
    teacher_model: str = ""  # litellm's name: hosted_vllm/NAME, openai/NAME, ...; a bare NAME = openai/NAME
    teacher_key_env: str = "OPENAI_API_KEY"  # the environment variable holding its API key ("" = none)
    teacher_max_tokens: int = 1024  # per reply
    teacher_timeout_s: float = 120.0  # one call; a slower reply is retried
    teacher_retries: int = 6  # per call, on 429s, time-outs, 5xx and malformed replies
    teacher_backoff_s: float = 1.0  # the first retry's wait, doubling each time (a Retry-After header wins if longer)
    teacher_max_rpm: float = 0.0  # requests a minute to the teacher, all episodes together (retries too); 0 = no limit
    # rejection sampling (tbexp.episodes.selection)
    min_pass_fraction: float = 1.0  # kept: per-test pass fraction >= this; 1 = strict (every test and the reward pass)
    max_per_task: int = 0  # kept rows per task, the shortest first (turns, then reply characters); 0 = all
    format: DataFormat = DataFormat.tbexp  # what the data file holds; chat = {"messages"} rows only
    # decontamination (tbexp.tasks.decontamination): drop rows of tasks that overlap the held-out tasks or these
    decontaminate: bool = True
    decontaminate_dirs: list[str] = field(default_factory=list)  # more directories of task directories to check
    decontaminate_ngram: int = 13  # words in a shared instruction n-gram that counts as an overlap


@dataclass
class TrialConfig:
    """Set by the Optuna sweeper (hydra/sweeper=tbexp_optuna) so a job can reach its trial; see tbexp.study.trial."""

    number: int = -1  # the Optuna trial this job runs; -1 = not in a sweep
    study: str = ""  # study name
    storage: str = ""  # the study's storage: an SQLAlchemy URL or a journal file path (tbexp.study.storage)
    objective: str = ""  # the metric the job returns to the sweeper; "" = eval/reward (tbexp.__main__.OBJECTIVE)
    pruning_metric: str = ""  # the metric the job reports at its eval points; "" = report nothing


@dataclass
class Config:
    model: ModelConfig = MISSING
    stage: StageConfig = MISSING
    reward: RewardConfig = MISSING
    task_filter: TaskFilterConfig = MISSING
    backend: BackendConfig = MISSING
    tasks: TasksConfig = MISSING
    sandbox: SandboxConfig = MISSING
    agent: AgentConfig = MISSING
    logger: LoggerConfig = MISSING
    eval: EvalConfig = field(default_factory=EvalConfig)
    harbor: HarborConfig = field(default_factory=HarborConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    trial: TrialConfig = field(default_factory=TrialConfig)  # filled in by the sweeper
    load_checkpoint: str = ""  # a checkpoint directory (local) or tinker:// URI for policy=model; "" = the base model
    cache_dir: str = "${oc.env:TBEXP_CACHE,${oc.env:HOME}/.cache/tbexp}"  # root of the tasks, rootfs and result caches
    policy: Policy = Policy.oracle  # model needs a training backend
    seed: int = 0


# Each option's own schema: `conf/<group>/<option>.yaml` names it first in its defaults list.
OPTIONS = {
    "reward": {
        "binary": BinaryRewardConfig,
        "per_test": RewardConfig,
        "per_test_efficiency": PerTestEfficiencyRewardConfig,
        "task_reward": TaskRewardConfig,
    },
    "backend": {"local": LocalBackendConfig, "tinker": TinkerBackendConfig},
    "sandbox": {"bwrap": BwrapSandboxConfig, "docker": DockerSandboxConfig},
}

GROUPS = {
    "model": ModelConfig,
    "stage": StageConfig,
    "reward": RewardConfig,
    "task_filter": TaskFilterConfig,
    "backend": BackendConfig,
    "tasks": TasksConfig,
    "sandbox": SandboxConfig,
    "agent": AgentConfig,
    "logger": LoggerConfig,
}


def register() -> None:
    """Make `conf/config.yaml` typed: `base_config`, each group's schema under `schema/<group>`, and each option's
    under `schema/<group>/<option>`.

    The schemas live outside the groups themselves so that an unknown
    choice (`reward=nonsense`) lists only real options.
    """
    from tbexp.redaction import register_resolver

    register_resolver()  # `${tbexp_secret:…}`: where `python -m tbexp` moved a secret off the command line
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, schema in GROUPS.items():
        cs.store(group=f"schema/{group}", name=group, node=schema)
    for group, options in OPTIONS.items():
        for option, schema in options.items():
            cs.store(group=f"schema/{group}", name=option, node=schema)


class ConfigError(TbexpError, ValueError):
    """A composed config whose values are well typed but unusable."""


def check(cfg: Any) -> None:
    """Refuse values no stage could run with, naming the key: ranges and rules across fields (the schema's
    types and enums have already refused a wrong type or an unknown choice at composition)."""
    _check_names(cfg)
    f = cfg.task_filter
    if not (0.0 <= f.lower <= 1.0 and 0.0 <= f.upper <= 1.0):
        raise ConfigError(f"task_filter.lower={f.lower}, task_filter.upper={f.upper}: bounds must lie in [0, 1]")
    if f.lower >= f.upper:
        raise ConfigError(f"task_filter.lower={f.lower} must be below task_filter.upper={f.upper}")
    if f.k < 1:
        raise ConfigError(f"task_filter.k={f.k}: need at least one sample per task")
    for key, value in (
        ("eval.n_runs", cfg.eval.n_runs),
        ("eval.concurrency", cfg.eval.concurrency),
        ("collect.concurrency", cfg.collect.concurrency),
        ("collect.n_runs", cfg.collect.n_runs),
        ("check.concurrency", cfg.check.concurrency),
        ("check.n_runs", cfg.check.n_runs),
        ("agent.max_turns", cfg.agent.max_turns),
    ):
        if value < 1:
            raise ConfigError(f"{key}={value}: must be at least 1")
    if cfg.verifier.isolation == "fresh" and "harbor" in (cfg.eval.harness, cfg.grpo.harness):
        raise ConfigError(
            "verifier.isolation=fresh runs tbexp's own verifier in a fresh sandbox; Harbor's trials (eval.harness or "
            "grpo.harness=harbor) verify as Harbor does, in the agent's environment: use harness=native with it"
        )
    if cfg.policy == "teacher" and cfg.stage.name != "collect":
        raise ConfigError(
            "policy=teacher collects data (stage=collect); other stages sample policy=model or run oracle/nop"
        )
    if not 0.0 < cfg.collect.min_pass_fraction <= 1.0:
        raise ConfigError(f"collect.min_pass_fraction={cfg.collect.min_pass_fraction}: must lie in (0, 1] (1 = strict)")
    if cfg.collect.max_per_task < 0 or cfg.collect.teacher_retries < 0:
        raise ConfigError("collect.max_per_task and collect.teacher_retries must be >= 0 (0 = all / no retry)")
    if cfg.eval.promote_z < 0:
        raise ConfigError(f"eval.promote_z={cfg.eval.promote_z}: must be >= 0 (0 = decide on the difference alone)")
    for key, value in (("backend.threads", cfg.backend.threads), ("backend.train_threads", cfg.backend.train_threads)):
        if value < 0:
            raise ConfigError(f"{key}={value}: must be >= 0 (0 = the default)")
    fraction = getattr(cfg.backend, "gpu_memory_fraction", 1.0)  # local only
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"backend.gpu_memory_fraction={fraction}: must lie in (0, 1]")
    if not 0.0 <= cfg.tasks.rl_share < 1.0:
        raise ConfigError(f"tasks.rl_share={cfg.tasks.rl_share}: must lie in [0, 1)")
    if cfg.tasks.source == "dir" and not cfg.tasks.path:
        raise ConfigError("tasks.source=dir needs tasks.path=<directory of Harbor task directories>")
    if not 0.0 < cfg.sft.val_fraction < 1.0:
        raise ConfigError(f"sft.val_fraction={cfg.sft.val_fraction}: must lie strictly between 0 and 1")
    for key, value in (
        ("sft.steps", cfg.sft.steps),
        ("sft.batch_size", cfg.sft.batch_size),
        ("sft.eval_every", cfg.sft.eval_every),
    ):
        if value < 1:
            raise ConfigError(f"{key}={value}: must be at least 1")
    g = cfg.grpo
    for key, value in (
        ("grpo.steps", g.steps),
        ("grpo.groups_per_step", g.groups_per_step),
        ("grpo.eval_every", g.eval_every),
        ("grpo.eval_n_runs", g.eval_n_runs),
        ("grpo.concurrency", g.concurrency),
        ("grpo.updates_per_step", g.updates_per_step),
    ):
        if value < 1:
            raise ConfigError(f"{key}={value}: must be at least 1")
    for key, value in (
        ("grpo.max_off_policy_steps", g.max_off_policy_steps),
        ("grpo.max_replaced_groups", g.max_replaced_groups),
        ("grpo.retire_after", g.retire_after),
    ):
        if value < 0:
            raise ConfigError(f"{key}={value}: must be >= 0 (0 = off)")
    if g.group_size < 2:
        raise ConfigError(f"grpo.group_size={g.group_size}: a group needs at least 2 episodes to compare")
    if not 0.0 < g.clip_low_threshold < 1.0 < g.clip_high_threshold:
        raise ConfigError(
            f"grpo.clip_low_threshold={g.clip_low_threshold}, grpo.clip_high_threshold={g.clip_high_threshold}: need low < 1 < high"
        )
    if not 0.0 < g.gspo_clip_low_threshold < 1.0 < g.gspo_clip_high_threshold:
        raise ConfigError(
            f"grpo.gspo_clip_low_threshold={g.gspo_clip_low_threshold}, "
            f"grpo.gspo_clip_high_threshold={g.gspo_clip_high_threshold}: need low < 1 < high"
        )
    if min(g.dppo_mask_low, g.dppo_mask_high, g.dppo_kl_tau) < 0:
        raise ConfigError(
            f"grpo.dppo_mask_low={g.dppo_mask_low}, grpo.dppo_mask_high={g.dppo_mask_high}, "
            f"grpo.dppo_kl_tau={g.dppo_kl_tau}: must be >= 0"
        )
    if g.loss_fn == "dppo" and cfg.backend.name == "tinker":
        raise ConfigError("grpo.loss_fn=dppo runs on backend=local only (Tinker serves no DPPO): choose cispo or gspo")
    if not 0.0 <= g.negative_weight <= 1.0:
        raise ConfigError(
            f"grpo.negative_weight={g.negative_weight}: must lie in [0, 1] (0 keeps only the above-mean episodes)"
        )
    if g.logit_scale_lr_factor < 0:
        raise ConfigError(
            f"grpo.logit_scale_lr_factor={g.logit_scale_lr_factor}: must be >= 0 (0 keeps the logit scale where it starts)"
        )
    if g.kl_scaled_reference and not cfg.model.logit_scale:
        # without a KL (grpo.kl_coef=0) it has nothing to change, which is no error: model=tiny turns it on by default
        raise ConfigError(
            "grpo.kl_scaled_reference=true needs model.logit_scale=true: it puts the KL's reference at the scale the "
            "model learns"
        )


def _check_names(cfg: Any) -> None:
    """A plug-in's `name` is a label: `backend.name=tinker` on the local backend's node would run local under
    tinker's name, so it is refused, saying how to choose."""
    from omegaconf import OmegaConf

    for group in ("reward", "backend", "sandbox", "agent"):
        node = cfg[group]
        schema = OmegaConf.get_type(node)
        if schema is None or not hasattr(schema, "name"):
            continue
        default = schema()
        if node.name != default.name and node._target_ == default._target_:
            raise ConfigError(
                f"{group}.name={node.name}: the {group} is chosen by {group}=<option> (or {group}._target_), "
                f"not by its name; this node runs {node._target_}"
            )
