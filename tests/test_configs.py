"""Every experiment composes; bad keys, choices and values fail with messages that name them."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException

from tbexp.config import ConfigError, check
from tests.conftest import CONF, REPO, compose_config

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
GROUP_OPTIONS = sorted(
    (p.parent.name, p.stem)
    for p in CONF.glob("*/*.yaml")
    if p.parent.name not in ("experiment", "sweep", "model_tuning")
)  # experiments and sweeps are added with +, sweeps tested in tests/test_sweep_configs.py; model_tuning is picked below


def test_there_are_experiments():
    assert "eval" in EXPERIMENTS


@pytest.mark.parametrize("model,lr", [("qwen3_8b", 1e-3), ("llama3_1_8b", 3e-4), ("gpt_oss_20b", 1e-4)])
def test_hub_models_on_tinker_train_sft_at_the_cookbooks_rate(model, lr):
    """tinker-cookbook's calibrated LoRA SFT rates (conf/model_tuning/<model>_tinker.yaml); before, 1e-2, the tiny
    model's. The local backend and the command line keep theirs."""
    assert compose_config(f"model={model}", "backend=tinker").sft.learning_rate == lr
    assert compose_config(f"model={model}").sft.learning_rate == 1e-2
    assert compose_config(f"model={model}", "backend=tinker", "sft.learning_rate=5e-5").sft.learning_rate == 5e-5


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_checks(name):
    cfg = compose_config(f"+experiment={name}")
    check(cfg)


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_group_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if (group, option) == ("tasks", "dir"):
        overrides.append("tasks.path=/somewhere")
    cfg = compose_config(*overrides)
    assert cfg[group] is not None


