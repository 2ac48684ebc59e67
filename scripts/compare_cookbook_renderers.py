"""Does tbexp's renderer for each Hub model give the tokens Harbor's TinkerLLM samples with? Run by hand:

    PYTHONPATH=. python scripts/compare_cookbook_renderers.py

Harbor's `TinkerLLM` renders with tinker-cookbook's renderer for the model (`get_recommended_renderer_name`).
For every `conf/model/*.yaml` with a Hub `path`, this renders a one-turn and a three-turn conversation with
tbexp's renderer (`initial_tokens`, then the reply and `continuation_tokens`, as an episode does) and with
tinker-cookbook's (`build_generation_prompt`), and prints whether the tokens are equal and, where not, both
texts. No Hub tokenizer can be downloaded here, so both render over one tokenizer built offline: the tiny
model's byte-level BPE with the format's special tokens added, each as one token. That checks the format
(special tokens, headers, separators, think blocks, channels), not the real vocabulary's merges.

Needs tinker-cookbook importable (it is not a tbexp dependency: 0.5.8, the newest that resolves here, pins
transformers<=5.5.4, below the venv's).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
EXTRA_SPECIALS = ("<|call|>", "<|constrain|>")  # harmony tokens tinker-cookbook's gpt_oss renderer also needs
CONVERSATION = [
    {"role": "user", "content": "list the files in /app"},
    {"role": "assistant", "content": "ls -la /app"},
    {"role": "user", "content": "total 0\nnow make a file"},
]


def _tokenizer(renderer_class):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "tbexp/models/tiny"), local_files_only=True)
    specials = list(renderer_class.required) + list(renderer_class.optional_stops) + list(EXTRA_SPECIALS)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def _tbexp_tokens(renderer, messages: list[dict]) -> list[int]:
    tokens = renderer.initial_tokens(messages[0]["content"])
    for reply, user in zip(messages[1::2], messages[2::2]):
        reply_tokens = renderer.encode_text(reply["content"]) + renderer.end_of_turn_tokens()
        tokens = tokens + reply_tokens + renderer.continuation_tokens(user["content"], reply_tokens)
    return tokens


def compare(model_yaml: Path) -> None:
    from tinker_cookbook.model_info import get_recommended_renderer_name
    from tinker_cookbook.renderers import get_renderer

    from tbexp.models.renderers import RENDERERS

    node = yaml.safe_load(model_yaml.read_text())
    try:
        theirs_name = get_recommended_renderer_name(node["path"])
    except Exception as err:  # a model tinker-cookbook does not know
        print(f"{model_yaml.stem}: {node['path']}: tinker-cookbook has no renderer ({type(err).__name__}: {err})")
        return
    tokenizer = _tokenizer(RENDERERS[node["renderer"]])
    ours = RENDERERS[node["renderer"]](tokenizer)
    theirs = get_renderer(theirs_name, tokenizer)
    for turns in (1, 3):
        a = _tbexp_tokens(ours, CONVERSATION[:turns])
        b = theirs.build_generation_prompt(CONVERSATION[:turns]).to_ints()
        same = "equal" if a == b else "DIFFER"
        print(f"{model_yaml.stem}: tbexp {node['renderer']} vs tinker-cookbook {theirs_name}, {turns} turn(s): {same}")
        if a != b:
            print(f"    tbexp:           {tokenizer.decode(a)!r}\n    tinker-cookbook: {tokenizer.decode(b)!r}")
    print(f"    stops: tbexp {ours.stop()}, tinker-cookbook {theirs.get_stop_sequences()}")


def main() -> int:
    try:
        import tinker_cookbook  # noqa: F401
    except ImportError:
        print("tinker-cookbook is not importable: pip install tinker-cookbook (see this script's docstring)")
        return 2
    for model_yaml in sorted((REPO / "conf/model").glob("*.yaml")):
        if yaml.safe_load(model_yaml.read_text()).get("path"):
            compare(model_yaml)
    return 0


if __name__ == "__main__":
    sys.exit(main())
