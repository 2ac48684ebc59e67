"""The conformance tasks' own test files run inside sandboxes, never in the project's pytest session."""

collect_ignore_glob = ["*/*"]