def test_the_tiny_models_grpo_settings_apply_to_it_on_the_local_backend_only():
    tiny = compose_config()
    check(tiny)
    assert (tiny.grpo.loss_fn, tiny.grpo.kl_scaled_reference, tiny.grpo.lr_schedule) == ("dppo", True, "constant")
    assert (tiny.grpo.steps, tiny.task_filter.max_tasks) == (24, 0)  # every RL candidate, 24 steps
    terminus = compose_config("+experiment=terminus_2")  # its episodes are long: the sample and steps of before
    assert (terminus.grpo.steps, terminus.task_filter.max_tasks) == (12, 80)
    assert (terminus.model.name, terminus.grpo.loss_fn) == ("tiny_terminus", "ppo")  # tiny's tuning is tiny's alone
    assert not compose_config("model.logit_scale=false").grpo.kl_scaled_reference  # it follows the model's scale
    assert compose_config("grpo.loss_fn=ppo").grpo.loss_fn == "ppo"  # the command line still decides
    assert compose_config("+experiment=grpo").grpo.loss_fn == "importance_sampling"  # and so does an experiment
    for overrides in (["backend=tinker", "model.logit_scale=false"], ["model=qwen3_8b"]):
        other = compose_config(*overrides)
        check(other)
        settings = (other.grpo.loss_fn, other.grpo.kl_scaled_reference, other.grpo.lr_schedule)
        assert settings == ("ppo", False, "cosine"), overrides
        assert (other.grpo.steps, other.task_filter.max_tasks) == (12, 80), overrides


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_file_starts_with_its_command_and_is_global(name):
    lines = (CONF / "experiment" / f"{name}.yaml").read_text().splitlines()
    assert lines[0] == "# @package _global_"  # Hydra reads the package header only from the file's leading lines
    assert lines[1] == f"# python -m tbexp +experiment={name}" or lines[1].startswith(
        f"# python -m tbexp +experiment={name} "
    )


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_cfg_job_prints_each_experiment(name):
    out = subprocess.run(
        [sys.executable, "-m", "tbexp", "--cfg", "job", f"+experiment={name}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "stage:" in out.stdout and "sandbox:" in out.stdout


def test_misspelt_key_names_the_key():
    with pytest.raises(ConfigCompositionException) as err:
        compose_config("model.lora_rnak=8")
    assert "lora_rnak" in str(err.value.__cause__ or err.value)


def test_misspelt_key_on_command_line_names_the_key():
    out = subprocess.run(
        [sys.executable, "-m", "tbexp", "model.lora_rnak=8"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "lora_rnak" in out.stderr and "ModelConfig" in out.stderr


def test_unknown_choice_lists_the_options():
    out = subprocess.run(
        [sys.executable, "-m", "tbexp", "reward=nonsense"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "reward/nonsense" in out.stderr
    for option in ("binary", "per_test", "per_test_efficiency"):
        assert option in out.stderr
    assert "schema" not in out.stderr.split("Available options")[1].split("Config search path")[0]


def test_wrong_type_is_refused():
    with pytest.raises(ConfigCompositionException):
        compose_config("eval.n_runs=three")


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["task_filter.lower=0.8", "task_filter.upper=0.8"], "must be below"),
        (["task_filter.lower=0.9", "task_filter.upper=0.2"], "must be below"),
        (["task_filter.upper=1.5"], "[0, 1]"),
        (["task_filter.k=0"], "task_filter.k"),
        (["eval.n_runs=0"], "eval.n_runs"),
        (["collect.concurrency=0"], "collect.concurrency"),
        (["grpo.group_size=1"], "grpo.group_size"),
        (["grpo.clip_low_threshold=1.1"], "need low < 1 < high"),
        (["grpo.negative_weight=-0.5"], "grpo.negative_weight"),
        (["grpo.logit_scale_lr_factor=-1"], "grpo.logit_scale_lr_factor"),
        (["grpo.kl_scaled_reference=true", "model.logit_scale=false"], "needs model.logit_scale=true"),
        (["backend.train_threads=-1"], "backend.train_threads"),
        (["backend.gpu_memory_fraction=0"], "backend.gpu_memory_fraction=0.0: must lie in (0, 1]"),
        (["backend.gpu_memory_fraction=1.2"], "backend.gpu_memory_fraction=1.2"),
    ],
)
def test_unusable_values_are_refused_by_check(overrides, needle):
    cfg = compose_config(*overrides)
    with pytest.raises(ConfigError) as err:
        check(cfg)
    assert needle in str(err.value)


def test_bad_bounds_stop_the_command_before_any_work(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tbexp",
            "task_filter.lower=0.9",
            "task_filter.upper=0.1",
            f"hydra.run.dir={tmp_path}/run",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "task_filter.lower=0.9 must be below task_filter.upper=0.1" in out.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(
    "override,key,choices",
    [
        ("stage.name=distill", "stage.name", "eval, collect, sft, filter, grpo, pipeline"),
        ("policy=oracel", "policy", "oracle, nop, model"),
        ("tasks.split=validation", "tasks.split", "train, heldout"),
        ("grpo.loss_fn=reinforce", "grpo.loss_fn", "importance_sampling, ppo, cispo, gspo, dppo"),
        ("sft.lr_schedule=cosin", "sft.lr_schedule", "cosine, linear, constant"),
        ("pipeline.stages=[collect,sft,rlhf]", "pipeline.stages", "collect, sft, filter, grpo, eval"),
    ],
)
def test_unknown_choice_is_refused_at_composition_naming_key_and_choices(override, key, choices):
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(override)
    message = str(err.value) + str(err.value.__cause__)
    assert f"full_key: {key}" in message and choices in message


def test_experiment_must_be_added_not_overridden():
    with pytest.raises(ConfigCompositionException):
        compose_config("experiment=eval")  # `experiment` is not in the defaults list: needs `+`


@pytest.mark.parametrize(
    "group,option,schema,own_key",
    [
        ("backend", "local", "LocalBackendConfig", "packing=true"),
        ("backend", "tinker", "TinkerBackendConfig", "base_url=http://127.0.0.1:1"),
        ("sandbox", "bwrap", "BwrapSandboxConfig", "environment_source=debootstrap"),
        ("sandbox", "docker", "DockerSandboxConfig", "max_lifetime_s=60"),
        ("reward", "per_test_efficiency", "PerTestEfficiencyRewardConfig", "tests_weight=0.5"),
    ],
)
def test_each_option_has_its_own_schema_and_takes_its_own_keys(group, option, schema, own_key):
    from omegaconf import OmegaConf

    cfg = compose_config(f"{group}={option}", f"{group}.{own_key}")
    assert OmegaConf.get_type(cfg[group]).__name__ == schema
    check(cfg)


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["backend=tinker", "backend.packing=true"], "Key 'packing' not in 'TinkerBackendConfig'"),  # local's key
        (["backend.base_url=http://x"], "Key 'base_url' not in 'LocalBackendConfig'"),  # tinker's key
        (
            ["sandbox=docker", "sandbox.environment_source=docker"],
            "Key 'environment_source' not in 'DockerSandboxConfig'",
        ),
        (["sandbox.max_lifetime_s=60"], "Key 'max_lifetime_s' not in 'BwrapSandboxConfig'"),
        (["sandbox=docker", "sandbox.cpu=2"], "Key 'cpu' not in 'DockerSandboxConfig'"),
    ],
)
def test_a_key_the_chosen_option_does_not_have_is_refused_in_one_line(overrides, line):
    out = subprocess.run(
        [sys.executable, "-m", "tbexp", *overrides], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert line in out.stderr.splitlines(), out.stderr  # one line names the key and the option's schema


@pytest.mark.parametrize("group,option", [("backend", "tinker"), ("reward", "binary"), ("sandbox", "docker")])
def test_choosing_a_plug_in_by_its_name_is_refused_saying_how_to_choose(group, option):
    cfg = compose_config(f"{group}.name={option}")
    with pytest.raises(ConfigError, match=f"{group}.name={option}: the {group} is chosen by {group}=<option>"):
        check(cfg)


@pytest.mark.parametrize(
    "group,option,target",
    [
        ("backend", "local", "tbexp.build.LocalHost"),
        ("backend", "tinker", "tbexp.build.TinkerHost"),
        ("reward", "binary", "tbexp.episodes.rewards.binary"),
        ("reward", "task_reward", "tbexp.episodes.rewards.task_reward"),
    ],
)
def test_reward_and_backend_are_chosen_by_target(group, option, target):
    from hydra.utils import get_object

    node = compose_config(f"{group}={option}")[group]
    assert node._target_ == target and node.name == option
    get_object(target)  # the target exists
