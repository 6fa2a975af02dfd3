"""The table of verified digests (``posenc_torch/hf/verified.json``) against the installed
transformers: every integer walk of every known model type has a digest the table holds
(a release that changes one fails here, naming the function and its digest), the table
records this release for each, and each row's function gives what posenc runs for it, by
the verify command's checks (``posenc_torch.hf.verify``):

* ``get_rope_index``: the walk of the row's convention, bit for bit, dtypes included, on
  prompts written to tell the conventions apart and prompts drawn from a fixed seed
  (``verify._prompts``);
* the 5.x ``vision_utils`` functions: posenc's function of the same name, on grids drawn
  from a fixed seed (int64 and int32, images and videos, several at once) under every
  argument value the models use and more (``verify._walks``);
* the 4.57 tower methods: the replacement the row names, on tiny towers of the class
  (``verify._towers``);
* the q/k-norm attentions of the fused types and their norm classes: the template and the
  norm form the rows name, on tiny attentions (``verify._attention``).

``make test`` runs this file under every transformers release it installs.  Also here:
the digest's own rules (what changes it and what does not).
"""

from __future__ import annotations

import linecache
import textwrap
import types

import pytest
import transformers

from posenc_torch.hf import _digests, _table, _tower_methods_457, verify
from posenc_torch.hf.verify._prompts import matching_conventions
from posenc_torch.hf.verify._towers import check_method
from posenc_torch.hf.verify._walks import check as check_vision_utils

pytestmark = pytest.mark.any_transformers
RELEASE = transformers.__version__
FUNCTIONS = [f for f in verify.functions() if isinstance(f, verify.Function)]
WALKS = [(f.model_type, f.name, f.func, f.owner) for f in FUNCTIONS
         if f.kind not in ("rotary", "norm", "attention")]
# the q/k-norm attentions and their norm classes of the types the release facts list as fused
FUSED = set(_table.releases()["fused"].get(RELEASE, ()))
QK_NORM = [f for f in FUNCTIONS if f.kind in ("norm", "attention") and f.model_type in FUSED]


def test_every_walk_has_a_verified_digest_that_lists_this_release():
    assert WALKS, "no integer walk found: the known model types are all absent"
    problems = []
    for mt, name, func, owner in WALKS:
        value = _digests.digest(func, owner)
        entry = _table.shipped().get((value, name))
        if entry is None:
            problems.append(f"{mt}.{name}: digest {value} is not in verified.json")
        elif RELEASE not in entry.releases:
            problems.append(f"{mt}.{name}: digest {value[:16]} does not list {RELEASE}")
    assert not problems, ("transformers " + RELEASE + " changed what posenc verified (run "
                          "`python -m posenc_torch.hf.verify`):\n" + "\n".join(problems))


@pytest.mark.parametrize("f", QK_NORM, ids=lambda f: f"{f.model_type}.{f.name}")
def test_q_k_norm_rows_verify(f):
    """The norm class and the attention forward of each fused type have a row listing this
    release, and the verify command's check on tiny attentions still gives the row's use."""
    value = _digests.digest(f.func, f.owner)
    entry = _table.shipped().get((value, f.name))
    assert entry is not None and RELEASE in entry.releases, (f, value)
    assert verify.decide(f, value) == (entry.use, "")


def _cases(walks: list, none: str) -> list:
    """The walks as parameters, or one case skipped with the reason ``none``."""
    if walks:
        return [pytest.param(*w, id=f"{w[0]}.{w[1]}") for w in walks]
    return [pytest.param(None, None, None, None, marks=pytest.mark.skip(
        reason=f"transformers {RELEASE} {none}"))]


ROPE_INDEX = [w for w in WALKS if w[1] == "get_rope_index"]


@pytest.mark.parametrize(("model_type", "name", "func", "owner"),
                         _cases(ROPE_INDEX, "has none of the Qwen-VL model types"))
def test_get_rope_index_rows_give_the_walk_of_their_convention(model_type, name, func, owner):
    entry, _ = _table.verified(func, owner, name)
    assert entry.use in matching_conventions(model_type, owner, func)


VISION_UTILS = list({name: (mt, name, f, o) for mt, name, f, o in WALKS
                     if o is None}.values())  # one module each: they are shared


@pytest.mark.parametrize(("model_type", "name", "func", "owner"), _cases(
    VISION_UTILS, "has no vision_utils functions (4.57 computes them in tower methods)"))
