"""Which functions ``posenc_torch.hf.patch`` replaces: a rotary function when its captured
graph is the graph of one of posenc's references (``_graphs``, ``_references``), an
integer walk when its digest is verified (``_digests``; the table is tested in
test_hf_digests.py), never by sampled inputs.

The functions judged here are transformers' own, imported, copies of them edited as an
upstream release might edit them, and the adversary's: functions that compute
transformers' result except where no sample would look (a wrapper, a hidden branch, a
large value, a long video).  Edits that keep the meaning are patched, with bit-identical
results; everything that can compute something else, for any input posenc takes, is
refused with a warning that says why.  ``make test`` runs this file under every
transformers release it installs; the supported set is written out per release.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import linecache
import operator
import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch
import transformers

import posenc_torch
import posenc_torch.hf as hf
from posenc_torch.hf import _graphs, _references

pytestmark = pytest.mark.any_transformers
RELEASE = transformers.__version__
V5 = int(RELEASE.split(".")[0]) >= 5

# ---------------------------------------------------------------------------------------
# The supported set, per release make test runs (written out, not computed).

_ALL_5X = {
    "llama", "qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "mistral", "mixtral", "ministral",
    "gemma", "gemma2", "gemma3", "phi", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_vl_moe",
    "olmo", "olmo2", "olmo3", "granite", "granitemoe", "starcoder2", "smollm3", "deepseek_v3",
    "exaone4", "seed_oss", "apertus", "hunyuan_v1_dense", "paddleocr_vl", "cohere", "cohere2",
    "glm4v", "phi3", "gpt_neox", "qwen3_next", "qwen3_5", "qwen3_5_moe", "glm4_moe",
    "glm4v_moe", "glm", "glm4", "ernie4_5", "gpt_oss",
}
# 4.57.6: no paddleocr_vl, qwen3_5, qwen3_5_moe modules; GLM-4V and GLM-4V-MoE attention
# calls the 4.x multimodal function with their own section merge.
_LEFT_TO_TRANSFORMERS_4 = {"paddleocr_vl", "qwen3_5", "qwen3_5_moe", "glm4v", "glm4v_moe"}
EXPECTED_SUPPORTED = {
    "4.57.6": _ALL_5X - _LEFT_TO_TRANSFORMERS_4,
    "5.17.0": _ALL_5X,
    "5.18.0": _ALL_5X,
    "5.24.0": _ALL_5X,
    "5.25.0": _ALL_5X,
}
ABSENT = {"4.57.6": {"paddleocr_vl", "qwen3_5", "qwen3_5_moe"}}


def test_the_written_set_is_patched():
    """A supported type that this release makes the patch refuse fails here, with the
    function and the reason (its graph, or its digest)."""
    assert len(_ALL_5X) == 43 and len(EXPECTED_SUPPORTED["4.57.6"]) == 38
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
# Helpers: transformers' modules, and functions made from source text.


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


def refused(model_type: str, match: str) -> str:
    """patch(model_type) refuses it: the warning of patch([it, other]) and the error of
    patch(it) alone say ``match``; returns the warning."""
    other = "qwen2" if model_type != "qwen2" else "llama"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = hf.patch([model_type, other])
    handle.undo()
    assert handle.model_types == (other,)
    messages = [str(w.message) for w in record if w.category is hf.UnsupportedModelWarning]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"posenc_torch.hf.patch leaves {model_type} to transformers")
    assert match in messages[0], messages[0]
    with pytest.raises(RuntimeError, match=match.replace("(", r"\(").replace(")", r"\)")):
        hf.patch(model_type)
    return messages[0]


def _qkcs(batch=2, heads=4, kv_heads=2, seq=5, dim=16, width=None, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, seq, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(batch, seq, kv_heads, dim, generator=gen).to(dtype).transpose(1, 2)
    cos = torch.randn(batch, seq, width or dim, generator=gen)
    sin = torch.randn(batch, seq, width or dim, generator=gen)
    return q, k, cos, sin


# ---------------------------------------------------------------------------------------
# Edits that keep the meaning: patched, with bit-identical results.

REWRITE = '''
def rotate_half(x):
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat([-second, first], dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(dim=unsqueeze_dim), sin.unsqueeze(dim=unsqueeze_dim)
    return cos * q + sin * rotate_half(q), cos * k + sin * rotate_half(k)
'''


def test_a_rewrite_that_keeps_the_meaning_is_patched_with_identical_logits(monkeypatch):
    """A temporary for the half width, tuple unpacking, a list for torch.cat, dim= by
    keyword, cos * q for q * cos: the same graph, so patched; a tiny Llama's logits and
    gradients are bit-identical to transformers'."""
    from test_hf_models import tiny_model

    module = modeling("llama")
    namespace = define(REWRITE, "<rewritten llama>", {"torch": torch})
    monkeypatch.setattr(module, "rotate_half", namespace["rotate_half"])
    monkeypatch.setattr(module, "apply_rotary_pos_emb", namespace["apply_rotary_pos_emb"])
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
        handle = hf.patch("llama")
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
def test_edits_that_keep_the_meaning_are_patched(edit, monkeypatch):
    edited(monkeypatch, "llama", EDITS_KEEPING_THE_MEANING[edit])
    module = modeling("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.UnsupportedModelWarning)
        handle = hf.patch("llama")
    with handle:
        args = _qkcs()
        out = module.apply_rotary_pos_emb(*args)
        assert handle.calls == {"llama.apply_rotary_pos_emb": 1}
    for o, r in zip(out, module.apply_rotary_pos_emb(*args), strict=True):
        assert torch.equal(o, r)


EDITS_CHANGING_THE_MEANING = {
    # model type, edits, what the reason says
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
    refused(model_type, reason)
    module = modeling(model_type)
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
    # what makes it differ, and what the refusal names
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
    monkeypatch.setattr(modeling("llama"), "apply_rotary_pos_emb", _wrapper(test, wraps))
    refused("llama", reason)


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
}


def _other_module_helper(x):
    return x * 2 if x.shape[1] > 64 else x


@pytest.mark.parametrize("case", HIDDEN)
def test_a_function_that_hides_a_branch_or_state_is_refused(case, monkeypatch):
    source, reason = HIDDEN[case]
    namespace = define(source, f"<hidden {case}>", {
        "torch": torch, "real": REAL_LLAMA, "SCALE": torch.ones(()),
        "helper": _other_module_helper})
    monkeypatch.setattr(modeling("llama"), "apply_rotary_pos_emb",
                        namespace["apply_rotary_pos_emb"])
    refused("llama", reason)


@pytest.mark.transformers4
@pytest.mark.parametrize("condition", ["real sections", "fp16", "a long sequence"])
def test_a_multimodal_rotation_that_differs_where_no_sample_looks_is_refused(condition,
                                                                            monkeypatch):
    module = modeling("qwen2_vl")
    real = module.apply_multimodal_rotary_pos_emb
    test = {"real sections": lambda q, s: s[0] == 16,
            "fp16": lambda q, s: q.dtype == torch.float16,
            "a long sequence": lambda q, s: q.shape[2] > 4096}[condition]

    def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
        q_embed, k_embed = real(q, k, cos, sin, mrope_section, unsqueeze_dim)
        return (q_embed + 1 if test(q, mrope_section) else q_embed), k_embed

    monkeypatch.setattr(module, "apply_multimodal_rotary_pos_emb", apply_multimodal_rotary_pos_emb)
    with pytest.raises(RuntimeError, match="apply_multimodal_rotary_pos_emb"):
        hf.patch("qwen2_vl")


def test_a_vision_rotation_that_differs_for_fp16_is_refused(monkeypatch):
    module = modeling("qwen2_vl")
    real = module.apply_rotary_pos_emb_vision

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        q_embed, k_embed = real(q, k, cos, sin)
        return (q_embed * 2 if q.dtype == torch.float16 else q_embed), k_embed

    monkeypatch.setattr(module, "apply_rotary_pos_emb_vision", apply_rotary_pos_emb_vision)
    refused("qwen2_vl", "apply_rotary_pos_emb_vision")


# ---------------------------------------------------------------------------------------
# Verdicts are kept per content: stale state cannot reach them, a second process decides
# nothing again.


def test_state_changed_after_a_verdict_is_judged_again(monkeypatch):
    """A helper rebound, a global value changed, a closure of other contents: new keys."""
    module = modeling("llama")
    hf.patch("llama").undo()
    namespace = define('''
        def rotate_half(x):
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), dim=-1) * SCALE
    ''', "<scaled rotate_half>", {"torch": torch, "SCALE": 1.0})
    monkeypatch.setattr(module, "rotate_half", namespace["rotate_half"])
    refused("llama", "aten.mul.Tensor")  # one more multiply, by a constant
    namespace["SCALE"] = 2.0
    key = _graphs.content_key("text", _graphs.reach(module.apply_rotary_pos_emb))
    namespace["SCALE"] = 1.0
    assert key != _graphs.content_key("text", _graphs.reach(module.apply_rotary_pos_emb))


def test_a_second_process_decides_nothing_again(tmp_path):
    code = ("import warnings, posenc_torch.hf as hf; from posenc_torch.hf import _graphs; "
            "warnings.simplefilter('ignore'); hf.patch(['llama', 'gpt_neox', 'cohere']).undo(); "
            "print(_graphs.STATS['decided'], _graphs.STATS['loaded'])")
    env = {**os.environ, "POSENC_TORCH_CACHE": str(tmp_path)}

    def run() -> list[int]:
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True).stdout
        return [int(n) for n in out.split()]

    assert run() == [3, 0]
    assert run() == [0, 3]
    assert len(list((tmp_path / "verdicts").iterdir())) == 3


def test_the_references_capture_without_guards_beyond_what_holds_for_every_input():
    """Every reference's captures record no guard but these two, each true for every input
    the replacement takes: chunk's (the gpt-oss form), for every width r >= 1 (3r - 1 =
    2r + (r - 1) with 0 <= r - 1 < r); the de-interleaving reshape's d != 1, the head size
    D = 2d being at least 4 wherever that form is computed."""
    allowed = {"half, one half of the tables": {"Eq(((3*r - 1)//r), 2)"},
               "half, de-interleaved input": {"Ne(d, 1)"}}
    for form in (*_references.TEXT_FORMS, _references.VISION_FORM, _references.SECTIONS_FORM):
        tracer = _references.reference(form)
        for regime in _references.regimes(form, True):
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
