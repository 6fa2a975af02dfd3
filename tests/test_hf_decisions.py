"""Which functions ``posenc_torch.hf.patch`` replaces: one whose digest (its normalized
code and everything it reaches, ``_digests``) has a row in the verified table
(``_table``), never by sampled inputs and never by tracing at run time; and the verify
command's verdicts that make the rows (``posenc_torch.hf.verify``: a rotary function when
its captured graph is the graph of one of posenc's references).

The functions judged here are transformers' own, imported, copies of them edited as an
upstream release might edit them, and the adversary's: functions that compute
transformers' result except where no sample would look (a wrapper, a hidden branch, a
dtype read through a view's size, state the function writes, its own builtins, a large
value, a long video).  At run time every one of them is refused with one warning that
names the verify command; the verify command refuses each, saying why, and accepts the
edits that keep the meaning, whose rows (a table file the user names) patch them with
bit-identical results.  What was decided is what runs: a global, a cell, a default or a
method reached through ``self`` that changes while patched sends the call back to
transformers.  ``make test`` runs this file under every transformers release it installs;
the patched set is written out per release (``verified.json``'s release facts).
"""

from __future__ import annotations

import builtins
import functools
import importlib
import importlib.util
import inspect
import json
import linecache
import operator
import os
import subprocess
import sys
import textwrap
import threading
import types
import warnings
from pathlib import Path

import pytest
import torch
import transformers

import posenc_torch
import posenc_torch.hf as hf
from posenc_torch.hf import _digests, _handle, _rotary, _table, verify
from posenc_torch.hf.verify import _forms

pytestmark = pytest.mark.any_transformers
RELEASE = transformers.__version__
V5 = int(RELEASE.split(".")[0]) >= 5
COMMAND = "python -m posenc_torch.hf.verify"

# ---------------------------------------------------------------------------------------
# The patched set, per release make test runs (written out in the release facts, not
# computed).

EXPECTED_SUPPORTED = {r: set(v) for r, v in _table.releases()["patched"].items()}
_ALL_5X = EXPECTED_SUPPORTED["5.17.0"]
# 4.57.6: no paddleocr_vl, qwen3_5, qwen3_5_moe modules; GLM-4V and GLM-4V-MoE attention
# calls the 4.x multimodal function with their own section merge.
_LEFT_TO_TRANSFORMERS_4 = {"paddleocr_vl", "qwen3_5", "qwen3_5_moe", "glm4v", "glm4v_moe"}
ABSENT = {"4.57.6": {"paddleocr_vl", "qwen3_5", "qwen3_5_moe"}}


def test_the_written_set_is_patched():
    """A supported type that this release makes the patch refuse fails here, with the
    function and the reason (its graph, or its digest)."""
    assert len(_ALL_5X) == 43 and len(EXPECTED_SUPPORTED["4.57.6"]) == 38
    assert EXPECTED_SUPPORTED["4.57.6"] == _ALL_5X - _LEFT_TO_TRANSFORMERS_4
    assert all(v == _ALL_5X for r, v in EXPECTED_SUPPORTED.items() if r.startswith("5."))
    assert RELEASE in EXPECTED_SUPPORTED, f"no supported set is written for {RELEASE}"
    expected, reasons = EXPECTED_SUPPORTED[RELEASE], hf.unsupported_model_types()
    lost = {mt: reasons[mt] for mt in expected if mt in reasons}
    assert not lost, "\n".join(f"{mt}: {why}" for mt, why in lost.items())
    assert set(hf.SUPPORTED_MODEL_TYPES) == expected


def test_patch_all_warns_once_for_each_type_it_leaves():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = hf.patch()
    handle.undo()
    assert set(handle.model_types) == EXPECTED_SUPPORTED[RELEASE]
    left = [str(w.message) for w in record if w.category is hf.UnsupportedModelWarning
            and " leaves " in str(w.message) and "." not in str(w.message).split(" leaves ")[1]
            .split(" ", 1)[0]]
    named = sorted(m.split("leaves ", 1)[1].split(" ", 1)[0] for m in left)
    absent = {mt for mt in hf.KNOWN_MODEL_TYPES
              if importlib.util.find_spec(f"transformers.models.{mt}") is None}
    assert absent == ABSENT.get(RELEASE, set())
    assert named == sorted(set(hf.KNOWN_MODEL_TYPES) - EXPECTED_SUPPORTED[RELEASE] - absent)
    # nothing else left behind: every walk of a patched type is verified
    assert [str(w.message) for w in record if w.category is hf.UnsupportedModelWarning
            and str(w.message) not in left] == []


# ---------------------------------------------------------------------------------------
# Helpers: transformers' modules, functions made from source text, table files.


def modeling(model_type: str) -> types.ModuleType:
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def define(source: str, filename: str, namespace: dict) -> dict:
    """Run ``source`` in ``namespace`` (its text kept where ``inspect`` finds it)."""
    source = textwrap.dedent(source)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec", dont_inherit=True), namespace)
    return namespace