def test_vision_utils_rows_give_posenc_walk(model_type, name, func, owner):
    entry, _ = _table.verified(func, None, name)
    assert entry.use == name
    assert check_vision_utils(name, func) is None


METHODS = [w for w in WALKS if w[1] in _tower_methods_457.METHODS]


@pytest.mark.parametrize(("model_type", "name", "func", "owner"), _cases(
    METHODS, "has no tower methods of these names (5.x calls vision_utils functions)"))
def test_tower_method_rows_give_their_replacement(model_type, name, func, owner):
    entry, _ = _table.verified(func, owner, name)
    assert check_method(owner, name, _tower_methods_457.REPLACEMENTS[entry.use], func) is None


# ---------------------------------------------------------------------------------------
# The digest itself.


def _define(source: str, filename: str, namespace: dict) -> types.FunctionType:
    """A function made from ``source``, its text where ``inspect`` finds it."""
    source = textwrap.dedent(source)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec", dont_inherit=True), namespace)
    return next((v for v in namespace.values() if isinstance(v, types.FunctionType)
                 and v.__code__.co_filename == filename), None)


WALK = '''
def walk(grid, merge):
    """Docstring."""
    total: int = 0  # a comment
    for t, h, w in grid.tolist():
        total = total + t * (h // merge) * (w // merge)
    return helper(total)
'''


HELPERS = """
def helper_a(x):
    return x


def helper_b(x):
    return x + 1


class Tower:
    def run(self, grid):
        return self.step(grid)

    def step(self, grid):
        return grid
"""
_NS: dict = {}
_define(HELPERS, "<helpers>", _NS)


def test_the_digest_ignores_names_comments_and_annotations_only():
    namespace = {"helper": _NS["helper_a"]}
    base = _digests.digest(_define(WALK, "<walk a>", dict(namespace)))
    same = WALK.replace('"""Docstring."""', "").replace(": int", "").replace("total", "n") \
        .replace("# a comment", "").replace("grid, merge", "g, m").replace("merge)", "m)") \
        .replace("grid.tolist", "g.tolist")
    assert _digests.digest(_define(same, "<walk b>", dict(namespace))) == base
    for old, new in (("h // merge", "h // merge + 1"), ("helper(total)", "helper(total, 1)"),
                     ("grid.tolist()", "grid.flip(0).tolist()"), ("t *", "t **")):
        changed = _define(WALK.replace(old, new), f"<walk {old}>", dict(namespace))
        assert _digests.digest(changed) != base, (old, new)


def test_the_digest_holds_what_the_walk_calls(monkeypatch):
    """A helper it calls (a Python function: its own code) and a method it calls on self."""
    a = _digests.digest(_define(WALK, "<walk h1>", {"helper": _NS["helper_a"]}))
    b = _digests.digest(_define(WALK, "<walk h2>", {"helper": _NS["helper_b"]}))
    assert a != b
    tower = _NS["Tower"]
    before = _digests.digest(tower.run, tower)
    monkeypatch.setattr(tower, "step", _NS["helper_b"])
    assert _digests.digest(tower.run, tower) != before


def test_code_that_is_not_its_file_text_is_not_digested():
    """A function whose code is not what its file's lines compile to (the file changed
    after import, or the code was made elsewhere) cannot be verified."""
    func = _define(WALK, "<walk changed>", {"helper": abs})
    text = textwrap.dedent(WALK).replace("h // merge", "h // merge + 1")
    linecache.cache["<walk changed>"] = (len(text), None, text.splitlines(True),
                                         "<walk changed>")
    with pytest.raises(_digests.Unverified, match="not the code that runs"):
        _digests.digest(func)


def test_a_verified_function_changed_in_place_is_no_longer_verified(monkeypatch):
    """Its code object replaced by one with another constant: not what its file says."""
    mt, name, func, owner = (ROPE_INDEX or WALKS)[0]
    _table.verified(func, owner, name)
    consts = list(func.__code__.co_consts)
    at = next(i for i, c in enumerate(consts) if type(c) is int)
    consts[at] += 1
    monkeypatch.setattr(func, "__code__", func.__code__.replace(co_consts=tuple(consts)))
    with pytest.raises(_digests.Unverified, match="not the code that runs"):
        _table.verified(func, owner, name)
