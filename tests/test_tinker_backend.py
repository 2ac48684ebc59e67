"""The Tinker adapter, against a stand-in at the SDK's boundary.

The Tinker service cannot be reached from this machine (no network, no API
key), so these tests replace `tinker.ServiceClient` with a stand-in that
records calls and returns futures shaped like the SDK's. They check the
adapter's mapping, pipelining and refusals, not the service itself.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from tinker import types

from tbexp.backends.tinker_backend import BackendError, TinkerBackend


class StandInFuture:
    def __init__(self, log, name, value):
        self.log, self.name, self.value = log, name, value

    def result(self):
        self.log.append(f"wait {self.name}")
        return self.value


class StandInTraining:
    def __init__(self, log):
        self.log = log

    def get_tokenizer(self):
        return "tokenizer"

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        self.log.append(f"submit forward_backward {loss_fn}")
        self.loss_fn_config = loss_fn_config
        outputs = [
            {
                "logprobs": types.TensorData.from_numpy(
                    np.array([-0.5] * len(d.loss_fn_inputs["target_tokens"].tolist()), dtype="float32")
                )
            }
            for d in data
        ]
        return StandInFuture(
            self.log, "forward_backward", SimpleNamespace(metrics={"loss:sum": 1.5}, loss_fn_outputs=outputs)
        )

    def optim_step(self, adam):
        self.log.append(f"submit optim_step lr={adam.learning_rate}")
        return StandInFuture(self.log, "optim_step", SimpleNamespace(metrics={"optim/grad_norm": 0.1}))

    def save_state(self, name):
        return StandInFuture(self.log, "save_state", SimpleNamespace(path=f"tinker://run-1/weights/{name}"))

    def save_weights_for_sampler(self, name):
        self.log.append(f"save_weights_for_sampler {name}")
        return StandInFuture(
            self.log, "save_weights_for_sampler", SimpleNamespace(path=f"tinker://run-1/sampler_weights/{name}")
        )

    def load_state_with_optimizer(self, path):
        self.log.append(f"load {path}")
        return StandInFuture(self.log, "load", None)

    def save_weights_and_get_sampling_client(self):
        sequence = SimpleNamespace(tokens=[5, 6], logprobs=[-0.1, -0.2], stop_reason="stop")
        client = SimpleNamespace(
            sample=lambda prompt, num_samples, sampling_params: StandInFuture(
                self.log, "sample", SimpleNamespace(sequences=[sequence] * num_samples)
            )
        )
        return StandInFuture(self.log, "sampling_client", client)


class StandInService:
    def __init__(self):
        self.log = []

    def create_lora_training_client(self, base_model, rank, seed, train_attn, train_mlp, train_unembed):
        self.log.append(f"create {base_model} rank={rank} attn={train_attn} mlp={train_mlp} unembed={train_unembed}")
        return StandInFuture(self.log, "create", StandInTraining(self.log))

    def create_training_client_from_state_with_optimizer(self, path):
        self.log.append(f"resume {path}")
        return StandInFuture(self.log, "create", StandInTraining(self.log))

    def create_sampling_client(self, model_path=None, base_model=None):
        self.log.append(f"create_sampling_client model_path={model_path} base_model={base_model}")
        return StandInFuture(self.log, "sampling_client", SimpleNamespace(get_tokenizer=lambda: "tokenizer"))


def _datum(n=3):
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(range(n))),
        loss_fn_inputs={"target_tokens": list(range(1, n + 1)), "weights": [0.0] + [1.0] * (n - 1)},
    )


def test_missing_api_key_stops_at_once_saying_what_to_set(monkeypatch):
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    with pytest.raises(BackendError, match="TINKER_API_KEY"):
        TinkerBackend("Qwen/Qwen3-8B", lora_rank=32)


def test_calls_are_pipelined_and_mapped():
    service = StandInService()
    backend = TinkerBackend("Qwen/Qwen3-8B", lora_rank=32, service_client=service)
    fb = backend.forward_backward([_datum(), _datum(4)], "cross_entropy")
    step = backend.optim_step(types.AdamParams(learning_rate=2e-5))
    assert service.log[-2:] == [
        "submit forward_backward cross_entropy",
        "submit optim_step lr=2e-05",
    ]  # nothing waited yet
    result = fb.result()
    assert result.loss == 1.5 and result.n_tokens == 5.0 and result.logprobs[1] == [-0.5] * 4
    assert step.result() == {"optim/grad_norm": 0.1}
    assert service.log[-2:] == ["wait forward_backward", "wait optim_step"]


def test_checkpoints_are_tinker_uris_and_resume_with_the_optimizer():
    service = StandInService()
    backend = TinkerBackend("Qwen/Qwen3-8B", lora_rank=32, service_client=service)
    uri = backend.save_state("step-50")
    assert uri == "tinker://run-1/weights/step-50"
    TinkerBackend("Qwen/Qwen3-8B", lora_rank=32, service_client=service, load_checkpoint=uri)
    assert f"resume {uri}" in service.log
    with pytest.raises(BackendError, match="tinker://"):
        backend.load_state("/local/dir")


def test_a_checkpoint_saves_sampler_weights_beside_its_state_and_samples_without_a_training_client(monkeypatch):
    """The job's model host on backend=tinker, against the stand-in service (no real Tinker is reached)."""
    from tbexp.job import Job
    from tests.conftest import compose_config

    service = StandInService()
    uri = TinkerBackend("Qwen/Qwen3-8B", lora_rank=32, service_client=service).save_state("step-50")
    assert "save_weights_for_sampler step-50" in service.log

    import tbexp.backends.tinker_backend as tinker_backend

    monkeypatch.setattr(tinker_backend, "_connect", lambda base_url: service)
    models = Job(
        compose_config("backend=tinker", "model.lora_rank=8", "model.logit_scale=false", "model.name=Qwen/Qwen3-8B")
    ).models
    before = len(service.log)
    assert models.sampler(uri).tokenizer == "tokenizer"
    models.sampler("")
    assert service.log[before:] == [
        "create_sampling_client model_path=tinker://run-1/sampler_weights/step-50 base_model=None",
        "wait sampling_client",
        "create_sampling_client model_path=None base_model=Qwen/Qwen3-8B",
        "wait sampling_client",
    ]  # no training client: an eval needs no optimizer
    assert models.loads == 0
    with pytest.raises(BackendError, match="tinker://"):
        models.sampler("/local/step-50")


