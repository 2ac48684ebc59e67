"""Run a built-in task's `test_outputs.py` as pytest would, without pytest's start-up.

Copied byte for byte into every built-in task as `tests/run_tests.py`; its `test.sh` runs

    python3 /tests/run_tests.py --junitxml=/logs/verifier/junit.xml /tests/test_outputs.py

in the task's sandbox, on the sandbox's own Python (3.11 in the root file system), so it uses the
standard library alone. Why not pytest: in the root file system a pytest run of a task's checks took
0.28 CPU-s on a 2-core machine (0.15 of it `import pytest`), this file's run 0.07, every episode; there the
verifier's CPU was the largest share of a GRPO step (docs/tasks.md, "How an instance is verified").

It runs what the built-in checks are: module-level `test*` functions without arguments, plain `assert`s.
It writes the JUnit XML that `pytest --junitxml` writes for them (suite `pytest`, classname the module's
name, `<failure>` for a failed test; a module that fails to import is one `<error>` case named after it)
and exits as pytest does: 0 all passed, 1 a test failed, 2 the module did not import, 5 no test. A test
file that needs more of pytest (a test class, a fixture argument) is refused with exit 4 and no report,
so the verifier reports that it ran no test rather than a made-up score. `tests/test_builtin_tasks.py`
runs every family's checks through both pytest and this file and compares the outcomes.

One difference on purpose: `python3 -m pytest` run from /app puts /app first on `sys.path`, so a file the
agent leaves there named like a module the tests import (`csv.py`) would be imported by the tests; here
`sys.path` starts with /tests.
"""

import sys
import time
import traceback
import types
from xml.sax.saxutils import escape, quoteattr

USAGE = "usage: run_tests.py --junitxml=PATH TEST_FILE"


def main(argv):
    if len(argv) != 2 or not argv[0].startswith("--junitxml="):
        print(USAGE)
        return 4
    junit_path, test_path = argv[0].split("=", 1)[1], argv[1]
    module = test_path.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    started = time.perf_counter()
    # A real module in sys.modules, as pytest imports it (dataclasses and pickling look a class's module up there).
    sys.modules[module] = types.ModuleType(module)
    namespace = vars(sys.modules[module])
    namespace["__file__"] = test_path
    try:
        with open(test_path, encoding="utf-8") as f:
            exec(compile(f.read(), test_path, "exec"), namespace)
    except Exception:
        detail = traceback.format_exc()
        print(detail)
        print("1 error during collection")
        _write_junit(junit_path, [("", module, "error", "collection failure", detail, 0.0)], started)
        return 2
    tests = [(name, obj) for name, obj in namespace.items() if name.startswith("test") and callable(obj)]
    tests = [(name, obj) for name, obj in tests if not isinstance(obj, type)]  # pytest collects classes as Test*
    unsupported = [name for name, obj in namespace.items() if name.startswith("Test") and isinstance(obj, type)]
    unsupported += [name for name, obj in tests if not _plain_function(obj)]
    if unsupported:
        print(f"{test_path}: needs pytest itself (a test class or a test with arguments): {', '.join(unsupported)}")
        return 4
    cases = []
    for name, test in tests:
        clock = time.perf_counter()
        try:
            test()
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # pytest fails a test on SystemExit too
            detail = traceback.format_exc()
            print(f"FAILED {module}.py::{name}\n{detail}")
            message = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            cases.append((module, name, "failure", message, detail, time.perf_counter() - clock))
        else:
            cases.append((module, name, "", "", "", time.perf_counter() - clock))
    failed = sum(1 for case in cases if case[2])
    print(f"{failed} failed, {len(cases) - failed} passed in {time.perf_counter() - started:.2f}s")
    _write_junit(junit_path, cases, started)
    if not cases:
        return 5
    return 1 if failed else 0


def _plain_function(obj):
    code = getattr(obj, "__code__", None)
    return code is not None and code.co_argcount == 0 and code.co_kwonlyargcount == 0


def _write_junit(path, cases, started):
    failures = sum(1 for case in cases if case[2] == "failure")
    errors = sum(1 for case in cases if case[2] == "error")
    parts = [
        '<?xml version="1.0" encoding="utf-8"?><testsuites>',
        f'<testsuite name="pytest" errors="{errors}" failures="{failures}" skipped="0" tests="{len(cases)}" '
        f'time="{time.perf_counter() - started:.3f}">',
    ]
    for classname, name, kind, message, detail, seconds in cases:
        case = f"<testcase classname={quoteattr(classname)} name={quoteattr(name)} time={quoteattr(f'{seconds:.3f}')}"
        if kind:
            parts.append(f"{case}><{kind} message={quoteattr(message)}>{escape(detail)}</{kind}></testcase>")
        else:
            parts.append(f"{case} />")
    parts.append("</testsuite></testsuites>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(parts))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
