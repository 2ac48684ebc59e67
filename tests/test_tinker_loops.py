"""The SFT and GRPO loops, unchanged, through `backend=tinker`, against a stand-in: what no server here can show.

tests/test_tinker_server.py runs the backend against a real Tinker-API server (SkyRL's), whose export is missing
(save_weights_external: 404) and whose call timing tbexp does not control. So here `tinker.ServiceClient`
is replaced by a stand-in at the SDK's boundary, for the export's download and conversion to a PEFT adapter, the
order in which calls are submitted and awaited, and GRPO's pipelining while the service trains. Unlike the one in
test_tinker_backend.py, this stand-in does real work: behind the SDK's method
names and result shapes it trains and samples the tiny model with the local
engine, so the stages' loops run end to end through `TinkerBackend` —
pipelined futures, `tinker://` checkpoints, resume from a URI — exactly as
they would against the service.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tinker import types

from tests.conftest import collect_oracle, compose_config, compose_job

pytestmark = [pytest.mark.slow, pytest.mark.sandbox]
TINKER_POLICY = ("backend=tinker", "model.lora_rank=8", "model.logit_scale=false", "policy=model")


class Later:
    """A future that does its work only when asked for the result, as the SDK's do from the caller's view."""

    def __init__(self, log, name, work):
        self.log, self.name, self.work = log, name, work

    def result(self):
        self.log.append(f"wait {self.name}")
        return self.work()


class StandInTraining:
    def __init__(self, service, rank, seed):
        from tbexp.backends.local import LocalBackend
        from tbexp.models import load_model

        model, tokenizer = load_model(compose_config().model, device="cpu")
        self.service, self.log, self.rank = service, service.log, rank
        self.local = LocalBackend(
            model,
            tokenizer,
            lora_rank=rank,
            lora_alpha=rank,
            lora_dropout=0.0,
            lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            device="cpu",
            seed=seed,
            save_dir=service.store,
        )

    def get_tokenizer(self):
        return self.local.tokenizer

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        self.log.append(f"submit forward_backward {loss_fn}")
        return Later(
            self.log,
            "forward_backward",
            lambda: _output(self.local.forward_backward(data, loss_fn, loss_fn_config).result()),
        )

    def forward(self, data, loss_fn, loss_fn_config=None):
        self.log.append(f"submit forward {loss_fn}")
        return Later(self.log, "forward", lambda: _output(self.local.forward(data, loss_fn, loss_fn_config).result()))

    def optim_step(self, adam):
        self.log.append("submit optim_step")
        return Later(
            self.log,
            "optim_step",
            lambda: SimpleNamespace(metrics={f"optim/{k}": v for k, v in self.local.optim_step(adam).result().items()}),
        )

    def save_state(self, name, ttl_seconds=None):
        path = self.local.save_state(name)
        return Later(
            self.log, "save_state", lambda: SimpleNamespace(path=f"{self.service.root}/weights/{Path(path).name}")
        )

    def save_weights_for_sampler(self, name, ttl_seconds=None):
        self.log.append(f"save_weights_for_sampler {name}")
        self.local.save_state(name)  # the stand-in keeps a checkpoint's sampler weights in its state's folder
        return Later(
            self.log,
            "save_weights_for_sampler",
            lambda: SimpleNamespace(path=f"{self.service.root}/sampler_weights/{name}"),
        )

    def load_state_with_optimizer(self, uri):
        self.log.append(f"load_state_with_optimizer {uri}")
        return Later(self.log, "load", lambda: self.local.load_state(self.service.local_path(uri)))

    def load_state(self, uri):
        self.log.append(f"load_state {uri}")
        return Later(self.log, "load", lambda: self.local.load_weights(self.service.local_path(uri)))

    def save_weights_and_get_sampling_client(self):
        return Later(self.log, "sampling_client", lambda: _sampling_client(self.log, self.local.sampler()))

    def save_weights_external(self, name, ttl_seconds=None):
        """The weights as the service exports them: a LoRA adapter under Tinker's names, its config rank and alpha."""
        from safetensors.torch import save_file

        self.log.append(f"save_weights_external {name}")
        folder = self.service.store / "external" / name
        folder.mkdir(parents=True, exist_ok=True)
        lora = {n.replace(".default", ""): p.detach().clone() for n, p in self.local._params.items() if "lora_" in n}
        save_file(lora, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps({"r": self.rank, "lora_alpha": self.rank}))
        return Later(
            self.log,
            "save_weights_external",
            lambda: SimpleNamespace(path=f"{self.service.root}/external_weights/{name}"),
        )


def _sampling_client(log, sampler):
    """A SamplingClient's methods over a local sampler."""

    def sample(prompt, num_samples, sampling_params):
        seqs = sampler.sample(prompt, num_samples, sampling_params).result()
        return Later(
            log,
            "sample",
            lambda: SimpleNamespace(
                sequences=[
                    SimpleNamespace(tokens=s.tokens, logprobs=s.logprobs, stop_reason=s.stop_reason) for s in seqs
                ]
            ),
        )

    return SimpleNamespace(
        sample=sample,
        compute_logprobs=lambda prompt: sampler.compute_logprobs(prompt),
        get_tokenizer=lambda: sampler.tokenizer,
    )


