"""The shipped tiny model, `load_model`, the chat renderers (token-exact episodes) and the model configs."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tbexp.models import SHIPPED, TINY_DIR, ModelLoadError, load_model
from tbexp.models.renderers import RENDERERS, RendererError, make_renderer
from tests.conftest import CONF, compose_config

MODEL_CONFIGS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
HUB_SPECIALS = {
    "qwen3": ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "gpt_oss": ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>"],
}
CONVERSATION = [
    {"role": "user", "content": "List the files in /app/src.\n\nReply with exactly one bash command per turn."},
    {"role": "assistant", "content": "ls /app/src"},
    {"role": "user", "content": "main.py\nutils.py\n[exit 0]"},
    {"role": "assistant", "content": "wc -l /app/src/main.py"},
    {"role": "user", "content": "12 /app/src/main.py\n[exit 0]"},
    {"role": "assistant", "content": "exit"},
]


@pytest.fixture(scope="module")
def tiny():
    return load_model(compose_config().model)


def tokenizer_for(renderer_name: str, tiny_tokenizer):
    """The tiny tokenizer, plus the hub format's special tokens when the renderer needs them."""
    if renderer_name == "plain":
        return tiny_tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_DIR)
    tokenizer.add_special_tokens({"additional_special_tokens": HUB_SPECIALS[renderer_name]})
    return tokenizer


# --- the tiny model ----------------------------------------------------------------------------


def test_default_config_loads_the_shipped_tiny_model(tiny):
    model, tokenizer = tiny
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 0.8e6 <= sum(p.numel() for p in model.parameters()) <= 2.5e6
    assert len(tokenizer) <= model.config.vocab_size
    assert sum(f.stat().st_size for f in TINY_DIR.iterdir()) < 10e6  # a few MB in the repository
    assert (TINY_DIR / "model.safetensors").is_file() and (TINY_DIR / "README.md").is_file()


def test_tiny_model_answers_in_its_format(tiny):
    model, tokenizer = tiny
    reply = _greedy_reply(
        model,
        tokenizer,
        "Print the contents of /app/notes.md.\n\nYou are in a bash shell in /app. Reply with exactly one bash command per turn; you will see its output. Reply `exit` when the task is done.",
        max_new_tokens=40,
    )
    assert reply.strip() and "<|" not in reply


