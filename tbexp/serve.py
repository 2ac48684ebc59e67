"""The command `python -m tbexp.serve CHECKPOINT [overrides] [--port N]`: a checkpoint as an OpenAI-compatible
chat-completions endpoint (the code: tbexp/serving/)."""

import sys

from tbexp.serving.command import main

if __name__ == "__main__":
    sys.exit(main())