def _output(result):
    outputs = [{"logprobs": types.TensorData.from_numpy(np.array(lp, dtype="float32"))} for lp in result.logprobs]
    return SimpleNamespace(metrics={"loss:sum": result.loss, **result.metrics}, loss_fn_outputs=outputs)


class StandInService:
    def __init__(self, store: Path):
        self.store, self.log = store, []
        # Tinker's paths name the training run that saved them, so no two runs share a path. The stand-in's paths
        # name the service instance for the same reason: tbexp's result caches key a tinker:// checkpoint by its
        # path, so a path that came back in a later test run would bring back what earlier weights scored.
        self.root = f"tinker://stand-in-{uuid.uuid4().hex[:12]}"
        self._sampling_engine = None

    def local_path(self, uri: str) -> str:
        kind, name = uri.removeprefix(f"{self.root}/").split("/")
        assert kind in ("weights", "sampler_weights", "external_weights"), uri
        return str(self.store / "external" / name if kind == "external_weights" else self.store / name)

    def create_sampling_client(self, model_path=None, base_model=None):
        """Sampling only, as the service does it: no training client, no optimizer."""
        self.log.append(f"create_sampling_client {model_path or base_model}")
        assert model_path is None or "/sampler_weights/" in model_path, "the service samples from sampler weights only"
        if self._sampling_engine is None:  # the stand-in's own copy of the model to sample with
            self._sampling_engine = StandInTraining(self, 8, 0).local
        sampler = self._sampling_engine.checkpoint_sampler(self.local_path(model_path) if model_path else "")
        return Later(self.log, "sampling_client", lambda: _sampling_client(self.log, sampler))

    def create_lora_training_client(
        self, base_model, rank, seed=None, train_attn=True, train_mlp=True, train_unembed=True
    ):
        self.log.append(f"create {base_model} rank={rank}")
        return Later(self.log, "create", lambda: StandInTraining(self, rank, seed))

    def create_training_client_from_state_with_optimizer(self, uri):
        """Weights and optimizer state (a resumed run)."""
        self.log.append(f"create_training_client_from_state_with_optimizer {uri}")

        def client():
            training = StandInTraining(self, 8, 0)
            training.local.load_state(self.local_path(uri))
            return training

        return Later(self.log, "create", client)

    def create_training_client_from_state(self, uri):
        """Weights only (what a stage and an export start from)."""
        self.log.append(f"create_training_client_from_state {uri}")

        def client():
            training = StandInTraining(self, 8, 0)
            training.local.load_weights(self.local_path(uri))
            return training

        return Later(self.log, "create", client)


class StandInRest:
    """A RestClient's external-weights calls; the signed URLs are file:// URLs into the stand-in's store."""

    def __init__(self, service):
        self.service, self.log = service, service.log

    def get_external_weights_urls(self, uri):
        folder = Path(self.service.local_path(uri))
        urls = {p.name: p.resolve().as_uri() for p in sorted(folder.iterdir())}
        return Later(self.log, "external_weights_urls", lambda: SimpleNamespace(urls=urls, expires=None))

    def delete_checkpoint_from_tinker_path(self, uri):
        self.log.append(f"delete {uri}")
        return Later(self.log, "delete", lambda: shutil.rmtree(self.service.local_path(uri)))


@pytest.fixture
def tinker_service(tmp_path, monkeypatch):
    import tinker

    import tbexp.backends.tinker_backend as tinker_backend

    service = StandInService(tmp_path / "service")
    monkeypatch.setattr(tinker_backend, "_connect", lambda base_url: service)
    monkeypatch.setattr(tinker, "RestClient", lambda base_url=None: StandInRest(service))  # deletes checkpoints
    return service


def test_sft_runs_unchanged_on_tinker_with_pipelined_steps_and_uri_checkpoints(rootfs, tmp_path, tinker_service):
    from tbexp.stages import sft

    collect_oracle(tmp_path / "gold.jsonl", "tasks.limit=4", "tasks.families=[file-move]")
    job = compose_job(
        "backend=tinker",
        "model.lora_rank=8",
        "model.logit_scale=false",
        "sft.steps=4",
        "sft.batch_size=2",
        "sft.eval_every=2",
        "sft.val_fraction=0.25",
        "sft.patience=0",
    )
    result = sft.train(job, tmp_path / "gold.jsonl", tmp_path / "sft")
    state = json.loads((tmp_path / "sft" / "sft_state.json").read_text())
    assert [e["checkpoint"] for e in state["evals"]] == [
        f"{tinker_service.root}/weights/step-00002",
        f"{tinker_service.root}/weights/step-00004",
    ]
    assert result.checkpoint.startswith("tinker://")
    # The chosen checkpoint, downloaded and converted (tests/test_adapters.py checks what it computes).
    assert result.summary()["sft/adapter"] == str(tmp_path / "sft" / "adapter")
    assert (tmp_path / "sft" / "adapter" / "adapter_config.json").is_file()
    assert f"create_training_client_from_state {result.checkpoint}" in tinker_service.log
    log = tinker_service.log
    first = log.index("submit forward_backward cross_entropy")
    assert log[first : first + 4] == [
        "submit forward_backward cross_entropy",
        "submit optim_step",
        "wait forward_backward",
        "wait optim_step",
    ]