def _greedy_reply(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    renderer = make_renderer("plain", tokenizer)
    tokens = renderer.initial_tokens(prompt)
    out = model.generate(
        torch.tensor([tokens]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=renderer.stop(),
        pad_token_id=tokenizer.pad_token_id,
    )
    return renderer.decode_reply(out[0, len(tokens) :].tolist())


def test_the_terminus_model_reads_harbors_prompt_in_fewer_tokens_and_answers_in_its_json(tiny):
    """model=tiny_terminus: Harbor's first prompt in well under half of tiny's tokens, and a reply that Harbor's
    parser takes without a warning, typing one command (for a generic chore, not a built-in task; which names it
    types is SFT's to teach, as for model=tiny)."""
    from tbexp.agents.terminus_2 import Terminus2Agent

    model, tokenizer = load_model(compose_config("model=tiny_terminus", "agent=terminus_2").model)
    agent = Terminus2Agent(SimpleNamespace(parser="json", summarize=False))
    instruction = SimpleNamespace(instruction="Print the contents of /app/notes.md.")
    prompt = agent.prompt(instruction, "Current Terminal Screen:\nroot@vm:/app#\n" + "\n" * 39)
    tokens = make_renderer("plain", tokenizer).initial_tokens(prompt)
    assert len(tokens) < 0.5 * len(make_renderer("plain", tiny[1]).initial_tokens(prompt))
    action = agent.parse(_greedy_reply(model, tokenizer, prompt, max_new_tokens=120), [])
    assert not action.error and not action.warning and len(action.commands) == 1 and action.commands[0].strip()


def test_save_pretrained_round_trip_is_the_hub_path(tiny, tmp_path):
    model, tokenizer = tiny
    model.save_pretrained(tmp_path / "copy")
    tokenizer.save_pretrained(tmp_path / "copy")
    again, again_tokenizer = load_model(SimpleNamespace(name="copy", path=str(tmp_path / "copy")))
    ids = torch.tensor([tokenizer.encode("ls -la /app", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    assert again_tokenizer.encode("grep -n foo bar.txt") == tokenizer.encode("grep -n foo bar.txt")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "copy", local_files_only=True)
    assert plain.config.hidden_size == model.config.hidden_size


def test_chat_template_matches_the_plain_renderer(tiny):
    _, tokenizer = tiny
    tokens, _ = make_renderer("plain", tokenizer).supervised(CONVERSATION)
    templated = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert list(templated) == tokens


def test_a_hub_id_that_is_not_cached_fails_at_once_with_what_to_do():
    started = time.monotonic()
    with pytest.raises(ModelLoadError) as err:
        load_model(SimpleNamespace(name="ghost", path="tbexp-test/no-such-model"))
    assert time.monotonic() - started < 20  # no network retries
    assert "nothing can be downloaded here" in str(err.value) and "model.path" in str(err.value)


def test_missing_directory_and_missing_path_are_named():
    with pytest.raises(ModelLoadError, match="no such directory"):
        load_model(SimpleNamespace(name="x", path="/no/such/model/dir"))
    with pytest.raises(ModelLoadError, match="model.path"):
        load_model(SimpleNamespace(name="qwen3_8b", path=""))


# --- renderers ---------------------------------------------------------------------------------


def incremental(renderer, messages: list[dict]) -> list[int]:
    """How an episode is built: prompt, sampled reply tokens, continuation, ..."""
    tokens = renderer.initial_tokens(messages[0]["content"])
    for i in range(1, len(messages), 2):
        reply = renderer.encode_text(messages[i]["content"]) + renderer.end_of_turn_tokens()
        tokens += reply
        if i + 1 < len(messages):
            tokens += renderer.continuation_tokens(messages[i + 1]["content"], reply)
    return tokens


@pytest.mark.parametrize("name", sorted(RENDERERS))
def test_supervised_equals_incremental_with_weights_on_replies_only(name, tiny):
    renderer = make_renderer(name, tokenizer_for(name, tiny[1]))
    tokens, weights = renderer.supervised(CONVERSATION)
    assert tokens == incremental(renderer, CONVERSATION)
    assert len(weights) == len(tokens) and set(weights) == {0.0, 1.0}
    replies = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    end = renderer.end_of_turn_tokens()
    expected = [t for r in replies for t in renderer.encode_text(r) + end]
    assert [t for t, w in zip(tokens, weights) if w] == expected
    # Each weighted stretch is one reply plus its end marker.
    stretches, current = [], []
    for t, w in zip(tokens, weights):
        if w:
            current.append(t)
        elif current:
            stretches.append(current)
            current = []
    stretches.append(current)
    assert [renderer.decode_reply(s) for s in stretches if s] == replies


@pytest.mark.parametrize("name", sorted(RENDERERS))
def test_decode_reply_strips_the_end_marker(name, tiny):
    renderer = make_renderer(name, tokenizer_for(name, tiny[1]))
    body = renderer.encode_text("cat /app/notes.md")
    assert renderer.decode_reply(body + renderer.end_of_turn_tokens()) == "cat /app/notes.md"
    assert renderer.decode_reply(body) == "cat /app/notes.md"  # cut at max_tokens: no marker
    for stop in renderer.stop():
        assert renderer.decode_reply(body + [stop]) == "cat /app/notes.md"


@pytest.mark.parametrize("name", sorted(RENDERERS))
def test_sampled_tokens_stay_as_sampled(name, tiny):
    tokenizer = tokenizer_for(name, tiny[1])
    renderer = make_renderer(name, tokenizer)
    text = "grep -rn secret /app/config"
    merged = renderer.encode_text(text)
    split = [t for ch in text for t in renderer.encode_text(ch)]  # one token a character: what a sampler may emit
    assert split != merged and tokenizer.decode(split) == text
    prompt = renderer.initial_tokens("Find the secret.")
    after = renderer.continuation_tokens("app.conf:3:secret=1\n[exit 0]", split)
    episode = prompt + split + after
    assert episode[len(prompt) : len(prompt) + len(split)] == split
    assert (
        after[: len(renderer.end_of_turn_tokens())] == renderer.end_of_turn_tokens()
    )  # closed, since the sample was not
    closed = split + renderer.end_of_turn_tokens()
    again = renderer.continuation_tokens("ok\n[exit 0]", closed)
    assert again == renderer.continuation_tokens("ok\n[exit 0]", merged + renderer.end_of_turn_tokens())
    assert again[: len(renderer.end_of_turn_tokens())] != renderer.end_of_turn_tokens()  # not closed twice
    assert renderer.decode_reply(split) == text


@pytest.mark.parametrize("name", sorted(RENDERERS))
def test_special_token_text_in_an_observation_stays_text(name, tiny):
    renderer = make_renderer(name, tokenizer_for(name, tiny[1]))
    marker = tokenizer_for(name, tiny[1]).convert_ids_to_tokens(renderer.end_of_turn_tokens())[0]
    tokens = renderer.encode_text(f"echo '{marker}'")
    assert not set(tokens) & set(renderer.stop())


def test_formats_look_like_their_templates(tiny):
    def text(name):
        tokenizer = tokenizer_for(name, tiny[1])
        renderer = make_renderer(name, tokenizer)
        return tokenizer.decode(renderer.supervised(CONVERSATION[:2])[0])

    assert text("plain") == f"<|user|>{CONVERSATION[0]['content']}<|end|><|assistant|>ls /app/src<|end|>"
    assert (
        text("qwen3")
        == f"<|im_start|>user\n{CONVERSATION[0]['content']}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nls /app/src<|im_end|>"
    )
    assert (
        text("llama3")
        == f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{CONVERSATION[0]['content']}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nls /app/src<|eot_id|>"
    )
    assert (
        text("gpt_oss")
        == f"<|start|>user<|message|>{CONVERSATION[0]['content']}<|end|><|start|>assistant<|channel|>final<|message|>ls /app/src<|return|>"
    )


@pytest.mark.parametrize("name", ["qwen3", "llama3", "gpt_oss"])
def test_a_tokenizer_without_the_special_tokens_is_refused(name, tiny):
    with pytest.raises(RendererError, match="needs the special token"):
        make_renderer(name, tiny[1])


def test_unknown_renderer_and_bad_roles_are_refused(tiny):
    with pytest.raises(RendererError, match="unknown renderer"):
        make_renderer("chatml2", tiny[1])
    with pytest.raises(RendererError, match="alternate"):
        make_renderer("plain", tiny[1]).supervised([{"role": "assistant", "content": "ls"}])


# --- model configs -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_CONFIGS)
def test_every_model_config_composes(name):
    lines = (CONF / "model" / f"{name}.yaml").read_text().splitlines()
    assert lines[0] == f"# python -m tbexp model={name}"
    model = compose_config(f"model={name}").model
    assert model.name == name and model.renderer in RENDERERS
    assert model.lora_targets and model.max_length_tokens > 0
    assert (model.path == "") == (name in SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_a_shipped_model_not_built_says_how_to_build_it(name, tmp_path, monkeypatch):
    import tbexp.models

    monkeypatch.setattr(tbexp.models, "SHIPPED_DIR", tmp_path)  # an empty tbexp/models/
    with pytest.raises(ModelLoadError, match=f"build_tiny_model.py --protocol {SHIPPED[name]}`"):
        load_model(compose_config(f"model={name}").model)


# A small random instance of each architecture: the LoRA targets must be real nn.Linear modules there.
ARCHITECTURES = {"qwen3": "qwen3", "llama3": "llama", "gpt_oss": "gpt_oss"}
SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=128,
)


@pytest.mark.parametrize("name", [n for n in MODEL_CONFIGS if n not in SHIPPED])
def test_lora_targets_are_linear_modules_of_the_architecture(name):
    from peft import LoraConfig, get_peft_model

    model_settings = compose_config(f"model={name}").model
    extra = {"num_local_experts": 2, "num_experts_per_tok": 1} if model_settings.renderer == "gpt_oss" else {}
    config = AutoConfig.for_model(ARCHITECTURES[model_settings.renderer], **SMALL, **extra)
    model = AutoModelForCausalLM.from_config(config)
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(model_settings.lora_targets) <= linear
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=list(model_settings.lora_targets)))
    assert sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n) > 0
