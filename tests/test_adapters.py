"""Exported checkpoints load with plain transformers + peft and compute the checkpoint's own logprobs.

Each test exports a checkpoint, then a fresh Python process that imports only
torch, transformers and peft (never tbexp, which the process checks) loads the
base model and the adapter exactly as a user's snippet does,

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)

and computes teacher-forced logprobs of a few token sequences. They must equal
tbexp's own logprobs for that checkpoint (`compute_logprobs` of a sampler over
it) to TOLERANCE nats per token: float32 on a CPU, where the differences seen
are about 1e-5 (tbexp's sampler runs the LoRA weights merged, peft unmerged).
The same process encodes a text with the tokenizer saved beside the adapter.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tinker import types

from tbexp.backends.adapters import ExportError, convert_tinker_adapter, folded_weight
from tbexp.models import TINY_DIR
from tests.conftest import compose_config, compose_job

TOLERANCE = 1e-4  # nats per token
TEXT = "cat /app/notes.txt && ls -la /app"

LOADER = """
import json, sys
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer


def logprobs_of(model, sequences):
    out = []
    for tokens in sequences:
        ids = torch.tensor([tokens])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        out.append(logp.gather(1, ids[0, 1:, None])[:, 0].tolist())
    return out


job = json.loads(sys.argv[1])
if job["kind"] == "adapter":
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(job["base"]), job["path"])
else:
    model = AutoModelForCausalLM.from_pretrained(job["path"])
logprobs = logprobs_of(model.eval(), job["sequences"])
base_logprobs = logprobs_of(AutoModelForCausalLM.from_pretrained(job["base"]).eval(), job["sequences"])
encoded = AutoTokenizer.from_pretrained(job["path"])(job["text"], add_special_tokens=False)["input_ids"]
assert not [m for m in sys.modules if m == "tbexp" or m.startswith("tbexp.")], "tbexp was imported"
print(json.dumps({"logprobs": logprobs, "base_logprobs": base_logprobs, "encoded": encoded}))
"""


def _sequences(tokenizer) -> list[list[int]]:
    texts = ["ls /app", "mv /app/a.txt /app/b.txt", "grep -r needle /app/data | head -n 3"]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts] + [list(range(4, 60, 3))]


def _plain(exported, sequences: list[list[int]], tmp_path: Path, base: str = str(TINY_DIR)) -> dict:
    """What the user's snippet computes, in a process that imports no tbexp."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    job = {"kind": exported.kind, "path": exported.path, "base": base, "sequences": sequences, "text": TEXT}
    out = subprocess.run(
        [sys.executable, "-c", LOADER, json.dumps(job)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _assert_reproduces(exported, sampler, tmp_path: Path, base: str = str(TINY_DIR)) -> float:
    """Check the plain process's logprobs against tbexp's; return how far the base model's are from them (an export
    that lost its weights would give 0)."""
    sequences = _sequences(sampler.tokenizer)
    plain = _plain(exported, sequences, tmp_path, base)
    base_distance = 0.0
    for tokens, got, base_got in zip(sequences, plain["logprobs"], plain["base_logprobs"]):
        want = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
        assert got == pytest.approx(want, abs=TOLERANCE)
        base_distance = max(base_distance, *(abs(a - b) for a, b in zip(base_got, want)))
    assert plain["encoded"] == sampler.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    return base_distance


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _train_step(backend, seed: int, lr: float = 0.05) -> None:
    tokens = torch.randint(4, 900, (30,), generator=torch.Generator().manual_seed(seed)).tolist()
    backend.forward_backward([_datum(tokens)], "cross_entropy").result()
    backend.optim_step(types.AdamParams(learning_rate=lr)).result()


@pytest.mark.slow
def test_the_sft_stage_writes_an_adapter_that_plain_peft_loads_with_the_checkpoints_logprobs(tmp_path, monkeypatch):
    from tbexp.stages import sft

    data = tmp_path / "conversations.jsonl"
    replies = ["ls /app", "cat /app/notes.txt", "mv /app/a.txt /app/b.txt", "rm /app/old.log", "touch /app/done"]
    data.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"Task {i}: do it."}, {"role": "assistant", "content": r}]}
            )
            + "\n"
            for i, r in enumerate(replies * 2)
        )
    )
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(run)
    job = compose_job(
        "stage=sft",
        f"sft.data={data}",
        "sft.steps=3",
        "sft.batch_size=4",
        "sft.eval_every=1",
        "sft.warmup_steps=0",
        "sft.learning_rate=0.02",
        "sft.val_fraction=0.2",
        "sft.patience=0",
    )
    metrics = sft.run(job)
    summary = json.loads((run / "summary.json").read_text())["sft_training"]
    assert summary["sft/adapter"] == metrics["sft/adapter"] == str(run / "adapter")
    result = sft.SFTResult.from_summary(summary)
    assert result.exported == {"adapter": str(run / "adapter")} and "sft/adapter" not in result.metrics
    record = json.loads((run / "adapter" / "tbexp_export.json").read_text())
    assert record == {
        "kind": "adapter",
        "checkpoint": result.checkpoint,
        "base_model": str(TINY_DIR),
        "logit_scale": 1.0,
    }
    # SFT leaves the logit scale at 1, so the adapter is plain LoRA.
    assert not json.loads((run / "adapter" / "adapter_config.json").read_text()).get("modules_to_save")
    from tbexp.backends.base import Export

    exported = Export(summary["sft/adapter"], "adapter", str(TINY_DIR))
    sampler = job.models.sampler(result.checkpoint)
    assert _assert_reproduces(exported, sampler, tmp_path) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [8, 0])
