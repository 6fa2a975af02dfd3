"""Generation with posenc_torch.hf.patch against the same model unpatched, the way
transformers' own generation tests run it: tiny random models (nothing downloaded), fp32,
and every output compared bit for bit (sequences and the scores of every step).

For the Qwen-VL types, llama, qwen3 and gemma3, under every transformers release ``make
test`` runs (and torch's newest release, ``make compat-newest``): greedy and sampling
``generate`` with the dynamic and the static cache, the model forward compiled with
``fullgraph=True`` as transformers' compiled generation compiles it, continuing from the
``past_key_values`` an earlier ``generate`` returned (text, and with an image for the
Qwen-VL types), beam search and left padding.  An exception the unpatched model raises
must be raised patched too, and no other.

The two first tests reproduce what transformers' own suites hit: a compiled frame that
mutates a dict before calling a replaced rotary function, and position ids of shape
(1, batch, seq), which ``generate`` passes when it continues from a cache.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import test_hf_models as models
import test_hf_patch as patch_tests
import torch
from conftest import TRANSFORMERS_MAJOR
from transformers import AutoConfig, AutoModelForImageTextToText, CompileConfig

import posenc_torch.hf as hf

pytestmark = pytest.mark.any_transformers

VL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
TEXT_TYPES = ("llama", "qwen3", "gemma3")
TYPES = tuple(mt for mt in VL_TYPES + TEXT_TYPES if mt in hf.SUPPORTED_MODEL_TYPES)
NEW_TOKENS = 4

def test_every_listed_type_is_patched():
    """The suite runs on each listed type (a type refused by mistake fails here instead of
    losing its generation tests)."""
    assert TYPES == VL_TYPES + TEXT_TYPES, set(VL_TYPES + TEXT_TYPES) - set(TYPES)


# ---------------------------------------------------------------------------------------
# The two reproductions.


def test_replacement_traces_in_a_frame_that_mutates_a_dict():
    """transformers' compiled generation forward writes into a dict before the attention
    calls the rotary: the replacement must trace there with fullgraph=True, static and
    dynamic, after a frame mutated a dict, a list and a module's state (it once bound its
    arguments with inspect, which dynamo cannot trace after a dict mutation)."""
    modeling_llama = patch_tests.modeling("llama")

    def step(q, k, cos, sin, state: dict, log: list, module: torch.nn.Module):
        state["step"] = state.get("step", 0) + 1
        log.append(1)
        module.steps = module.steps + 1
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 16, generator=gen), torch.randn(2, 2, 5, 16, generator=gen)
    cos, sin = torch.randn(2, 5, 16, generator=gen), torch.randn(2, 5, 16, generator=gen)
    module = torch.nn.Module()
    module.steps = 0
    ref = step(q, k, cos, sin, {}, [], module)
    for dynamic in (False, True):
        torch._dynamo.reset()
        with hf.patch("llama") as handle:
            out = torch.compile(step, fullgraph=True, dynamic=dynamic, backend="aot_eager")(
                q, k, cos, sin, {}, [], module)
        assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
        assert handle.calls["llama.apply_rotary_pos_emb"] == 1
        assert handle.fallbacks["llama.apply_rotary_pos_emb"] == 0


@pytest.mark.parametrize("model_type", [mt for mt in VL_TYPES if mt in TYPES])
def test_position_ids_of_one_row_for_every_axis_pass_the_guard(model_type):
    """(1, batch, seq) position ids, as generate passes them when it continues from a
    cache: the packed-batch guard around the model forward stays silent and the call
    computes what it computes unpatched."""
    model = vl_model(model_type)
    input_ids = torch.randint(3, 100, (3, 1), generator=torch.Generator().manual_seed(2))
    position_ids = torch.arange(5, 6).view(1, 1, 1).expand(1, 3, 1)
    with torch.no_grad():
        ref = model(input_ids=input_ids, position_ids=position_ids).logits
        with hf.patch(model_type), warnings.catch_warnings():
            warnings.simplefilter("error")
            out = model(input_ids=input_ids, position_ids=position_ids).logits
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------------
# Tiny models and their inputs.


def vl_model(model_type: str):
    """A tiny Qwen-VL model with the placeholder token ids of tests/test_hf_patch.py."""
    if model_type != "qwen3_vl_moe":
        return patch_tests.tiny_model(model_type).eval()
    config = patch_tests.tiny_config("qwen3_vl")
    text = config.text_config.to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        text.pop(key, None)
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                decoder_sparse_step=1)
    vision = config.vision_config.to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        vision.pop(key, None)
    moe = AutoConfig.for_model(
        "qwen3_vl_moe", text_config=text, vision_config=vision,
        image_token_id=patch_tests.IMAGE, video_token_id=patch_tests.VIDEO,
        vision_start_token_id=patch_tests.VISION_START,
        vision_end_token_id=patch_tests.VISION_END)
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(moe, attn_implementation="sdpa").eval()


def tiny(model_type: str):
    if model_type in VL_TYPES:
        return vl_model(model_type)
    return models.tiny_model(model_type, torch.float32, "sdpa").eval()


def inputs_for(model_type: str, model, kind: str) -> dict:
    """Two prompts: "text", "image" (Qwen-VL: an image in each row), or "left-padded"
    (rows of 9 and 13 tokens, the shorter one padded on the left)."""
    if kind == "image":
        return patch_tests.make_inputs("qwen3_vl" if model_type == "qwen3_vl_moe"
                                       else model_type, model.config, "image")
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 100, (2, 13), generator=gen)
    mask = torch.ones_like(input_ids)
    if kind == "left-padded":
        input_ids[0, :4] = 2  # pad_token_id of the tiny configs
        mask[0, :4] = 0
    out = dict(input_ids=input_ids, attention_mask=mask)
    if model_type in VL_TYPES and TRANSFORMERS_MAJOR >= 5:
        out["mm_token_type_ids"] = torch.zeros_like(input_ids, dtype=torch.int32)
    return out


GENERATE = dict(max_new_tokens=NEW_TOKENS, return_dict_in_generate=True, output_scores=True,
                pad_token_id=2, eos_token_id=-1)


def compiled_forward() -> dict:
    """generate's own compiled decoding: a static cache, the model's forward compiled with
    fullgraph=True (``_compile_all_devices``: also on the CPU, as transformers' tests set
    it); the aot_eager backend runs the traced ops as eager ones, so both sides round
    alike and compare bit for bit."""
    config = CompileConfig(fullgraph=True, backend="aot_eager")
    config._compile_all_devices = True
    return dict(cache_implementation="static", compile_config=config)


CASES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=20),
    "greedy-static": dict(do_sample=False, cache_implementation="static"),
    "sample-static": dict(do_sample=True, top_k=20, cache_implementation="static"),
    "compiled-fullgraph": dict(do_sample=False),  # + compiled_forward()
    "beam-search": dict(do_sample=False, num_beams=2),
}


def run(model_type: str, patched: bool, call) -> tuple[object, BaseException | None]:
    """``call(model)`` on a fresh tiny model, patched or not: (result, exception)."""
    model = tiny(model_type)
    torch._dynamo.reset()
    torch.manual_seed(0)
    handle = hf.patch(model_type) if patched else None
    try:
        with torch.no_grad():
            return call(model), None
    except Exception as e:  # noqa: BLE001  compared with the unpatched run's
        return None, e
    finally:
        if handle is not None:
            handle.undo()


def assert_same(out, ref) -> None:
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores)
    for a, b in zip(out.scores, ref.scores, strict=True):
        assert torch.equal(a, b)


def compare(model_type: str, call) -> None:
    """``call`` succeeds unpatched (every case here is a valid call) and patched, with the
    same outputs."""
    ref, ref_error = run(model_type, False, call)
    if ref_error is not None:
        raise ref_error
    out, error = run(model_type, True, call)
    if error is not None:
        raise AssertionError(f"the patched model raised where the unpatched one did not: "
                             f"{type(error).__name__}: {error}") from error
    assert_same(out, ref)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model_type", TYPES)
def test_generate_as_unpatched(model_type, case):
    kwargs = dict(CASES[case])
    if case == "compiled-fullgraph":
        kwargs.update(compiled_forward())

    def call(model):
        return model.generate(**inputs_for(model_type, model, "text"), **GENERATE, **kwargs)

    compare(model_type, call)


@pytest.mark.parametrize("model_type", TYPES)
def test_left_padding_as_unpatched(model_type):
    def call(model):
        return model.generate(**inputs_for(model_type, model, "left-padded"), **GENERATE,
                              do_sample=False)

    compare(model_type, call)


@pytest.mark.parametrize("model_type", [mt for mt in VL_TYPES if mt in TYPES])
def test_generate_with_an_image_as_unpatched(model_type):
    def call(model):
        return model.generate(**inputs_for(model_type, model, "image"), **GENERATE,
                              do_sample=False)

    compare(model_type, call)


def cache_argument(model) -> str:
    """The name under which the model's forward takes a cache (5.25 renamed it)."""
    names = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in names and "past_key_values" not in names else \
        "past_key_values"


