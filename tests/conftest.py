"""Shared test setup.

`make test` runs this suite twice: on the installed transformers 5.x, and with the
transformers 4.57.6 overlay (.venv/hf4) first on PYTHONPATH, selecting the tests marked
``transformers4`` (they compare against 4.x-only functions such as Qwen2-VL's
``apply_multimodal_rotary_pos_emb`` and the vision-start based ``get_rope_index``) and
those marked ``any_transformers`` (they hold under both, e.g. the transformers patch).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# torch.compile's on-disk caches (under the system temp dir by default) outlive a run and are
# keyed on the graph, not on the fake kernels of custom ops: a graph compiled against an
# older build of the extension would be replayed with its old output layouts.  Each run
# compiles into a fresh directory of its own.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="posenc-inductor-")
atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import posenc_torch  # noqa: E402

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "transformers4: compares against transformers 4.x (run with the 4.57.6 overlay)")
    config.addinivalue_line(
        "markers", "any_transformers: runs under both transformers 4.x and 5.x")
    expected = os.environ.get("POSENC_EXPECT_TRANSFORMERS")  # a major version, or a full one
    if expected is not None and (expected != transformers.__version__ if "." in expected
                                 else int(expected) != TRANSFORMERS_MAJOR):
        raise pytest.UsageError(
            f"expected transformers {expected}{'' if '.' in expected else '.x'} on the path, "
            f"found {transformers.__version__}")


_NEEDS_HF4: set[str] = set()


def pytest_collection_modifyitems(config, items):
    if TRANSFORMERS_MAJOR >= 5:
        skip = pytest.mark.skip(
            reason=f"needs transformers 4.x (installed: {transformers.__version__}); "
                   "`make test` runs it in its second pass with transformers 4.57.6")
        for item in items:
            if "transformers4" in item.keywords:
                item.add_marker(skip)
                _NEEDS_HF4.add(item.nodeid)


def pytest_terminal_summary(terminalreporter):
    """A plain `pytest` cannot run the 4.x parity tests: say so at the end, with the count
    and the command that runs them, rather than leaving them among the skips."""
    tr = terminalreporter
    skipped = [r for r in tr.stats.get("skipped", []) if r.nodeid in _NEEDS_HF4]
    if not skipped:
        return
    tr.section("transformers 4.x parity tests NOT RUN", sep="!", yellow=True, bold=True)
    tr.line(f"{len(skipped)} tests compare against transformers 4.57 functions and were "
            f"skipped under transformers {transformers.__version__}.", yellow=True, bold=True)
    tr.line("Run them with `make pytest-hf4` (part of `make test`), i.e. from tests/: "
            "PYTHONPATH=../.venv/hf4 POSENC_EXPECT_TRANSFORMERS=4 python -m pytest "
            "-m 'transformers4 or any_transformers' .", yellow=True)


# every variant up to the best this CPU has (each one's instructions are a superset of the
# one before)
_ORDER = ("baseline", "avx2", "avx512", "avx512bf16")
ISAS = list(_ORDER[:_ORDER.index(posenc_torch._C.best_isa()) + 1])


@pytest.fixture(params=ISAS)
def isa(request):
    """Run a test once per SIMD kernel variant this CPU supports."""
    posenc_torch.set_kernel_isa(request.param)
    yield request.param
    posenc_torch.set_kernel_isa(None)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
