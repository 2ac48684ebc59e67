"""Which settings move which result cache's key (tbexp.caches): each deciding setting moves the keys of the results it
decides and no other; each setting of the one table NOT_DECIDING moves none; paths never matter, contents do."""

from __future__ import annotations

import copy
import shutil
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from tbexp import caches
from tests.conftest import compose_config
from tests.test_content_key import tasks  # noqa: F401  (two task directories)

RESULTS = ("trajectories", "sft", "eval", "filter")
# The config groups some key reads: every setting in them decides a result unless NOT_DECIDING names it.
READ = ("model", "sft", "backend", "agent", "sandbox", "tasks", "sampling", "eval", "reward", "verifier", "collect")


@pytest.fixture
def inputs(tasks, tmp_path):  # noqa: F811
    """Two task directories, an SFT data file and a local checkpoint: what the keys read besides the config."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"messages": []}\n')
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "adapter_model.safetensors").write_bytes(b"weights")
    return SimpleNamespace(tasks=tasks, data=data, checkpoint=str(checkpoint))


def keys(cfg, inputs) -> dict[str, str]:
    """Each cached result's key, as the stages compute it (the filter samples at GRPO's temperature)."""
    sampling = OmegaConf.merge(cfg.sampling, {"temperature": cfg.grpo.temperature})
    return {
        "trajectories": caches.trajectories_key(cfg, inputs.tasks),
        "sft": caches.sft_key(cfg, inputs.data),
        "eval": caches.eval_key(cfg, inputs.tasks, inputs.checkpoint, "sft"),
        "filter": caches.filter_key(cfg, inputs.tasks, "model", inputs.checkpoint, sampling),
    }


def moved(inputs, *overrides: str, base: tuple[str, ...] = ()) -> set[str]:
    before = keys(compose_config(*base), inputs)
    after = keys(compose_config(*base, *overrides), inputs)
    return {name for name in RESULTS if before[name] != after[name]}


@pytest.mark.parametrize(
    "override, results",
    [
        ("model.lora_rank=4", {"sft", "eval", "filter"}),
        ("backend.packing=false", {"sft", "eval", "filter"}),
        ("backend=tinker", {"sft", "eval", "filter"}),
        ("seed=1", {"sft", "eval", "filter"}),  # the oracle draws nothing
        ("sft.steps=3", {"sft"}),
        ("sft.learning_rate=0.1", {"sft"}),
        ("agent.max_turns=2", {"trajectories", "eval", "filter"}),  # SFT reads it through its data only
        ("sandbox.memory_mb=256", {"trajectories", "eval", "filter"}),
        ("sandbox=docker", {"trajectories", "eval", "filter"}),
        ("collect.n_runs=2", {"trajectories"}),
        ("collect.max_per_task=1", {"trajectories"}),
        ("collect.min_pass_fraction=0.5", {"trajectories"}),
        ("collect.decontaminate=false", {"trajectories"}),
        ("collect.decontaminate_ngram=8", {"trajectories"}),
        ("task_filter.k=3", {"filter"}),
        ("grpo.temperature=1.0", {"filter"}),  # the temperature the filter samples at
        ("sampling.temperature=0.2", {"eval"}),  # the filter's temperature is GRPO's
        ("sampling.max_tokens=10", {"eval", "filter"}),
        ("eval.n_runs=1", {"eval"}),
        ("eval.harness=harbor", {"eval"}),
        ("reward=binary", {"eval"}),
        ("tasks.seed=3", {"eval"}),  # the other keys hold the tasks as their contents
    ],
)
def test_a_deciding_setting_moves_the_keys_of_the_results_it_decides(inputs, override, results):
    assert moved(inputs, override) == results


@pytest.mark.parametrize(
    "override",
    [
        "backend.threads=3",
        "backend.train_threads=2",
        "backend.share_cores=false",  # once it moved the SFT and filter keys but not the eval's
        "eval.concurrency=1",
        "eval.save_episodes=0",
        "eval.candidates=[nop,oracle]",
        "eval.promote_by=eval/reward",
        "eval.promote_margin=0.1",
        "eval.promote_z=0",
        "eval.incumbent=/somewhere/else",
        "sft.save_every=5",
        "sft.eval_after=true",
        "sft.data=/a/data/file",  # its bytes decide, not where it lies
        "cache_dir=/another/machine/cache",  # moves tasks.cache_dir and sandbox.rootfs with it
        "tasks.cache_dir=/elsewhere/tasks",
        "sandbox.rootfs=/elsewhere/rootfs",
        # Settings of no group a key reads.
        "grpo.learning_rate=0.5",
        "task_filter.lower=0.3",
        "logger=wandb",
        "pipeline.cache_sft=false",
        "collect.teacher_url=http://127.0.0.1:1/v1",  # a teacher's collection is never cached
        "collect.teacher_model=big",
        "collect.format=chat",  # the cached oracle rows are always tbexp rows
        "collect.concurrency=16",
        "collect.data=/some/file.jsonl",
        "collect.decontaminate_dirs=[/some/tasks]",  # their contents decide, not where they lie
    ],
)
def test_a_setting_that_decides_nothing_moves_no_key(inputs, override):
    assert moved(inputs, override) == set()


def test_the_table_is_the_one_place_a_setting_is_left_out(inputs):
    """Each setting of the groups the keys read, changed to another value, moves a key unless the table names it:
    no key function drops a setting of its own, and no entry of the table is one that a key still reads."""
    cfg = compose_config()
    before = keys(cfg, inputs)
    deciding_nothing, unlisted = [], []
    for group in READ:
        for setting, value in OmegaConf.to_container(cfg[group], resolve=False).items():
            name = f"{group}.{setting}"
            changed = copy.deepcopy(cfg)
            OmegaConf.update(changed, name, _another(cfg[group][setting]), merge=False)
            moves = keys(changed, inputs) != before
            if name in caches.NOT_DECIDING and moves:
                unlisted.append(name)
            if name not in caches.NOT_DECIDING and not moves:
                deciding_nothing.append(name)
    assert not deciding_nothing, f"in no key although not in NOT_DECIDING: {deciding_nothing}"
    assert not unlisted, f"listed in NOT_DECIDING but a key moves: {unlisted}"
    assert all(name.partition(".")[0] in READ for name in caches.NOT_DECIDING)


def test_the_harbor_settings_decide_an_eval_under_the_harbor_harness_only(inputs):
    assert moved(inputs, "harbor.agent=oracle", base=("eval.harness=harbor",)) == {"eval"}
    assert moved(inputs, "harbor.agent=oracle") == set()


def test_contents_decide_and_where_they_lie_does_not(inputs, tmp_path):
    cfg = compose_config()
    before = keys(cfg, inputs)
    elsewhere = SimpleNamespace(**vars(inputs))
    elsewhere.data = tmp_path / "copy" / "data.jsonl"
    elsewhere.data.parent.mkdir()
    shutil.copyfile(inputs.data, elsewhere.data)
    elsewhere.checkpoint = str(tmp_path / "copy" / "checkpoint")
    shutil.copytree(inputs.checkpoint, elsewhere.checkpoint)
    elsewhere.tasks = []
    for task in inputs.tasks:
        shutil.copytree(task.path, tmp_path / "copy" / task.name)
        elsewhere.tasks.append(SimpleNamespace(name=task.name, path=tmp_path / "copy" / task.name))
    assert keys(cfg, elsewhere) == before

    (Path(inputs.checkpoint) / "adapter_model.safetensors").write_bytes(b"trained further")
    assert {name for name, key in keys(cfg, inputs).items() if key != before[name]} == {"eval", "filter"}
    inputs.data.write_text('{"messages": [{"role": "user", "content": "more"}]}\n')
    (inputs.tasks[0].path / "instruction.md").write_text("another task\n")
    assert {name for name, key in keys(cfg, inputs).items() if key != before[name]} == set(RESULTS)


def test_the_base_model_a_local_checkpoint_and_a_tinker_uri_are_three_checkpoints(inputs):
    cfg = compose_config()
    evals = {caches.eval_key(cfg, inputs.tasks, c, "x") for c in ("", inputs.checkpoint, "tinker://run/weights/1")}
    assert len(evals) == 3


def _another(value):
    """A value of the same type as `value`, different from it."""
    if value is None:  # an optional switch (backend.gradient_checkpointing: null = decided by the memory plan)
        return True
    if isinstance(value, Enum):
        return next(member for member in type(value) if member != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    if OmegaConf.is_list(value):
        return [*value, "other"]
    if OmegaConf.is_dict(value):
        return {**value, "other": 1}
    raise TypeError(f"no other value for {value!r}")
