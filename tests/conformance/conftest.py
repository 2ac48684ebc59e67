"""The conformance tasks' own pytest files run inside their sandboxes, never in tbexp's test session."""

collect_ignore_glob = ["*/tests/*"]
