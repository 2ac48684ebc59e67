"""Where tbexp's verifier start-up (verifier_runtime/: sitecustomize.py, the pytest plugin) is, on the host and in a
sandbox. Both sandboxes bind the folder read-only at RUNTIME_MOUNT for the verifier (bwrap: its execs only; Docker:
from the container's start, read-only, so the agent sees it but cannot change it)."""

from pathlib import Path

RUNTIME = Path(__file__).with_name("verifier_runtime")
RUNTIME_MOUNT = "/tmp/.tbexp-verifier"
