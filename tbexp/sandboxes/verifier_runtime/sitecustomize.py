"""tbexp's start-up for the Python processes a task's test.sh runs (never the agent's own).

tbexp binds this folder read-only into the sandbox and puts it first on PYTHONPATH for the verifier's exec only,
with PYTHONNOUSERSITE=1 (tbexp/episodes/integrity.py). Python imports the first `sitecustomize` on its path, so
this one runs instead of any the agent planted on it, and then:

1. puts the user's site-packages back on sys.path where Python would have put it, as a plain path: packages the
   agent installed there (`pip install --user`) still import, but its `.pth` lines and `usercustomize` never run;
2. refuses to import the test runner's own modules (pytest, _pytest, pluggy, iniconfig, py, pytest plugins) from a
   loose place the agent could write (the working directory, a script's folder, PYTHONPATH entries and the user
   site under the roots TBEXP_VERIFIER_UNTRUSTED names), and, in a pytest process, any standard-library module
   or module the image installed: Python then finds the real one further down the path. Each refusal is written
   to TBEXP_VERIFIER_RESULTS, where the episode's tamper record reads it;
3. in a pytest process started by test.sh (not one nested inside the tests), adds tbexp's results plugin
   (`tbexp_pytest_results`) to PYTEST_PLUGINS, so every pytest run test.sh makes reports its tests;
4. runs the image's own sitecustomize, the next one on the path that is not in a loose place.

Written for every Python 3 a task image may hold (3.6 and up): no newer syntax, nothing beyond the standard library.
"""

import importlib.machinery
import importlib.util
import json
import os
import sys

RESULTS = os.environ.get("TBEXP_VERIFIER_RESULTS", "")
UNTRUSTED = [os.path.realpath(p) for p in os.environ.get("TBEXP_VERIFIER_UNTRUSTED", "").split(":") if p]
TOOLS = ("pytest", "_pytest", "pluggy", "iniconfig", "py", "tbexp_pytest_results")
PLUGIN = "tbexp_pytest_results"
NESTED = "TBEXP_VERIFIER_IN_PYTEST"
HERE = os.path.dirname(os.path.abspath(__file__))


def _user_site():
    try:
        import site

        return site.getusersitepackages()
    except Exception:  # noqa: BLE001 - an interpreter without user sites
        return ""


USER_SITE = _user_site()


def _is_pytest_process():
    argv = list(getattr(sys, "orig_argv", []))
    if not argv:
        try:
            with open("/proc/self/cmdline", "rb") as f:
                argv = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
        except OSError:
            argv = []
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m" and i + 1 < len(argv):
            return argv[i + 1] in ("pytest", "py.test")
        if not arg.startswith("-"):
            return os.path.basename(arg) in ("pytest", "py.test", "pytest-3")
    return False


def _loose(entry):
    """A sys.path entry the agent could have filled: under an untrusted root and not a package folder (the user
    site counts as loose; a virtual environment's site-packages, e.g. one uv makes for the tests, does not)."""
    path = os.path.realpath(entry or os.getcwd())
    if path == HERE or not any(path == root or path.startswith(root + os.sep) for root in UNTRUSTED):
        return False
    if USER_SITE and path == os.path.realpath(USER_SITE):
        return True
    return os.path.basename(path) not in ("site-packages", "dist-packages")


def _record(kind, name, origin):
    if not RESULTS:
        return
    try:
        os.makedirs(RESULTS, exist_ok=True)
        line = json.dumps({"kind": kind, "module": name, "path": origin, "pid": os.getpid()}) + "\n"
        fd = os.open(os.path.join(RESULTS, "guard.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


class ShadowGuard:
    """A meta path finder: a protected top-level name is looked up on the path without its loose entries."""

    def __init__(self, protected):
        self.protected = protected

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if path is not None or top not in self.protected:
            return None  # submodules follow their package, which this finder already placed
        spec = importlib.machinery.PathFinder.find_spec(name, sys.path)
        if spec is None or not spec.origin or not _loose(os.path.dirname(_package_root(spec))):
            return None  # not found, or found in a trusted place: Python's own finders go on as usual
        _record("shadow-module", name, spec.origin)
        found = importlib.machinery.PathFinder.find_spec(name, [e for e in sys.path if not _loose(e)])
        if found is None:  # nothing trusted by that name: the loose one must not load in its place
            raise ModuleNotFoundError("No module named %r (tbexp refused %s)" % (name, spec.origin), name=name)
        return found


def _package_root(spec):
    origin = spec.origin
    return os.path.dirname(origin) if spec.submodule_search_locations is not None else origin


def _installed_names():
    """Top-level modules the standard library and the trusted path entries hold (what the tests rely on)."""
    names = set(getattr(sys, "stdlib_module_names", ())) | set(sys.builtin_module_names)
    for entry in sys.path:
        if _loose(entry) or not os.path.isdir(entry or "."):
            continue
        try:
            listing = os.listdir(entry)
        except OSError:
            continue
        for item in listing:
            stem = item.split(".")[0]
            if stem and (item.endswith((".py", ".so", ".pyc")) or os.path.isdir(os.path.join(entry, item))):
                names.add(stem)
    return names


def _restore_user_site():
    if not USER_SITE or not os.path.isdir(USER_SITE) or USER_SITE in sys.path:
        return
    at = next((i for i, e in enumerate(sys.path) if os.path.basename(e) in ("site-packages", "dist-packages")), None)
    sys.path.insert(len(sys.path) if at is None else at, USER_SITE)


def _register_plugin():
    if os.environ.get(NESTED):
        return  # a pytest the tests started (perhaps the agent's own suite): its tests are not the task's
    os.environ[NESTED] = "1"
    plugins = [p for p in os.environ.get("PYTEST_PLUGINS", "").split(",") if p]
    if PLUGIN not in plugins:
        os.environ["PYTEST_PLUGINS"] = ",".join(plugins + [PLUGIN])


def _chain_image_sitecustomize():
    for entry in sys.path:
        folder = os.path.realpath(entry or os.getcwd())
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder == HERE or _loose(entry) or not os.path.isfile(candidate):
            continue
        spec = importlib.util.spec_from_file_location("_image_sitecustomize", candidate)
        before = list(sys.path)
        sys.path[:] = [e for e in before if not _loose(e)]  # what it imports comes from trusted places only
        try:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except Exception as err:  # noqa: BLE001 - as Python itself reports a broken sitecustomize
            sys.stderr.write("Error in the image's sitecustomize (%s): %r\n" % (candidate, err))
        finally:
            sys.path[:] = before + [e for e in sys.path if e not in before]
        return


def _main():
    _restore_user_site()
    pytest_process = _is_pytest_process()
    protected = set(TOOLS)
    if pytest_process:
        protected |= _installed_names()
    protected.discard("__main__")
    sys.meta_path.insert(0, ShadowGuard(protected))
    if pytest_process:
        _register_plugin()
    _chain_image_sitecustomize()


_main()