def continue_from_cache(model_type: str, kind: str):
    """generate 3 tokens, then 1 more from the returned cache (as transformers'
    test_generate_continue_from_past_key_values does); the sequences and scores of both
    calls, which must equal one call of 4 tokens."""

    def call(model):
        inputs = inputs_for(model_type, model, kind)
        once = model.generate(**copy.copy(inputs), **GENERATE, do_sample=False,
                              use_cache=True)
        first = model.generate(**copy.copy(inputs), **{**GENERATE, "max_new_tokens": 3},
                               do_sample=False, use_cache=True)
        longer = first.sequences.shape[1] - inputs["input_ids"].shape[1]
        for key in ("pixel_values", "image_grid_thw"):  # in the cache already
            inputs.pop(key, None)
        inputs.update(input_ids=first.sequences, **{cache_argument(model): first.past_key_values},
                      attention_mask=torch.nn.functional.pad(inputs["attention_mask"],
                                                             (0, longer), value=1))
        if "mm_token_type_ids" in inputs:
            inputs["mm_token_type_ids"] = torch.nn.functional.pad(
                inputs["mm_token_type_ids"], (0, longer), value=0)
        last = model.generate(**inputs, **{**GENERATE, "max_new_tokens": 1},
                              do_sample=False, use_cache=True)
        assert torch.equal(last.sequences, once.sequences)
        last.scores = first.scores + last.scores
        return last

    return call


@pytest.mark.parametrize("model_type, kind", [(mt, "text") for mt in TYPES]
                         + [(mt, "image") for mt in TYPES if mt in VL_TYPES])
def test_continue_from_past_key_values_as_unpatched(model_type, kind):
    compare(model_type, continue_from_cache(model_type, kind))
