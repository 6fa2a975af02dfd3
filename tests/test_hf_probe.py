"""Which model types ``posenc_torch.hf.patch`` takes: decided by what the installed
transformers' rotary functions compute (known source forms, else the behaviour probe), and
every type it leaves to transformers named in one warning.

The functions probed here are transformers' own, imported, or copies of them edited as an
upstream release might edit them: edits that keep the meaning must still be patched, edits
that change it must be refused.  ``make test`` runs this file under 5.17.0, 4.57.6 and the
5.18.0 and newest 5.x overlays; the supported set is compared with the list written below
for each of those releases.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import textwrap
import threading
import warnings

import pytest
import torch
import transformers

import posenc_torch.hf as hf

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


def test_supported_set_is_the_checked_one():
    if transformers.__version__ not in EXPECTED_SUPPORTED:
        pytest.skip(f"no supported set written down for transformers {transformers.__version__}"
                    f" (checked: {', '.join(EXPECTED_SUPPORTED)})")
    expected = EXPECTED_SUPPORTED[transformers.__version__]
    assert len(_ALL_5X) == 43 and len(EXPECTED_SUPPORTED["4.57.6"]) == 38
    assert set(hf.SUPPORTED_MODEL_TYPES) == expected
    assert set(hf.unsupported_model_types()) == set(hf.KNOWN_MODEL_TYPES) - expected


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
        exec(compile(source, f"<edited {model_type}.{name}>", "exec"), namespace)
    for name in edits:
        monkeypatch.setattr(module, name, namespace[name])
    return {name: namespace[name] for name in edits}


ROTATION = ("    q_embed = (q * cos) + (rotate_half(q) * sin)\n"
            "    k_embed = (k * cos) + (rotate_half(k) * sin)\n"
            "    return q_embed, k_embed")
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
    # not Llama's meaning, but OLMo's (results cast back to q's and k's dtypes)
    "casts posenc also computes": {"apply_rotary_pos_emb": [
        ("return q_embed, k_embed", "return q_embed.to(q.dtype), k_embed.to(k.dtype)")]},
    "hoisted half": {"rotate_half": [
        ("    x1 = x[..., : x.shape[-1] // 2]",
         "    half = x.shape[-1] // 2\n    x1 = x[..., :half]"),
        ("x[..., x.shape[-1] // 2 :]", "x[..., half:]")]},
}


@pytest.mark.parametrize("edit", SAME_MEANING)
def test_edits_that_keep_the_meaning_are_patched(edit, monkeypatch):
    functions = edited(monkeypatch, "llama", SAME_MEANING[edit])
    module = modeling("llama")
    original = module.apply_rotary_pos_emb
    assert hf._form_of(module, original) is None  # no longer a known source form
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


OTHER_MEANING = {
    # model type, edits, what the reason says
    "a sign": ("llama", {"apply_rotary_pos_emb": [("(q * cos) + (rotate_half(q) * sin)",
                                                   "(q * cos) - (rotate_half(q) * sin)")]},
               "differ from posenc's in bits"),
    "the wrong half": ("llama", {"rotate_half": [("torch.cat((-x2, x1), dim=-1)",
                                                  "torch.cat((-x1, x2), dim=-1)")]},
                       "differ from posenc's in bits"),
    "a fixed unsqueeze": ("llama", {"apply_rotary_pos_emb": [
        ("cos.unsqueeze(unsqueeze_dim)", "cos.unsqueeze(1)"),
        ("sin.unsqueeze(unsqueeze_dim)", "sin.unsqueeze(1)")]}, "raises"),
    "a missing cast (Cohere)": ("cohere", {"apply_rotary_pos_emb": [
        ("return q_embed.to(dtype=dtype), k_embed.to(dtype=dtype)", "return q_embed, k_embed")]},
        "result is torch.float32"),
    "a missing cast (ERNIE-4.5)": ("ernie4_5", {"apply_rotary_pos_emb": [
        ("return q_embed.to(original_dtype), k_embed.to(original_dtype)",
         "return q_embed, k_embed")]}, "closest: "),
    "a detached term": ("llama", {"apply_rotary_pos_emb": [
        ("(rotate_half(q) * sin)", "(rotate_half(q) * sin).detach()")]}, "gradients differ"),
    "the vision tower's sign": ("qwen2_vl", {"apply_rotary_pos_emb_vision": [
        ("(q * cos) + (rotate_half(q) * sin)", "(q * cos) - (rotate_half(q) * sin)")]},
        "differ from posenc's in bits"),
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


def test_patch_all_raises_when_no_type_remains(monkeypatch):
    edited(monkeypatch, "llama", OTHER_MEANING["a sign"][1])
    monkeypatch.setattr(hf, "KNOWN_MODEL_TYPES", ("llama",))
    with pytest.raises(RuntimeError, match="leaves|differ from posenc's in bits"):
        hf.patch()


def test_the_probe_runs_once_per_behaviour(monkeypatch):
    """A second patch() probes nothing again, and the copies of one function in other model
    files (Mistral's and Qwen2's are Llama's) share its probe."""
    import weakref

    monkeypatch.setattr(hf, "_PROBED", weakref.WeakKeyDictionary())
    monkeypatch.setattr(hf, "_PROBED_BY_KEY", {})
    module = modeling("llama")
    assert modeling("mistral").apply_rotary_pos_emb is not module.apply_rotary_pos_emb
    spent = hf._PROBE_SECONDS[0]
    hf.patch("llama").undo()
    assert hf._PROBE_SECONDS[0] > spent
    spent = hf._PROBE_SECONDS[0]
    hf.patch(["llama", "mistral", "qwen2"]).undo()
    assert hf._PROBE_SECONDS[0] == spent
    # Replacing a helper the function reads makes it a function to probe again.
    edited(monkeypatch, "llama", SAME_MEANING["list in torch.cat"])
    hf.patch("llama").undo()
    assert hf._PROBE_SECONDS[0] > spent


def test_probe_compares_bf16_with_transformers_own_rounding():
    """The bf16 criterion: posenc's single rounding passes, a result one bf16 step off in
    one element (a value transformers' rounding could not give) fails."""
    q = torch.randn(2, 4, 5, 16, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 5, 16, dtype=torch.bfloat16)
    angle = torch.rand(1, 5, 16, dtype=torch.float64) * 6
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    llama = modeling("llama").apply_rotary_pos_emb
    theirs = llama(q, k, cos, sin)
    ours = hf._rope.apply_rotary_pos_emb(q, k, cos, sin)
    exact = llama(q.double(), k.double(), cos.double(), sin.double())
    scale = 2 * max(q.abs().max(), k.abs().max()).item()
    assert hf._close_to_exact(ours[0], theirs[0], exact[0], scale)
    # an element where both round to the same value, moved one bf16 step (the next
    # representable value: 2^16 up in the fp32 bit pattern)
    i = int(((ours[0] == theirs[0]) & (ours[0] != 0)).view(-1).nonzero()[0])
    off = ours[0].clone().view(-1)
    bits = off[i].float().view(torch.int32) + (1 << 16)
    off[i] = bits.view(torch.float32).bfloat16()
    assert off[i] != ours[0].view(-1)[i]
    assert not hf._close_to_exact(off.view_as(ours[0]), theirs[0], exact[0], scale)


# ---------------------------------------------------------------------------------------
# get_rope_index: the convention is the one whose walk gives the installed function's
# results on the probe prompts.

from posenc_torch import _hf_positions, positions  # noqa: E402


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_installed_convention_is_found_by_running_get_rope_index(model_type):
    expected = positions.convention_for_version(transformers.__version__)
    assert positions.resolve_convention("installed", model_type) == expected
    assert _hf_positions.installed_convention(model_type) == expected


def test_prompts_separate_the_conventions():
    """On each model's probe prompts, every pair of conventions with different rules for it
    gives different results somewhere (else the check could not choose)."""
    import types

    from transformers import AutoConfig

    from posenc_torch._tables import CONVENTIONS, MROPE_MODELS

    for model_type in _hf_positions.MODEL_TYPES:
        model = model_type
        config = AutoConfig.for_model(model_type)
        obj = types.SimpleNamespace(config=config)
        outcomes = {}
        for convention in positions.MROPE_CONVENTIONS:
            results = []
            for _, kw in _hf_positions._probe_prompts(model, config):
                args = dict(kw)
                if convention == "4.57":
                    args.pop("mm_token_type_ids")
                try:
                    results.append(_hf_positions._walk(obj, args, model, convention))
                except Exception as e:  # noqa: BLE001
                    results.append(type(e).__name__)
            outcomes[convention] = results
        reads_seconds = MROPE_MODELS[model_type].reads_seconds
        for a in positions.MROPE_CONVENTIONS:
            for b in positions.MROPE_CONVENTIONS:
                if a < b and not CONVENTIONS[a].same_rules_for(CONVENTIONS[b], reads_seconds):
                    assert any(not (isinstance(x, tuple) and isinstance(y, tuple)
                                    and _hf_positions._identical(x, y))
                               for x, y in zip(outcomes[a], outcomes[b], strict=True)), (
                        model_type, a, b)


def test_a_get_rope_index_of_other_rules_is_left_to_transformers(monkeypatch):
    """An installed get_rope_index that follows none of the conventions keeps running (one
    warning), the rotary functions are still patched, and convention='installed' says why
    it cannot resolve."""
    module = modeling("qwen2_vl")
    owner = _hf_positions._owner_class(module)
    real = vars(owner)["get_rope_index"]

    def get_rope_index(self, *args, **kwargs):
        position_ids, deltas = real(self, *args, **kwargs)
        return position_ids + 1, deltas - 1  # everything one position later

    get_rope_index.__signature__ = inspect.signature(real)
    monkeypatch.setattr(owner, "get_rope_index", get_rope_index)
    monkeypatch.setattr(_hf_positions, "_DECIDED", {})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = hf.patch("qwen2_vl")
    with handle:
        assert "qwen2_vl.get_rope_index" not in handle.targets
        assert vars(owner)["get_rope_index"] is get_rope_index
        assert any(t.endswith("apply_rotary_pos_emb_vision") for t in handle.targets)
    messages = [str(w.message) for w in record if w.category is hf.UnsupportedModelWarning]
    assert len(messages) == 1 and "qwen2_vl.get_rope_index" in messages[0]
    assert "none of the conventions" in messages[0]
    with pytest.raises(ValueError, match="none of the conventions"):
        positions.resolve_convention("installed", "qwen2_vl")
    # An explicit convention needs no check.
    assert positions.resolve_convention("4.57", "qwen2_vl") == "4.57"
