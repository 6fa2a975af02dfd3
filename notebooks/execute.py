"""Run the notebooks with nbclient, in the interpreter that runs this script.

    python notebooks/execute.py                 # run all, write the outputs back in place
    python notebooks/execute.py --check         # run all, write nothing (exit 1 on error)
    python notebooks/execute.py 02_mrope_qwen_vl.ipynb

The kernel is always ``sys.executable -m ipykernel_launcher`` (whatever kernel specs are
installed elsewhere), and Jupyter / IPython / matplotlib state goes to a temporary
directory, never to the user's home.  ``tests/test_notebooks.py`` uses the same functions.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from traitlets import default

NOTEBOOK_DIR = Path(__file__).resolve().parent
KERNEL_NAME = "python3"


def notebook_paths() -> list[Path]:
    """The project's notebooks, in reading order."""
    return sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


class _ThisInterpreter(KernelSpecManager):
    """Every kernel name resolves to an IPython kernel of the running interpreter."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(
            argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            display_name="Python 3", language="python", name=KERNEL_NAME,
            resource_dir=str(NOTEBOOK_DIR))

    def find_kernel_specs(self) -> dict[str, str]:
        return {KERNEL_NAME: str(NOTEBOOK_DIR)}


class _KernelManager(AsyncKernelManager):
    """Kernel manager whose kernels run in this interpreter."""

    @default("kernel_spec_manager")
    def _this_interpreter(self) -> KernelSpecManager:
        return _ThisInterpreter()


_ENV_DIRS = ("JUPYTER_RUNTIME_DIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "IPYTHONDIR",
             "MPLCONFIGDIR")
_ENV_FLAGS = {"JUPYTER_PLATFORM_DIRS": "1", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
_active = False


@contextlib.contextmanager
def private_jupyter_dirs() -> Iterator[None]:
    """Point Jupyter's runtime/config/data dirs, IPython's profile dir and matplotlib's
    config/cache dir at one temporary directory while the context is open (kernels inherit
    the environment), and build matplotlib's font cache there once, so that no notebook
    shows the "building the font cache" message.  Nested use reuses the outer directory."""
    global _active
    if _active:
        yield
        return
    saved = {n: os.environ.get(n) for n in (*_ENV_DIRS, *_ENV_FLAGS)}
    with tempfile.TemporaryDirectory(prefix="posenc-nb-") as tmp:
        for n in _ENV_DIRS:
            os.environ[n] = os.path.join(tmp, n.lower())
        os.environ.update(_ENV_FLAGS)
        _active = True
        try:
            subprocess.run([sys.executable, "-c", "import matplotlib.font_manager"],
                           check=True, capture_output=True)
            yield
        finally:
            _active = False
            for n, v in saved.items():
                if v is None:
                    os.environ.pop(n, None)
                else:
                    os.environ[n] = v


def execute(path: Path, timeout: int = 120) -> nbformat.NotebookNode:
    """Run every cell of the notebook at ``path`` (working directory: the notebook's folder)
    and return the executed notebook.  Raises nbclient's CellExecutionError on the first
    cell that fails, or CellTimeoutError when one runs longer than ``timeout`` seconds."""
    nb = nbformat.read(path, as_version=4)
    with private_jupyter_dirs():
        client = NotebookClient(nb, timeout=timeout, kernel_name=KERNEL_NAME,
                                kernel_manager_class=_KernelManager,
                                resources={"metadata": {"path": str(path.parent)}})
        client.execute()
    return nb


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="notebook files (default: all)")
    parser.add_argument("--check", action="store_true", help="run only, do not write")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per cell")
    args = parser.parse_args()
    paths = [Path(p) if Path(p).exists() else NOTEBOOK_DIR / p for p in args.notebooks]
    with private_jupyter_dirs():
        for path in paths or notebook_paths():
            nb = execute(path.resolve(), timeout=args.timeout)
            if not args.check:
                nbformat.write(nb, path)
            print(f"{path.name}: ok{'' if args.check else ', outputs written'}"
                  f" ({path.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
