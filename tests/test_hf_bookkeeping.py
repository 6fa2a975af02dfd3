"""The patch handle's bookkeeping under torch's other modes: functorch transforms and
forward AD (handed to transformers' function), counters made under inference mode or a
default device, and patch() / undo() from several threads.  Runs under transformers 5.x
and 4.57.6 (``make test``'s second pass)."""

from __future__ import annotations

import importlib
import threading

import pytest
import torch

import posenc_torch.hf as hf

pytestmark = pytest.mark.any_transformers


def llama():
    return importlib.import_module("transformers.models.llama.modeling_llama")


def inputs():
    q = torch.randn(2, 5, 4, 16).transpose(1, 2)
    k = torch.randn(2, 5, 2, 16).transpose(1, 2)
    angle = torch.rand(1, 5, 16) * 6
    return q, k, angle.cos(), angle.sin()


TARGET = "llama.apply_rotary_pos_emb"


@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp", "vmap", "forward_ad"])
def test_transforms_go_to_transformers(transform):
    """Under torch.func transforms and forward AD the patched function gives what
    transformers' gives (it is transformers' function that runs, counted as a fallback)."""
    module = llama()
    original = module.apply_rotary_pos_emb
    q, k, cos, sin = inputs()

    def run(fn):
        rotate = lambda q: fn(q, k, cos, sin)[0]  # noqa: E731
        if transform == "grad":
            return torch.func.grad(lambda q: rotate(q).square().sum())(q)
        if transform == "vjp":
            out, pullback = torch.func.vjp(rotate, q)
            return pullback(torch.ones_like(out))[0]
        if transform == "jvp":
            return torch.func.jvp(rotate, (q,), (torch.ones_like(q),))[1]
        if transform == "vmap":
            return torch.func.vmap(rotate)(torch.stack([q, 2 * q]))
        import torch.autograd.forward_ad as fwAD

        with fwAD.dual_level():
            out = rotate(fwAD.make_dual(q, torch.ones_like(q)))
            return fwAD.unpack_dual(out).tangent

    expected = run(original)
    with hf.patch("llama") as handle:
        got = run(module.apply_rotary_pos_emb)
        assert handle.calls[TARGET] == 0 and handle.fallbacks[TARGET] == 1
        module.apply_rotary_pos_emb(q, k, cos, sin)  # outside the transform: posenc
        assert handle.calls[TARGET] == 1
    assert torch.equal(got, expected)


def test_counters_made_in_inference_mode_work_outside_it():
    module = llama()
    with torch.inference_mode():
        handle = hf.patch("llama")
    with handle:
        module.apply_rotary_pos_emb(*inputs())  # outside inference mode
        with torch.inference_mode():
            module.apply_rotary_pos_emb(*inputs())
        assert handle.calls[TARGET] == 2
        handle.reset_counts()
        assert handle.calls[TARGET] == 0


def test_counters_made_under_a_default_device_are_cpu_tensors():
    module = llama()
    with torch.device("meta"):
        handle = hf.patch("llama")
    with handle:
        assert handle.calls == {TARGET: 0}
        assert "active" in repr(handle)
        with pytest.raises(RuntimeError, match="already patched by PatchHandle"):
            hf.patch("llama")
        module.apply_rotary_pos_emb(*inputs())
        assert handle.calls == {TARGET: 1}


def test_patch_and_undo_are_serialized_across_threads(monkeypatch):
    """A second thread's patch() started while the first is half-way through its own waits
    for it, then finds the functions patched and fails; undo() then leaves transformers'
    functions in place (without the lock both handles would install, and undoing them
    would put the first wrapper back for good)."""
    module = llama()
    original = module.apply_rotary_pos_emb
    results: dict[str, object] = {}
    started = threading.Event()

    def second():
        started.set()
        try:
            results["second"] = hf.patch("llama")
        except RuntimeError as e:
            results["second"] = e

    def midway(handle, model_types):  # runs inside the first patch(), after it installed
        if "thread" in results:
            return
        results["thread"] = thread = threading.Thread(target=second)
        thread.start()
        started.wait(5)
        thread.join(0.5)
        results["waited"] = thread.is_alive()  # blocked on the lock

    monkeypatch.setattr(hf._patch, "INSTALLERS", [*hf._patch.INSTALLERS, midway])
    first = hf.patch("llama")
    results["thread"].join(10)
    assert results["waited"]
    assert isinstance(results["second"], RuntimeError), results["second"]
    assert "already patched" in str(results["second"])
    first.undo()
    assert module.apply_rotary_pos_emb is original


FRESH = """
import torch
import posenc_torch.hf as hf
from posenc_torch import compute_mrope_position_ids

# first use under torch.compile: the convention check runs at trace time, once
ids = torch.tensor([[1, 151652, 151655, 151655, 151655, 151655, 151653, 2]])
fn = lambda ids: compute_mrope_position_ids(
    ids, torch.tensor([[1, 4, 4]]), model="qwen2_vl", image_token_id=151655,
    video_token_id=151656, vision_start_token_id=151652,
    mm_token_type_ids=(ids == 151655).long())
compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
assert torch.equal(compiled(ids)[0], fn(ids)[0])

# patch() decides as in plain eager code whatever context it is called in
modes = {"inference": torch.inference_mode, "no_grad": torch.no_grad,
         "meta": lambda: torch.device("meta"),
         "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
for name, mode in modes.items():
    with mode():
        handle = hf.patch(["llama", "qwen2_vl"])
    assert "qwen2_vl.get_rope_index" in handle.targets, (name, handle.targets)
    assert "llama.apply_rotary_pos_emb" in handle.targets, (name, handle.targets)
    handle.undo()
print("ok")
"""


def test_first_use_under_compile_and_other_modes(tmp_path):
    """In a fresh process (nothing decided yet): the first convention='installed' call inside
    torch.compile(fullgraph=True), and patch() under inference mode, no_grad, a meta
    default device and autocast, decide as in plain eager code."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FRESH], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600,
                          env=os.environ)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
