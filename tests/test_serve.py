"""`python -m tbexp.serve`: a trained tiny checkpoint served over HTTP and called through Harbor's litellm path.

The server runs in a subprocess on a free port; Harbor's `LiteLLM` (`hosted_vllm/tiny`, rollout details on)
calls it, and its reply, token ids and logprobs are held against tbexp's own sampler over the same checkpoint
in this process (the path the stages take: ModelHost.sampler and the model's renderer). Token ids must be
equal; logprobs within LOGPROB_TOLERANCE: the server's come from the KV-cached decode, the reference's from
one full forward pass (`compute_logprobs`), both float32 on the CPU, so they differ only by rounding.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import compose_config, compose_job
from tests.services import tbexp_serve

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # before harbor or litellm is imported: no network lookup

LOGPROB_TOLERANCE = 1e-4
MODEL_INFO = {
    "max_input_tokens": 2048,
    "max_output_tokens": 2048,
    "input_cost_per_token": 0.0,
    "output_cost_per_token": 0.0,
}
PROMPT = "list the files in /app"


def _datum(renderer):
    import numpy as np
    from tinker import types

    tokens, weights = renderer.supervised(
        [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "ls -la"}]
    )
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:])),
            "weights": types.TensorData.from_numpy(np.array(weights[1:], dtype=np.float32)),
        },
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint with trained LoRA weights (so it differs from the base), in a run directory as a stage leaves it."""
    from omegaconf import OmegaConf
    from tinker import types

    from tbexp.build import make_backend
    from tbexp.models.renderers import make_renderer

    run = tmp_path_factory.mktemp("run")
    cfg = compose_config("model=tiny")
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    backend = make_backend(cfg, run / "checkpoints")
    datum = _datum(make_renderer(cfg.model.renderer, backend.tokenizer))
    for _ in range(3):
        backend.forward_backward([datum], "cross_entropy").result()
        backend.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return Path(backend.save_state("step-00003"))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """The server's base URL (…/v1), from the line it prints when ready."""
    with tbexp_serve(tmp_path_factory.mktemp("server") / "stderr.txt", str(checkpoint)) as url:
        yield url


@pytest.fixture(scope="module")
def reference(checkpoint):
    """tbexp's own sampler and renderer over the same checkpoint, as the eval stage builds them."""
    from tbexp.models.renderers import make_renderer

    job = compose_job("model=tiny")
    sampler = job.models.sampler(str(checkpoint))
    return sampler, make_renderer(job.cfg.model.renderer, sampler.tokenizer)


def _harbor_llm(url: str, temperature: float | None):
    from harbor.llms.lite_llm import LiteLLM

    return LiteLLM(
        "hosted_vllm/tiny", temperature=temperature, api_base=url, collect_rollout_details=True, model_info=MODEL_INFO
    )


def _sample(reference, prompt_tokens: list[int], temperature: float, seed: int | None, max_tokens: int):
    from tinker import types

    sampler, renderer = reference
    params = types.SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=renderer.stop(), seed=seed)
    return sampler.sample(types.ModelInput.from_ints(prompt_tokens), 1, params).result()[0]


def _assert_logprobs_match(reference, prompt_tokens, completion_tokens, logprobs):
    from tinker import types

    full = reference[0].compute_logprobs(types.ModelInput.from_ints(prompt_tokens + completion_tokens)).result()
    expected = full[len(prompt_tokens) :]
    assert len(logprobs) == len(completion_tokens) == len(expected)
    assert max(abs(a - b) for a, b in zip(logprobs, expected)) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 11), (0.7, 5)])
def test_harbor_litellm_gets_tbexps_tokens_and_logprobs(server, reference, temperature, seed):
    llm = _harbor_llm(server, temperature)
    kwargs = {"max_tokens": 24} | ({"seed": seed} if seed is not None else {})
    try:
        response = asyncio.run(llm.call(PROMPT, **kwargs))
    except Exception as err:  # a reply cut at max_tokens is Harbor's OutputLengthExceededError: compare it too
        from harbor.llms.base import OutputLengthExceededError

        if not isinstance(err, OutputLengthExceededError):
            raise
        pytest.fail(f"reply hit max_tokens; raise it in the test: {err}")
    _, renderer = reference
    prompt_tokens = renderer.initial_tokens(PROMPT)
    assert response.prompt_token_ids == prompt_tokens
    expected = _sample(reference, prompt_tokens, temperature, seed, 24)
    assert response.completion_token_ids == expected.tokens  # the same draw: same sampler, seed and weights
    assert response.content == renderer.decode_reply(expected.tokens)
    assert response.model_name.endswith("tiny")
    _assert_logprobs_match(reference, prompt_tokens, response.completion_token_ids, response.logprobs)
    assert response.usage.prompt_tokens == len(prompt_tokens)


def test_a_reply_sent_back_keeps_its_sampled_tokens(server, reference):
    """The second turn's prompt is the first turn's prompt + the reply *as sampled* + the renderer's continuation."""
    llm = _harbor_llm(server, 1.0)
    first = asyncio.run(llm.call(PROMPT, max_tokens=24, seed=3))
    history = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": first.content}]
    second = asyncio.run(llm.call("now show hidden files", message_history=history, max_tokens=24, seed=4))
    _, renderer = reference
    expected_prompt = (
        first.prompt_token_ids
        + first.completion_token_ids
        + renderer.continuation_tokens("now show hidden files", first.completion_token_ids)
    )
    assert second.prompt_token_ids == expected_prompt
    _assert_logprobs_match(reference, expected_prompt, second.completion_token_ids, second.logprobs)


