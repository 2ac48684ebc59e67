"""Serving a checkpoint as an OpenAI-compatible chat-completions endpoint (`python -m tbexp.serve`).

`checkpoint` turns a checkpoint path and Hydra overrides into a sampler and renderer, `chat` answers one
chat-completions request with them (token ids and logprobs as vLLM returns them), and `http` is the
standard-library HTTP server in front of it.
"""
