"""tests/sweep_app's job as a package's `__main__` (like `python -m tbexp`) that fails to import in a fork server.

    python -m tests.unforkable_app -m hydra.sweep.dir=... hydra.sweeper.storage=...

The sweeper preloads a `pkg.__main__` task module in its jobs' fork server;
this one raises there, so the sweeper has to fall back to spawning its jobs.
"""

import sys

import hydra

from tests.sweep_app import app

if sys.argv == ["-c"]:  # the fork server runs `python -c CMD` with no arguments; the sweeper and spawned jobs do not
    raise RuntimeError("tests.unforkable_app refuses to be imported by a fork server")


@hydra.main(version_base=None, config_path="../sweep_app/conf", config_name="config")
def main(cfg) -> float:
    return app.main.__wrapped__(cfg)


if __name__ == "__main__":
    main()
