"""tbexp's pytest plugin: each pytest run test.sh makes reports its tests to TBEXP_VERIFIER_RESULTS.

tbexp's sitecustomize adds it to PYTEST_PLUGINS in the pytest processes test.sh starts, so the task's files are
never edited. One JSON file per run, `run-<pid>-<ns>.json`: written once when the session starts
(`finished: false`) and again when it ends, with every test's outcome (passed | failed | skipped, by node id; an
error in set-up or tear-down is a failure, an expected failure a skip, an unexpected pass a pass), the modules
that could not be collected, pytest's exit status, its ini file and the conftest files it loaded. A run whose
file still says `finished: false` ended before pytest did. tbexp.episodes.test_results reads the files.

Written for the pytest versions task images hold (6 and up) on Python 3.6 and up.
"""

import json
import os
import time

OUT = os.environ.get("TBEXP_VERIFIER_RESULTS", "")
_tests = {}
_collection_errors = []
_path = os.path.join(OUT, "run-%d-%d.json" % (os.getpid(), time.time_ns() if hasattr(time, "time_ns") else 0))
_config = None


def _write(finished, exitstatus=None):
    if not OUT:
        return
    conftests = []
    if _config is not None:
        for plugin in _config.pluginmanager.get_plugins():
            origin = getattr(plugin, "__file__", "") or ""
            if os.path.basename(origin) == "conftest.py":
                conftests.append(origin)
    record = {
        "finished": finished,
        "exitstatus": None if exitstatus is None else int(exitstatus),
        "cwd": os.getcwd(),
        "args": list(getattr(getattr(_config, "invocation_params", None), "args", ()) or ()),
        "inifile": str(getattr(_config, "inipath", "") or getattr(_config, "inifile", "") or ""),
        "rootdir": str(getattr(_config, "rootpath", "") or getattr(_config, "rootdir", "") or ""),
        "conftests": sorted(conftests),
        "tests": _tests,
        "collection_errors": _collection_errors,
    }
    try:
        os.makedirs(OUT, exist_ok=True)
        tmp = _path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, _path)
    except OSError:
        pass


def pytest_configure(config):
    global _config
    _config = config
    _write(False)


def pytest_collectreport(report):
    if report.failed:
        _collection_errors.append(report.nodeid or str(getattr(report, "fspath", "")))


def pytest_runtest_logreport(report):
    before = _tests.get(report.nodeid)
    if report.failed:
        outcome = "skipped" if hasattr(report, "wasxfail") else "failed"
    elif report.skipped:
        outcome = "skipped"
    elif report.when == "call":
        outcome = "passed"
    else:
        return  # a set-up or tear-down that passed says nothing about the test
    if before == "failed" or (before == "skipped" and outcome == "passed"):
        return  # a failure in any phase stands; a skipped set-up is not undone by a later phase
    _tests[report.nodeid] = outcome


def pytest_sessionfinish(session, exitstatus):
    _write(True, exitstatus)