def edited(monkeypatch, model_type: str, edits: dict[str, list[tuple[str, str]]]) -> dict:
    """Install in the model's module copies of its functions ``edits`` names, each with its
    (old, new) text replacements applied to transformers' own source (each must apply);
    returns the new functions by name."""
    module = modeling(model_type)
    namespace = dict(vars(module))
    for name, replacements in edits.items():
        source = textwrap.dedent(inspect.getsource(getattr(module, name)))
        source = "\n".join(line for line in source.splitlines() if not line.startswith("@"))
        for old, new in replacements:
            assert old in source, f"transformers' {model_type} {name} no longer has {old!r}"
            source = source.replace(old, new)
        define(source, f"<edited {model_type}.{name}>", namespace)
    for name in edits:
        monkeypatch.setattr(module, name, namespace[name])
    return {name: namespace[name] for name in edits}


def refused(model_type: str, match: str = COMMAND, table: object = None) -> str:
    """patch(model_type) refuses it: the warning of patch([it, other]) and the error of
    patch(it) alone say ``match`` (by default: the verify command); returns the warning."""
    other = "qwen2" if model_type != "qwen2" else "llama"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = hf.patch([model_type, other], table=table)
    handle.undo()
    assert handle.model_types == (other,)
    messages = [str(w.message) for w in record if w.category is hf.UnsupportedModelWarning]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"posenc_torch.hf.patch leaves {model_type} to transformers")
    assert match in messages[0], messages[0]
    with pytest.raises(RuntimeError, match=match.replace("(", r"\(").replace(")", r"\)")):
        hf.patch(model_type, table=table)
    return messages[0]


def verdict(func, name: str = "apply_rotary_pos_emb") -> tuple[str | None, str]:
    """The verify command's verdict on the rotary function ``func``: (form, "") or (None,
    why)."""
    found = _forms.which_form(func, _rotary._FORMS[name], name)
    return found["form"], found.get("reason", "")


def verify_refuses(func, reason: str, name: str = "apply_rotary_pos_emb") -> None:
    """The verify command makes no row for ``func``, saying ``reason``."""
    form, why = verdict(func, name)
    assert form is None, f"the verify command took it as {form!r}"
    assert reason in why, why


def table_file(path: Path, *functions: tuple[object, str]) -> Path:
    """A table file as ``verify --write`` writes it, with the verify command's rows for
    the rotary ``functions`` ((function, name) pairs), each of which it must accept."""
    rows = []
    for func, name in functions:
        form, why = verdict(func, name)
        assert form is not None, why
        rows.append({"digest": _digests.digest(func), "function": name, "use": form,
                     "releases": [RELEASE]})
    verify.write(path, rows)
    return path


def refused_everywhere(monkeypatch, model_type: str, func, reason: str,
                       name: str = "apply_rotary_pos_emb") -> None:
    """``func`` in place of the model's ``name``: refused by patch() (the verify command
    named) and by the verify command (``reason``)."""
    monkeypatch.setattr(modeling(model_type), name, func)
    refused(model_type)
    verify_refuses(func, reason, name)


def _qkcs(batch=2, heads=4, kv_heads=2, seq=5, dim=16, width=None, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, seq, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(batch, seq, kv_heads, dim, generator=gen).to(dtype).transpose(1, 2)
    cos = torch.randn(batch, seq, width or dim, generator=gen)
    sin = torch.randn(batch, seq, width or dim, generator=gen)
    return q, k, cos, sin


# ---------------------------------------------------------------------------------------
# Edits that keep the meaning: not in the shipped table (refused, naming the command);
# the verify command's rows for them, in a table file the user names, patch them with
# bit-identical results.

REWRITE = '''
def rotate_half(x):
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat([-second, first], dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(dim=unsqueeze_dim), sin.unsqueeze(dim=unsqueeze_dim)
    return cos * q + sin * rotate_half(q), cos * k + sin * rotate_half(k)
'''


def test_a_rewrite_that_keeps_the_meaning_is_patched_with_identical_logits(monkeypatch,
                                                                            tmp_path):
    """A temporary for the half width, tuple unpacking, a list for torch.cat, dim= by
    keyword, cos * q for q * cos: the same graph, so the verify command writes its row;
    with that table file, a tiny Llama's logits and gradients are bit-identical to
    transformers'."""
    from test_hf_models import tiny_model

    module = modeling("llama")
    namespace = define(REWRITE, "<rewritten llama>", {"torch": torch})
    monkeypatch.setattr(module, "rotate_half", namespace["rotate_half"])
    monkeypatch.setattr(module, "apply_rotary_pos_emb", namespace["apply_rotary_pos_emb"])
    refused("llama")
    table = table_file(tmp_path / "table.json",
                       (namespace["apply_rotary_pos_emb"], "apply_rotary_pos_emb"))
    model = tiny_model("llama", torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator()
                        .manual_seed(0))

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(ids).logits
        logits.square().sum().backward()
        return logits, [p.grad for p in model.parameters()]

    expected, expected_grads = run()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.UnsupportedModelWarning)
        handle = hf.patch("llama", table=table)
    with handle:
        got, grads = run()
        assert handle.calls["llama.apply_rotary_pos_emb"] == model.config.num_hidden_layers
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))


