"""posenc_torch.hf.patch and transformers' hub kernels (the ``kernels`` package), on the CPU.

With ``kernels`` importable, transformers 5.x puts a hub-kernel layer (an ``nn.Module``
named ``"rotary_pos_emb"``) in the place of each model file's ``apply_rotary_pos_emb``;
the attention calls it by its global name, and the layer runs the kernel that
``kernelize`` (``from_pretrained(use_kernels=...)``, on by default in 5.25) attached to
the calling attention, or the function.  The patch decides on the function inside the
layer and takes the layer's place: posenc's replacement is what the attention calls,
whichever kernel ``kernelize`` attached, and a call posenc hands back goes to the layer.

Transformers' own mapping has no CPU kernel for ``rotary_pos_emb``, so a local one
stands in for the hub: a kernel that leaves q and k unrotated, which no result of
posenc's can be mistaken for, registered with ``kernels.use_kernel_mapping``.

``make pytest-hub-kernels`` runs this file with the newest-5.x overlay and the ``kernels``
release it accepts (POSENC_EXPECT_KERNELS=1: a missing package is an error there);
elsewhere it is skipped.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import transformers

import posenc_torch.hf as hf
from posenc_torch.hf import _handle, _transformers


def _kernels_usable() -> str | None:
    """None when transformers uses the installed kernels package, else why not."""
    try:
        from transformers.utils.import_utils import is_kernels_available
    except ImportError:
        return f"transformers {transformers.__version__} has no hub-kernel support"
    if not is_kernels_available():
        return (f"transformers {transformers.__version__} finds no kernels package it "
                "accepts installed")
    return None


_WHY_NOT = _kernels_usable()
if _WHY_NOT is not None and os.environ.get("POSENC_EXPECT_KERNELS"):
    raise RuntimeError(f"POSENC_EXPECT_KERNELS is set, but {_WHY_NOT}")
pytestmark = pytest.mark.skipif(
    _WHY_NOT is not None,
    reason=f"{_WHY_NOT}; `make pytest-hub-kernels` runs these tests with kernels installed")

if _WHY_NOT is None:
    import kernels
    from transformers.models.llama import modeling_llama

# Calls of the local kernel (a list: the layer class may hold no state of its own).
KERNEL_CALLS: list[int] = []


class _Unrotated(torch.nn.Module):
    """The stand-in hub kernel: q and k back unrotated, each call counted."""

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        KERNEL_CALLS.append(1)
        return q, k


class _LocalRepository:
    """A kernel mapping's repository that loads the stand-in layer (no hub, no files)."""

    def load(self):
        return _Unrotated


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        attn_implementation="eager")
    return transformers.LlamaForCausalLM(config).eval()


IDS = torch.tensor([[3, 17, 5, 9, 41, 7]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def kernelized(model) -> torch.nn.Module:
    """``kernels.kernelize`` for inference on the CPU, with the local kernel mapped for
    ``rotary_pos_emb`` (and nothing else)."""
    mapping = {"rotary_pos_emb": {"cpu": {kernels.Mode.INFERENCE: _LocalRepository()}}}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        return kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")


@pytest.fixture(autouse=True)
def _calls():
    KERNEL_CALLS.clear()
    yield


def test_the_rotary_function_is_a_hub_kernel_layer_and_patch_takes_its_place():
    layer = modeling_llama.apply_rotary_pos_emb
    assert isinstance(layer, torch.nn.Module) and type(layer).kernel_layer_name == "rotary_pos_emb"
    func = _transformers.hub_kernel_function(layer, "apply_rotary_pos_emb")
    assert func.__module__ == modeling_llama.__name__
    with hf.patch("llama") as handle:
        assert handle.targets == ("llama.apply_rotary_pos_emb",)
        replacement = modeling_llama.apply_rotary_pos_emb
        assert _handle.original_of(replacement) is layer
        assert list(inspect.signature(replacement).parameters) == [
            "q", "k", "cos", "sin", "unsqueeze_dim"]
    assert modeling_llama.apply_rotary_pos_emb is layer


def test_the_written_set_patches_with_the_layers_in_place():
    """Every type of the release's written supported set patches with kernels importable:
    its layers are read through to their functions, with the verdicts of those."""
    from test_hf_decisions import EXPECTED_SUPPORTED

    reasons = hf.unsupported_model_types()
    lost = {mt: reasons[mt] for mt in EXPECTED_SUPPORTED[transformers.__version__]
            if mt in reasons}
    assert not lost, "\n".join(f"{mt}: {why}" for mt, why in lost.items())


def test_the_local_kernel_runs_where_posenc_does_not():
    """Unpatched, the kernelized model runs the mapped kernel: the mapping is effective,
    and its result (q, k unrotated) differs from transformers' own."""
    model = tiny_llama()
    reference = logits(model)
    kernelized(model)
    assert not torch.allclose(logits(model), reference)
    assert len(KERNEL_CALLS) == 2  # one per layer


@pytest.mark.parametrize("order", ["kernelize, then patch", "patch, then kernelize"])
def test_patched_kernelized_model_runs_posenc(order):
    """Patched, posenc's replacement is what runs, whichever kernel kernelize mapped, and
    in either order: the kernel is not called, the counters show every call, and the
    logits are transformers' own."""
    model = tiny_llama()
    reference = logits(model)
    if order.startswith("kernelize"):
        kernelized(model)
    with hf.patch("llama") as handle:
        if order.startswith("patch"):
            kernelized(model)
        out = logits(model)
        assert handle.calls == {"llama.apply_rotary_pos_emb": 2}
        assert handle.fallbacks == {"llama.apply_rotary_pos_emb": 0}
    assert KERNEL_CALLS == []
    torch.testing.assert_close(out, reference)
    # undone: the kernel runs again
    logits(model)
    assert len(KERNEL_CALLS) == 2


def test_a_call_posenc_hands_back_goes_to_the_kernel():
    """A call outside what posenc takes (float64 here) goes to the hub-kernel layer, and so
    to the kernel kernelize attached to the calling attention: counted as a fallback."""
    model = tiny_llama().double()
    kernelized(model)
    with hf.patch("llama") as handle:
        logits(model)
        assert handle.calls == {"llama.apply_rotary_pos_emb": 0}
        assert handle.fallbacks == {"llama.apply_rotary_pos_emb": 2}
    assert len(KERNEL_CALLS) == 2


def test_from_pretrained_turns_kernels_on_and_posenc_runs(tmp_path):
    """``from_pretrained`` kernelizes by default where kernels is importable (5.25); on the
    CPU transformers maps no rotary kernel, so the unpatched model runs the function, and
    the patched one posenc: the same logits, every call counted."""
    if transformers.__version__ < "5.25":
        pytest.skip(f"transformers {transformers.__version__} leaves hub kernels off by default")
    tiny_llama().save_pretrained(tmp_path)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert model.use_kernels
    reference = logits(model)
    with hf.patch("llama") as handle:
        torch.testing.assert_close(logits(model), reference)
        assert handle.calls == {"llama.apply_rotary_pos_emb": 2}