def test_a_learnt_logit_scale_is_folded_into_the_final_norm(tmp_path, lora_rank):
    """LoRA: the norm travels in modules_to_save. Full fine-tuning: the whole model, in Hugging Face format."""
    from tbexp.build import make_host

    cfg = compose_config(f"model.lora_rank={lora_rank}", "backend.device=cpu")
    backend = make_host(cfg).trainer(tmp_path / "states", logit_scale_lr_factor=1.0)
    _train_step(backend, seed=1)
    with torch.no_grad():
        backend._params[backend._scale_name].fill_(math.log(1.7))
    chosen = backend.save_state("chosen")
    _train_step(backend, seed=2)  # training went on past the chosen checkpoint, as in a stage
    live = {n: p.detach().clone() for n, p in backend._params.items()}

    exported = backend.export_checkpoint(chosen, str(tmp_path / "stage"))
    assert all(torch.equal(p, live[n]) for n, p in backend._params.items())  # exporting leaves training alone
    record = json.loads((Path(exported.path) / "tbexp_export.json").read_text())
    assert record["logit_scale"] == pytest.approx(1.7)
    if lora_rank:
        assert exported.kind == "adapter" and exported.path == str(tmp_path / "stage" / "adapter")
        config = json.loads((Path(exported.path) / "adapter_config.json").read_text())
        assert config["modules_to_save"] == ["model.norm"]
        assert "base_model.model.model.norm.weight" in load_file(Path(exported.path) / "adapter_model.safetensors")
    else:
        assert exported.kind == "hf_model" and exported.path == str(tmp_path / "stage" / "hf_model")
        assert "no adapter" in exported.describe()
    assert _assert_reproduces(exported, backend.checkpoint_sampler(chosen), tmp_path) > 1e-3


def test_a_norm_not_proportional_to_its_weight_is_refused():
    class OnePlusWeightNorm(torch.nn.Module):  # Gemma's RMSNorm computes x̂ · (1 + w)
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((16,), 0.1))

        def forward(self, x):
            return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * (1 + self.weight)

    with pytest.raises(ExportError, match="not proportional"):
        folded_weight(OnePlusWeightNorm(), 1.5)
    plain = torch.nn.RMSNorm(16)
    with torch.no_grad():
        plain.weight.fill_(0.3)
    assert torch.allclose(folded_weight(plain, 2.0), torch.full((16,), 0.6))


