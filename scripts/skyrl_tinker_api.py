"""SkyRL's Tinker-API server (`python -m skyrl.tinker.api`), with its engine started by this Python.

    $TBEXP_CACHE/skyrl-venv/bin/python scripts/skyrl_tinker_api.py --host 127.0.0.1 --port 8000 --base-model DIR ...

Run with the SkyRL environment's Python (scripts/setup_tinker_server.sh), not tbexp's; the arguments are the
module's own. SkyRL 0.4.0's API process starts its engine as `uv run <the flags of the uv run that started the API>
--extra tinker --extra <backend> -m skyrl.tinker.engine ...`, and refuses to start unless it was itself started by
`uv run` inside a SkyRL checkout. Installed from PyPI into a plain environment there is neither, so this starts the
engine module with the same interpreter and the same engine arguments instead; everything else is SkyRL's.
"""

from __future__ import annotations

import argparse
import sys

import uvicorn
from skyrl.tinker import api, config


def engine_command(parent_cmd: list[str], engine_config: config.EngineConfig) -> list[str]:
    return [sys.executable, "-m", "skyrl.tinker.engine", *config.config_to_argv(engine_config)]


def main() -> None:
    parser = argparse.ArgumentParser(description="SkyRL tinker API server, its engine started by this Python")
    config.add_model(parser, config.EngineConfig)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    fields = config.EngineConfig.model_fields
    api.app.state.engine_config = config.EngineConfig.model_validate(
        {k: v for k, v in vars(args).items() if k in fields}
    )
    api._build_uv_run_cmd_engine = engine_command  # the lifespan looks it up when the server starts
    uvicorn.run(
        api.app,
        host=args.host,
        port=args.port,
        log_config=api.get_uvicorn_log_config(),
        backlog=api.SKYRL_HTTP_CONNECTION_LIMIT,
        timeout_keep_alive=api.HTTP_KEEP_ALIVE_TIMEOUT_SECONDS,
    )


if __name__ == "__main__":
    main()
