"""Bytes per sent entry on the wire, with and without compact indices and values, and what
coding costs.

For each model and density: the MLP on the digits data, or ResNet-50 on random images, trained
``--steps`` steps in one process with error feedback as ``SparseDistributedOptimizer`` runs it
(the compensated gradient's largest entries sent, the rest kept; ``--budget model``: one cut
over the whole model, the default, or ``layer``: top-k per variable), so the selections are
those of a run under way, not of a first gradient. Then the words one rank hands to the
allgather for that step's selections: the values (float32, or 16-bit with ``compression``) as
they are or coded (``value_coding``), and the indices as int32 (``exchange="allgather"``) or
Elias-Fano coded (``exchange="compact_allgather"``; with ``grouping="layerwise"`` each
variable's among its own entries, its values a block of their own), and the blocks ``exchange=
"sparse_allreduce"`` sends its owners (``--regions`` equal regions, headers included). Prints
bytes per entry and the time to code and decode one rank's indices and values (median of 20,
one process).

    .venv/bin/python scripts/benchmarks/bench_index_bytes.py [--models mlp,resnet50]
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)


def model_and_batches(model_name):
    """``(model, loss, batches)``: a model and an endless list of its training batches."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    if model_name == "mlp":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype("float32")
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(2048, "relu"),
                                  keras.layers.Dense(2048, "relu"), keras.layers.Dense(10)])
        batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, len(x) - 64, 64)]
    else:
        model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
        rng = np.random.RandomState(0)
        batches = [(rng.rand(8, 32, 32, 3).astype("float32"), np.arange(8) % 10)
                   for _ in range(4)]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=model_name == "mlp")
    return model, loss, batches


