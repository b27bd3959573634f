"""Bytes per sent entry on the wire, with and without compact indices, and what coding costs.

For each model and density: one real gradient (the MLP on the digits data; ResNet-50 on random
images), its top-k selection per sparse variable, as ``SparseDistributedOptimizer`` routes them,
then the words one rank hands to the allgather for them: the values (float32, or 16-bit with
``compression``) and the indices, as int32 (``exchange="allgather"``) or Elias-Fano coded
(``exchange="compact_allgather"``). Prints bytes per entry and the time to code and decode one
rank's indices (median of 20, one process).

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


def gradient_of(model_name):
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    if model_name == "mlp":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype("float32")[:64]
        y = y[:64]
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(2048, "relu"),
                                  keras.layers.Dense(2048, "relu"), keras.layers.Dense(10)])
    else:
        model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
        x = np.random.RandomState(0).rand(8, 32, 32, 3).astype("float32")
        y = np.arange(8) % 10
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=model_name == "mlp")
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True))
    return model.trainable_variables, tape.gradient(value, model.trainable_variables)


def measure(model_name, density, repeats=20):
    import tensorflow as tf

    from sparse_hvd.exchanges.compact_allgather import CompactAllgather
    from sparse_hvd.exchanges.fused_allgather import FusedAllgather
    from sparse_hvd.feedback.payload import route_for
    from sparse_hvd.selection.density import elements_to_send
    from sparse_hvd.selection.sparsifiers import Selection

    variables, grads = gradient_of(model_name)
    selections, sizes = [], []
    for variable, grad in zip(variables, grads):
        route = route_for(variable, density, 1024)
        if not route.sparse:
            continue
        flat = tf.reshape(grad, [-1])
        k = elements_to_send(route.num_elements, density)
        _, indices = tf.math.top_k(tf.abs(flat), k)
        selections.append(Selection(tf.gather(flat, indices), tf.cast(indices, tf.int32)))
        sizes.append(route.num_elements)
    entries = sum(int(tf.size(s.indices)) for s in selections)
    plain = FusedAllgather(name="bench")._pack_indices(selections, sizes)[0]
    compact = CompactAllgather(name="bench", compression=None)
    coded, _ = compact._pack_indices(selections, sizes)
    counts = tf.constant([[int(tf.size(s.indices)) for s in selections]], tf.int32)

    def timed(fn):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    encode = tf.function(lambda: compact._pack_indices(selections, sizes)[0])
    decode = tf.function(lambda: compact._unpack_indices(coded, counts, sizes))
    row = {"model": model_name, "density": density, "variables": len(selections),
           "entries": entries, "space": sum(sizes),
           "index_bytes_plain": 4 * int(tf.size(plain)) / entries,
           "index_bytes_compact": 4 * int(tf.size(coded)) / entries,
           "encode_ms": timed(lambda: encode().numpy()) * 1e3}
    row["decode_ms"] = timed(lambda: decode().numpy()) * 1e3
    for values, item in (("float32", 4), ("float16", 2)):
        row[f"entry_bytes_{values}_plain"] = item + row["index_bytes_plain"]
        row[f"entry_bytes_{values}_compact"] = item + row["index_bytes_compact"]
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,resnet50")
    parser.add_argument("--densities", default="0.01,0.001")
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "bench_index_bytes.json"))
    args = parser.parse_args(argv)
    rows = []
    print("| model | density | entries | index bytes int32 / coded | entry bytes float32 "
          "int32 / coded | entry bytes float16 int32 / coded | encode ms | decode ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models.split(","):
        for density in (float(d) for d in args.densities.split(",")):
            r = measure(model, density)
            rows.append(r)
            print(f"| {model} | {density} | {r['entries']:,} | {r['index_bytes_plain']:.2f} / "
                  f"{r['index_bytes_compact']:.2f} | {r['entry_bytes_float32_plain']:.2f} / "
                  f"{r['entry_bytes_float32_compact']:.2f} | {r['entry_bytes_float16_plain']:.2f}"
                  f" / {r['entry_bytes_float16_compact']:.2f} | {r['encode_ms']:.2f} | "
                  f"{r['decode_ms']:.2f} |", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
