"""Models: the `model` config node to a transformers model and its tokenizer.

`load_model` is the one path for every model: a local directory or a
Hugging Face Hub id through `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained`. `model.path == ""` with `model.name` one of
`SHIPPED` is a small model shipped in `tbexp/models/<name>/` (built by
`scripts/build_tiny_model.py --protocol <the agent it speaks>`). Nothing is ever downloaded here: a Hub id
must already be in the local Hugging Face cache, and one that is not fails
at once with a message that says so (instead of retrying the network for a
minute first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tbexp.errors import TbexpError

SHIPPED = {"tiny": "raw_command", "tiny_terminus": "terminus_2"}  # model.name -> the agent its corpus speaks
SHIPPED_DIR = Path(__file__).resolve().parent  # each SHIPPED model in SHIPPED_DIR / its name
TINY_DIR = SHIPPED_DIR / "tiny"


class ModelLoadError(TbexpError, RuntimeError):
    """A model that cannot be loaded; the message says what to set."""


def resolve_model_path(model_settings: Any) -> str:
    """The directory or Hub id that `model_settings` names."""
    if model_settings.path:
        return str(model_settings.path)
    if model_settings.name in SHIPPED:
        shipped = SHIPPED_DIR / model_settings.name
        if not (shipped / "config.json").is_file():
            raise ModelLoadError(
                f"{shipped} holds no model; build it with"
                f" `python scripts/build_tiny_model.py --protocol {SHIPPED[model_settings.name]}`"
            )
        return str(shipped)
    raise ModelLoadError(
        f"model.name={model_settings.name!r} has no model.path; set model.path to a Hugging Face id or a local directory"
    )


def load_model(model_settings: Any, device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) for the `model` config node, the model in eval mode on `device`.

    Weights load in the dtype their config records (`dtype="auto"`: float32 for
    the tiny model, bfloat16 for most Hub models).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model_settings)
    local = Path(path).expanduser()
    if local.is_dir():
        source = str(local)
    elif local.is_absolute() or path.startswith((".", "~")) or path.count("/") != 1:
        raise ModelLoadError(f"model.path={path!r}: no such directory (and not a Hub id of the form 'org/name')")
    else:
        source = path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype="auto")
    except OSError as err:
        if local.is_dir():
            raise ModelLoadError(f"model.path={path!r}: not a loadable model directory ({err})") from err
        raise ModelLoadError(
            f"model.path={path!r} is not in the local Hugging Face cache, and nothing can be downloaded here. "
            f"Fetch it on a machine with network access (`hf download {path}`, then copy the cache or the "
            f"snapshot directory over), or set model.path to a local directory holding the config, weights and tokenizer."
        ) from err
    return model.to(device).eval(), tokenizer
