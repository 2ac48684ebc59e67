"""`python -m tbexp.serve`: parse the command line, load the checkpoint once, serve until interrupted.

`CHECKPOINT` and the Hydra overrides are read by `checkpoint.py`; the server prints one line,
`tbexp.serve: serving MODEL at http://HOST:PORT/v1`, once it accepts requests (a script can wait for it).
Errors in the input (a bad checkpoint path, an unknown override, a port in use) end it with one line
on stderr and exit status 2, as `python -m tbexp` does.
"""

from __future__ import annotations

import argparse
import sys

from tbexp.errors import TbexpError


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tbexp.serve",
        description="Serve a tbexp checkpoint as an OpenAI-compatible chat-completions endpoint.",
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint directory (<run>/checkpoints/step-NNNNN), 'base', or tinker://"
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m tbexp (model=..., backend=...)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    parser.add_argument("--served-model-name", default="", help="the model name clients send (default: model.name)")
    parser.add_argument("--quiet", action="store_true", help="no line per request on stderr")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    try:
        server = _build(args)
    except TbexpError as err:
        print(f"tbexp.serve: {err}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"tbexp.serve: serving {server.endpoint.model_name} at http://{host}:{port}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _build(args: argparse.Namespace):
    from tbexp.serving.chat import ChatEndpoint
    from tbexp.serving.checkpoint import check_checkpoint, load_policy, run_config_path, serving_config
    from tbexp.serving.http import make_server

    cfg = serving_config(args.checkpoint, args.overrides)
    check_checkpoint(args.checkpoint, cfg.backend.name)  # before the weights load: a typo fails in a second
    run_config = run_config_path(args.checkpoint)
    if run_config is not None:
        print(f"tbexp.serve: model and backend settings from {run_config}", file=sys.stderr)
    server = make_server(None, args.host, args.port, quiet=args.quiet)  # bound before loading: a taken port fails fast
    try:
        sampler, renderer = load_policy(cfg, args.checkpoint)
    except BaseException:
        server.server_close()
        raise
    name = args.served_model_name or cfg.model.name
    server.endpoint = ChatEndpoint(sampler, renderer, name, cfg.model.max_length_tokens)
    return server