EDITS_KEEPING_THE_MEANING = {
    "renamed local": {"apply_rotary_pos_emb": [("q_embed", "q_out")]},
    "one-line return": {"apply_rotary_pos_emb": [
        ("    q_embed = (q * cos) + (rotate_half(q) * sin)\n"
         "    k_embed = (k * cos) + (rotate_half(k) * sin)\n"
         "    return q_embed, k_embed",
         "    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)")]},
    "chunk for the halves": {"rotate_half": [
        ("    x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]",
         "    x1 = x[..., : x.size(-1) // 2]\n    x2 = x[..., x.size(-1) // 2 :]")]},
}


@pytest.mark.parametrize("edit", EDITS_KEEPING_THE_MEANING)
def test_edits_that_keep_the_meaning_are_patched(edit, monkeypatch, tmp_path):
    """A renamed local has the shipped digest (names are normalized); the other edits are
    patched with the verify command's table file."""
    edited(monkeypatch, "llama", EDITS_KEEPING_THE_MEANING[edit])
    module = modeling("llama")
    table = None
    if edit != "renamed local":
        refused("llama")
        table = table_file(tmp_path / "t.json", (module.apply_rotary_pos_emb,
                                                  "apply_rotary_pos_emb"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.UnsupportedModelWarning)
        handle = hf.patch("llama", table=table)
    with handle:
        args = _qkcs()
        out = module.apply_rotary_pos_emb(*args)
        assert handle.calls == {"llama.apply_rotary_pos_emb": 1}
    for o, r in zip(out, module.apply_rotary_pos_emb(*args), strict=True):
        assert torch.equal(o, r)


EDITS_CHANGING_THE_MEANING = {
    # model type, edits, what the verify command's reason says
    "a sign": ("llama", {"apply_rotary_pos_emb": [
        ("(q * cos) + (rotate_half(q) * sin)", "(q * cos) - (rotate_half(q) * sin)")]},
        "it also runs aten.sub.Tensor x1"),
    "the wrong half": ("llama", {"rotate_half": [
        ("torch.cat((-x2, x1), dim=-1)", "torch.cat((-x1, x2), dim=-1)")]},
        "the same ops, combined otherwise"),
    "a fixed unsqueeze": ("llama", {"apply_rotary_pos_emb": [
        ("cos.unsqueeze(unsqueeze_dim)", "cos.unsqueeze(2)")]}, "cannot capture"),
    "a detached term": ("llama", {"apply_rotary_pos_emb": [
        ("(rotate_half(q) * sin)", "(rotate_half(q) * sin).detach()")]}, "reads .detach"),
    "a missing cast (Cohere)": ("cohere", {"apply_rotary_pos_emb": [
        ("return q_embed.to(dtype=dtype), k_embed.to(dtype=dtype)", "return q_embed, k_embed")]},
        "none of posenc's"),
    "a missing cast (ERNIE-4.5)": ("ernie4_5", {"apply_rotary_pos_emb": [
        ("return q_embed.to(original_dtype), k_embed.to(original_dtype)",
         "return q_embed, k_embed")]}, "none of posenc's"),
    "the vision tower's sign": ("qwen2_vl", {"apply_rotary_pos_emb_vision": [
        ("(q * cos) + (rotate_half(q) * sin)", "(q * cos) - (rotate_half(q) * sin)")]},
        "aten.sub.Tensor"),
}


@pytest.mark.parametrize("edit", EDITS_CHANGING_THE_MEANING)
def test_edits_that_change_the_meaning_are_refused(edit, monkeypatch):
    model_type, edits, reason = EDITS_CHANGING_THE_MEANING[edit]
    functions = edited(monkeypatch, model_type, edits)
    refused(model_type)
    module = modeling(model_type)
    name = ("apply_rotary_pos_emb_vision" if "apply_rotary_pos_emb_vision" in edits
            else "apply_rotary_pos_emb")
    verify_refuses(getattr(module, name), reason, name)
    for name, function in functions.items():
        assert getattr(module, name) is function  # left as it was


# ---------------------------------------------------------------------------------------
# The adversary: each function computes Llama's rotation except where no sample looks.

REAL_LLAMA = modeling("llama").apply_rotary_pos_emb


def _wrapper(condition, wraps: bool):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        q_embed, k_embed = REAL_LLAMA(q, k, cos, sin, unsqueeze_dim)
        if condition(q, k, cos):
            q_embed = q_embed * 2
        return q_embed, k_embed

    return functools.wraps(REAL_LLAMA)(apply_rotary_pos_emb) if wraps else apply_rotary_pos_emb


WRAPPED_CONDITIONS = {
    # what makes it differ, and what the verify command's refusal names
    "head_dim 96": (lambda q, k, cos: q.shape[-1] in (96, 192, 512), "holds only where"),
    "more than 2048 tokens": (lambda q, k, cos: q.shape[2] > 2048, "holds only where"),
    "batch of 3 or more": (lambda q, k, cos: q.shape[0] >= 3, "holds only where"),
    "decode": (lambda q, k, cos: q.shape[2] == 1, "holds only where"),
    "equal head counts": (lambda q, k, cos: q.shape[1] == k.shape[1], "holds only where"),
    "tables shared over the batch": (lambda q, k, cos: cos.shape[0] == 1, "aten.mul.Tensor"),
    "tables per row": (lambda q, k, cos: cos.shape[0] == q.shape[0], "aten.mul.Tensor"),
    "a non-leaf q": (lambda q, k, cos: q.grad_fn is not None, "reads .grad_fn"),
    "large values": (lambda q, k, cos: q.abs().max() > 300, "reads .abs"),
    "fp16": (lambda q, k, cos: q.dtype == torch.float16, "none of posenc's"),
    "a dtype read through a view's size": (
        lambda q, k, cos: q.view(torch.float16).shape[-1] == q.shape[-1], "none of posenc's"),
    "no-grad": (lambda q, k, cos: not torch.is_grad_enabled(), "reads .is_grad_enabled"),
    "numel": (lambda q, k, cos: q.nelement() > 10**6, "reads .nelement"),
    "a fused-qkv slice": (lambda q, k, cos: k.storage_offset() > 0, "reads .storage_offset"),
    "a shape getter": (lambda q, k, cos: operator.attrgetter("shape")(q)[0] > 2,
                       "the global operator"),
}


@pytest.mark.parametrize("wraps", [True, False], ids=["functools.wraps", "plain wrapper"])
@pytest.mark.parametrize("condition", WRAPPED_CONDITIONS)
def test_a_wrapper_that_differs_where_no_sample_looks_is_refused(condition, wraps, monkeypatch):
    test, reason = WRAPPED_CONDITIONS[condition]
    refused_everywhere(monkeypatch, "llama", _wrapper(test, wraps), reason)


HIDDEN = {
    "a clamp at 300": ('''
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            return real(torch.clamp(q, -300, 300), k, cos, sin, unsqueeze_dim)
    ''', "reads .clamp"),
    "nan_to_num": ('''
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            return real(torch.nan_to_num(q), k, cos, sin, unsqueeze_dim)
    ''', "reads .nan_to_num"),
    "a branch in a helper class": ('''
        class Policy:
            @staticmethod
            def scale(q):
                return 2 if q.shape[-1] == 96 else 1

        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            q_embed, k_embed = real(q, k, cos, sin, unsqueeze_dim)
            return q_embed * Policy.scale(q), k_embed
    ''', "the global Policy"),
    "a branch in another module's helper": ('''
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            q_embed, k_embed = real(q, k, cos, sin, unsqueeze_dim)
            return helper(q_embed), k_embed
    ''', "holds only where"),
    "globals() lookup": ('''
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            return globals()["real"](q, k, cos, sin, unsqueeze_dim)
    ''', "builtin globals"),
    "a class attribute": ('''
        class Settings:
            factor = 1.0

        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            q_embed, k_embed = real(q, k, cos, sin, unsqueeze_dim)
            return q_embed * Settings.factor, k_embed
    ''', "the global Settings"),
    "a global tensor": ('''
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            q_embed, k_embed = real(q, k, cos, sin, unsqueeze_dim)
            return q_embed * SCALE, k_embed
    ''', "the global SCALE"),
    "a caught error": ('''
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            try:
                return real(q, k, cos, sin, unsqueeze_dim)
            except RuntimeError:
                return q, k
    ''', "catches exceptions"),
    "a formatted tensor": ('''
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            q_embed, k_embed = real(q, k, cos, sin, unsqueeze_dim)
            return q_embed * len(f"{q}"), k_embed
    ''', "FORMAT"),
    "a nonlocal counter": ('''
        def make():
            calls = 0

            def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
                nonlocal calls
                calls += 1
                q_embed, k_embed = real(q, k, cos, sin, unsqueeze_dim)
                return (q_embed * 2 if calls > 60 else q_embed), k_embed

            return apply_rotary_pos_emb

        apply_rotary_pos_emb = make()
    ''', "(nonlocal)"),
    "an argument written": ('''
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, seen=[0]):
            seen[0] = seen[0] + 1
            q_embed, k_embed = real(q, k, cos, sin, unsqueeze_dim)
            return (q_embed * 2 if seen[0] > 60 else q_embed), k_embed
    ''', "STORE_SUBSCR"),
}


def _other_module_helper(x):
    return x * 2 if x.shape[1] > 64 else x


@pytest.mark.parametrize("case", HIDDEN)
def test_a_function_that_hides_a_branch_or_state_is_refused(case, monkeypatch):
    source, reason = HIDDEN[case]
    namespace = define(source, f"<hidden {case}>", {
        "torch": torch, "real": REAL_LLAMA, "SCALE": torch.ones(()),
        "helper": _other_module_helper})
    refused_everywhere(monkeypatch, "llama", namespace["apply_rotary_pos_emb"], reason)


def test_a_function_with_builtins_of_its_own_is_refused(monkeypatch):
    """Transformers' own code run with builtins of its own (a ``len`` that reads grad
    mode): no digest at run time; the verify command refuses the builtin."""
    real_len = len

    def fake_len(x):
        return real_len(x) + (0 if torch.is_grad_enabled() else 1)

    own = {**vars(builtins), "len": fake_len}
    namespace = define('''
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            q_embed, k_embed = real(q, k, cos, sin, unsqueeze_dim)
            return q_embed * (len(q.shape) - 3), k_embed
    ''', "<own builtins>", {"torch": torch, "real": REAL_LLAMA, "__builtins__": own})
    func = namespace["apply_rotary_pos_emb"]
    assert func.__builtins__ is own
    with pytest.raises(_digests.Unverified, match="builtins that are not Python's own"):
        _digests.digest(func)
    refused_everywhere(monkeypatch, "llama", func, "reads the builtin len")
    # a verified walk (it reads builtins) rebuilt around builtins of its own
    walk = next((f for f in verify.functions() if isinstance(f, verify.Function)
                 and f.kind == "get_rope_index"), None)
    if walk is not None:
        rebuilt = types.FunctionType(walk.func.__code__, {**walk.func.__globals__,
                                                          "__builtins__": own},
                                     walk.func.__name__, walk.func.__defaults__,
                                     walk.func.__closure__)
        rebuilt.__qualname__ = walk.func.__qualname__
        with pytest.raises(_digests.Unverified, match="builtins that are not Python's own"):
            _table.verified(rebuilt, walk.owner, walk.name)
        monkeypatch.setattr(builtins, "len", fake_len)
        with pytest.raises(_digests.Unverified, match="builtins that are not Python's own"):
            _digests.digest(walk.func, walk.owner)
        monkeypatch.undo()
        _table.verified(walk.func, walk.owner, walk.name)


@pytest.mark.transformers4
@pytest.mark.parametrize("condition", ["real sections", "fp16", "a long sequence",
                                       "a written section list"])
def test_a_multimodal_rotation_that_differs_where_no_sample_looks_is_refused(condition,
                                                                            monkeypatch):
    module = modeling("qwen2_vl")
    real = module.apply_multimodal_rotary_pos_emb
    test = {"real sections": lambda q, s: s[0] == 16,
            "fp16": lambda q, s: q.dtype == torch.float16,
            "a long sequence": lambda q, s: q.shape[2] > 4096,
            "a written section list": lambda q, s: s.append(0) or len(s) > 60}[condition]

    def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
        q_embed, k_embed = real(q, k, cos, sin, mrope_section, unsqueeze_dim)
        return (q_embed + 1 if test(q, mrope_section) else q_embed), k_embed

    monkeypatch.setattr(module, "apply_multimodal_rotary_pos_emb", apply_multimodal_rotary_pos_emb)
    with pytest.raises(RuntimeError, match=COMMAND):
        hf.patch("qwen2_vl")
    form, _ = verdict(apply_multimodal_rotary_pos_emb, "apply_multimodal_rotary_pos_emb")
    assert form is None


def test_a_vision_rotation_that_differs_for_fp16_is_refused(monkeypatch):
    module = modeling("qwen2_vl")
    real = module.apply_rotary_pos_emb_vision

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        q_embed, k_embed = real(q, k, cos, sin)
        return (q_embed * 2 if q.dtype == torch.float16 else q_embed), k_embed

    monkeypatch.setattr(module, "apply_rotary_pos_emb_vision", apply_rotary_pos_emb_vision)
    message = refused("qwen2_vl")
    assert "apply_rotary_pos_emb_vision" in message
    verify_refuses(apply_rotary_pos_emb_vision, "none of posenc's", "apply_rotary_pos_emb_vision")


# ---------------------------------------------------------------------------------------
# What runs is what was decided: state changed while patched hands the call back.

FLAGGED = '''
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def make(turn):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, rotate=True):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        if ROTATE and rotate:
            return turn(q, cos, sin), turn(k, cos, sin)
        return q, k

    return apply_rotary_pos_emb


def make_other(turn):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, rotate=True):
        return turn(q, cos.unsqueeze(unsqueeze_dim), 0 * sin.unsqueeze(unsqueeze_dim)), k

    return apply_rotary_pos_emb


def turn(x, cos, sin):
    return (x * cos) + (rotate_half(x) * sin)


apply_rotary_pos_emb = make(turn)
'''


def _flagged(monkeypatch, tmp_path):
    namespace = define(FLAGGED, "<flagged llama>", {"torch": torch, "ROTATE": True})
    module = modeling("llama")
    monkeypatch.setattr(module, "apply_rotary_pos_emb", namespace["apply_rotary_pos_emb"])
    table = table_file(tmp_path / "flagged.json",
                       (namespace["apply_rotary_pos_emb"], "apply_rotary_pos_emb"))
    return namespace, module, table


@pytest.mark.parametrize("change", ["a global flag", "a helper rebound", "a closure cell",
                                    "a default", "the code"])
def test_state_changed_while_patched_hands_the_call_back(change, monkeypatch, tmp_path):
    """Decided with ROTATE true and the helpers it had: after any of them changes, every
    call goes to the function as it is now (counted as a fallback), never to posenc's
    rotation; changed back, posenc computes again."""
    namespace, module, table = _flagged(monkeypatch, tmp_path)
    func = namespace["apply_rotary_pos_emb"]
    args = _qkcs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.UnsupportedModelWarning)
        handle = hf.patch("llama", table=table)
    with handle:
        patched = module.apply_rotary_pos_emb
        rotated = patched(*args)
        assert handle.calls == {"llama.apply_rotary_pos_emb": 1}
        cell = func.__closure__[0]
        saved = (namespace["ROTATE"], namespace["rotate_half"], cell.cell_contents,
                 func.__defaults__, func.__code__)
        if change == "a global flag":
            namespace["ROTATE"] = False
        elif change == "a helper rebound":
            namespace["rotate_half"] = lambda x: torch.zeros_like(x)
        elif change == "a closure cell":
            cell.cell_contents = lambda x, cos, sin: x * cos
        elif change == "a default":
            func.__defaults__ = (1, False)
        else:
            func.__code__ = namespace["make_other"](turn=None).__code__
        theirs = func(*args)
        got = patched(*args)
        assert handle.fallbacks == {"llama.apply_rotary_pos_emb": 1}
        for a, b in zip(got, theirs, strict=True):
            assert torch.equal(a, b)
        assert not all(torch.equal(a, b) for a, b in zip(got, rotated, strict=True))
        (namespace["ROTATE"], namespace["rotate_half"], cell.cell_contents,
         func.__defaults__, func.__code__) = saved
        patched(*args)
        assert handle.calls == {"llama.apply_rotary_pos_emb": 2}


