"""Draw the benchmark plots from a results file written by run.py.

    python benchmarks/plot.py benchmarks/results/quick.json [--out DIR]

For every op and model measured over sequence lengths (batch 1): ``<op>-<model>-time.png``
(median time vs T per method, p10-p90 as error bars) and ``<op>-<model>-ratio.png`` (time /
clone-floor time per method, with the clone floor at 1, the 1.3x target line, and the
copy_ floor as its own line below 1); rows are forward,
backward and forward+backward, columns the dtypes, solid lines all threads, dashed one
thread.  Decode steps and position-id cases go to ``other-time.png`` as bars.  Everything
is read from the file; nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

MODE_LABEL = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward"}
COLORS = {"posenc": "#1b6ca8", "posenc_fused": "#0b3c66", "posenc_tables": "#6aa9d8",
          "hf_eager": "#d1495b", "hf_compile": "#edae49", "liger": "#66a182",
          "posenc_op": "#9ecae1", "hf_norm_posenc_rotary": "#8e6c8a",
          "posenc_unfused": "#b39ddb", "copy": "#555555",
          "copy_into": "#999999",
          "packed": "#1b6ca8", "padded": "#d1495b"}
LABELS = {"posenc": "posenc_torch", "posenc_fused": "posenc_torch apply_rope (fused)",
          "posenc_tables": "posenc_torch tables + apply", "hf_eager": "transformers eager",
          "hf_compile": "torch.compile(transformers)", "liger": "Liger-Kernel",
          "posenc_op": "posenc op alone",
          "hf_norm_posenc_rotary": "transformers norm + posenc_torch rotary",
          "posenc_unfused": "patch(fuse_qk_norm=False)",
          "copy": "clone q,k (allocating floor)",
          "copy_into": "copy_ into preallocated q,k (bandwidth floor)",
          "packed": "packed batch (posenc_torch.packing)", "padded": "padded batch"}
ORDER = list(COLORS)


def method_rank(method: str) -> tuple[int, str]:
    """Sort key of a method in legends and bar groups: its place in ORDER; a method ORDER
    lacks comes last (by name) instead of failing the plot."""
    return (ORDER.index(method) if method in ORDER else len(ORDER), method)


def _label(method: str, threads: int | None = None) -> str:
    """Legend text of a method (its name where LABELS lacks it), with a thread count."""
    text = LABELS.get(method, method)
    return text if threads is None else f"{text}, {threads} thr"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def _title(payload: dict) -> str:
    m = payload["machine"]
    v = payload["versions"]
    return (f"{m['cpu']}, {m['usable_cores']} cores, ISA {m.get('posenc_isa')}\ntorch "
            f"{v['torch']}, posenc_torch {v['posenc_torch']}, {payload['date'][:10]}")


def _metric_axis(ax, metric: str) -> None:
    """y label; for ratios also the clone floor (1x) and the 1.3x target line."""
    if metric == "ratio":
        ax.axhline(1.0, color=COLORS["copy"], lw=1)
        ax.axhline(1.3, color=COLORS["copy"], lw=0.8, ls=":")
        ax.set_ylabel("time / clone-floor time")
    else:
        ax.set_ylabel("median time (ms)")


def _plain_log_axis(ax) -> None:
    """Log scale with tick labels like 2, 5, 10 (not 2x10^0)."""
    from matplotlib.ticker import FormatStrFormatter, FuncFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FuncFormatter(
        lambda v, _: f"{v:g}" if f"{v:.1e}"[0] in "25" else ""))
    ax.tick_params(axis="y", which="minor", labelsize=7)


def _bars(ax, sel: list[dict], metric: str, threads: list[int]) -> None:
    """One sequence length only: a bar per method (and thread count)."""
    bars = []
    for method in sorted({r["method"] for r in sel}, key=method_rank):
        if metric == "ratio" and method == "copy":
            continue
        for n in threads:
            hit = [r for r in sel if r["method"] == method and r["threads"] == n]
            if hit and (metric == "time" or hit[0].get("ratio_to_copy")):
                bars.append((method, n, hit[0]))
    xs = range(len(bars))
    for x, (method, n, r) in zip(xs, bars):
        label = _label(method, n if len(threads) > 1 else None)
        if metric == "time":
            y = r["median_ms"]
            ax.bar(x, y, color=COLORS.get(method, "0.5"), label=label,
                   yerr=[[y - r["p10_ms"]], [r["p90_ms"] - y]], capsize=3)
        else:
            ax.bar(x, r["ratio_to_copy"], color=COLORS.get(method, "0.5"), label=label)
            ax.text(x, r["ratio_to_copy"], f"{r['ratio_to_copy']:.2f}", ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks([])
    _plain_log_axis(ax)
    seq = sel[0]["seq"] if sel else ""
    ax.set_xlabel(f"T = {seq}")
    _metric_axis(ax, metric)
    ax.grid(True, axis="y", which="both", alpha=0.3)


def _sweep_figure(plt, rows: list[dict], op: str, model: str, metric: str, title: str):
    modes = [m for m in MODE_LABEL if any(r["mode"] == m for r in rows)]
    dtypes = sorted({r["dtype"] for r in rows})
    threads = sorted({r["threads"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(len(modes), len(dtypes), squeeze=False,
                             figsize=(max(7.5, 5.2 * len(dtypes)), 3.4 * len(modes)))
    for i, mode in enumerate(modes):
        for j, dtype in enumerate(dtypes):
            ax = axes[i][j]
            sel = [r for r in rows if r["mode"] == mode and r["dtype"] == dtype]
            ax.set_title(f"{MODE_LABEL[mode]}, {dtype}", fontsize=10)
            if len({r["seq"] for r in rows}) == 1:
                _bars(ax, sel, metric, threads)
                continue
            for method in sorted({r["method"] for r in sel}, key=method_rank):
                if metric == "ratio" and method == "copy":
                    continue
                for n, style in zip(threads, ("-", "--", ":")):
                    pts = sorted((r for r in sel if r["method"] == method and
                                  r["threads"] == n), key=lambda r: r["seq"])
                    if metric == "ratio":
                        pts = [r for r in pts if r.get("ratio_to_copy")]
                    if not pts:
                        continue
                    xs = [r["seq"] for r in pts]
                    label = _label(method, n if len(threads) > 1 else None)
                    if metric == "time":
                        ys = [r["median_ms"] for r in pts]
                        err = [[y - r["p10_ms"] for y, r in zip(ys, pts)],
                               [r["p90_ms"] - y for y, r in zip(ys, pts)]]
                        ax.errorbar(xs, ys, yerr=err, fmt="o" + style, ms=4, capsize=2,
                                    color=COLORS.get(method, "0.5"), label=label)
                    else:
                        ys = [r["ratio_to_copy"] for r in pts]
                        ax.plot(xs, ys, "o" + style, ms=4, color=COLORS.get(method, "0.5"),
                                label=label)
            ax.set_xscale("log", base=2)
            seqs = sorted({r["seq"] for r in sel})
            ax.set_xticks(seqs, [f"{t // 1024}k" if t >= 1024 else str(t) for t in seqs])
            ax.minorticks_off()
            _plain_log_axis(ax)
            _metric_axis(ax, metric)
            ax.set_xlabel("sequence length T")
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for row in axes:
        for ax in row:
            h, lab = ax.get_legend_handles_labels()
            for a, b in zip(h, lab):
                if b not in labels:
                    handles.append(a)
                    labels.append(b)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8)
    what = "time" if metric == "time" else "time relative to cloning q and k (clone floor)"
    fig.suptitle(f"{op} {model}: {what}\n{title}", fontsize=10)
    fig.tight_layout(rect=(0, 0.07 + 0.02 * (len(labels) > 3), 1, 0.92))
    return fig


def _other_figure(plt, rows: list[dict], title: str):
    cases = sorted({(r["op"], r["model"], r["batch"], r["seq"], r["dtype"], r["mode"],
                     r["threads"], r["extra"]) for r in rows})
    methods = sorted({r["method"] for r in rows}, key=method_rank)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases)), 4.2))
    width = 0.8 / max(len(methods), 1)
    for k, method in enumerate(methods):
        xs, ys = [], []
        for i, c in enumerate(cases):
            hit = [r for r in rows if (r["op"], r["model"], r["batch"], r["seq"], r["dtype"],
                                       r["mode"], r["threads"], r["extra"]) == c
                   and r["method"] == method]
            if hit:
                xs.append(i + (k - (len(methods) - 1) / 2) * width)
                ys.append(hit[0]["median_ms"])
        ax.bar(xs, ys, width, color=COLORS.get(method, "0.5"), label=_label(method))
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{c[0]}\n{c[1]}\nB={c[2]} T={c[3]} {c[4]}\n{c[7]} thr={c[6]}"
                        for c in cases], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("median time (ms)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"decode steps and position ids\n{title}", fontsize=10)
    fig.tight_layout()
    return fig


def main(argv: Sequence[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a results JSON written by run.py")
    p.add_argument("--out", help="plot directory (default: plots-<file name>/ beside the file)")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(args.results)
    payload = json.loads(path.read_text())
    out = Path(args.out) if args.out else path.parent / f"plots-{path.stem}"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):
        old.unlink()
    rows = [r for r in payload["results"] if r["status"] == "ok"]
    title = _title(payload)
    made = []

    sweep = [r for r in rows if r["batch"] == 1 and r["seq"] > 1 and r["op"] !=
             "mrope_position_ids"]
    for op, model in sorted({(r["op"], r["model"]) for r in sweep}):
        sel = [r for r in sweep if r["op"] == op and r["model"] == model]
        for metric in ("time", "ratio"):
            if metric == "ratio" and not any(r.get("ratio_to_copy") for r in sel):
                continue
            fig = _sweep_figure(plt, sel, op, model, metric, title)
            name = out / f"{_slug(op)}-{_slug(model)}-{metric}.png"
            fig.savefig(name, dpi=90)
            plt.close(fig)
            made.append(str(name))

    other = [r for r in rows if r not in sweep]
    if other:
        fig = _other_figure(plt, other, title)
        name = out / "other-time.png"
        fig.savefig(name, dpi=90)
        plt.close(fig)
        made.append(str(name))
    return made


if __name__ == "__main__":
    files = main()
    print("\n".join(files))
    sys.exit(0)
