"""The Tinker adapter, against a stand-in at the SDK's boundary: only what no server here can show.

tests/test_tinker_server.py runs the backend against a real Tinker-API server (SkyRL's): training, checkpoints,
resuming, sampling, the mapping of every reply. What stays here cannot be seen from a server's replies: which LoRA
switches and loss_fn_config keys the adapter sends (SkyRL's JAX backend answers the same either way, and refuses
gspo), and the refusals made before any call. The stand-in replaces `tinker.ServiceClient`, records calls and
returns futures shaped like the SDK's.
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

    def save_state(self, name, ttl_seconds=None):
        return StandInFuture(self.log, "save_state", SimpleNamespace(path=f"tinker://run-1/weights/{name}"))

    def save_weights_for_sampler(self, name, ttl_seconds=None):
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

    def create_lora_training_client(
        self, base_model, rank, seed=None, train_attn=True, train_mlp=True, train_unembed=True
    ):
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


def test_no_credential_stops_at_once_saying_what_to_set(monkeypatch, tmp_path):
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.delenv("TINKER_CREDENTIAL_CMD", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no key stored by `tinker auth login` either
    with pytest.raises(BackendError, match="TINKER_API_KEY.*tinker auth login.*TINKER_CREDENTIAL_CMD"):
        TinkerBackend("Qwen/Qwen3-8B", lora_rank=32)


@pytest.mark.parametrize(
    "policy,stage,asks", [("oracle", "eval", False), ("nop", "check", False), ("model", "eval", True)]
)
def test_only_a_job_that_samples_or_trains_asks_the_service(monkeypatch, tmp_path, policy, stage, asks):
    """The probe before any work: an oracle eval with backend=tinker (a sweep's config, say) never calls the service,
    so it needs no credential; before, it was refused for the missing key (tests/test_redaction.py caught it)."""
    from tests.conftest import compose_job

    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.delenv("TINKER_CREDENTIAL_CMD", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    models = compose_job("backend=tinker", f"stage={stage}", f"policy={policy}").models
    if asks:
        with pytest.raises(BackendError, match="no Tinker credential"):
            models.probe()
    else:
        models.probe()


def test_the_sdks_other_credentials_are_accepted(monkeypatch, tmp_path):
    """TINKER_CREDENTIAL_CMD (and a key stored by `tinker auth login`) are the SDK's own; before, tbexp refused
    every run without TINKER_API_KEY. Nothing is called: the connection is made, not used."""
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TINKER_CREDENTIAL_CMD", "echo tml-from-a-command")
    from tbexp.backends.tinker_backend import _connect

    assert _connect("http://127.0.0.1:9") is not None


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


@pytest.mark.parametrize(
    "targets,parameters,switches",
    [
        (["q_proj", "v_proj"], [], "attn=True mlp=False unembed=False"),
        # gpt-oss (conf/model/gpt_oss_20b.yaml): attention modules plus the experts' 3-D parameters, which are MLP;
        # before, its recipe trained attention-only LoRA on Tinker.
        (["q_proj", "k_proj", "v_proj", "o_proj"], ["mlp.experts.gate_up_proj"], "attn=True mlp=True unembed=False"),
        (None, None, "attn=True mlp=True unembed=True"),  # no targets named: Tinker's defaults
    ],
)
def test_lora_targets_map_to_the_services_switches(targets, parameters, switches):
    service = StandInService()
    backend = TinkerBackend(
        "Qwen/Qwen3-8B", lora_rank=16, lora_targets=targets, lora_target_parameters=parameters, service_client=service
    )
    backend.client  # the training client is made at first use
    assert service.log[0] == f"create Qwen/Qwen3-8B rank=16 {switches}"


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


def test_gspo_sends_a_sequence_ratio_mask_over_the_sampled_tokens():
    """No server here serves gspo (SkyRL 0.4.0's JAX backend refuses it), so what is sent is checked here: the mask
    marks the tokens with an advantage, the ones rl_losses.py's gspo averages its sequence ratio over. Before, none
    was sent."""
    service = StandInService()
    backend = TinkerBackend("Qwen/Qwen3-8B", lora_rank=32, service_client=service)
    sent = []
    submit = backend.client.forward_backward
    backend.client.forward_backward = lambda data, loss_fn, config: sent.extend(data) or submit(data, loss_fn, config)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={
            "target_tokens": [2, 3, 4, 5],
            "logprobs": [0.0, -0.5, 0.0, -0.2],
            "advantages": [0, 0.5, 0, 0.5],
        },
    )
    backend.forward_backward([datum], "gspo").result()
    assert sent[0].loss_fn_inputs["sequence_ratio_mask"].tolist() == [0.0, 1.0, 0.0, 1.0]
    backend.forward_backward([datum], "ppo").result()
    assert "sequence_ratio_mask" not in sent[1].loss_fn_inputs