def test_tinker_adapter_names_become_peft_names(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    lora = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 8),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 2),
        "base_model.model.model.unembed_tokens.lora_A.weight": torch.zeros(2, 8),
        "base_model.model.model.unembed_tokens.lora_B.weight": torch.zeros(30, 2),
    }
    save_file(lora, raw / "adapter_model.safetensors")
    convert_tinker_adapter(raw, tmp_path / "peft", "Qwen/Qwen3-8B")
    assert sorted(load_file(tmp_path / "peft" / "adapter_model.safetensors")) == [
        "base_model.model.lm_head.lora_A.weight",
        "base_model.model.lm_head.lora_B.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    ]
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (2, 4, ["lm_head", "q_proj"])
    assert config["base_model_name_or_path"] == "Qwen/Qwen3-8B" and config["peft_type"] == "LORA"

    save_file(
        {"base_model.model.model.layers.0.mlp.experts.w1.lora_A.weight": torch.zeros(4, 2, 8)},
        raw / "adapter_model.safetensors",
    )
    with pytest.raises(ExportError, match="build_lora_adapter"):
        convert_tinker_adapter(raw, tmp_path / "moe", "Qwen/Qwen3-30B-A3B")


@pytest.mark.slow
def test_a_tinker_checkpoint_is_downloaded_and_converted(tmp_path, monkeypatch):
    """Against the stand-in service of tests/test_tinker_loops.py, not Tinker: the service cannot be reached from
    this machine. The stand-in trains the tiny model locally behind the SDK's method names, exports its LoRA
    weights under Tinker's names with a Tinker-style config, and serves them through file:// URLs; what is tested
    is tbexp's side: the export, download, clean-up, conversion and that the result computes the checkpoint."""
    import tinker

    from tbexp.backends.tinker_backend import TinkerBackend, sampling_client
    from tests.test_tinker_loops import StandInRest, StandInService

    service = StandInService(tmp_path / "service")
    monkeypatch.setattr(tinker, "RestClient", lambda base_url=None: StandInRest(service))  # nothing leaves the machine
    backend = TinkerBackend(str(TINY_DIR), lora_rank=8, service_client=service)
    _train_step(backend, seed=3, lr=0.02)
    checkpoint = backend.save_state("chosen")
    _train_step(backend, seed=4, lr=0.02)

    exported = backend.export_checkpoint(checkpoint, str(tmp_path / "stage"))
    assert exported.kind == "adapter" and exported.path == str(tmp_path / "stage" / "adapter")
    assert f"create_training_client_from_state {checkpoint}" in service.log
    assert f"delete {service.root}/external_weights/export-chosen" in service.log  # the temporary export
    assert not (tmp_path / "service" / "external" / "export-chosen").exists()
    sampler = sampling_client(service, str(TINY_DIR), checkpoint)
    assert _assert_reproduces(exported, sampler, tmp_path) > 1e-3
    # a failed export is reported, not raised: the stage keeps its trained checkpoint (#42)
    refused = backend.export_checkpoint("/a/local/dir", str(tmp_path / "other"))
    assert refused.kind == "none" and "tinker://" in refused.error and refused.checkpoint == "/a/local/dir"


GRPO = [
    "stage=grpo",
    "policy=model",
    "reward=per_test",
    "task_filter=none",
    "tasks.limit=2",
    "tasks.families=[file-move]",
    "grpo.steps=1",
    "grpo.groups_per_step=2",
    "grpo.group_size=2",
    "grpo.eval_at_start=false",
    "grpo.eval_n_runs=1",
    "grpo.temperature=1.5",
    "sampling.max_tokens=24",
    "agent.max_turns=2",
]


@pytest.mark.slow
@pytest.mark.sandbox
def test_the_grpo_stage_exports_its_peak_checkpoint(rootfs, tmp_path, monkeypatch):
    from tbexp.stages import grpo

    monkeypatch.chdir(tmp_path)
    job = compose_job(*GRPO)
    summary = grpo.run(job)
    assert json.loads((tmp_path / "summary.json").read_text())["grpo/adapter"] == str(tmp_path / "adapter")
    assert summary["grpo/adapter"] == str(tmp_path / "adapter")
    record = json.loads((tmp_path / "adapter" / "tbexp_export.json").read_text())
    assert record["checkpoint"] == summary["grpo/checkpoint"]
    # GRPO trains the tiny model's logit scale; a scale moved off 1 travels as the final norm.
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert bool(config.get("modules_to_save")) == (record["logit_scale"] != 1.0)
    from tbexp.backends.base import Export

    exported = Export(summary["grpo/adapter"], "adapter", str(TINY_DIR))
    _assert_reproduces(exported, job.models.sampler(summary["grpo/checkpoint"]), tmp_path)