def test_sampling_maps_sequences():
    backend = TinkerBackend("Qwen/Qwen3-8B", lora_rank=32, service_client=StandInService())
    seqs = backend.sampler().sample(types.ModelInput.from_ints([1, 2]), 3, types.SamplingParams(max_tokens=4)).result()
    assert (
        len(seqs) == 3
        and seqs[0].tokens == [5, 6]
        and seqs[0].logprobs == [-0.1, -0.2]
        and seqs[0].stop_reason == "stop"
    )


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"lora_rank": 0}, "LoRA adapters only"),
        ({"lora_rank": 8, "lora_dropout": 0.1}, "dropout"),
        ({"lora_rank": 8, "logit_scale": True}, "logit_scale"),
        ({"lora_rank": 8, "lora_targets": ["q_proj", "router"]}, "router"),
    ],
)
def test_settings_tinker_cannot_honour_are_refused(kwargs, needle):
    with pytest.raises(BackendError, match=needle):
        TinkerBackend("Qwen/Qwen3-8B", service_client=StandInService(), **kwargs)


def test_lora_targets_map_to_the_services_switches():
    service = StandInService()
    TinkerBackend("Qwen/Qwen3-8B", lora_rank=16, lora_targets=["q_proj", "v_proj"], service_client=service)
    assert service.log[0] == "create Qwen/Qwen3-8B rank=16 attn=True mlp=False unembed=False"


@pytest.mark.parametrize(
    "loss_fn,sent",
    [
        ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.5}),
        ("gspo", {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1.5}),
    ],
)
def test_cispo_and_gspo_go_to_tinkers_own_losses_with_every_key_filled_in(loss_fn, sent):
    service = StandInService()
    backend = TinkerBackend("Qwen/Qwen3-8B", lora_rank=32, service_client=service)
    backend.forward_backward([_datum()], loss_fn, {"clip_high_threshold": 1.5}).result()
    assert service.log[-2] == f"submit forward_backward {loss_fn}"
    assert backend.client.loss_fn_config == sent


def test_dppo_is_refused_by_name_on_tinker():
    backend = TinkerBackend("Qwen/Qwen3-8B", lora_rank=32, service_client=StandInService())
    with pytest.raises(BackendError, match="dppo runs on backend=local only.*cispo, gspo"):
        backend.forward_backward([_datum()], "dppo")
