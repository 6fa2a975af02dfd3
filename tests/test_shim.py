"""The torch shim as built and installed: the wheel's tags and requirements, its ABI (stable
LibTorch surface, limited Python API, minimum torch), output layouts as torch's empty_like
gives them, and the argument checks that live in the shim (raw ``torch.ops.posenc`` calls)."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import posenc_torch
from op_errors import RAW_BAD_INPUT, raw_raises

# The oldest torch the extension is built for (TORCH_TARGET_VERSION in meson.build).
TARGET_TORCH = (2, 11)


def _dist() -> importlib.metadata.Distribution:
    return importlib.metadata.distribution("posenc_torch")


# ------------------------------------------------------------------ the installed wheel


def test_package_is_an_installed_wheel_not_the_source_tree():
    package = Path(posenc_torch.__file__).resolve().parent
    assert package.parent.name in ("site-packages", "dist-packages"), package
    assert Path(posenc_torch._C.__file__).name == "_C.abi3.so"
    direct_url = _dist().read_text("direct_url.json")
    if direct_url is not None:  # pip records where it installed from
        assert not json.loads(direct_url).get("dir_info", {}).get("editable", False)


def test_the_wheel_holds_every_module_of_the_source_tree():
    """Every .py and .json file under posenc_torch/ in the source tree is installed (a
    module left out of meson.build's install lists would be missing from the wheel while the
    source tree's tests pass)."""
    source = Path(__file__).resolve().parents[1] / "posenc_torch"
    installed = Path(posenc_torch.__file__).resolve().parent
    wanted = {p.relative_to(source) for ext in ("*.py", "*.json") for p in source.rglob(ext)}
    missing = sorted(str(p) for p in wanted if not (installed / p).is_file())
    assert wanted and not missing, missing


def test_wheel_tags_say_abi3_for_cpython_3_11_on():
    tags = [line.split(":", 1)[1].strip() for line in _dist().read_text("WHEEL").splitlines()
            if line.startswith("Tag:")]
    assert len(tags) == 1, tags
    interpreter, abi, platform = tags[0].split("-")
    assert (interpreter, abi) == ("cp311", "abi3")
    assert platform.startswith("linux_"), platform


def test_requirements_accept_every_torch_from_the_target_on():
    meta = _dist().metadata
    assert meta["Requires-Python"] == ">=3.11"
    torch_reqs = [r for r in meta.get_all("Requires-Dist") if r.split(";")[0].strip()
                  .startswith("torch")]
    assert torch_reqs == [f"torch>={TARGET_TORCH[0]}.{TARGET_TORCH[1]}"]


def _audit_tool() -> str | None:
    tool = Path(sys.executable).with_name("torch-abi-audit")
    return str(tool) if tool.exists() else shutil.which("torch-abi-audit")


@pytest.mark.skipif(_audit_tool() is None,
                    reason="torch-abi-audit is installed in .venv-compat "
                           "(requirements-compat.txt); `make compat` runs this test there")
def test_abi_audit_stable_abi3_and_minimum_torch():
    package = Path(posenc_torch.__file__).resolve().parent
    out = subprocess.run([_audit_tool(), "--json", str(package)], check=True,
                         capture_output=True, text=True).stdout
    report = json.loads(out)
    assert report["error"] is None
    (ext,) = report["extensions"]
    assert ext["error"] is None
    assert ext["cpython"]["compliant"], ext["cpython"]["violations"]
    assert ext["torch"]["stable"], ext["torch"]["unstable_symbols"][:20]
    assert ext["torch"]["unstable_symbols"] == []
    assert ext["torch"]["unknown_shim_symbols"] == []
    minimum = tuple(int(p) for p in ext["torch"]["min_torch_version"].split(".")[:2])
    assert minimum <= TARGET_TORCH, ext["torch"]["version_defining_symbols"]


# ------------------------------------------------------ output layouts (empty_like's rule)


def _q_layouts():
    base = torch.randn(2, 5, 3, 8)
    yield "contiguous", base
    yield "hf-transposed", torch.randn(2, 3, 5, 8).transpose(1, 2)  # dense, permuted
    yield "batch-expanded", torch.randn(1, 5, 3, 8).expand(2, 5, 3, 8)  # overlapping
    yield "head-slice", torch.randn(2, 5, 6, 8)[:, :, ::2]  # gaps: not dense
    yield "channel-strided", torch.randn(2, 5, 3, 16)[..., ::2]  # copied for the kernel
    yield "channels-last-like", torch.randn(2, 8, 5, 3).permute(0, 2, 3, 1)


@pytest.mark.parametrize("name,q", list(_q_layouts()), ids=[n for n, _ in _q_layouts()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_output_layout_and_values_follow_the_input_layout(name, q, dtype):
    q = q.to(dtype)
    k = torch.randn(2, 5, 1, 8, dtype=dtype)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    qo, ko = torch.ops.posenc.rope(q, k, cos, sin, [], False, 0, False)
    want = torch.empty_like(q, dtype=qo.dtype)
    if want.stride(-1) != 1:
        want = torch.empty(q.shape, dtype=qo.dtype)
    assert qo.stride() == want.stride()
    assert qo.dtype == torch.result_type(q, cos)
    ref, _ = torch.ops.posenc.rope(q.contiguous(), k, cos, sin, [], False, 0, False)
    torch.testing.assert_close(qo, ref, rtol=0, atol=0)


@pytest.mark.parametrize("name,q", list(_q_layouts()), ids=[n for n, _ in _q_layouts()])
@pytest.mark.parametrize("fused", [False, True], ids=["tables", "fused"])
def test_heads_first_reads_the_caller_layout_bit_for_bit(name, q, fused):
    """heads_first=True takes q, k as (batch, heads, seq, head_dim): the same bits, in
    outputs laid out like the inputs, as the (batch, seq, heads, head_dim) call on the
    transposed views, and no copy of the inputs."""
    qh, kh = q.transpose(1, 2), torch.randn(2, 1, 5, 8)
    if fused:
        pos, inv = torch.randint(0, 5000, (2, 5)), torch.rand(4)
        rope = lambda a, b, hf: torch.ops.posenc.rope_fused(  # noqa: E731
            a, b, pos, inv, [], False, 1.0, 0, False, hf)
    else:
        cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
        rope = lambda a, b, hf: torch.ops.posenc.rope(  # noqa: E731
            a, b, cos, sin, [], False, 0, False, None, None, hf)
    qo, ko = rope(qh, kh, True)
    ref_q, ref_k = rope(q, kh.transpose(1, 2), False)
    assert qo.shape == qh.shape and ko.shape == kh.shape
    torch.testing.assert_close(qo, ref_q.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(ko, ref_k.transpose(1, 2), rtol=0, atol=0)
    if qh.stride(-1) == 1:
        want = torch.empty_like(qh)
        assert qo.stride() == (want.stride() if want.stride(-1) == 1 else qh.contiguous().stride())


def test_heads_first_messages_name_the_layout():
    q = torch.randn(2, 3, 5, 8)
    cos = torch.randn(2, 5, 8)
    with raw_raises(ValueError, r"q must be 4-D \(batch, heads, seq, head_dim\)"):
        torch.ops.posenc.rope(q[0], q, cos, cos, [], False, 0, False, None, None, True)
    with raw_raises(ValueError, "k sequence length 4 must equal q sequence length 5"):
        torch.ops.posenc.rope(q, q[:, :, :4], cos, cos, [], False, 0, False, None, None, True)
    with raw_raises(ValueError, "cos sequence length 3 must equal the sequence"):
        torch.ops.posenc.rope(q, q, cos[:, :3], cos[:, :3], [], False, 0, False, None, None,
                              True)


@pytest.mark.parametrize("q_dtype,cos_dtype", [
    (torch.bfloat16, torch.float16), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float64), (torch.float32, torch.bfloat16),
], ids=str)
def test_output_dtype_is_torch_result_type(q_dtype, cos_dtype):
    q = torch.randn(1, 2, 2, 4, dtype=q_dtype)
    cos = torch.randn(1, 2, 4, dtype=cos_dtype)
    qo, ko = torch.ops.posenc.rope(q, q, cos, cos, [], False, 0, False)
    assert qo.dtype == ko.dtype == torch.result_type(q, cos)


# ---------------------------------------------------------- checks that live in the shim


@pytest.mark.parametrize("sections", [
    [2**63 - 1, 2**63 - 1, 10],  # the sum wraps around in int64
    [2**62, 2**62, 8],
    [9, 0, 0],  # one entry alone exceeds the 8 slots
], ids=["wraps-int64", "large", "one-too-large"])
def test_raw_ops_reject_sections_larger_than_the_slots(sections):
    q = torch.randn(1, 4, 2, 16)
    pos = torch.zeros(3, 1, 4, dtype=torch.long)
    inv_freq = torch.rand(8)
    cos = torch.randn(3, 1, 4, 16)
    with raw_raises(ValueError, r"mrope_section .* must satisfy 2 \* sum == 16"):
        torch.ops.posenc.rope_fused(q, q, pos, inv_freq, sections, False, 1.0, 0, False)
    with raw_raises(ValueError, r"mrope_section .* must satisfy 2 \* sum == 16"):
        torch.ops.posenc.rope(q, q, cos, cos, sections, False, 0, False)
    with raw_raises(ValueError, r"mrope_section .* must satisfy 2 \* sum == 16"):
        torch.ops.posenc.rope_tables(pos, inv_freq, sections, False, 1.0, 0, torch.float32)


def test_raw_op_messages_are_the_plain_message():
    """Checks raise with their class tag and message alone: no source file, line or function
    of the shim."""
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(RAW_BAD_INPUT) as info:
        torch.ops.posenc.rope(q, q, torch.randn(1, 4, 16), torch.randn(1, 4, 16), [], False, 5,
                              False)
    assert str(info.value) == "ValueError: pairing must be 0 (half) or 1 (adjacent), got 5"


def test_raw_position_op_raises_value_error_naming_the_grid():
    ids = torch.tensor([[1, 5, 7, 7, 7]])  # vision start 5, image token 7: 3 tokens
    grid = torch.tensor([[1, 4, 4]])  # needs 4 tokens with merge size 2
    with raw_raises(ValueError, r"^image_grid_thw\[0\] = \(1, 4, 4\) needs 4"):
        torch.ops.posenc.mrope_position_ids(ids, grid, None, None, None, 0, 7, 8, 5, 2, 2.0)
