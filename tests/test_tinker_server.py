"""backend=tinker against a real Tinker-API server: SkyRL 0.4.0's, JAX on CPU, serving the shipped tiny model.

The SDK is tbexp's own (tinker 0.38.0); the server pins SDK 0.25.0. Where they disagree tbexp copes in
tbexp/backends/tinker_compat.py, and the test that needs each shim names the version pair. The server is started
once per session (tests/tinker_server.py: skipped when it cannot be had, failed under TBEXP_REQUIRE_TINKER=1).
"""

from __future__ import annotations

import math
import threading
import time

import pytest
from tinker import types

from tbexp.backends.tinker_backend import BackendError, TinkerBackend, sampling_client
from tbexp.models import TINY_DIR
from tests.conftest import compose_config

pytestmark = pytest.mark.slow
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # model=tiny's


def _backend(url: str) -> TinkerBackend:
    return TinkerBackend(str(TINY_DIR), lora_rank=8, lora_targets=TARGETS, seed=0, base_url=url)


def _datum(tokenizer, text: str) -> types.Datum:
    ids = tokenizer.encode(text)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )


def test_trains_saves_resumes_and_samples_through_the_real_server(tinker_server, tmp_path):
    """A LoRA client's whole life on the server. SDK 0.38 x SkyRL 0.4.0: the loss comes from `elementwise_loss` (no
    `loss:sum` is sent: NaN before), a crc32 seed above 2**31 is folded (refused before), sampling replies carry no
    `sample_sequence_ids` (an AssertionError in the SDK before), and resuming through
    create_training_client_from_state_with_optimizer falls back from its 422 to load_state_with_optimizer."""
    backend = _backend(tinker_server)
    data = [_datum(backend.tokenizer, "ls -la /tmp"), _datum(backend.tokenizer, "echo hello > out.txt")]
    first = backend.forward_backward(data, "cross_entropy").result()
    assert math.isfinite(first.loss) and first.loss > 0
    assert first.loss == pytest.approx(-sum(sum(lp) for lp in first.logprobs), rel=1e-4)  # the sum, as Tinker's
    assert first.n_tokens == sum(len(d.loss_fn_inputs["target_tokens"].tolist()) for d in data)
    backend.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    trained = backend.forward(data, "cross_entropy").result().loss
    assert trained < first.loss  # the step trained the adapter
    checkpoint = backend.save_state("step-1")
    assert checkpoint.startswith("tinker://") and "/weights/step-1" in checkpoint

    resumed = _backend(tinker_server)
    resumed.load_state(checkpoint)
    assert resumed.forward(data, "cross_entropy").result().loss == pytest.approx(trained, rel=1e-3)

    prompt = types.ModelInput.from_ints(backend.tokenizer.encode("list the files"))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=2**31 + 7)
    for sampler in (backend.sampler(), sampling_client(backend.service, str(TINY_DIR), checkpoint)):
        sequences = sampler.sample(prompt, 2, params).result()
        assert len(sequences) == 2 and all(1 <= len(s.tokens) <= 6 for s in sequences)
        assert all(len(s.logprobs) == len(s.tokens) and all(lp <= 0 for lp in s.logprobs) for s in sequences)
        logprobs = sampler.compute_logprobs(prompt).result()
        assert logprobs[0] is None and len(logprobs) == prompt.length
        assert all(lp is not None and lp <= 0 for lp in logprobs[1:])


def test_an_export_the_server_cannot_make_keeps_the_trained_checkpoint(tinker_server, tmp_path):
    """SDK 0.38 x SkyRL 0.4.0: save_weights_external is a 404 there. Before, the exception failed the stage after
    its training; now the export says it failed and names the checkpoint, which the stage keeps."""
    backend = _backend(tinker_server)
    checkpoint = backend.save_state("kept")
    exported = backend.export_checkpoint(checkpoint, str(tmp_path))
    assert exported.kind == "none" and exported.path == "" and exported.checkpoint == checkpoint
    assert checkpoint in exported.describe() and "export failed" in exported.describe()


