"""The probes' training: the 4.35M-parameter MLP on this rank's digits shard (as
``bench_step.py``'s ``mlp``), batches of 64 drawn at random, one traced step a call."""


def training(make_optimizer, rank, size):
    """``(optimizer, run_step)``: ``make_optimizer()`` built on the MLP's variables (its
    weights the same on every rank), and a function that runs one step of a new batch (rank's
    own draw) and returns the loss (a tensor)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import sparse_hvd
    from tta_worker import load_digits_shards

    (x, y), _ = load_digits_shards(0, rank, size)
    x, y = tf.constant(x), tf.constant(y)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(2048, activation="relu"),
                              keras.layers.Dense(2048, activation="relu"), keras.layers.Dense(10)])
    optimizer = make_optimizer()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    optimizer.build(variables)
    rng = np.random.default_rng(1000 + rank)

    @sparse_hvd.function(optimizer, jit_compile=False)
    def step(indices):
        with tf.GradientTape() as tape:
            loss = loss_fn(tf.gather(y, indices), model(tf.gather(x, indices), training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    def run_step():
        return step(tf.constant(rng.choice(int(x.shape[0]), 64, replace=False), tf.int32))

    return optimizer, run_step
