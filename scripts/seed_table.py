"""The RL gain over seeds, one row per default-job run directory: `tbexp.study.seed_table` says how.

python scripts/seed_table.py RUN_DIR ... [--metric eval/reward] [--against OTHER_RUN_DIR ...]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tbexp.study.seed_table import main  # noqa: E402

if __name__ == "__main__":
    main()
