"""The command `python -m tbexp.report SWEEP_DIR|STORAGE [--wandb]`: a sweep's report (the code: tbexp/study/report.py)."""

import os
import sys

from tbexp.study.report import main

if __name__ == "__main__":
    code = main()
    if code:  # W&B failed: after a request that timed out, wandb 0.31's exit hook can wait minutes on its service
        sys.stdout.flush()  # process (a race in its teardown, seen here once in 14 runs); report.md is written and
        sys.stderr.flush()  # nothing of ours needs exit hooks, so leave at once (its service exits with us)
        os._exit(code)
    sys.exit(code)
