"""A chosen checkpoint as files a user loads without tbexp: a PEFT adapter directory, or a whole Hugging Face model.

`export_local` (backend=local) writes the LoRA weights of a `save_state`
checkpoint with peft's own `save_pretrained` (adapter_config.json,
adapter_model.safetensors) and the tokenizer beside them, so that

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)

computes the checkpoint's logits. `model.logit_scale` (logit_scale.py) is no
PEFT module: its factor s = exp(log_scale) multiplies the decoder's final
norm's output, and an RMSNorm's output is proportional to its weight, so s is
folded into that weight (w·s) and the norm travels in the adapter's
`modules_to_save` (hidden-size numbers). The fold is checked on a probe input
first: a norm whose output is not proportional to its weight (Gemma's 1 + w)
is refused with a message rather than exported wrong. A scale of exactly 1
(SFT never trains it) adds nothing, so the adapter stays plain LoRA.
Full fine-tuning has no adapter: the whole model is written in Hugging Face
format instead (`hf_model/`, the scale folded the same way).

`export_tinker` (backend=tinker): the service writes the checkpoint's weights
as an external-weights checkpoint (`TrainingClient.save_weights_external` on a
client made from the state, as `tinker checkpoint download` does), the files
are fetched from the signed URLs `RestClient.get_external_weights_urls` gives,
the temporary export is deleted, and the Tinker adapter is converted to PEFT's
layout: keys keep PEFT's `base_model.model.` prefix, Tinker's
`model.unembed_tokens` becomes `lm_head`, and adapter_config.json is written
by peft's `LoraConfig` with Tinker's rank and alpha.

Simplified: for Tinker, dense models only. Mixture-of-experts adapters (3-D
expert tensors) and vision-language models (a `language_model.` prefix that
only the base model's own config reveals) are refused with a pointer to
tinker-cookbook's `weights.build_lora_adapter`, which knows each family. In
bfloat16 the folded norm weight is rounded once more than the trained model
computes it (a relative 2^-8 on that weight).

Each export directory also holds `tbexp_export.json`: the checkpoint it came
from, the base model, its kind and the logit scale folded in (1.0 = none).
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import tempfile
import urllib.request
import warnings
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tbexp.backends.base import Export
from tbexp.backends.logit_scale import ScaledNorm
from tbexp.errors import TbexpError

log = logging.getLogger(__name__)

RECORD = "tbexp_export.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
EXTERNAL_TTL_S = 3600  # the shortest lifetime Tinker allows; the export is deleted once fetched anyway


class ExportError(TbexpError, RuntimeError):
    """A checkpoint that cannot be written as an adapter or model; the message says why and what to do."""


# ---- backend=local ----


def export_local(backend: Any, checkpoint: str, folder: Path) -> Export:
    """`checkpoint`'s weights ("" = the initial ones) from LocalBackend `backend`, under `folder` (see module doc)."""
    from peft import PeftModel

    weights = backend._read_weights(checkpoint, scale_optional=True) if checkpoint else backend._initial_weights()
    lm = backend._lm
    base = str(lm.config._name_or_path)
    kind = "adapter" if isinstance(backend.model, PeftModel) else "hf_model"
    partial = _fresh(folder / kind)
    with backend._lock, backend._weights(weights):  # the checkpoint's tensors in place, the live ones put back after
        scale = float(backend._params[backend._scale_name].detach().exp()) if backend._scale_name else 1.0
        if kind == "adapter":
            with warnings.catch_warnings():  # peft 0.21 reads a property transformers 5 deprecated
                warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
                backend.model.save_pretrained(partial)
            if scale != 1.0:
                _carry_scale(lm, scale, partial)
        else:
            lm.save_pretrained(partial, state_dict=_plain_state_dict(lm, scale))
    backend.tokenizer.save_pretrained(partial)
    return _publish(partial, folder / kind, Export(str(folder / kind), kind, base), checkpoint, scale)