def test_a_prompt_over_the_context_is_harbors_context_length_error(server):
    from harbor.llms.base import ContextLengthExceededError

    with pytest.raises(ContextLengthExceededError):
        asyncio.run(_harbor_llm(server, 0.0).call("word " * 3000))


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + "/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_concurrent_requests_get_what_they_get_alone(server):
    bodies = [
        {
            "messages": [{"role": "user", "content": f"task {i}: {PROMPT}"}],
            "temperature": 1.0,
            "seed": i,
            "max_tokens": 16,
            "logprobs": True,
            "n": 1 + i % 2,
        }
        for i in range(6)
    ]
    alone = [_post(server, b)[1]["choices"] for b in bodies]
    with ThreadPoolExecutor(6) as pool:
        together = [r[1]["choices"] for r in pool.map(lambda b: _post(server, b), bodies)]
    assert together == alone
    assert [len(c) for c in alone] == [1, 2, 1, 2, 1, 2]


def test_models_and_refused_requests(server):
    with urllib.request.urlopen(server + "/models", timeout=30) as reply:
        models = json.loads(reply.read())
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 2048
    refused = {
        "system": {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        "stream": {"messages": [{"role": "user", "content": "hi"}], "stream": True},
        "temperature": {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
        "model": {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"},
        "last_turn": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
        "max_tokens": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000},
    }
    status = {name: _post(server, body) for name, body in refused.items()}
    assert {name: s for name, (s, _) in status.items()} == {**dict.fromkeys(refused, 400), "model": 404}
    assert "system role" in status["system"][1]["error"]["message"]
    assert status["max_tokens"][1]["error"]["code"] == "context_length_exceeded"


def test_stop_strings_cut_the_content_and_the_sampling(reference):
    from tbexp.serving.chat import ChatEndpoint

    sampler, renderer = reference
    endpoint = ChatEndpoint(sampler, renderer, "tiny", 2048)
    body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 1.0, "seed": 2, "max_tokens": 24}
    free = endpoint.complete(body)["choices"][0]
    text = free["message"]["content"]
    if len(text) < 2:
        pytest.skip(f"the seeded reply {text!r} is too short to cut")
    stop = text[1:3] if len(text) >= 3 else text[1]
    cut = endpoint.complete({**body, "stop": [stop]})["choices"][0]
    assert cut["message"]["content"] == text[: text.find(stop)]
    assert cut["finish_reason"] == "stop"
    assert len(cut["token_ids"]) <= len(free["token_ids"])
    assert cut["token_ids"] == free["token_ids"][: len(cut["token_ids"])]  # the same draw, stopped where the text ends


def _serve_fails(capsys, *args: str) -> str:
    """`python -m tbexp.serve ARGS`, run in this process (the same main), which must refuse with exit status 2."""
    from tbexp.serving.command import main

    capsys.readouterr()
    assert main(list(args)) == 2
    return capsys.readouterr().err


def test_bad_checkpoints_and_a_taken_port_fail_with_one_clear_line(tmp_path, checkpoint, capsys):
    assert "no such directory" in _serve_fails(capsys, str(tmp_path / "nowhere"))
    assert "not a tbexp checkpoint directory" in _serve_fails(capsys, str(tmp_path))
    assert "needs backend=tinker" in _serve_fails(capsys, "tinker://run/weights/1")
    assert "model.lora_rnak" in _serve_fails(capsys, "base", "model.lora_rnak=4")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert "is in use" in _serve_fails(capsys, str(checkpoint), "--port", str(taken.getsockname()[1]))


def test_a_checkpoint_served_with_other_lora_settings_is_refused(checkpoint, capsys):
    err = _serve_fails(capsys, str(checkpoint), "model.lora_rank=2", "--port", "0")
    assert "trainable parameters differ" in err and "model.lora_rank" in err


def test_a_reply_split_unlike_its_encoding_is_sent_back_as_sampled(reference):
    """A sampler may emit `l` + `s` where encoding "ls" gives one token: the history must hold the sampled two."""
    from tbexp.backends.base import Done, SampledSequence
    from tbexp.serving.chat import ChatEndpoint

    _, renderer = reference
    tok = renderer.tokenizer
    split = [tok.convert_tokens_to_ids("l"), tok.convert_tokens_to_ids("s")] + renderer.end_of_turn_tokens()
    assert renderer.encode_text("ls") != split[:2]  # the case only matters where the split is not the encoding

    class Scripted:
        tokenizer = tok

        def sample(self, prompt, n, params):
            return Done([SampledSequence(split, [-0.5] * len(split), "stop")] * n)

    endpoint = ChatEndpoint(Scripted(), renderer, "tiny", 2048)
    first = endpoint.complete({"messages": [{"role": "user", "content": PROMPT}]})
    assert first["choices"][0]["message"]["content"] == "ls"
    history = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": "ls"},
        {"role": "user", "content": "ok"},
    ]
    second = endpoint.complete({"messages": history})
    assert second["prompt_token_ids"] == first["prompt_token_ids"] + split + renderer.continuation_tokens("ok", split)
    other = history[:1] + [{"role": "assistant", "content": "cd /"}] + history[2:]  # text it never sampled: encoded
    reply = renderer.encode_text("cd /") + renderer.end_of_turn_tokens()
    third = endpoint.complete({"messages": other})
    assert third["prompt_token_ids"] == first["prompt_token_ids"] + reply + renderer.continuation_tokens("ok", reply)