def test_concurrent_episodes_have_their_samples_in_flight_together(tinker_server):
    """Four episodes sampling at once through the runtime every model policy shares: every request is submitted
    before the first reply is back. Before, ModelRuntime's lock was held across each network wait, so each
    request went out only after the previous reply came back (no two in flight)."""
    from tbexp.build import model_runtime
    from tbexp.episodes.policies import sample_reply

    backend = _backend(tinker_server)
    sampler = backend.sampler()
    events: list[tuple[float, str]] = []

    class Recorded:
        tokenizer = sampler.tokenizer

        def sample(self, prompt, num_samples, params):
            events.append((time.perf_counter(), "submit"))
            future = sampler.sample(prompt, num_samples, params)

            class Waited:
                def result(self):
                    value = future.result()
                    events.append((time.perf_counter(), "reply"))
                    return value

            return Waited()

        def compute_logprobs(self, prompt):
            return sampler.compute_logprobs(prompt)

    cfg = compose_config("backend=tinker")
    runtime = model_runtime(cfg, Recorded(), cfg.sampling)
    prompt = backend.tokenizer.encode("list the files")
    sample_reply(runtime, prompt, runtime.params)  # compiles the sampling shapes: the timing below is the service's
    events.clear()
    threads = [threading.Thread(target=sample_reply, args=(runtime, prompt, runtime.params)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    kinds = [kind for _, kind in sorted(events)]
    assert kinds.count("submit") == 4 and kinds.count("reply") == 4
    assert kinds[:4] == ["submit"] * 4, kinds  # all four in flight before the first reply


def test_the_probe_refuses_an_unserved_model_or_loss_by_name_before_any_work(tinker_server):
    """SkyRL 0.4.0's JAX backend answers 400 to gspo. Before, a run found that out at its first GRPO step, after the
    collection, the SFT and the filter; `python -m tbexp` now probes first (Job.models.probe)."""
    from tbexp.backends.tinker_backend import BackendError
    from tbexp.job import Job

    def probe(*overrides):
        Job(compose_config("backend=tinker", f"backend.base_url={tinker_server}", *overrides)).models.probe()

    probe("stage=pipeline", "grpo.loss_fn=ppo")  # served: nothing to say
    with pytest.raises(BackendError, match="grpo.loss_fn=gspo.*refuses it"):
        probe("stage=pipeline", "grpo.loss_fn=gspo")
    with pytest.raises(BackendError, match="does not serve model 'Qwen/Qwen3-8B'"):
        probe("stage=sft", "model.path=Qwen/Qwen3-8B")


def test_a_superseded_checkpoint_is_deleted_from_the_service(tinker_server):
    """Stored checkpoints stay, and on hosted Tinker are billed, until deleted. Before, GRPO deleted superseded
    per-step checkpoints only when they were local directories; a tinker:// one stayed on the service."""
    import tinker

    backend = _backend(tinker_server)
    old, new = backend.save_state("step-00001"), backend.save_state("step-00002")
    rest = tinker.RestClient(base_url=tinker_server)
    run = old.removeprefix("tinker://").split("/")[0]

    def stored():
        return {c.tinker_path for c in rest.list_checkpoints(run).result().checkpoints}

    assert {old, new} <= stored()
    backend.delete_checkpoint(old)
    left = stored()
    assert old not in left and old.replace("/weights/", "/sampler_weights/") not in left and new in left


def test_saved_checkpoints_carry_the_configured_time_to_live(tinker_server, monkeypatch):
    """backend.checkpoint_ttl_s reaches both saves (state and sampler weights) and the real server takes it; before,
    every checkpoint was saved with no TTL (stored, and on hosted Tinker billed, until deleted). What the server does
    with the TTL is its own: the request is what tbexp controls, so the SDK's calls are watched, not replaced."""
    with pytest.raises(BackendError, match="an hour"):
        TinkerBackend(str(TINY_DIR), lora_rank=8, lora_targets=TARGETS, base_url=tinker_server, checkpoint_ttl_s=60)
    backend = TinkerBackend(
        str(TINY_DIR), lora_rank=8, lora_targets=TARGETS, seed=0, base_url=tinker_server, checkpoint_ttl_s=7200
    )
    sent: list[tuple[str, int | None]] = []
    for name in ("save_state", "save_weights_for_sampler"):
        real = getattr(backend.client, name)

        def watched(path, ttl_seconds=None, *args, _real=real, _name=name, **kwargs):
            sent.append((_name, ttl_seconds))
            return _real(path, ttl_seconds, *args, **kwargs)

        monkeypatch.setattr(backend.client, name, watched)
    assert backend.save_state("kept-two-hours").startswith("tinker://")
    assert sorted(sent) == [("save_state", 7200), ("save_weights_for_sampler", 7200)]
