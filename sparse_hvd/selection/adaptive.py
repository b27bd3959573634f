"""Layer-wise adaptive density after LAGS-SGD (Shi et al., 2020).

With the layer-wise exchange, a layer's gradient travels while backprop of the layers below it
is still running. Its exchange is free as long as it fits in that remaining backward time; a
layer whose gradient comes last (the input layers) has no time left and should send little.
:class:`AdaptiveDensity` chooses each layer's density that way, from two measurements of the
live job:

* communication cost: a latency/bandwidth model ``t(bytes) = alpha + beta * bytes`` fitted to
  timed Horovod allgathers of two sizes (:func:`probe_allgather_costs`,
  :func:`fit_latency_bandwidth`) at start-up and again every ``probe_steps``. The probes are
  sized from the job's own payload (a layer's selection at ``density``) and are rare, so that
  measuring costs far less than it saves: by default under 1% of the bytes the selections put
  on the wire (counted in ``communication_stats()["measurement_bytes"]``);
* compute left after each layer: inside the training step, a timestamp is taken when each
  gradient becomes available; the window of layer i is the time from its gradient to the last
  gradient of the step (the end of backprop), smoothed over steps.

Every ``refresh_steps`` steps (and once early, at step ``first_refresh``) the windows and the cost
model are averaged over the ranks (so all ranks decide the same) and :func:`solve_densities`
picks the densities, which are stored in an optimizer variable: identical on every rank, saved
with checkpoints, visible in ``optimizer.layer_stats()``.
"""

import tensorflow as tf

from ..runtime import collectives, startup as runtime
from ..runtime.stamps import time_after
from .density import DensityPolicy, elements_to_send, register_density_policy, validate_density

DEFAULT_PROBE_BYTES = (4096, 65536, 524288, 2097152)  # for the probe functions called alone


def probe_sizes_for(payload_bytes):
    """Two allgather sizes that bracket the per-layer payloads ``payload_bytes`` of a job: the
    smallest (at least 1 KiB, at most 64 KiB) and the largest (at least 4x the smallest, at most
    1 MiB): the range where the model is used, with no megabyte probes for a kilobyte payload."""
    payload_bytes = [int(b) for b in payload_bytes] or [4096]
    small = min(max(min(payload_bytes), 1024), 65536)
    large = min(max(max(payload_bytes), 4 * small), 1 << 20)
    return small - small % 4, large - large % 4


def fit_latency_bandwidth(sizes, times):
    """Least-squares ``t = alpha + beta * size``; alpha >= 0, beta > 0. TF float64 tensors."""
    sizes = tf.cast(sizes, tf.float64)
    times = tf.cast(times, tf.float64)
    mean_size, mean_time = tf.reduce_mean(sizes), tf.reduce_mean(times)
    variance = tf.reduce_sum(tf.square(sizes - mean_size))
    beta = tf.reduce_sum((sizes - mean_size) * (times - mean_time)) / variance
    beta = tf.maximum(beta, 1e-15)
    alpha = tf.maximum(mean_time - beta * mean_size, 0.0)
    return alpha, beta


def probe_allgather_costs(name, sizes_bytes=DEFAULT_PROBE_BYTES, repeats=5, process_set=None):
    """Median seconds of a Horovod allgather of each per-rank size, and a keep-alive value.

    Returns ``(medians, keep_alive)``, float64. Works eagerly and inside a traced step alike:
    each timed collective waits for the previous one through control dependencies, so the
    timings do not overlap. In a graph, the caller must consume ``keep_alive`` (e.g. assign it
    to a variable): Grappler prunes a collective whose result nothing uses, and the timing
    would then measure nothing. Must be called on every rank with the same arguments. Alone
    (no other worker) every time is zero.
    """
    return _probe_costs(name, "allgather", sizes_bytes, repeats, process_set)


