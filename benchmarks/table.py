"""Print a results file written by run.py as a Markdown table (the tables of README.md and
docs/benchmarks.md are pasted from this; nothing is measured here).

    python benchmarks/table.py benchmarks/results/quick.json [--topics mrope,positions]
                               [--threads 2] [--modes fwd,fwdbwd]

One row per case that posenc ran: posenc's method and median time, the time as a multiple
of the clone floor and of the copy_ floor (posenc time / floor time: 1 is the floor), and
how many times faster it is than transformers eager and compiled (their time / posenc's,
paired medians as run.py computes them).  A first line names the machine, versions and
date of the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import harness as H

OP_NAMES = {
    "rope": "`apply_rotary_pos_emb`",
    "rope_vision": "`apply_rotary_pos_emb_vision`",
    "mrope": "MRoPE, 4.x tables `apply_multimodal_rotary_pos_emb`",
    "mrope_fused": "fused `apply_rope` vs rotary module + apply",
    "rotary_step": "rotary step, ids to rotated q, k",
    "qk_norm_rope": "q/k norm + rotary (`apply_qk_norm_rope`)",
    "rope_call": "one decode call",
    "mrope_position_ids": "`compute_mrope_position_ids` vs `get_rope_index`",
    "packed_position_ids": "`compute_packed_mrope_position_ids` vs a `get_rope_index` loop",
    "vision_all": "vision tower positions (`posenc_torch.vision`, all four walks)",
}


def _x(v: float | None) -> str:
    return f"{v:.2f}" if v else ""


def _ms(v: float) -> str:
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def markdown(payload: dict, topics: set[str] | None, threads: set[int] | None,
             modes: set[str] | None) -> str:
    m, v = payload["machine"], payload["versions"]
    lines = [f"{m['cpu']}, {m['usable_cores']} cores, posenc kernels {m.get('posenc_isa')}; "
             f"torch {v.get('torch')}; {payload['command']}; {payload['date'][:10]}", "",
             "| op | model | B | T | dtype | mode | thr | posenc ms | × clone | × copy_ "
             "| × faster than eager | × faster than compiled | |",
             "|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    results = H.results_from_dicts(payload["results"])
    for key, rows in H.group_by_case(results).items():
        case = H.Case(*key)
        if (topics and rows[0].topic not in topics) or (threads and case.threads not in threads) \
                or (modes and case.mode and case.mode not in modes):
            continue
        ok = {r.method: r for r in rows if r.status == "ok"}
        ours = next((ok[k] for k in sorted(ok, key=lambda k: H.PRIMARY.get(k, 9))
                     if k in H.PRIMARY), None)
        if ours is None:
            continue
        eager, compiled = ok.get("hf_eager"), ok.get("hf_compile")
        lines.append(
            f"| {OP_NAMES.get(case.op, case.op)} | {case.model} | {case.batch} | {case.seq} | "
            f"{case.dtype} | {case.mode} | {case.threads} | {_ms(ours.median_ms)} | "
            f"{_x(ours.ratio_to_copy)} | {_x(ours.ratio_to_copy_into)} | "
            f"{_x(eager and eager.posenc_speedup)} | {_x(compiled and compiled.posenc_speedup)} "
            f"| {ours.transformers or ''} {case.extra} |".replace("  |", " |"))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--topics", help="comma-separated topics (default: all)")
    ap.add_argument("--threads", help="comma-separated thread counts (default: all)")
    ap.add_argument("--modes", help="comma-separated modes: fwd, bwd, fwdbwd (default: all)")
    a = ap.parse_args(argv)
    split = lambda s: set(s.split(",")) if s else None  # noqa: E731
    threads = {int(t) for t in a.threads.split(",")} if a.threads else None
    print(markdown(json.loads(a.results.read_text()), split(a.topics), threads, split(a.modes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
