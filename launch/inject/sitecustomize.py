"""ftkit's import hook (see launch/hook.py, ftkit.launch.hook): on the ranks' PYTHONPATH for one run of ``ftkit launch
-- CMD``.

Python imports the first ``sitecustomize`` on its path at start-up: this one runs the next one on the path first
(a site's own keeps working), then, in a rank of an ftkit run only, installs ftkit's services.
"""

import os
import sys


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_chain()
if os.environ.get("FTKIT_RUN_DIR"):
    try:
        from ftkit.launch.hook import install

        install()
    except Exception as e:  # noqa: BLE001 - a rank must not train unwatched: stop it, saying why
        import traceback

        traceback.print_exc()
        print(f"ftkit: error: the import hook could not start in this rank: {e}", file=sys.stderr, flush=True)
        os._exit(14)  # ExitCode.SCRIPT_FAILED