def selections_under_way(model_name, density, steps, budget, learning_rate=0.05):
    """``(selections, sizes)`` of the last of ``steps`` steps of plain SGD with error feedback
    on one worker: each sparse-route variable's compensated gradient ``g + residual`` sends its
    largest entries (one cut over the model, or per variable), keeps the rest."""
    import tensorflow as tf

    from sparse_hvd.feedback.payload import route_for
    from sparse_hvd.selection.density import elements_to_send
    from sparse_hvd.selection.sparsifiers import Selection

    model, loss, batches = model_and_batches(model_name)
    variables = model.trainable_variables
    routes = [route_for(v, density, 1024) for v in variables]
    residuals = [tf.zeros([r.num_elements]) if r.sparse else None for r in routes]

    @tf.function
    def gradients(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        return tape.gradient(value, variables)

    for step in range(steps):
        x, y = batches[step % len(batches)]
        grads = gradients(x, y)
        compensated = {i: tf.reshape(g, [-1]) + residuals[i]
                       for i, g in enumerate(grads) if routes[i].sparse}
        ks = {i: elements_to_send(routes[i].num_elements, density) for i in compensated}
        cuts = {i: tf.math.top_k(tf.abs(c), ks[i]).values[-1] for i, c in compensated.items()}
        if budget == "model":
            every = tf.concat([tf.abs(c) for c in compensated.values()], 0)
            cut = tf.math.top_k(every, sum(ks.values())).values[-1]
            cuts = {i: cut for i in compensated}
        selections, sizes = [], []
        for i, g in enumerate(grads):
            if i not in compensated:
                variables[i].assign_sub(learning_rate * g)
                continue
            chosen = tf.reshape(tf.where(tf.abs(compensated[i]) >= cuts[i]), [-1])
            values = tf.gather(compensated[i], chosen)
            sent = tf.scatter_nd(chosen[:, None], values, compensated[i].shape)
            residuals[i] = compensated[i] - sent
            variables[i].assign_sub(learning_rate * tf.reshape(sent, variables[i].shape))
            selections.append(Selection(values, tf.cast(chosen, tf.int32)))
            sizes.append(routes[i].num_elements)
    return selections, sizes


def measure(model_name, density, steps, budget, regions=4, repeats=20):
    import tensorflow as tf

    from sparse_hvd.exchanges import value_coding
    from sparse_hvd.exchanges.compact_allgather import CompactAllgather
    from sparse_hvd.exchanges.fused_allgather import FusedAllgather

    selections, sizes = selections_under_way(model_name, density, steps, budget)
    entries = sum(int(tf.size(s.indices)) for s in selections)
    plain = FusedAllgather(name="bench").pack_indices(selections, sizes)[0]
    compact = CompactAllgather(name="bench", compression=None)
    coded, ordered = compact.pack_indices(selections, sizes)
    counts = tf.constant([[int(tf.size(s.indices)) for s in selections]], tf.int32)

    def timed(fn):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    encode = tf.function(lambda: compact.pack_indices(selections, sizes)[0])
    decode = tf.function(lambda: compact._unpack_indices(coded, counts, sizes))
    row = {"model": model_name, "density": density, "steps": steps, "budget": budget,
           "variables": len(selections), "entries": entries, "space": sum(sizes),
           "index_bytes_plain": 4 * int(tf.size(plain)) / entries,
           "index_bytes_compact": 4 * int(tf.size(coded)) / entries,
           "encode_ms": timed(lambda: encode().numpy()) * 1e3}
    row["decode_ms"] = timed(lambda: decode().numpy()) * 1e3
    per_variable = [tf.size(s.indices) for s in ordered]
    values = tf.concat([s.values for s in ordered], 0)
    for name, item in (("float32", 4), ("float16", 2)):
        wire = tf.cast(tf.clip_by_value(values, -65504.0, 65504.0), name)
        block = value_coding.encode(wire, per_variable)
        row[f"value_bytes_{name}_compact"] = 4 * int(tf.size(block.words)) / entries
        encode_values = tf.function(lambda: value_coding.encode(wire, per_variable).words)
        fields = value_coding.header_fields(block)[tf.newaxis]
        decode_values = tf.function(lambda: value_coding.decode(block.words, counts, fields,
                                                                name))
        row[f"value_encode_ms_{name}"] = timed(lambda: encode_values().numpy()) * 1e3
        row[f"value_decode_ms_{name}"] = timed(lambda: decode_values().numpy()) * 1e3
        row[f"entry_bytes_{name}_plain"] = item + row["index_bytes_plain"]
        row[f"entry_bytes_{name}_compact_indices"] = item + row["index_bytes_compact"]
        row[f"entry_bytes_{name}_compact"] = (row[f"value_bytes_{name}_compact"]
                                             + row["index_bytes_compact"])
        row[f"entry_bytes_{name}_sparse_allreduce"] = sparse_allreduce_bytes(
            selections, sizes, name, regions) / entries
        row[f"entry_bytes_{name}_compact_layerwise"] = layerwise_compact_bytes(
            compact, selections, sizes, name) / entries
    return row


def layerwise_compact_bytes(compact, selections, sizes, compression):
    """Bytes of the codes ``exchange="compact_allgather"`` with ``grouping="layerwise"`` makes
    of one rank's ``selections``: each variable's indices coded among its own entries and its
    values in a block of their own (``compact``'s passes; headers left out, as for the grouped
    rows)."""
    import tensorflow as tf

    from sparse_hvd.exchanges import value_coding

    words = 0
    for selection, size in zip(selections, sizes):
        coded, (ordered,) = compact.pack_indices([selection], [size])
        wire = tf.cast(tf.clip_by_value(ordered.values, -65504.0, 65504.0), compression)
        block = value_coding.encode(wire, [tf.size(ordered.indices)])
        words += int(tf.size(coded)) + int(tf.size(block.words))
    return 4 * words


def sparse_allreduce_bytes(selections, sizes, compression, regions):
    """Bytes of the scatter blocks ``exchange="sparse_allreduce"`` makes of one rank's
    ``selections`` with ``regions`` equal regions (headers included)."""
    import numpy as np
    import tensorflow as tf

    from sparse_hvd.exchanges.compression import Compression
    from sparse_hvd.exchanges.regions import even_boundaries
    from sparse_hvd.exchanges.sparse_blocks import CodedBlocks

    offsets = np.cumsum([0] + list(sizes[:-1]))
    indices = tf.concat([s.indices + int(o) for s, o in zip(selections, offsets)], 0)
    values = tf.concat([s.values for s in selections], 0)
    if compression == "float16":  # as the payload holds them: rounded, saturated
        values = tf.cast(tf.cast(tf.clip_by_value(values, -65504.0, 65504.0), tf.float16),
                         values.dtype)
    blocks = CodedBlocks(Compression("float16" if compression == "float16" else "none"))
    bounds = even_boundaries(sum(sizes), regions)
    words = 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        mine = (indices >= start) & (indices < end)
        words += int(tf.size(blocks.scatter_block(
            tf.boolean_mask(indices, mine), tf.boolean_mask(values, mine),
            tf.constant(start, tf.int64), tf.constant(end - start, tf.int64))))
    return 4 * words


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,resnet50")
    parser.add_argument("--densities", default="0.01,0.001")
    parser.add_argument("--steps", type=int, default=30,
                        help="steps of error feedback before the measured selection")
    parser.add_argument("--budget", choices=("model", "layer"), default="model")
    parser.add_argument("--regions", type=int, default=4,
                        help="workers (regions) of the sparse allreduce's blocks")
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "bench_index_bytes.json"))
    args = parser.parse_args(argv)
    rows = []
    print("| model | density | entries | index bytes int32 / coded | value bytes float32 / "
          "float16 coded | entry bytes float32 int32 / coded indices / all coded | entry bytes "
          "float16 int32 / coded indices / all coded | sparse allreduce blocks float32 / "
          "float16 | one code per variable (layerwise) float32 / float16 | index encode / "
          "decode ms | float32 value encode / decode ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models.split(","):
        for density in (float(d) for d in args.densities.split(",")):
            r = measure(model, density, args.steps, args.budget, args.regions)
            rows.append(r)
            print(f"| {model} | {density} | {r['entries']:,} | {r['index_bytes_plain']:.2f} / "
                  f"{r['index_bytes_compact']:.2f} | {r['value_bytes_float32_compact']:.2f} / "
                  f"{r['value_bytes_float16_compact']:.2f} | "
                  f"{r['entry_bytes_float32_plain']:.2f} / "
                  f"{r['entry_bytes_float32_compact_indices']:.2f} / "
                  f"{r['entry_bytes_float32_compact']:.2f} | "
                  f"{r['entry_bytes_float16_plain']:.2f} / "
                  f"{r['entry_bytes_float16_compact_indices']:.2f} / "
                  f"{r['entry_bytes_float16_compact']:.2f} | "
                  f"{r['entry_bytes_float32_sparse_allreduce']:.2f} / "
                  f"{r['entry_bytes_float16_sparse_allreduce']:.2f} | "
                  f"{r['entry_bytes_float32_compact_layerwise']:.2f} / "
                  f"{r['entry_bytes_float16_compact_layerwise']:.2f} | {r['encode_ms']:.2f} / "
                  f"{r['decode_ms']:.2f} | {r['value_encode_ms_float32']:.2f} / "
                  f"{r['value_decode_ms_float32']:.2f} |", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
