"""Turn CommunicationLogger's JSON lines into a table and plots.

    python -m sparse_hvd.report run.jsonl [--out DIR]

Prints one row per epoch and, with matplotlib installed (the ``examples`` extra), writes
``communication.png`` to DIR (default: next to the log): payload per step and compression,
achieved density, residual norm, and time per step in sparsification and exchange.
"""

import argparse
import json
import os
import sys

COLUMNS = [
    ("epoch", "epoch", "{:d}"),
    ("bytes_sent_per_step", "B/step", "{:,.0f}"),
    ("compression", "x less", "{:.1f}"),
    ("density_last_step", "density %", "{:.3f}"),
    ("residual_norm", "residual", "{:.3g}"),
    ("sparsify_ms_per_step", "sparsify ms", "{:.2f}"),
    ("exchange_ms_per_step", "exchange ms", "{:.2f}"),
    ("skipped_steps", "skipped", "{:d}"),
    ("update_factor", "factor", "{:.2f}"),  # logs written before it have none: "-"
]


def read(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def table(records):
    """The records as a fixed-width text table."""
    rows = [[title for _, title, _ in COLUMNS]]
    for record in records:
        values = dict(record, epoch=record["epoch"] + 1,
                      density_last_step=100 * record["density_last_step"])
        rows.append([fmt.format(values[key]) if key in values else "-"
                     for key, _, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] + 1 for r in records]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    (payload, density), (residual, times) = axes
    payload.plot(epochs, [r["bytes_sent_per_step"] for r in records], label="sent")
    payload.plot(epochs, [r["dense_bytes_per_step"] for r in records], "--", label="dense")
    payload.set_yscale("log")
    payload.set_title("bytes per step")
    payload.legend()
    density.plot(epochs, [100 * r["density_last_step"] for r in records])
    density.set_title("achieved density of the sparse layers (%)")
    residual.plot(epochs, [r["residual_norm"] for r in records])
    residual.set_title("residual norm (rank 0)")
    times.plot(epochs, [r["sparsify_ms_per_step"] for r in records], label="sparsify")
    times.plot(epochs, [r["exchange_ms_per_step"] for r in records], label="exchange")
    times.set_title("ms per step")
    times.legend()
    for ax in axes.ravel():
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m sparse_hvd.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="JSON lines written by sparse_hvd.CommunicationLogger(path=...)")
    parser.add_argument("--out", help="folder for communication.png (default: the log's folder)")
    args = parser.parse_args(argv)
    if not os.path.exists(args.log):
        parser.error(f"no such log: {args.log}")
    records = read(args.log)
    if not records:
        parser.error(f"{args.log} holds no records")
    print(table(records))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'sparse_hvd[examples]')", file=sys.stderr)
        return 0
    out = args.out or os.path.dirname(os.path.abspath(args.log))
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "communication.png")
    plot(records, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
