"""Which model types ``posenc_torch.hf.patch`` takes: decided by what the installed
transformers' rotary functions compute (known source forms, else the behaviour probe), and
every type it leaves to transformers named in one warning.

The functions probed here are transformers' own, imported, or copies of them edited as an
upstream release might edit them, or as an adversary would: edits that keep the meaning
must still be patched, edits that change it (for any input the replacement takes, however
rare) must be refused.  ``make test`` runs this file under 5.17.0, 4.57.6 and the 5.18.0
and newest 5.x overlays; every test runs on any release (the supported set is also
compared with the list written below where one is written for the installed release).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import itertools
import linecache
import textwrap
import warnings

import pytest
import torch
import transformers

import posenc_torch.hf as hf
import posenc_torch.rope as pt_rope
from posenc_torch import positions
from posenc_torch.hf import _forms, _probe, _rope_index, _verdicts

pytestmark = pytest.mark.any_transformers

# ---------------------------------------------------------------------------------------
# The supported set, per checked release (written out, not computed).

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
}


# Known types that a release does not have at all.
ABSENT = {"4.57.6": {"paddleocr_vl", "qwen3_5", "qwen3_5_moe"}, "5.17.0": set(), "5.18.0": set(),
          "5.24.0": set()}


def test_supported_set():
    """On a release with a written set: that set.  On any release: every type the release
    has is supported unless its reason names the function or call that does not fit, the
    types of the first integration are supported, and each refused type is refused by name
    with its reason."""
    supported, unsupported = set(hf.SUPPORTED_MODEL_TYPES), hf.unsupported_model_types()
    assert len(_ALL_5X) == 43 and len(EXPECTED_SUPPORTED["4.57.6"]) == 38
    if transformers.__version__ in EXPECTED_SUPPORTED:
        assert supported == EXPECTED_SUPPORTED[transformers.__version__]
    assert {"llama", "qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"} <= supported
    for model_type, reason in unsupported.items():
        present = importlib.util.find_spec(f"transformers.models.{model_type}") is not None
        assert (f"modeling_{model_type}" in reason) if present else ("cannot import" in reason)
        with pytest.raises(RuntimeError) as error:
            hf.patch(model_type)
        assert reason in str(error.value)


def test_patch_all_warns_once_for_each_type_it_leaves():
    expected = EXPECTED_SUPPORTED.get(transformers.__version__, set(hf.SUPPORTED_MODEL_TYPES))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = hf.patch()
    try:
        assert set(handle.model_types) == expected
    finally:
        handle.undo()
    left = [str(w.message) for w in record if w.category is hf.UnsupportedModelWarning]
    named = [m.split("leaves ", 1)[1].split(" ", 1)[0] for m in left]
    # types this transformers does not have at all did not drop out: no warning for them
    absent = {mt for mt in hf.KNOWN_MODEL_TYPES
              if importlib.util.find_spec(f"transformers.models.{mt}") is None}
    assert absent == ABSENT.get(transformers.__version__, absent)
    assert sorted(named) == sorted(set(hf.KNOWN_MODEL_TYPES) - expected - absent)
    reasons = hf.unsupported_model_types()
    for model_type, message in zip(named, left, strict=True):
        assert reasons[model_type] in message


# ---------------------------------------------------------------------------------------
# Copies of transformers' functions, edited.


def modeling(model_type: str):
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def define(source: str, filename: str, namespace: dict) -> None:
    """Run ``source`` in ``namespace``, its text kept where ``inspect.getsource`` finds it
    (the rule reads the source of every function it judges)."""
    source = textwrap.dedent(source)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)


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


ROTATION = ("    q_embed = (q * cos) + (rotate_half(q) * sin)\n"
            "    k_embed = (k * cos) + (rotate_half(k) * sin)\n"
            "    return q_embed, k_embed")
# transformers' rotate_half reads x.shape (which the rule counts as a branch); this one
# computes the same without reading any metadata, so an edited function that calls it is
# branch-free and the probe alone decides.
CHUNKED_HALF = [("    x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]",
                 "    x1, x2 = torch.chunk(x, 2, dim=-1)")]


def branch_free(edits: dict) -> dict:
    return {"rotate_half": CHUNKED_HALF + edits.get("rotate_half", []),
            **{name: e for name, e in edits.items() if name != "rotate_half"}}


SAME_MEANING = {
    "renamed local": {"apply_rotary_pos_emb": [("q_embed", "q_out")]},
    "cos * q": {"apply_rotary_pos_emb": [("(q * cos)", "(cos * q)"), ("(k * cos)", "(cos * k)")]},
    "unsqueeze(dim=...)": {"apply_rotary_pos_emb": [
        ("cos.unsqueeze(unsqueeze_dim)", "cos.unsqueeze(dim=unsqueeze_dim)"),
        ("sin.unsqueeze(unsqueeze_dim)", "sin.unsqueeze(dim=unsqueeze_dim)")]},
    "one-line return": {"apply_rotary_pos_emb": [
        (ROTATION, "    return (q * cos) + (rotate_half(q) * sin), "
                   "(k * cos) + (rotate_half(k) * sin)")]},
    "list in torch.cat": {"rotate_half": [("torch.cat((-x2, x1), dim=-1)",
                                           "torch.cat([-x2, x1], dim=-1)")]},
}


@pytest.mark.parametrize("edit", SAME_MEANING)
def test_branch_free_edits_that_keep_the_meaning_are_patched(edit, monkeypatch):
    functions = edited(monkeypatch, "llama", branch_free(SAME_MEANING[edit]))
    module = modeling("llama")
    original = module.apply_rotary_pos_emb
    assert _forms.form_of(original) is None  # no longer a known source form
    assert _forms.branches(original) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.UnsupportedModelWarning)
        handle = hf.patch("llama")
    with handle:
        assert handle.targets == ("llama.apply_rotary_pos_emb",)
        q = torch.randn(2, 5, 4, 16).transpose(1, 2)
        k = torch.randn(2, 5, 2, 16).transpose(1, 2)
        cos, sin = torch.randn(1, 5, 16), torch.randn(1, 5, 16)
        out = module.apply_rotary_pos_emb(q, k, cos, sin)
        assert handle.calls == {"llama.apply_rotary_pos_emb": 1}
    for o, r in zip(out, original(q, k, cos, sin), strict=True):
        assert torch.equal(o, r)
    assert set(functions) <= {"apply_rotary_pos_emb", "rotate_half"}


@pytest.mark.parametrize("edit", SAME_MEANING)
def test_edits_of_a_branching_source_are_refused_by_the_rule(edit, monkeypatch):
    """The same edits with transformers' rotate_half (which reads ``x.shape``): no longer a
    known form, and a source that can take another path, so refused whatever the probe
    would say."""
    edited(monkeypatch, "llama", SAME_MEANING[edit])
    with pytest.raises(RuntimeError, match="can take another path.*rotate_half: a read of .shape"):
        hf.patch("llama")


OTHER_MEANING = {
    # model type, edits, what the reason says
    "a sign": ("llama", branch_free({"apply_rotary_pos_emb": [
        ("(q * cos) + (rotate_half(q) * sin)", "(q * cos) - (rotate_half(q) * sin)")]}),
        "differ from posenc's in bits"),
    "the wrong half": ("llama", branch_free({"rotate_half": [
        ("torch.cat((-x2, x1), dim=-1)", "torch.cat((-x1, x2), dim=-1)")]}),
        "differ from posenc's in bits"),
    "a fixed unsqueeze": ("llama", branch_free({"apply_rotary_pos_emb": [
        ("cos.unsqueeze(unsqueeze_dim)", "cos.unsqueeze(1)"),
        ("sin.unsqueeze(unsqueeze_dim)", "sin.unsqueeze(1)")]}), "raises"),
    "a detached term": ("llama", branch_free({"apply_rotary_pos_emb": [
        ("(rotate_half(q) * sin)", "(rotate_half(q) * sin).detach()")]}), "gradients differ"),
    # sources that read .dtype: the rule refuses them before any probe
    "a missing cast (Cohere)": ("cohere", {"apply_rotary_pos_emb": [
        ("return q_embed.to(dtype=dtype), k_embed.to(dtype=dtype)", "return q_embed, k_embed")]},
        "can take another path"),
    "a missing cast (ERNIE-4.5)": ("ernie4_5", {"apply_rotary_pos_emb": [
        ("return q_embed.to(original_dtype), k_embed.to(original_dtype)",
         "return q_embed, k_embed")]}, "can take another path"),
    "the vision tower's sign": ("qwen2_vl", {"apply_rotary_pos_emb_vision": [
        ("(q * cos) + (rotate_half(q) * sin)", "(q * cos) - (rotate_half(q) * sin)")]},
        "not the known form"),
}


@pytest.mark.parametrize("edit", OTHER_MEANING)
def test_edits_that_change_the_meaning_are_refused(edit, monkeypatch):
    model_type, edits, reason = OTHER_MEANING[edit]
    functions = edited(monkeypatch, model_type, edits)
    module = modeling(model_type)
    other = "qwen2" if model_type != "qwen2" else "llama"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = hf.patch([model_type, other])
    handle.undo()
    assert handle.model_types == (other,)
    messages = [str(w.message) for w in record if w.category is hf.UnsupportedModelWarning]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"posenc_torch.hf.patch leaves {model_type} to transformers")
    assert reason in messages[0], messages[0]
    for name, function in functions.items():
        assert getattr(module, name) is function  # left as it was
    # Asked for alone: nothing is left to patch, so it is an error with the same reason.
    with pytest.raises(RuntimeError, match=reason):
        hf.patch(model_type)


# ---------------------------------------------------------------------------------------
# The adversary's functions: each computes transformers' Llama rotation except on one kind
# of input the replacement takes.  Those that branch are refused by the rule, the
# branch-free one (large magnitudes) by the probe.


REAL_LLAMA = modeling("llama").apply_rotary_pos_emb


def _differs_when(condition):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        q_embed, k_embed = REAL_LLAMA(q, k, cos, sin, unsqueeze_dim)
        if condition(q, k, cos):
            q_embed = q_embed * 2
        return q_embed, k_embed

    return apply_rotary_pos_emb


ONLY_FOR = {
    "fp16": lambda q, k, cos: q.dtype == torch.float16,
    "head_dim >= 64": lambda q, k, cos: q.shape[-1] >= 64,
    "decode": lambda q, k, cos: q.shape[-2] == 1,
    "equal head counts": lambda q, k, cos: q.shape[1] == k.shape[1],
    "T > 1000": lambda q, k, cos: q.shape[-2] > 1000,
    "no-grad": lambda q, k, cos: not torch.is_grad_enabled(),
    "batch 1": lambda q, k, cos: q.shape[0] == 1,
}


@pytest.mark.parametrize("condition", ONLY_FOR)
def test_a_rotation_that_differs_on_rare_inputs_is_refused(condition, monkeypatch):
    monkeypatch.setattr(modeling("llama"), "apply_rotary_pos_emb",
                        _differs_when(ONLY_FOR[condition]))
    with pytest.raises(RuntimeError, match="can take another path"):
        hf.patch("llama")


def test_what_the_rule_leaves_to_the_probe_is_probed_where_it_differs(monkeypatch):
    """A branch-free difference the rule cannot see (only for |q| > 6, via torch.where):
    the probe's large-magnitude inputs find it; the same function without the difference
    is accepted."""
    namespace = dict(vars(modeling("llama")))
    define("""
        def rotate_half(x):
            x1, x2 = torch.chunk(x, 2, dim=-1)
            return torch.cat((-x2, x1), dim=-1)

        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            cos = cos.unsqueeze(unsqueeze_dim)
            sin = sin.unsqueeze(unsqueeze_dim)
            q = torch.where(q.abs() > 6, q * 1.5, q)
            return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
    """, "<large magnitudes>", namespace)
    func = namespace["apply_rotary_pos_emb"]
    assert _forms.branches(func) == []
    monkeypatch.setattr(modeling("llama"), "apply_rotary_pos_emb", func)
    with pytest.raises(RuntimeError, match=r"scale=40\.0"):
        hf.patch("llama")


@pytest.mark.transformers4
@pytest.mark.parametrize("condition", ["real sections", "fp16"])
def test_a_multimodal_rotation_that_differs_on_rare_inputs_is_refused(condition, monkeypatch):
    module = modeling("qwen2_vl")
    real = module.apply_multimodal_rotary_pos_emb
    test = {"real sections": lambda q, section: list(section) == [16, 24, 24],
            "fp16": lambda q, section: q.dtype == torch.float16}[condition]

    def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
        q_embed, k_embed = real(q, k, cos, sin, mrope_section, unsqueeze_dim)
        return (q_embed + 1 if test(q, mrope_section) else q_embed), k_embed

    monkeypatch.setattr(module, "apply_multimodal_rotary_pos_emb", apply_multimodal_rotary_pos_emb)
    with pytest.raises(RuntimeError, match="can take another path"):
        hf.patch("qwen2_vl")


# ---------------------------------------------------------------------------------------
# Verdicts are keyed on everything a result depends on.


def _scaled(func, factor):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        q_embed, k_embed = func(*args, **kwargs)
        return q_embed * factor, k_embed

    return wrapper


def test_a_wrapper_that_changes_the_result_is_refused_after_the_function_was_accepted(
        monkeypatch):
    module = modeling("llama")
    hf.patch("llama").undo()  # the real function, accepted
    monkeypatch.setattr(module, "apply_rotary_pos_emb", _scaled(REAL_LLAMA, 2.0))
    with pytest.raises(RuntimeError, match="llama"):
        hf.patch("llama")
    # ... and refusing the wrapper does not refuse the function it wraps
    monkeypatch.setattr(module, "apply_rotary_pos_emb", REAL_LLAMA)
    hf.patch("llama").undo()
    assert _verdicts.behaviour_key(_scaled(REAL_LLAMA, 2.0)) != _verdicts.behaviour_key(
        REAL_LLAMA)


def test_two_closures_of_one_factory_have_their_own_keys():
    same, other = _scaled(REAL_LLAMA, 1.0), _scaled(REAL_LLAMA, -1.0)
    assert same.__code__ is other.__code__
    assert _verdicts.behaviour_key(same) != _verdicts.behaviour_key(other)
    assert _verdicts.behaviour_key(same) == _verdicts.behaviour_key(_scaled(REAL_LLAMA, 1.0))


def test_a_branch_free_wrapper_is_decided_by_its_own_behaviour(monkeypatch):
    """Closures of one factory around a branch-free rotation: the one that keeps the result
    is patched, the one that scales it is refused, whichever is decided first."""
    namespace = dict(vars(modeling("llama")))
    define("""
        def rotate_half(x):
            x1, x2 = torch.chunk(x, 2, dim=-1)
            return torch.cat((-x2, x1), dim=-1)

        def inner(q, k, cos, sin, unsqueeze_dim=1):
            cos = cos.unsqueeze(unsqueeze_dim)
            sin = sin.unsqueeze(unsqueeze_dim)
            return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
    """, "<branch-free inner>", namespace)
    inner = namespace["inner"]
    module = modeling("llama")
    for order in ((1.0, -1.0), (-1.0, 1.0)):
        _verdicts.forget()
        for factor in order:
            func = _scaled(inner, factor)
            monkeypatch.setattr(module, "apply_rotary_pos_emb", func)
            if factor == 1.0:
                hf.patch("llama").undo()
            else:
                with pytest.raises(RuntimeError, match="differ from posenc's in bits"):
                    hf.patch("llama")


def test_the_probe_runs_once_per_behaviour(monkeypatch):
    """A second patch() probes nothing again, and the copies of one function in other model
    files (Mistral's and Qwen2's are Llama's) share its probe; replacing a helper the
    function reads makes it a function to probe again."""
    _verdicts.forget()
    module = modeling("llama")
    assert modeling("mistral").apply_rotary_pos_emb is not module.apply_rotary_pos_emb
    spent = _verdicts.SECONDS.get("rotary", 0.0)
    hf.patch("llama").undo()
    assert _verdicts.SECONDS["rotary"] > spent
    spent = _verdicts.SECONDS["rotary"]
    hf.patch(["llama", "mistral", "qwen2"]).undo()
    assert _verdicts.SECONDS["rotary"] == spent
    edited(monkeypatch, "llama", SAME_MEANING["list in torch.cat"])
    with pytest.raises(RuntimeError):
        hf.patch("llama")
    assert _verdicts.SECONDS["rotary"] > spent


# ---------------------------------------------------------------------------------------
# The probe covers what the replacements take: the axes of every accepted input are
# derived here from the replacement's own predicate, over a universe wider than the probe.

_ALL_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
               torch.float8_e4m3fn, torch.float8_e5m2)


def _text_input(dtypes=(torch.float32,) * 3, dim=16, seq=5, batch=2, kv_heads=2, width=None,
                unsqueeze_dim=1):
    qd, kd, td = dtypes
    heads_first = unsqueeze_dim == 1
    q = torch.zeros(batch, seq, 4, dim).to(qd)
    k = torch.zeros(batch, seq, kv_heads, dim).to(kd)
    if heads_first:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    rows = 1 if heads_first else batch
    cos = torch.zeros(rows, seq, width or dim).to(td)
    return (q, k, cos, cos.clone()), ({} if heads_first else {"unsqueeze_dim": unsqueeze_dim})


def _accepted_axes(supported, build, axes: dict[str, list]) -> dict[str, set]:
    """Per axis, the values for which ``supported`` accepts the input ``build`` makes with
    that one axis changed from the base (the grad mode and magnitudes are not input
    metadata: every value of theirs is accepted)."""
    out = {}
    for axis, values in axes.items():
        accepted = set()
        for value, kwargs in values:
            args, kw = build(**kwargs)
            if supported(*args, **kw):
                accepted.add(value)
        out[axis] = accepted
    out["grad"] = {True, False}
    out["magnitude"] = {"small", "large"}
    return out


def _covered(cases, supported, layout="text") -> dict[str, set]:
    out: dict[str, set] = {}
    for case in cases:
        if supported(*case.args, **case.kwargs):
            for axis, value in _probe.features(case, layout).items():
                out.setdefault(axis, set()).add(value)
    return out


def _text_axes(width_of):
    return {
        "dtypes": [(t, {"dtypes": t, "width": width_of(16)})
                   for t in itertools.product(_ALL_FLOATS, repeat=3)],
        "head_dim": [(d, {"dim": d, "width": width_of(d)}) for d in (16, 64, 128, 256)],
        "partial": [(w < 64, {"dim": 64, "width": w}) for w in (64, 48, 32, 16)],
        "seq": [(name, {"seq": t, "width": width_of(16)})
                for name, t in (("one", 1), ("few", 5), ("long", 1500))],
        "batch": [(name, {"batch": b, "width": width_of(16)}) for name, b in ((1, 1), ("several", 3))],
        "heads": [(name, {"kv_heads": h, "width": width_of(16)})
                  for name, h in (("equal", 4), ("grouped", 1))],
    }


@pytest.mark.parametrize("form", _forms.DISTINCT_FORMS, ids=_forms.describe)
def test_the_text_probe_covers_every_axis_the_replacement_accepts(form):
    from posenc_torch.hf import _rotary

    ours, supported = _rotary._text_ours(form)
    width_of = (lambda d: d // 2) if form.table == "doubled" else (lambda d: d)
    accepted = _accepted_axes(supported, _text_input, _text_axes(width_of))
    covered = _covered(_probe.text_cases(), supported)
    for axis, values in accepted.items():
        assert values <= covered.get(axis, set()), (axis, values - covered.get(axis, set()))


def test_the_multimodal_and_vision_probes_cover_every_axis_their_replacements_accept():
    from posenc_torch.hf import _rotary

    def mm_input(section=(2, 3, 3), **kw):
        (q, k, cos, _), kwargs = _text_input(**kw)
        cos = cos.expand(3, *cos.shape).contiguous()
        return (q, k, cos, cos.clone(), list(section)), {"unsqueeze_dim": kwargs.get(
            "unsqueeze_dim", 1)}

    def mm_supported(*args, **kwargs):
        return _rotary._multimodal_supported(*args, **kwargs)

    axes = _text_axes(lambda d: d)
    del axes["partial"]
    for axis in ("head_dim",):
        axes[axis] = [(d, {"dim": d, "section": (d // 8, d // 8, d // 4)}) for d in (16, 64, 128, 256)]
    accepted = _accepted_axes(mm_supported, mm_input, axes)
    covered = _covered(_probe.multimodal_cases(), mm_supported)
    for axis, values in accepted.items():
        assert values <= covered.get(axis, set()), ("multimodal", axis, values - covered[axis])

    def vision_input(dtypes=(torch.float32,) * 3, dim=16, seq=7):
        q = torch.zeros(seq, 2, dim).to(dtypes[0])
        k = torch.zeros(seq, 2, dim).to(dtypes[1])
        cos = torch.zeros(seq, dim).to(dtypes[2])
        return (q, k, cos, cos.clone()), {}

    axes = {"dtypes": [(t, {"dtypes": t}) for t in itertools.product(_ALL_FLOATS, repeat=3)],
            "head_dim": [(d, {"dim": d}) for d in (16, 64, 80, 128)],
            "seq": [(name, {"seq": t}) for name, t in (("one", 1), ("few", 5), ("long", 1500))]}
    accepted = _accepted_axes(_rotary._vision_supported, vision_input, axes)
    covered = _covered(_probe.vision_cases(), _rotary._vision_supported, "vision")
    for axis, values in accepted.items():
        assert values <= covered.get(axis, set()), ("vision", axis, values - covered[axis])


def test_probe_compares_bf16_with_transformers_own_rounding():
    """The bf16 criterion: posenc's single rounding passes, a result one bf16 step off in
    one element (a value transformers' rounding could not give) fails."""
    q = torch.randn(2, 4, 5, 16, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 5, 16, dtype=torch.bfloat16)
    angle = torch.rand(1, 5, 16, dtype=torch.float64) * 6
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    theirs = REAL_LLAMA(q, k, cos, sin)
    ours = pt_rope.apply_rotary_pos_emb(q, k, cos, sin)
    exact = REAL_LLAMA(q.double(), k.double(), cos.double(), sin.double())
    slack = 2.0 ** -22 * 2 * max(q.abs().max(), k.abs().max()).item()
    assert _probe.close_to_exact(ours[0], theirs[0], exact[0], slack)
    # an element where both round to the same value, moved one bf16 step (the next
    # representable value: 2^16 up in the fp32 bit pattern)
    i = int(((ours[0] == theirs[0]) & (ours[0] != 0)).view(-1).nonzero()[0])
    off = ours[0].clone().view(-1)
    bits = off[i].float().view(torch.int32) + (1 << 16)
    off[i] = bits.view(torch.float32).bfloat16()
    assert off[i] != ours[0].view(-1)[i]
    assert not _probe.close_to_exact(off.view_as(ours[0]), theirs[0], exact[0], slack)


# ---------------------------------------------------------------------------------------
# get_rope_index: the convention is the one whose walk gives the installed function's
# results on the probe prompts.


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_installed_convention_is_found_by_running_get_rope_index(model_type):
    expected = positions.convention_for_version(transformers.__version__)
    assert positions.resolve_convention("installed", model_type) == expected
    assert _rope_index.installed_convention(model_type) == expected


def test_the_prompts_cover_what_the_rules_can_differ_on():
    """Videos of 1 to 16 frames at each merge size 1, 2 and 4, fractional seconds, several
    images in a row, left and right padding, masks with holes."""
    for model_type in _rope_index.MODEL_TYPES:
        seen = {}
        for label, config, kw in _rope_index.prompts(model_type):
            merge = config.vision_config.spatial_merge_size
            if kw["video_grid_thw"] is not None:
                seen.setdefault(merge, set()).update(kw["video_grid_thw"][:, 0].tolist())
            mask = kw["attention_mask"]
            if mask is not None:
                seen.setdefault("left", set()).add(bool((mask[:, 0] == 0).any()))
                seen.setdefault("right", set()).add(bool((mask[:, -1] == 0).any()))
                inner = mask[:, 1:-1]
                holes = ((inner == 0) & (mask[:, :-2] == 1) & (mask[:, 2:] == 1)).any()
                seen.setdefault("holes", set()).add(bool(holes))
            if kw["image_grid_thw"] is not None:
                seen.setdefault("images", set()).add(len(kw["image_grid_thw"]))
            seconds = kw.get("second_per_grid_ts")
            if seconds is not None:
                seen.setdefault("seconds", set()).update(seconds.tolist())
        for merge in (1, 2, 4):
            assert seen[merge] == set(range(1, 17)), (model_type, merge)
        assert True in seen["left"] and True in seen["right"] and True in seen["holes"]
        assert max(seen["images"]) >= 3
        if model_type == "qwen2_5_vl":
            assert any(s != int(s) for s in seen["seconds"])


def test_prompts_separate_the_conventions():
    """On each model's probe prompts, every pair of conventions with different rules for it
    gives different results somewhere (else the check could not choose)."""
    import types

    from posenc_torch._tables import CONVENTIONS, MROPE_MODELS

    for model_type in _rope_index.MODEL_TYPES:
        outcomes = {}
        for convention in positions.MROPE_CONVENTIONS:
            results = []
            for _, config, kw in _rope_index.prompts(model_type):
                obj = types.SimpleNamespace(config=config)
                args = dict(kw)
                if convention == "4.57":
                    args.pop("mm_token_type_ids")
                try:
                    results.append(_rope_index._walk(obj, args, model_type, convention))
                except Exception as e:  # noqa: BLE001
                    results.append(type(e).__name__)
            outcomes[convention] = results
        reads_seconds = MROPE_MODELS[model_type].reads_seconds
        for a in positions.MROPE_CONVENTIONS:
            for b in positions.MROPE_CONVENTIONS:
                if a < b and not CONVENTIONS[a].same_rules_for(CONVENTIONS[b], reads_seconds):
                    assert any(not (isinstance(x, tuple) and isinstance(y, tuple)
                                    and _rope_index._identical(x, y))
                               for x, y in zip(outcomes[a], outcomes[b], strict=True)), (
                        model_type, a, b)


def _owner():
    module = modeling("qwen2_vl")
    from posenc_torch.hf import _transformers

    return _transformers.owner_class(module, "get_rope_index")


def _changed_get_rope_index(real, when):
    def get_rope_index(self, *args, **kwargs):
        position_ids, deltas = real(self, *args, **kwargs)
        if when(self, inspect.signature(real).bind(self, *args, **kwargs).arguments):
            return position_ids + 1, deltas - 1  # everything one position later
        return position_ids, deltas

    get_rope_index.__signature__ = inspect.signature(real)
    return get_rope_index


def _videos_longer_than_8(self, arguments):
    videos = arguments.get("video_grid_thw")
    return videos is not None and bool((videos[:, 0] > 8).any())


def _merge_size_not_2(self, arguments):
    return self.config.vision_config.spatial_merge_size != 2


@pytest.mark.parametrize("when", [lambda self, a: True, _videos_longer_than_8, _merge_size_not_2],
                         ids=["always", "videos longer than 8 frames", "merge size not 2"])
def test_a_get_rope_index_of_other_rules_is_left_to_transformers(when, monkeypatch):
    """An installed get_rope_index that follows none of the conventions, even only for long
    videos or other merge sizes, keeps running (one warning), the rotary functions are
    still patched, and convention='installed' says why it cannot resolve."""
    owner = _owner()
    real = vars(owner)["get_rope_index"]
    changed = _changed_get_rope_index(real, when)
    monkeypatch.setattr(owner, "get_rope_index", changed)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = hf.patch("qwen2_vl")
    with handle:
        assert "qwen2_vl.get_rope_index" not in handle.targets
        assert vars(owner)["get_rope_index"] is changed
        assert any(t.endswith("apply_rotary_pos_emb_vision") for t in handle.targets)
    messages = [str(w.message) for w in record if w.category is hf.UnsupportedModelWarning]
    assert len(messages) == 1 and "qwen2_vl.get_rope_index" in messages[0]
    assert "none of the conventions" in messages[0]
    with pytest.raises(ValueError, match="none of the conventions"):
        positions.resolve_convention("installed", "qwen2_vl")
    # An explicit convention needs no check.
    assert positions.resolve_convention("4.57", "qwen2_vl") == "4.57"


def test_get_rope_index_decisions_follow_the_installed_method(monkeypatch):
    """Modified after a first patch(): the next patch() refuses it; the original restored:
    accepted again (nothing stale either way)."""
    owner = _owner()
    real = vars(owner)["get_rope_index"]
    hf.patch("qwen2_vl").undo()
    changed = _changed_get_rope_index(real, _videos_longer_than_8)
    monkeypatch.setattr(owner, "get_rope_index", changed)
    with pytest.warns(hf.UnsupportedModelWarning, match="get_rope_index"):
        hf.patch("qwen2_vl").undo()
    monkeypatch.setattr(owner, "get_rope_index", real)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.UnsupportedModelWarning)
        handle = hf.patch("qwen2_vl")
    with handle:
        assert "qwen2_vl.get_rope_index" in handle.targets


def test_the_rotary_verdicts_follow_the_installed_function(monkeypatch):
    """The same for the rotary functions: an edited function after a first patch() is
    refused, the original restored is patched again."""
    module = modeling("llama")
    hf.patch("llama").undo()
    edited(monkeypatch, "llama", OTHER_MEANING["a sign"][1])
    with pytest.raises(RuntimeError):
        hf.patch("llama")
    monkeypatch.setattr(module, "apply_rotary_pos_emb", REAL_LLAMA)
    monkeypatch.setattr(module, "rotate_half", REAL_LLAMA.__globals__["rotate_half"])
    hf.patch("llama").undo()


def test_the_probe_runs_on_one_thread_and_restores_the_count():
    threads = torch.get_num_threads()
    seen = []
    with _verdicts.plain_mode():
        seen.append(torch.get_num_threads())
    assert seen == [1] and torch.get_num_threads() == threads
