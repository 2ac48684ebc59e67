"""From `CHECKPOINT [overrides]` on the command line to the config, sampler and renderer that serve it.

CHECKPOINT is one of
* a tbexp checkpoint directory, as the training stages write them (`<run>/checkpoints/step-NNNNN/`, holding
  `trainable.safetensors`; `sft_state.json` and `chosen_checkpoint.txt` name them);
* `base`: the base model of the composed config, with no trained weights;
* a `tinker://` URI, with `backend=tinker`.

The config is composed from `conf/` with the given Hydra overrides, as `python -m tbexp` composes it. A
checkpoint directory carries no config of its own, so the nearest run directory above it that holds
`.hydra/config.yaml` supplies the `model` and `backend` nodes (the base model, LoRA settings and
`model.logit_scale` the weights were trained with), unless the command line sets that group itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tbexp.errors import TbexpError

CONF_DIR = Path(__file__).resolve().parent.parent.parent / "conf"
BASE = "base"
RUN_NODES = ("model", "backend")  # what a checkpoint's run decides about how to load it


class ServeError(TbexpError, ValueError):
    """A checkpoint or setting that cannot be served; the message names the path or key."""


def run_config_path(checkpoint: str) -> Path | None:
    """The `.hydra/config.yaml` of the nearest run directory above a checkpoint directory, if any."""
    if checkpoint == BASE or checkpoint.startswith("tinker://"):
        return None
    for folder in Path(checkpoint).resolve().parents:
        if (folder / ".hydra" / "config.yaml").is_file():
            return folder / ".hydra" / "config.yaml"
    return None


def serving_config(checkpoint: str, overrides: list[str]) -> Any:
    """The composed config that loads `checkpoint`: its run's model and backend, then the command line."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from tbexp.config import check, register

    register()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose("config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise ServeError(f"overrides {' '.join(overrides)!r}: {err}") from err
    run_config = run_config_path(checkpoint)
    if run_config is not None:
        named = {o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] for o in overrides}
        saved = OmegaConf.load(run_config)
        try:
            cfg = OmegaConf.merge(cfg, {k: saved[k] for k in RUN_NODES if k in saved and k not in named})
        except OmegaConfBaseException as err:
            raise ServeError(f"{run_config}: its model/backend nodes do not fit this tbexp's schema: {err}") from err
    check(cfg)
    return cfg


def check_checkpoint(checkpoint: str, backend: str) -> str:
    """The checkpoint as ModelHost.sampler takes it ("" = the base model), or a ServeError saying what is wrong."""
    if checkpoint == BASE:
        return ""
    if checkpoint.startswith("tinker://"):
        if backend != "tinker":
            raise ServeError(f"{checkpoint}: a tinker:// checkpoint needs backend=tinker (backend.name={backend!r})")
        return checkpoint
    path = Path(checkpoint)
    if not path.is_dir():
        raise ServeError(
            f"checkpoint {checkpoint}: no such directory (give a checkpoint directory, 'base' or tinker://)"
        )
    if not (path / "trainable.safetensors").is_file():
        raise ServeError(
            f"checkpoint {checkpoint}: not a tbexp checkpoint directory (no trainable.safetensors); the training "
            f"stages write them as <run>/checkpoints/step-NNNNN/, and chosen_checkpoint.txt names the chosen one"
        )
    if backend != "local":
        raise ServeError(f"checkpoint {checkpoint}: a local checkpoint directory needs backend=local")
    return str(path.resolve())


def load_policy(cfg: Any, checkpoint: str) -> tuple[Any, Any]:
    """(sampler over the checkpoint's weights, the model's renderer over its tokenizer)."""
    from tbexp.job import ModelHost
    from tbexp.models.renderers import make_renderer

    path = check_checkpoint(checkpoint, cfg.backend.name)
    try:
        sampler = ModelHost(cfg).sampler(path)
    except ValueError as err:  # trainable parameters that differ from the composed model's: wrong base or LoRA settings
        if isinstance(err, TbexpError):
            raise
        raise ServeError(f"checkpoint {checkpoint}: {err}") from err
    return sampler, make_renderer(cfg.model.renderer, sampler.tokenizer)