def test_grpo_runs_unchanged_on_tinker_from_a_tinker_checkpoint(rootfs, tmp_path, tinker_service):
    from tbexp.build import make_backend
    from tbexp.stages import grpo

    # A starting checkpoint saved by the service: the stage loads its weights only (fresh optimizer).
    cfg = compose_config("backend=tinker", "model.lora_rank=8", "model.logit_scale=false", "policy=model")
    start = make_backend(cfg, tmp_path / "unused").save_state("start")
    overrides = [
        "stage=grpo",
        *TINKER_POLICY,
        f"load_checkpoint={start}",
        "tasks.limit=2",
        "tasks.families=[file-move]",
        "task_filter.k=1",
        "task_filter.lower=0.0",
        "task_filter.upper=1.0",
        "reward=per_test",
        "grpo.steps=1",
        "grpo.groups_per_step=2",
        "grpo.group_size=2",
        "grpo.eval_at_start=false",
        "grpo.eval_n_runs=1",
        "grpo.temperature=1.5",
        "sampling.max_tokens=24",
        "agent.max_turns=2",
    ]
    job = compose_job(*overrides)
    result = grpo.train(job, start, grpo.rl_tasks(job, start, tmp_path / "grpo"), tmp_path / "grpo")
    assert f"create_training_client_from_state {start}" in tinker_service.log  # not the deprecated load_state
    assert result.checkpoint == f"{tinker_service.root}/weights/step-00001"
    # The filter sampled the start through a sampling client; the one training client made here is GRPO's.
    assert f"create_sampling_client {tinker_service.root}/sampler_weights/start" in tinker_service.log
    assert sum(line.startswith("create ") for line in tinker_service.log) == 1  # the start's (above): GRPO's is from it
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert any("rollout/reward_mean" in r for r in rows) and any("heldout/reward" in r for r in rows)


def test_pipelined_grpo_samples_the_next_step_while_the_service_trains(rootfs, tmp_path, tinker_service, monkeypatch):
    """grpo.max_off_policy_steps=1 on Tinker: while the service works on step 0's forward_backward (made to take
    until a sample request arrives, or 60 s), the next step's rollouts send their sample requests. In the
    synchronous loop none would arrive: the rollouts wait for the update."""
    import threading
    import time

    from tbexp.stages import grpo

    sampled = threading.Event()
    real_client = _sampling_client

    def signalling_client(log, sampler):
        client = real_client(log, sampler)
        real_sample = client.sample

        def sample(prompt, num_samples, sampling_params):
            sampled.set()
            return real_sample(prompt, num_samples, sampling_params)

        client.sample = sample
        return client

    monkeypatch.setattr(f"{__name__}._sampling_client", signalling_client)
    waits = []
    real_forward_backward = StandInTraining.forward_backward

    def slow_forward_backward(self, data, loss_fn, loss_fn_config=None):
        sampled.clear()
        future = real_forward_backward(self, data, loss_fn, loss_fn_config)
        work = future.work

        def after_a_sample():
            clock = time.perf_counter()
            # the first update has the next step's rollouts beside it; the last has none, so it need not wait long
            waits.append((sampled.wait(60 if not waits else 1), time.perf_counter() - clock))
            return work()

        future.work = after_a_sample
        return future

    monkeypatch.setattr(StandInTraining, "forward_backward", slow_forward_backward)
    # Rewards that always spread (a group's runs score 0, 1, ...), so every step updates, whatever the samples.
    monkeypatch.setattr(grpo, "score_episodes", lambda episodes, _: {id(ep): float(ep.run) for ep in episodes})
    overrides = [
        "stage=grpo",
        *TINKER_POLICY,
        "task_filter=none",
        "tasks.limit=2",
        "tasks.families=[file-move]",
        "reward=per_test",
        "grpo.steps=2",
        "grpo.groups_per_step=2",
        "grpo.group_size=2",
        "grpo.updates_per_step=1",
        "grpo.eval_at_start=false",
        "grpo.eval_n_runs=1",
        "grpo.temperature=1.5",
        "grpo.max_off_policy_steps=1",
        "sampling.max_tokens=24",
        "agent.max_turns=2",
    ]
    job = compose_job(*overrides)
    grpo.train(job, "", job.tasks("rl"), tmp_path / "grpo")
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["rollout/off_policy_steps"] for r in steps] == [0.0, 1.0]
    assert len(waits) == 2
    # step 0's update overlapped step 1's rollouts; step 1's (the last) had nothing left to sample beside it
    assert waits[0][0], f"no sample request reached the service during step 0's forward_backward ({waits})"