def test_the_state_check_traces_under_compile(monkeypatch, tmp_path):
    """The per-call check is dictionary and identity reads: torch.compile(fullgraph=True)
    traces it, and a change after compiling is seen (a guard), not baked in."""
    namespace, module, table = _flagged(monkeypatch, tmp_path)
    args = _qkcs()
    with hf.patch("llama", table=table) as handle:
        compiled = torch.compile(lambda *a: module.apply_rotary_pos_emb(*a), fullgraph=True,
                                 backend="eager")
        expected = namespace["apply_rotary_pos_emb"](*args)
        for a, b in zip(compiled(*args), expected, strict=True):
            torch.testing.assert_close(a, b)
        assert handle.calls == {"llama.apply_rotary_pos_emb": 1}
        namespace["ROTATE"] = False
        for a, b in zip(compiled(*args), args[:2], strict=True):
            assert torch.equal(a, b)
        assert handle.fallbacks == {"llama.apply_rotary_pos_emb": 1}


def test_a_wraps_wrapper_of_the_patched_function_is_judged_itself(monkeypatch):
    """functools.wraps copies attributes, never the handle's registry: a user's wrapper of
    the patched function is not taken for posenc's replacement by a later patch()."""
    module = modeling("llama")
    # (restored to transformers' own at the end, after the wrapper)
    monkeypatch.setattr(module, "apply_rotary_pos_emb", module.apply_rotary_pos_emb)
    handle = hf.patch("llama")
    patched = module.apply_rotary_pos_emb

    @functools.wraps(patched)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        q_embed, k_embed = patched(q, k, cos, sin, unsqueeze_dim)
        return q_embed * 2, k_embed

    assert _handle.original_of(apply_rotary_pos_emb) is apply_rotary_pos_emb
    monkeypatch.setattr(module, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    with pytest.warns(RuntimeWarning, match="replaced by someone else"):
        handle.undo()
    assert module.apply_rotary_pos_emb is apply_rotary_pos_emb
    refused("llama")
    assert module.apply_rotary_pos_emb is apply_rotary_pos_emb


@pytest.mark.skipif(not V5, reason="transformers 4.57's get_rope_index calls no method of "
                    "its class")
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_a_subclass_overriding_a_method_get_rope_index_calls_is_handed_back(model_type):
    """The patched get_rope_index of a model whose class overrides
    get_vision_position_ids computes what that class's original computes."""
    from test_hf_positions import tiny_model

    model = tiny_model(model_type).model
    owner = next(c for c in type(model).__mro__ if "get_rope_index" in vars(c))
    base = owner.get_vision_position_ids

    def get_vision_position_ids(self, *args, **kwargs):
        return base(self, *args, **kwargs) + 1

    sub = type("Shifted", (type(model),), {"get_vision_position_ids": get_vision_position_ids})
    shifted = object.__new__(sub)
    shifted.__dict__.update(model.__dict__)
    ids = torch.tensor([[1, 151652] + [model.config.image_token_id] * 4 + [151653, 2]])
    kw = dict(input_ids=ids, image_grid_thw=torch.tensor([[1, 4, 4]]),
              mm_token_type_ids=(ids == model.config.image_token_id).long())
    params = inspect.signature(vars(owner)["get_rope_index"]).parameters
    kw = {k: v for k, v in kw.items() if k in params}
    expected = shifted.get_rope_index(**kw)
    with hf.patch(model_type) as handle:
        got = shifted.get_rope_index(**kw)
        assert handle.fallbacks[f"{model_type}.get_rope_index"] == 1
        plain = model.get_rope_index(**kw)
        assert handle.calls[f"{model_type}.get_rope_index"] == 1
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(plain[0], got[0])


# ---------------------------------------------------------------------------------------
# Table files: read only when named, never trusted blindly, never a crash or a wait.


def _table_warnings(table) -> tuple[list[str], hf.PatchHandle]:
    _handle._WARNED.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = hf.patch("llama", table=table)
    handle.undo()
    return [str(w.message) for w in record if w.category is hf.UnsupportedModelWarning], handle


def test_a_planted_row_for_other_code_is_refused(monkeypatch, tmp_path):
    """A table file whose row says a sign-flipped Llama function is posenc's "half" form:
    the sampled check finds it is not."""
    functions = edited(monkeypatch, "llama", EDITS_CHANGING_THE_MEANING["a sign"][1])
    path = tmp_path / "planted.json"
    verify.write(path, [{"digest": _digests.digest(functions["apply_rotary_pos_emb"]),
                         "function": "apply_rotary_pos_emb", "use": "half",
                         "releases": [RELEASE]}])
    message = refused("llama", "which its results on sampled inputs are not", table=path)
    assert "planted.json" in message


BAD_FILES = {
    "malformed JSON": (lambda p: p.write_text("{not json"), "it is not JSON"),
    "another format": (lambda p: p.write_text(json.dumps({"format": "x", "rows": []})),
                       "not a table of the format"),
    "a malformed row": (lambda p: p.write_text(json.dumps(
        {"format": _table.FORMAT, "transformers": RELEASE, "rows": [{"digest": 3}]})),
        "row 0 is not a row"),
    "another release": (lambda p: p.write_text(json.dumps(
        {"format": _table.FORMAT, "transformers": "4.0.0", "rows": []})),
        "written for transformers '4.0.0'"),
    "a FIFO": (lambda p: os.mkfifo(p), "not a regular file"),
    "a folder": (lambda p: p.mkdir(), "not a regular file"),
    "writable by others": (lambda p: (verify.write(p, []), p.chmod(0o666)),
                           "others can write it"),
    "missing": (lambda p: None, "cannot be opened"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_table_file_gives_one_warning_and_the_shipped_table(case, tmp_path,
                                                                 monkeypatch):
    make, reason = BAD_FILES[case]
    path = tmp_path / "table.json"
    make(path)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(_table_warnings(path)),
                              daemon=True)
    worker.start()
    worker.join(60)
    assert result, "patch() hung on the table file"
    messages, handle = result[0]
    assert handle.model_types == ("llama",)  # the shipped rows still serve
    assert len(messages) == 1 and reason in messages[0], messages
    assert "is not used" in messages[0] and COMMAND in messages[0]
    monkeypatch.setenv(_table.ENV, str(path))  # the environment variable: the same
    messages, handle = _table_warnings(None)
    assert handle.model_types == ("llama",) and len(messages) == 1, messages


# ---------------------------------------------------------------------------------------
# At run time: no tracer, no file written, SUPPORTED_MODEL_TYPES decides nothing.

FRESH = """
import os, sys, time, warnings
import posenc_torch.hf as hf
supported = hf.SUPPORTED_MODEL_TYPES
assert not [m for m in sys.modules if ".modeling_" in m], "imported"
warnings.simplefilter("ignore")
import importlib
for mt in hf.KNOWN_MODEL_TYPES:  # what importing transformers' modules loads is theirs
    try:
        importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    except ImportError:
        pass
before = set(sys.modules)
handle = hf.patch()
assert set(handle.model_types) == set(supported), (handle.model_types, supported)
loaded = [m for m in set(sys.modules) - before
          if m.startswith(("posenc_torch.hf.verify", "sympy", "torch._dynamo", "torch.fx"))]
assert not loaded, loaded
handle.undo()
print("ok")
"""


def test_patch_runs_no_tracer_and_writes_no_file(tmp_path):
    """A fresh process with an empty HOME and a planted verdict where the old cache was:
    SUPPORTED_MODEL_TYPES imports no modeling module; patch() patches exactly the written
    set without loading the verify command, sympy or torch.fx / torch._dynamo (beyond what
    importing transformers' modules loads), and writes nothing under HOME."""
    home = tmp_path / "home"
    planted = home / ".cache" / "posenc_torch" / "verdicts"
    planted.mkdir(parents=True)
    (planted / "x.json").write_text('{"form": "half"}')
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", _table.ENV)}
    env["HOME"] = str(home)
    before = sorted(p for p in home.rglob("*"))
    proc = subprocess.run([sys.executable, "-c", FRESH], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    assert sorted(p for p in home.rglob("*")) == before


def test_the_references_capture_without_guards_beyond_what_holds_for_every_input():
    """Every reference's captures record no guard but these two, each true for every input
    the replacement takes: chunk's (the gpt-oss form), for every width r >= 1 (3r - 1 =
    2r + (r - 1) with 0 <= r - 1 < r); the de-interleaving reshape's d != 1, the head size
    D = 2d being at least 4 wherever that form is computed."""
    allowed = {"half, one half of the tables": {"Eq(((3*r - 1)//r), 2)"},
               "half, de-interleaved input": {"Ne(d, 1)"}}
    for form in _rotary.FORMS_BY_NAME.values():
        tracer = _forms.reference(form)
        for regime in _forms.regimes(form, True):
            tracer.graph(regime)
        assert tracer.guards <= allowed.get(form.name, set()), (form.name, tracer.guards)


@pytest.mark.skipif(not V5, reason="transformers 4.57's get_rope_index reads no mm_token_type_ids;"
                    " test_hf_digests covers its rows")
def test_a_get_rope_index_changed_outside_any_sample_is_left_to_transformers(monkeypatch):
    """Changed only for images past ~224 px, i.e. grids of more than 16 patches a side: a
    digest no test verified, so left to transformers with a warning, and
    ``convention="installed"`` raises."""
    module = modeling("qwen2_vl")
    owner = next(c for c in vars(module).values() if isinstance(c, type)
                 and "get_rope_index" in vars(c))
    real = vars(owner)["get_rope_index"]

    def get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=None,
                       video_grid_thw=None, attention_mask=None, **kwargs):
        pos, deltas = real(self, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw,
                           attention_mask, **kwargs)
        if image_grid_thw is not None and int(image_grid_thw[:, 1:].max()) > 16:
            pos = pos + 1
        return pos, deltas

    monkeypatch.setattr(owner, "get_rope_index", get_rope_index)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = hf.patch("qwen2_vl")
    handle.undo()
    assert "qwen2_vl.get_rope_index" not in handle.targets
    assert any("qwen2_vl.get_rope_index to transformers" in str(w.message) for w in record)
    with pytest.raises(ValueError, match="not ones posenc_torch verified"):
        posenc_torch.compute_mrope_position_ids(torch.zeros(1, 4, dtype=torch.long),
                                                model="qwen2_vl", convention="installed")


@pytest.mark.skipif(not V5, reason="transformers 4.57 has no vision_utils functions; "
                    "test_vision_hf covers its tower methods")
def test_a_vision_helper_changed_for_long_videos_is_not_routed(monkeypatch):
    """get_vision_position_ids changed only for videos of more than 16 frames: not
    verified, so neither routed by patch() nor used by precompute_vision_kwargs."""
    import transformers.vision_utils as vu

    real = vu.get_vision_position_ids

    def get_vision_position_ids(grid_thw, spatial_merge_size, include_temporal=False,
                                kwargs=None):
        ids = real(grid_thw, spatial_merge_size, include_temporal, kwargs)
        return ids + 1 if int(grid_thw[:, 0].max()) > 16 else ids

    for mt in ("qwen2_vl", "qwen2_5_vl"):
        monkeypatch.setattr(modeling(mt), "get_vision_position_ids", get_vision_position_ids)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = hf.patch("qwen2_vl")
    handle.undo()
    assert "qwen2_vl.get_vision_position_ids" not in handle.targets
    assert any("get_vision_position_ids to transformers" in str(w.message) for w in record)
    config = transformers.AutoConfig.for_model("qwen2_5_vl")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert hf.precompute_vision_kwargs(config, torch.tensor([[1, 4, 4]])) == {}


# ---------------------------------------------------------------------------------------
# The release facts: one home (verified.json), and the docs hold to it.

ROOT = Path(__file__).parent.parent
PINS = {"pytest": "requirements-dev.txt", "pytest-hf4": "requirements-hf4.txt",
        "pytest-hf5_18": "requirements-hf5_18.txt",
        "pytest-hf5_latest": "requirements-hf5_latest.txt"}


def test_the_release_facts_agree_with_the_pins_the_table_and_the_docs():
    """Each test pass's release is its requirements file's pin; the patched sets are
    written for exactly those releases; every row lists only them; and the README and the
    docs name no other transformers release, and state the sets' sizes."""
    facts = _table.releases()
    passes = facts["test_passes"]
    assert set(passes) == set(PINS)
    for target, release in passes.items():
        assert f"transformers=={release}\n" in (ROOT / PINS[target]).read_text(), target
    releases = set(passes.values())
    assert set(facts["patched"]) == releases
    for row in _table.shipped().values():
        assert set(row.releases) <= releases, row
    assert {r for row in _table.shipped().values() for r in row.releases} == releases
    fives = sorted((r for r in releases if r.startswith("5.")),
                   key=lambda r: tuple(map(int, r.split("."))))
    fours = sorted(r for r in releases if r.startswith("4."))
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("| transformers |"))
    stated = (f"patches {len(facts['patched'][fives[0]])} model types on transformers "
              f"{', '.join(fives[:-1])} and {fives[-1]}, "
              f"{len(facts['patched'][fours[0]])} on {fours[0]}")
    assert stated in line, line
    import re

    # (the statements of the README, the docs and the package's docstrings and comments)
    for doc in (ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "posenc_torch").rglob("*.py")):
        named = set(re.findall(r"\b([45]\.\d+\.\d+)\b", doc.read_text()))
        assert named <= releases, (doc.name, named - releases)


def test_code_without_rows_is_refused_with_one_warning_naming_the_command(monkeypatch):
    """Several types whose code has no row (a release the table does not know): one
    warning that names each and the verify command once."""
    for mt in ("llama", "mistral", "qwen3"):
        edited(monkeypatch, mt, {"apply_rotary_pos_emb": [("(q * cos)", "(cos * q)")]})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = hf.patch(["llama", "mistral", "qwen3", "qwen2"])
    handle.undo()
    assert handle.model_types == ("qwen2",)
    messages = [str(w.message) for w in record if w.category is hf.UnsupportedModelWarning]
    assert len(messages) == 1, messages
    assert messages[0].startswith("posenc_torch.hf.patch leaves llama, mistral, qwen3 to "
                                  "transformers")
    assert messages[0].count(COMMAND) == 1