def _final_norm(lm) -> tuple[str, ScaledNorm]:
    """The logit-scaled final norm of `lm` and its module name (e.g. `model.norm`)."""
    norm = lm.get_decoder().norm
    name = next(n for n, m in lm.named_modules() if m is norm)
    return name, norm


def folded_weight(norm: torch.nn.Module, scale: float) -> torch.Tensor:
    """The weight that makes `norm` alone compute norm(x)·scale; checked on a probe input."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or getattr(norm, "bias", None) is not None:
        raise ExportError(
            f"model.logit_scale: the final norm ({type(norm).__name__}) has no plain weight to fold the scale into; "
            "train with model.logit_scale=false to export an adapter"
        )
    folded = (weight.detach().float() * scale).to(weight.dtype)
    probe = torch.randn(8, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight)
    trial = copy.deepcopy(norm)
    with torch.no_grad():
        want = norm(probe).float() * scale
        trial.weight.copy_(folded)
        got = trial(probe).float()
    tolerance = 1e-5 if weight.dtype == torch.float32 else 2e-2
    if not torch.allclose(got, want, rtol=tolerance, atol=tolerance * float(want.abs().max())):
        raise ExportError(
            f"model.logit_scale: the final norm ({type(norm).__name__}) is not proportional to its weight, so the "
            f"scale {scale:.4g} cannot be folded into it; train with model.logit_scale=false to export an adapter"
        )
    return folded.contiguous().cpu()


def _carry_scale(lm, scale: float, adapter: Path) -> None:
    """Put the final norm, its weight times `scale`, into the adapter peft wrote (`modules_to_save`)."""
    name, norm = _final_norm(lm)
    tensors = load_file(adapter / ADAPTER_WEIGHTS)
    tensors[f"base_model.model.{name}.weight"] = folded_weight(norm.norm, scale)
    save_file(tensors, adapter / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    config["modules_to_save"] = [*(config.get("modules_to_save") or []), name]
    (adapter / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _plain_state_dict(lm, scale: float) -> dict[str, torch.Tensor]:
    """`lm`'s weights under the base architecture's names: the scaled norm unwrapped, its scale folded in."""
    state = lm.state_dict()
    if not isinstance(getattr(lm.get_decoder(), "norm", None), ScaledNorm):
        return state
    name, norm = _final_norm(lm)
    state.pop(f"{name}.log_scale")
    for key in [k for k in state if k.startswith(f"{name}.norm.")]:
        state[name + key.removeprefix(f"{name}.norm")] = state.pop(key)
    if scale != 1.0:
        state[f"{name}.weight"] = folded_weight(norm.norm, scale)
    return state


# ---- backend=tinker ----


def export_tinker(
    service: Any, checkpoint: str, folder: Path, base_model: str, tokenizer: Any, base_url: str = ""
) -> Export:
    """Download `checkpoint` (a `tinker://…/weights/…` state) through `service` and write it as a PEFT adapter."""
    if not checkpoint.startswith("tinker://") or "/weights/" not in checkpoint:
        raise ExportError(f"backend=tinker exports tinker://…/weights/… checkpoints (save_state's), not {checkpoint!r}")
    partial = _fresh(folder / "adapter")
    with tempfile.TemporaryDirectory(dir=folder) as raw:
        _download_tinker(service, checkpoint, Path(raw), base_url)
        convert_tinker_adapter(Path(raw), partial, base_model)
    tokenizer.save_pretrained(partial)
    return _publish(partial, folder / "adapter", Export(str(folder / "adapter"), "adapter", base_model), checkpoint)


def _download_tinker(service: Any, checkpoint: str, into: Path, base_url: str = "") -> None:
    """The files of `checkpoint`'s weights, exported by the service as external weights, into `into`. The clients
    as tinker 0.38 wants them made: the training client from the checkpoint's state (tinker_compat copes with a server
    that refuses that call), the REST client directly (`ServiceClient.create_rest_client` is deprecated)."""
    import tinker

    from tbexp.backends.tinker_compat import training_client_from_state

    def rest_client() -> Any:
        return tinker.RestClient(base_url=base_url or None)

    training = training_client_from_state(service, rest_client, checkpoint, optimizer=False)
    external = (
        training.save_weights_external(f"export-{checkpoint.rsplit('/', 1)[-1]}", ttl_seconds=EXTERNAL_TTL_S)
        .result()
        .path
    )
    rest = rest_client()
    try:
        urls = rest.get_external_weights_urls(external).result().urls
        if not urls:
            raise ExportError(f"{checkpoint}: Tinker's export {external} holds no files")
        for name, url in sorted(urls.items()):
            relative = PurePosixPath(name)
            if relative.is_absolute() or ".." in relative.parts:
                raise ExportError(f"{external}: unsafe file name {name!r} in the export")
            if name.endswith(".age"):
                raise ExportError(f"{external}: {name} is encrypted; tbexp exports unencrypted checkpoints only")
            target = into / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with urllib.request.urlopen(url, timeout=60) as response, open(target, "wb") as out:
                shutil.copyfileobj(response, out)
    finally:  # the export is a copy made only for this download
        try:
            rest.delete_checkpoint_from_tinker_path(external).result()
        except Exception as err:  # noqa: BLE001 - the adapter is written either way; the export expires by itself
            log.warning(
                "could not delete Tinker's temporary export %s (%s); it expires in %d s", external, err, EXTERNAL_TTL_S
            )


def convert_tinker_adapter(raw: Path, out: Path, base_model: str) -> None:
    """Tinker's adapter files in `raw` as a PEFT adapter in `out` (see module doc for the mapping)."""
    from peft import LoraConfig

    for required in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (raw / required).is_file():
            raise ExportError(f"Tinker's export has no {required} (files: {sorted(p.name for p in raw.iterdir())})")
    tinker_config = json.loads((raw / ADAPTER_CONFIG).read_text())
    missing = [k for k in ("r", "lora_alpha") if k not in tinker_config]
    if missing:
        raise ExportError(f"Tinker's {ADAPTER_CONFIG} lacks {missing}")
    tensors = load_file(raw / ADAPTER_WEIGHTS)
    if any(".experts" in key for key in tensors):
        raise ExportError(
            f"{base_model}: a mixture-of-experts adapter (3-D expert tensors) needs per-family conversion, which tbexp "
            "does not do; use tinker_cookbook.weights.build_lora_adapter on the downloaded files"
        )
    peft_tensors = {}
    for key, tensor in tensors.items():
        if ".lora_A." not in key and ".lora_B." not in key:
            raise ExportError(f"Tinker's {ADAPTER_WEIGHTS}: {key!r} is not a LoRA weight")
        module = key.removeprefix("base_model.model.").replace("model.unembed_tokens", "lm_head")
        peft_tensors[f"base_model.model.{module}"] = tensor.contiguous()
    targets = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in peft_tensors})
    out.mkdir(parents=True, exist_ok=True)
    LoraConfig(
        r=int(tinker_config["r"]),
        lora_alpha=tinker_config["lora_alpha"],
        lora_dropout=0.0,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
        inference_mode=True,
    ).save_pretrained(str(out))
    save_file(peft_tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})


# ---- writing ----


def _fresh(target: Path) -> Path:
    """An empty directory beside `target` to write into; `_publish` moves it into place when complete."""
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def _publish(partial: Path, target: Path, export: Export, checkpoint: str, scale: float = 1.0) -> Export:
    record = {"kind": export.kind, "checkpoint": checkpoint, "base_model": export.base_model, "logit_scale": scale}
    (partial / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)  # an earlier export of this stage (a re-run chooses again)
    partial.rename(target)
    return export
