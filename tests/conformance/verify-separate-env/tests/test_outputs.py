"""verify-separate-env: the tests run in the verifier's own environment, on the artifacts the agent's handed over.

The first test checks the environment (it passes without work); the others need the agent's artifacts.
"""
import os
from pathlib import Path


def test_runs_in_the_verifier_environment():
    assert os.environ.get("VERIFIER_SIDE") == "1"  # tests/Dockerfile's ENV, not the agent's image
    assert not Path("/app/words.txt").exists()  # the agent's environment and workspace do not cross
    assert not Path("/app/scratch.txt").exists()  # nor what the agent wrote that is not an artifact


def test_declared_artifact_handed_over():
    assert Path("/app/count.txt").read_text().strip() == Path("/tests/expected.txt").read_text().strip()


def test_convention_dir_handed_over():
    assert Path("/logs/artifacts/report.txt").read_text().strip() == "done"
