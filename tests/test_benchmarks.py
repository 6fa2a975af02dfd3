"""The benchmark harness itself: it checks outputs before timing, and the suite writes its
results file and plots.  No timing is asserted anywhere."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import harness as H  # noqa: E402

TINY = H.Model("tiny", heads=4, kv_heads=2, head_dim=16, rope_theta=10000.0)


def _tiny_case(mode: str, dtype: str = "fp32") -> H.Case:
    return H.Case("test", "rope", "tiny", 2, 8, dtype, mode, torch.get_num_threads())


def _tiny_inputs(dtype=torch.float32):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf

    _, _, q, k = H.qk_as_hf(2, 8, TINY, dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    ang = torch.arange(8).float()[:, None] * inv_freq
    emb = torch.cat((ang, ang), -1)[None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    return hf, q, k, cos, sin, gq, gk


@pytest.fixture
def broken_method(monkeypatch):
    """A method whose rotation is wrong (it forgets rotate_half)."""
    monkeypatch.setitem(H.METHODS, "broken", H.Method("broken", "q * cos only", "peer"))
    return "broken"


TINY_POLICY = H.TimingPolicy(min_run_time=0.0, min_rounds=2, max_time=1.0, block_time=1e-4,
                             warmup=0)


@pytest.mark.parametrize("mode", H.MODES)
def test_run_case_checks_outputs_before_timing(mode, broken_method):
    import posenc_torch

    hf, q, k, cos, sin, gq, gk = _tiny_inputs()
    with torch.no_grad():
        ref_fwd = hf(q, k, cos, sin)
    ref_grad = torch.autograd.grad(hf(q, k, cos, sin), (q, k), (gq, gk))
    common = {"wrt": (q, k), "grad_outputs": (gq, gk)}

    def build(name):
        if name == "posenc":
            return H.Workload(lambda: posenc_torch.apply_rotary_pos_emb(q, k, cos, sin), **common)
        if name == "hf_eager":
            return H.Workload(lambda: hf(q, k, cos, sin), **common)
        if name == "broken":
            return H.Workload(lambda: (q * cos[:, None], k * cos[:, None]), **common)
        if name == "copy":
            return H.copy_workload((q, k), (gq, gk))
        raise KeyError(name)

    names = ("posenc", "hf_eager", "broken", "copy")
    results = {r.method: r for r in H.run_case(
        _tiny_case(mode), names, build, ref_fwd if mode == "fwd" else ref_grad, TINY_POLICY,
        floor=H.floor_bytes(q, k))}

    assert results["broken"].status == "failed"
    assert "not timed" in results["broken"].reason
    assert results["broken"].median_ms is None and results["broken"].samples == 0
    for name in ("posenc", "hf_eager", "copy"):
        r = results[name]
        assert r.status == "ok", r.reason
        assert r.samples >= TINY_POLICY.min_rounds and r.median_ms > 0
        assert r.p10_ms <= r.median_ms <= r.p90_ms
        assert r.ratio_to_copy is not None
    assert results["posenc"].max_rel_err <= H.VERIFY_TOL["fp32"]
    assert results["copy"].max_rel_err is None  # the floor is not checked: it is a copy
    assert results["hf_eager"].posenc_speedup is not None


def test_backward_callable_returns_the_gradients():
    hf, q, k, cos, sin, gq, gk = _tiny_inputs()
    work = H.Workload(lambda: hf(q, k, cos, sin), wrt=(q, k), grad_outputs=(gq, gk))
    expected = torch.autograd.grad(hf(q, k, cos, sin), (q, k), (gq, gk))
    bwd = H.timed_callable(work, "bwd")
    for _ in range(2):  # the retained graph serves every timed call
        got = bwd()
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    got = H.timed_callable(work, "fwdbwd")()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("floor", H.FLOORS)
def test_copy_floors_keep_the_layout(floor):
    _, q, k, _, _, gq, gk = _tiny_inputs()
    work = H.floor_workload(floor, (q, k), (gq, gk))
    qc, kc = work.timed["fwd"]()
    assert qc.stride() == q.stride() and kc.stride() == k.stride()
    assert torch.equal(qc, q) and torch.equal(kc, k)
    again = work.timed["fwd"]()
    # copy_ writes into the same preallocated tensors every call; clone allocates anew
    assert (again[0].data_ptr() == qc.data_ptr()) == (floor == "copy_into")
    assert len(work.timed["fwdbwd"]()) == 4
    assert H.floor_bytes(q, k) == 2 * (q.numel() + k.numel()) * 4


def test_topics_depend_on_the_harness_never_the_reverse():
    """harness.py imports neither run.py nor a topic; run.py lists every topic module."""
    import ast

    tree = ast.parse((BENCH / "harness.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module}
    local = {p.stem for p in BENCH.glob("*.py")}
    assert not imported & local, imported & local
    import run

    # Every bench_*.py that declares a TOPIC is a topic of run.py (the GPU cases too:
    # topic "gpu", selected for --device cuda).
    topics = {p.stem for p in BENCH.glob("bench_*.py")
              if re.search(r"^TOPIC\s*=", p.read_text(), re.M)}
    assert "bench_gpu" in topics
    assert {m.__name__ for m in run.TOPICS.values()} == topics


def test_exact_comparison_and_failures_are_reported(broken_method):
    ids = torch.arange(12).view(3, 4)

    def build(name):
        if name == "hf_eager":
            return H.Workload(lambda: (ids.clone(),))
        if name == "broken":
            return H.Workload(lambda: (ids + 1,))
        if name == "posenc":
            raise NotImplementedError("not in this build")
        if name == "copy":
            raise RuntimeError("boom")
        raise KeyError(name)

    case = H.Case("test", "ids", "tiny", 3, 4, "int64", "fwd", 1)
    results = {r.method: r for r in H.run_case(case, ("posenc", "hf_eager", "broken", "copy"),
                                               build, (ids,), TINY_POLICY, exact=True)}
    assert results["hf_eager"].status == "ok"
    assert results["broken"].status == "failed" and "exact" in results["broken"].reason
    assert results["posenc"].status == "skipped" and results["posenc"].reason == \
        "not in this build"
    assert results["copy"].status == "failed" and "boom" in results["copy"].reason


def test_gpu_only_methods_are_skipped_with_a_reason_on_cpu():
    reason = H.method_unavailable(H.METHODS["liger"], "cpu")
    assert reason and "CPU" in reason
    import posenc_torch

    reason = H.method_unavailable(H.METHODS["posenc"], "cuda")
    if posenc_torch._C.has_cuda():
        assert reason is None
    else:
        assert reason and "built without its CUDA kernels" in reason


def test_summary_statistics():
    s = H.summarize([0.004, 0.001, 0.002, 0.003, 0.005])
    assert s["median_ms"] == pytest.approx(3.0) and s["min_ms"] == pytest.approx(1.0)
    assert s["p10_ms"] == pytest.approx(1.4) and s["p90_ms"] == pytest.approx(4.6)
    assert s["iqr_ms"] == pytest.approx(2.0)
    assert H.paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == pytest.approx(2.0)


def test_driver_writes_results_and_plots(tmp_path):
    """`run.py` on tiny sizes: results JSON/CSV with machine and versions, and the PNGs."""
    pytest.importorskip("matplotlib")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--smoke", "--topics", "rope", "--threads", "1",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((tmp_path / "smoke.json").read_text())
    for key in ("cpu", "cores", "posenc_isa", "posenc_best_isa", "host_kind", "load_average"):
        assert key in payload["machine"]
    assert payload["floor_check"] == []  # the floor topic did not run
    assert "Floor check (the floor topic" in proc.stdout
    assert "NOT RUN: the floor topic was not part of this run" in proc.stdout
    assert "hostname" not in json.dumps(payload["machine"]).lower()
    assert {"torch", "transformers", "posenc_torch"} <= set(payload["versions"])
    rows = payload["results"]
    fields = set(H.Result.row_fields())
    assert rows and all(set(r) == fields for r in rows)
    ok = {(r["op"], r["mode"], r["method"]) for r in rows if r["status"] == "ok"}
    for op in ("rope", "rope_vision"):
        for mode in H.MODES:
            for method in ("posenc", "hf_eager", "hf_compile", "copy", "copy_into"):
                assert (op, mode, method) in ok, (op, mode, method)
    assert all(r["ratio_to_copy"] and r["ratio_to_copy_into"] for r in rows
               if r["status"] == "ok")
    assert all(r["status"] == "skipped" for r in rows if r["method"] == "liger")
    assert [t["target"][:2] for t in payload["targets"]] == \
        ["1.", "1b", "1c", "2a", "2b", "3.", "4.", "6.", "5a", "5b", "7.", "7b", "8a", "8b",
         "8c", "8d", "8e", "9a", "9b", "9c"]
    assert "x clone" in proc.stdout and "x copy_" in proc.stdout
    assert (tmp_path / "smoke.csv").read_text().startswith("topic,op,model")
    plots = sorted(p.name for p in (tmp_path / "plots-smoke").glob("*.png"))
    assert "rope-Llama-3-8B-time.png" in plots and "rope-Llama-3-8B-ratio.png" in plots
    assert all((tmp_path / "plots-smoke" / p).stat().st_size > 10_000 for p in plots)
    assert "Targets" in proc.stdout and "posenc" in proc.stdout
    assert payload["complete"] is True
    # the Markdown table of the docs: one row per case of each mode, posenc's numbers
    import table
    lines = table.markdown(payload, {"rope"}, {1}, {"fwd"}).splitlines()
    assert lines[0].startswith(payload["machine"]["cpu"]) and "--smoke" in lines[0]
    body = [ln.split(" | ") for ln in lines[4:]]
    assert len(body) == 2 and {b[0] for b in body} == {"| `apply_rotary_pos_emb`",
                                                       "| `apply_rotary_pos_emb_vision`"}
    assert all(b[5] == "fwd" and float(b[7]) > 0 and float(b[9]) > 0 for b in body)


def test_targets_are_data_and_read_the_rows_they_name():
    """run.TARGETS is a table: each target selects rows by field values and reads one value;
    a row past the bound is a MISS, rows of other thread counts or methods are not read."""
    import run

    case = H.Case("mrope", "mrope", "Qwen2-VL-7B", 1, 4096, "bf16", "fwd", 2)
    rows = [H.Result.for_case(case, "posenc", "ok", ratio_to_copy=1.2),
            H.Result.for_case(case, "hf_eager", "ok", ratio_to_copy=9.0),
            H.Result.for_case(dataclasses.replace(case, threads=1), "posenc", "ok",
                              ratio_to_copy=7.0)]
    by_id = {t["target"][:2]: t for t in run.evaluate_targets(rows, threads=2)}
    assert by_id["1."]["status"] == "PASS" and by_id["1."]["detail"] == ["T=4096 bf16 fwd: 1.20"]
    rows[0].ratio_to_copy = 1.31
    assert run.evaluate_targets(rows, threads=2)[0]["status"] == "MISS"
    assert by_id["2a"]["status"] == "NOT RUN"
    assert all(isinstance(t, run.Target) for t in run.TARGETS)


def test_floor_check_reads_the_floor_topic_per_variant_and_thread_count():
    """run.floor_check: per kernel variant (the case's extra) and thread count, the floor
    topic's Qwen2-VL-7B apply rows at T >= 4096 against the copy_ floor; PASS needs fp32 and
    bf16, forward and backward, each <= 1.3x; the fused rows are for information only; the
    other topics' rows and a variant's skipped rows are not read as measurements."""
    import run

    def row(dtype, mode, ratio, op="mrope", method="posenc", threads=2, seq=4096,
            isa="avx2", topic="floor", status="ok"):
        case = H.Case(topic, op, "Qwen2-VL-7B", 1, seq, dtype, mode, threads, extra=isa)
        return H.Result.for_case(case, method, status, ratio_to_copy_into=ratio,
                                 ratio_to_copy=2.0, reason="no avx512 kernels" * (status != "ok"))

    rows = [row(dt, m, 1.2) for dt in ("fp32", "bf16") for m in ("fwd", "bwd")]
    rows += [row("bf16", "fwd", 9.0, op="mrope_fused", method="posenc_fused"),
             row("bf16", "fwd", 9.0, seq=1024), row("bf16", "fwd", 9.0, threads=1),
             row("bf16", "fwdbwd", 9.0), row("fp32", "fwd", 9.0, topic="mrope", isa="")]
    (check,) = run.floor_check(rows, [2])
    assert check["isa"] == "avx2" and check["status"] == "PASS" and len(check["rows"]) == 5
    assert [r["required"] for r in check["rows"]] == [True] * 4 + [False]
    rows[1].ratio_to_copy_into = 1.31
    (check,) = run.floor_check(rows, [2])
    assert check["status"] == "MISS" and check["misses"] == ["B=1 T=4096 fp32 bwd apply"]
    one, two = run.floor_check(rows, [1, 2])
    assert one["status"] == "NOT RUN" and "fp32 fwd" in one["not_run"]
    rows.append(row("fp32", "fwd", None, isa="avx512", status="skipped"))
    checks = run.floor_check(rows, [1, 2])
    assert [(c["isa"], c["threads"]) for c in checks] == [
        ("avx2", 1), ("avx2", 2), ("avx512", 1), ("avx512", 2)]
    assert checks[3]["status"] == "NOT RUN" and checks[3]["skipped"] == ["no avx512 kernels"]
    text = run.format_floor_check(checks, {"host_kind": "AVX2-only"})
    assert "on an AVX2-only host" in text and "avx2 thr=2 => MISS" in text
    assert "avx2 thr=1 => NOT RUN" in text and "avx512 thr=2 => NOT RUN" in text
    assert "skipped: no avx512 kernels" in text


def test_floor_topic_workers_keep_freed_memory_and_force_their_variant(monkeypatch):
    """The floor topic's workers get glibc's mmap threshold and top pad raised (allocation
    out of its timings), the other topics' the allocator as it comes; its parts name the
    variant each worker forces and report a variant the CPU lacks as skipped."""
    import bench_floor
    import bench_rope
    import run

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TOP_PAD_", raising=False)
    env = run._worker_env(run.Unit(bench_floor, "apply-avx2", 4, 1, []), None)
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(1 << 32)
    assert env["MALLOC_TOP_PAD_"] == str(1 << 30)
    other = run._worker_env(run.Unit(bench_rope, "rope", 5, 1, []), None)
    assert "MALLOC_MMAP_THRESHOLD_" not in other and "MALLOC_TOP_PAD_" not in other
    assert set(bench_floor.PARTS) == {"apply-avx512bf16", "apply-avx512", "apply-avx2",
                                      "fused-avx512bf16", "fused-avx512", "fused-avx2"}
    opts = H.Options("fused-avx2", "quick", 1, "cpu", None, None)
    cases = bench_floor.plan(opts)
    assert {c.extra for c, _ in cases} == {"avx2"}
    assert {(c.seq, c.dtype, c.mode) for c, _ in cases} == {
        (t, dt, m) for t in (4096, 8192) for dt in ("fp32", "bf16") for m in ("fwd", "bwd")}
    rep = H.Reporter(sum(len(ms) for _, ms in cases), to_driver=False)
    monkeypatch.setattr(H, "apply_isa", lambda isa=None: (_ for _ in ()).throw(
        ValueError("the CPU has no avx2")))
    bench_floor.run(opts, rep)
    assert rep.results and all(r.status == "skipped" and "no avx2 kernels" in r.reason
                               for r in rep.results)


def test_driver_keeps_the_results_of_a_worker_that_dies(tmp_path, monkeypatch):
    """Results reach the driver case by case: a worker that dies midway loses only the
    cases it had not finished, which are reported as failed."""
    import run

    worker = tmp_path / "bench_dying.py"
    case = H.Case("dying", "rope", "tiny", 1, 8, "fp32", "fwd", 1)
    done = H.Result.for_case(case, "posenc", "ok", median_ms=1.0)
    worker.write_text(
        "import json, sys\n"
        f"print({H.PROGRESS_MARK!r} + json.dumps({{'done': 1, 'label': 'x', 'result': "
        f"{done.to_dict()!r}}}), flush=True)\n"
        "sys.exit(3)\n")
    module = type(sys)("bench_dying")
    module.__file__ = str(worker)
    module.TOPIC = "dying"
    unit = run.Unit(module, "p", 5, 1, [(case, ("posenc", "hf_eager"))])
    seen = []
    bar = H.ProgressBar(2)
    got = run.run_unit(unit, "smoke", "cpu", bar, None, None, seen.append)
    bar.close()
    assert [r.method for r in seen] == ["posenc"] and seen[0].median_ms == 1.0
    status = {r.method: r.status for r in got}
    assert status == {"posenc": "ok", "hf_eager": "failed"}


def test_gpu_topic_is_selected_for_cuda_runs_only():
    import bench_gpu
    import run

    assert bench_gpu.DEVICES == ("cuda",) and run.TOPICS["gpu"] is bench_gpu
    opts = H.Options("cuda", "smoke", 1, "cuda", None)
    cases = [c for c, _ in bench_gpu.plan(opts)]
    assert {c.op for c in cases} == {"rope", "mrope", "rotary_step"}
    assert any(c.extra == "decode" and c.batch == bench_gpu.DECODE_BATCH for c in cases)


@pytest.mark.transformers4
def test_positions_topic_checks_against_get_rope_index():
    """Under transformers 4.57.6: HF get_rope_index and posenc's compute_mrope_position_ids
    are both timed, after their results were found equal (else they are reported failed)."""
    import bench_positions

    opts = H.Options("qwen2_vl", "smoke", 1, "cpu", None)
    rep = H.Reporter(sum(len(m) for _, m in bench_positions.plan(opts)), to_driver=True)
    bench_positions.run(opts, rep)
    by = {r.method: r for r in rep.results}
    assert by["hf_eager"].status == "ok"
    assert by["posenc"].status == "ok", by["posenc"].reason
    assert by["posenc"].max_rel_err == 0.0  # exact comparison with get_rope_index
    ids, grids, mask = bench_positions.make_prompts(2, 256, 1)
    assert int(mask[1].sum()) < 256 and (ids == bench_positions.IMAGE_PAD).sum() == \
        int((grids[:, 0] * grids[:, 1] * grids[:, 2]).sum()) // 4


def test_every_method_has_a_label_and_a_colour():
    """plot.py (and the benchmarks notebook, which reads its tables) names and colours every
    method the suite can write, so a new method cannot reach a plot unlabelled; a method the
    tables lack still sorts (last) instead of failing the plot."""
    import bench_packing_train  # noqa: F401 - adds the padded and packed methods
    import plot

    methods = set(H.METHODS)
    assert {"padded", "packed"} <= methods
    assert methods - set(plot.LABELS) == set()
    assert methods - set(plot.COLORS) == set()
    assert sorted(["zz_new", "copy", "posenc"], key=plot.method_rank) == \
        ["posenc", "copy", "zz_new"]


def test_plots_of_a_sweep(tmp_path):
    """plot.py draws lines for a sequence sweep and both thread counts, from the file only."""
    pytest.importorskip("matplotlib")
    import plot

    def row(method, seq, threads, ms):
        case = H.Case("mrope", "mrope", "Qwen2-VL-7B", 1, seq, "bf16", "fwd", threads)
        return H.Result.for_case(
            case, method, "ok", median_ms=ms, p10_ms=0.9 * ms, p90_ms=1.1 * ms, min_ms=0.8 * ms,
            ratio_to_copy=ms / seq * 1e3 if method != "copy" else 1.0).to_dict()

    rows = [row(m, t, n, t / 1e3 * f * (2 if n == 1 else 1))
            for m, f in (("posenc", 1.2), ("hf_eager", 8.0), ("copy", 1.0))
            for t in (1024, 4096, 16384) for n in (1, 2)]
    rows.append(H.Result.for_case(
        H.Case("positions", "mrope_position_ids", "Qwen2-VL-7B", 8, 8192, "int64", "fwd", 2),
        "hf_eager", "ok", median_ms=5.0, p10_ms=4.0, p90_ms=6.0).to_dict())
    payload = {"suite": "test", "date": "2026-01-01T00:00:00+00:00",
               "machine": {"cpu": "test cpu", "usable_cores": 2, "posenc_isa": "avx2"},
               "versions": {"torch": torch.__version__, "posenc_torch": "0"}, "results": rows}
    path = tmp_path / "test.json"
    path.write_text(json.dumps(payload))
    made = sorted(Path(p).name for p in plot.main([str(path), "--out", str(tmp_path / "png")]))
    assert made == ["mrope-Qwen2-VL-7B-ratio.png", "mrope-Qwen2-VL-7B-time.png",
                    "other-time.png"]


@pytest.mark.any_transformers
def test_packing_topic_checks_against_per_example_get_rope_index():
    """The packed position-id case under the installed transformers: posenc's one call and
    the per-example loop over get_rope_index are both timed, after their results were found
    equal; the examples hold images, videos and text only, and fit the rows."""
    import transformers

    import bench_packing

    part = "qwen2_5_vl" if transformers.__version__.startswith("4.") else "qwen2_5_vl_5x"
    opts = H.Options(part, "smoke", 1, "cpu", None)
    planned = [c for c, _ in bench_packing.plan(opts) if c.op == "packed_position_ids"]
    rep = H.Reporter(sum(len(m) for _, m in bench_packing.plan(opts)), to_driver=True)
    bench_packing.run(opts, rep)
    by = {r.method: r for r in rep.results if r.op == "packed_position_ids"}
    assert by["hf_eager"].status == "ok", by["hf_eager"].reason
    assert by["posenc"].status == "ok", by["posenc"].reason
    assert by["posenc"].max_rel_err == 0.0  # exact comparison with the per-example loop
    assert len(planned) == 1 and (planned[0].batch, planned[0].seq) == (by["posenc"].batch,
                                                                        by["posenc"].seq)
    examples = bench_packing.make_examples(*bench_packing.SHAPES["quick"][:3])
    assert len(examples) == 64
    assert all(128 <= len(ex["ids"]) <= 4096 for ex in examples)
    kinds = [(bool(ex["images"]), bool(ex["videos"])) for ex in examples]
    assert {(False, False), (True, False), (False, True)} <= set(kinds)
    assert any(s % 1 for ex in examples for s in ex["seconds"])  # fractional seconds
    _, rows, ids, images, videos, _ = bench_packing.pack(examples, 65536)
    assert ids.shape[1] <= 65536 and sorted(i for r in rows for i in r) == list(range(64))
    n_image = int((ids == bench_packing.IMAGE_PAD).sum())
    assert n_image == int((images[:, 0] * images[:, 1] * images[:, 2]).sum()) // 4


@pytest.mark.any_transformers
def test_vision_topic_checks_against_transformers():
    """The vision topic under the installed transformers (5.x: vision_utils; 4.57.6: the
    models' methods): every computation and their sum timed for posenc and transformers,
    after their results were found equal; the batches are the ones the topic names."""
    import transformers

    import bench_vision

    part = "vision_4_57" if transformers.__version__.startswith("4.") else "vision_5x"
    opts = H.Options(part, "smoke", 1, "cpu", None)
    planned = bench_vision.plan(opts)
    rep = H.Reporter(sum(len(m) for _, m in planned), to_driver=True)
    bench_vision.run(opts, rep)
    assert [(r.case, r.method) for r in rep.results] == [(c, m) for c, ms in planned for m in ms]
    towers = {"vision_tower"} if part == "vision_5x" else set()
    assert {r.op for r in rep.results} == {f"vision_{c}" for c in bench_vision.COMPUTATIONS} | towers
    for r in rep.results:
        if r.method != "hf_compile" and not (r.op == "vision_tower" and r.method == "copy"):
            assert r.status == "ok", (r.op, r.method, r.reason)
    assert all(r.max_rel_err == 0.0 for r in rep.results if r.method == "posenc")
    patches = {label: sum(t * h * w for t, h, w in grids)
               for label, grids in bench_vision.BATCHES.items()}
    assert patches == {"32x896^2": 131072, "256x224^2": 65536, "8img+2vid64f": 294912}


def test_floor_check_reads_the_paired_calls_where_measured():
    """harness.measure_pairs: one ratio per round of single calls back to back; the floor
    check judges a row by the median of those (ratio_pair_copy_into) where the floor topic
    measured them, and prints the interleaved blocks' ratio next to it."""
    import run

    calls = []
    ratios = H.measure_pairs(lambda: calls.append("m"), lambda: calls.append("c"), "cpu", 4)
    assert len(ratios) == 4 and all(r > 0 for r in ratios)
    assert calls == ["c", "m", "m", "c", "c", "m", "m", "c"]
    opts = H.Options("apply-avx2", "quick", 1, "cpu", None, None)
    assert opts.policy.pair_rounds == 0
    assert dataclasses.replace(opts, paired=True).policy.pair_rounds == H.PAIR_ROUNDS["quick"]

    def row(dtype, mode, blocks, pair):
        case = H.Case("floor", "mrope", "Qwen2-VL-7B", 1, 4096, dtype, mode, 2, extra="avx2")
        return H.Result.for_case(case, "posenc", "ok", ratio_to_copy_into=blocks,
                                 ratio_pair_copy_into=pair, ratio_to_copy=2.0)

    rows = [row(dt, m, 1.5, 1.2) for dt in ("fp32", "bf16") for m in ("fwd", "bwd")]
    (check,) = run.floor_check(rows, [2])
    assert check["status"] == "PASS" and check["rows"][0]["x_copy_"] == 1.2
    assert "1.20 x copy_ (blocks  1.50)" in run.format_floor_check([check], {})
    rows[0].ratio_pair_copy_into = 1.4
    (check,) = run.floor_check(rows, [2])
    assert check["status"] == "MISS" and check["misses"] == ["B=1 T=4096 fp32 fwd apply"]