def probe_allreduce_costs(name, sizes_bytes=DEFAULT_PROBE_BYTES, repeats=5, process_set=None):
    """:func:`probe_allgather_costs` for a Horovod allreduce (op=Average) of each size."""
    return _probe_costs(name, "allreduce", sizes_bytes, repeats, process_set)


def _probe_costs(name, collective, sizes_bytes, repeats, process_set):
    if runtime.size(process_set) == 1:
        return tf.zeros([len(sizes_bytes)], tf.float64), tf.zeros([], tf.float64)
    token = tf.constant(0.0, tf.float64)
    medians, keep_alive = [], []
    for size in sizes_bytes:
        samples = []
        for repeat in range(repeats + 1):  # the first of each size is a warm-up
            with tf.control_dependencies([token]):
                payload = tf.zeros([size // 4], tf.float32) + tf.cast(token * 0.0, tf.float32)
                start = tf.timestamp()
            with tf.control_dependencies([start]):
                probe_name = f"{name}.{collective}_probe.{size}.{repeat}"
                if collective == "allgather":
                    result = collectives.allgather(payload, name=probe_name, process_set=process_set)
                else:
                    result = collectives.allreduce(payload, name=probe_name, process_set=process_set)
            keep_alive.append(tf.cast(result[0], tf.float64))
            with tf.control_dependencies([result]):
                token = tf.timestamp()
            if repeat:
                samples.append(token - start)
        ordered = tf.sort(tf.stack(samples))
        medians.append(ordered[len(samples) // 2])
    return tf.stack(medians), tf.add_n(keep_alive)


def solve_densities(windows, alpha, beta, num_elements, bytes_per_entry, sparse,
                    min_density, max_density, budget_bytes=None):
    """The LAGS choice: per layer, the largest density whose exchange hides in its window.

    1. bytes_i = (window_i - alpha) / beta: what fits in the backward time left after layer
       i's gradient;
    2. density_i = bytes_i / (bytes_per_entry_i * n_i), clamped to [min_density, max_density];
    3. all exchanges share one link: if their summed time exceeds the longest window (the
       whole backward pass after the first gradient), scale the payloads down to fit;
    4. with ``budget_bytes``, also scale down so the step's payload stays within it;
    5. clamp again (min_density wins over the scalings). Dense-route layers get 1.0.

    All inputs are float64 tensors or Python numbers of shape [V] or scalars.
    """
    windows = tf.cast(windows, tf.float64)
    n = tf.cast(num_elements, tf.float64)
    per_entry = tf.cast(bytes_per_entry, tf.float64)
    sparse = tf.convert_to_tensor(sparse, tf.bool)
    fits = tf.maximum(windows - alpha, 0.0) / beta
    density = tf.clip_by_value(fits / (per_entry * n), min_density, max_density)
    zeros = tf.zeros_like(density)
    payload = tf.where(sparse, density * n * per_entry, zeros)
    total_time = tf.reduce_sum(tf.where(sparse, alpha + beta * payload, zeros))
    scale = tf.minimum(tf.reduce_max(windows) / tf.maximum(total_time, 1e-30), 1.0)
    if budget_bytes is not None:
        scale = tf.minimum(scale, budget_bytes / tf.maximum(tf.reduce_sum(payload), 1e-30))
    density = tf.clip_by_value(density * scale, min_density, max_density)
    return tf.where(sparse, density, tf.ones_like(density))


class AdaptiveDensity(DensityPolicy):
    """Layer-wise adaptive density from the measured communication and compute of the job.

    Use it with ``grouping="layerwise"`` (the optimizer warns otherwise: with one fused group
    there is no overlap to fill).

    Args:
        density: the density every layer uses until the first refresh; also the density the
            optimizer uses to decide which variables are worth sparsifying.
        min_density, max_density: the clamp for every layer's density.
        budget_bytes: optional cap on one rank's payload per step, in bytes.
        refresh_steps: re-decide every this many steps, from the backward windows measured
            in the steps (no extra traffic).
        first_refresh: the step of the first decision (the first steps trace and warm up).
        probe_bytes: per-rank allgather sizes timed for the cost model; None (the default):
            two sizes bracketing the job's per-layer payloads at ``density``
            (:func:`probe_sizes_for`).
        probe_repeats: timings per size (the median is used), after one untimed warm-up.
        probe_steps: re-fit the cost model at the refreshes on multiples of this many steps
            (default ``10 * refresh_steps``); it is also fitted once when the optimizer is
            built. The network changes far more slowly than the backward windows.
    """

    requires_layerwise = True
    supports_staleness = False

    def __init__(self, density=0.01, min_density=0.001, max_density=0.1, budget_bytes=None,
                 refresh_steps=200, first_refresh=10, probe_bytes=None, probe_repeats=3,
                 probe_steps=None):
        self.final_density = validate_density(density)
        self.min_density = validate_density(min_density, "min_density")
        self.max_density = validate_density(max_density, "max_density")
        if not self.min_density <= self.final_density <= self.max_density:
            raise ValueError(
                "need `min_density` <= `density` <= `max_density`, got "
                f"{self.min_density}, {self.final_density}, {self.max_density}"
            )
        if budget_bytes is not None and not budget_bytes > 0:
            raise ValueError(f"`budget_bytes` must be positive, got {budget_bytes!r}")
        if probe_steps is None:
            probe_steps = 10 * refresh_steps if isinstance(refresh_steps, int) else refresh_steps
        for argument, value in (("refresh_steps", refresh_steps), ("first_refresh", first_refresh),
                                ("probe_repeats", probe_repeats), ("probe_steps", probe_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{argument}` must be a positive int, got {value!r}")
        if probe_bytes is not None and (len(probe_bytes) < 2 or any(int(b) < 4 for b in probe_bytes)
                                        or len(set(probe_bytes)) < 2):
            raise ValueError("`probe_bytes` needs at least two different sizes of >= 4 bytes, got "
                             f"{probe_bytes!r}")
        self.budget_bytes = budget_bytes
        self.refresh_steps = refresh_steps
        self.first_refresh = first_refresh
        self.probe_bytes = None if probe_bytes is None else tuple(int(b) for b in probe_bytes)
        self.probe_repeats = int(probe_repeats)
        self.probe_steps = probe_steps
        self.densities = None

    def get_config(self):
        return {
            "density": self.final_density,
            "min_density": self.min_density,
            "max_density": self.max_density,
            "budget_bytes": self.budget_bytes,
            "refresh_steps": self.refresh_steps,
            "first_refresh": self.first_refresh,
            "probe_bytes": None if self.probe_bytes is None else list(self.probe_bytes),
            "probe_repeats": self.probe_repeats,
            "probe_steps": self.probe_steps,
        }

    # ---- hooks called by the optimizer ---------------------------------------------------------

    def prepare(self, optimizer, variables, routes):
        count = len(variables)
        self._name = f"sparse_hvd.{optimizer.name}.lags"
        self._process_set = optimizer.process_set
        self._num_elements = [r.num_elements for r in routes]
        # what an entry of this exchange takes on the wire (coded exchanges: about half of a
        # value and an int32 index), at the density the policy aims at
        exchange = optimizer._exchange  # exchange="auto": the allgather it starts from
        self._bytes_per_entry = [exchange.sent_bytes_per_entry(self.final_density, r.itemsize)
                                 for r in routes]
        self._sparse = [r.sparse for r in routes]
        self._probe_sizes = self.probe_bytes or probe_sizes_for(
            [elements_to_send(n, self.final_density) * b
             for n, b, sparse in zip(self._num_elements, self._bytes_per_entry, self._sparse)
             if sparse])
        # Decisions and the cost model: identical on every rank, saved with the optimizer.
        self.densities = optimizer.add_variable(
            shape=(count,), dtype="float32", name="lags_density",
            initializer=lambda shape, dtype: tf.fill(shape, tf.constant(self.final_density, dtype)),
        )
        self.cost_model = optimizer.add_variable(shape=(2,), dtype="float64", name="lags_cost_model")
        # Measurements: this rank's own, not checkpointed.
        with tf.init_scope():
            self.windows = tf.Variable(tf.zeros([count], tf.float64), trainable=False)
            self.measured_steps = tf.Variable(tf.zeros([], tf.int64), trainable=False)
            self._probe_sink = tf.Variable(tf.zeros([], tf.float64), trainable=False)
            self.probe_bytes_sent = tf.Variable(tf.zeros([], tf.int64), trainable=False)
            self.cost_model.assign(self._fit_cost_model())
        self._ready = {}

    def gradient_ready(self, index, grad):
        self._ready[index] = time_after(grad)  # not chained to the other stamps (runtime.stamps)

    def end_step(self, step):
        ready, self._ready = self._ready, {}
        if not ready:
            return
        indices = sorted(ready)
        times = tf.stack([ready[i] for i in indices])
        window = tf.reduce_max(times) - times  # backward time left after each gradient
        update = tf.scatter_nd([[i] for i in indices], window, [len(self._num_elements)])
        seen = tf.scatter_nd([[i] for i in indices], tf.ones([len(indices)], tf.bool),
                             [len(self._num_elements)])
        first = tf.equal(self.measured_steps, 0)
        smoothed = tf.where(first, update, 0.8 * self.windows + 0.2 * update)
        self.windows.assign(tf.where(seen, smoothed, self.windows))
        self.measured_steps.assign_add(1)
        step = tf.cast(step, tf.int64)
        due = tf.logical_or(
            tf.equal(step, self.first_refresh),
            tf.logical_and(step > self.first_refresh, tf.equal(step % self.refresh_steps, 0)),
        )
        tf.cond(due, lambda: self._refresh(step), lambda: None)

    def k(self, index, num_elements, step):
        k = tf.cast(tf.math.ceil(tf.cast(self.densities[index], tf.float64) * num_elements), tf.int32)
        return tf.clip_by_value(k, 1, num_elements)

    def current_density(self, index, step):
        return float(self.densities[index].numpy())

    def measurement_bytes(self):
        return int(self.probe_bytes_sent.numpy()) if self.densities is not None else 0

    # ---- internals -----------------------------------------------------------------------------

    def _average_over_ranks(self, tensor, what):
        if runtime.size(self._process_set) == 1:
            return tensor
        return collectives.allreduce(tensor, name=f"{self._name}.{what}",
                                     process_set=self._process_set)

    def _fit_cost_model(self):
        times, keep_alive = probe_allgather_costs(
            self._name, self._probe_sizes, self.probe_repeats, self._process_set
        )
        self._probe_sink.assign(keep_alive)
        if runtime.size(self._process_set) > 1:
            self.probe_bytes_sent.assign_add(sum(self._probe_sizes) * (self.probe_repeats + 1))
        alpha, beta = fit_latency_bandwidth(tf.constant(self._probe_sizes, tf.float64), times)
        return self._average_over_ranks(tf.stack([alpha, beta]), "cost_model")

    def _refresh(self, step):
        cost_model = tf.cond(tf.equal(step % self.probe_steps, 0), self._fit_cost_model,
                             lambda: tf.convert_to_tensor(self.cost_model))
        self.cost_model.assign(cost_model)
        windows = self._average_over_ranks(tf.convert_to_tensor(self.windows), "windows")
        densities = solve_densities(
            windows, cost_model[0], cost_model[1], self._num_elements, self._bytes_per_entry,
            self._sparse, self.min_density, self.max_density, self.budget_bytes,
        )
        self.densities.assign(tf.cast(densities, tf.float32))


register_density_policy("adaptive", AdaptiveDensity)
