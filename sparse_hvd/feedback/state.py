"""The public face of each rank's own state: residuals, their checkpoints, and the averages
in flight with ``staleness`` (a mixin of ``SparseDistributedOptimizer``, before
``keras.optimizers.Optimizer`` so that its ``save_own_variables``/``load_own_variables`` come
first).

Residuals (and DGC velocities, and the accumulated backward passes) are each rank's own: they
are never broadcast, a checkpoint written by one rank holds that rank's, and
:meth:`LocalState.share_residuals` makes rank 0's stand for all. Restored on another number of
workers they are rescaled so that their sum over the ranks is kept.
"""

from typing import List, Sequence, Set, Tuple

import keras
import tensorflow as tf

from ..runtime import lockstep
from ..runtime.broadcast import average_variables
from ..wrapping import without_legacy_ema_copy
from . import local_update


def filled_where_missing(store, variables: Sequence, additions: Sequence[Sequence]
                         ) -> Tuple[dict, Set[int]]:
    """A checkpoint's ``store`` of the optimizer's ``variables`` (Keras keeps them by position),
    with zeros for those it was written without, and the ids of the variables filled.

    ``additions`` are the groups of variables that releases added, oldest first, each absent
    where it does not apply (an empty group). A checkpoint written before a group existed
    lacks it and every newer one, so:

    1. the shortfall is the number of variables less the number of values stored;
    2. the newest groups are taken one by one until their sizes add up to the shortfall;
    3. those variables get zeros, the stored values the other positions, in order.

    Where no run of newest groups accounts for the shortfall the store is returned as it is
    (Keras then warns that it skips the optimizer's variables).
    """
    shortfall = len(variables) - len(store.keys())
    missing: Set[int] = set()
    for group in reversed(additions):
        if len(missing) >= shortfall:
            break
        missing |= {id(v) for v in group}
    if not shortfall or len(missing) != shortfall:
        return store, set()
    saved = iter([store[str(i)] for i in range(len(store.keys()))])
    return {str(i): tf.zeros(v.shape, v.dtype) if id(v) in missing else next(saved)
            for i, v in enumerate(variables)}, missing


class LocalState:
    """Uses the optimizer's ``_feedback`` (``ErrorFeedback``), ``_step`` (the step strategy),
    ``_accumulation``, ``process_set`` and ``_prefix``."""

    @property
    def residuals(self) -> List[keras.Variable]:
        """The error-feedback residuals, one per variable, in build order (rank-local state)."""
        return list(self._feedback.residuals)

    @property
    def local_variables(self) -> List[keras.Variable]:
        """State that is each rank's own and must not be broadcast: residuals and, with
        momentum correction, the local velocities; with ``backward_passes_per_step``, the
        accumulated gradients."""
        accumulated = list(self._accumulation.accumulators) if self._accumulation else []
        return self._feedback.local_variables + accumulated

    @property
    def residual_world_size(self):
        """The variable holding the number of workers the residuals belong to (saved with
        them; see :meth:`share_residuals`). None before the optimizer is built."""
        return self._feedback.world_size

    def share_residuals(self):
        """Make every rank's residuals (and local velocities; with ``sparsify="update"``, the
        inner optimizer's momentum or moments) their mean over the ranks.

        Residuals are each rank's own, and a checkpoint written by rank 0 holds only rank 0's.
        Called on every rank just before such a checkpoint (``ShareResidualsCallback`` does it
        at each epoch end), it makes rank 0's copy stand for all: the sum over the ranks, the
        gradient still owed to the model, is unchanged, and it is what a restore brings back.
        Restored on a different number of workers, the residuals are scaled by
        saved_workers / workers at the first step, so that sum is kept there too (the inner
        optimizer's state is a per-worker mean and is kept as it is). Eager; a collective:
        every rank must call it.
        """
        if not self.built:
            return
        self._feedback.share(self.process_set, name=f"{self._prefix}.share_residuals")
        if self.sparsify == "update":
            average_variables(local_update.own_state(self), self.process_set,
                              name=f"{self._prefix}.share_inner_state")

    def save_own_variables(self, store):
        self.hold_pending()  # the checkpoint must hold the exchanges in flight
        super().save_own_variables(store)

    def load_own_variables(self, store):
        self._step.discard()  # the restored slots replace whatever is in flight
        if self.built and self.use_ema:
            store = without_legacy_ema_copy(store, len(self.variables), self._legacy_ema_at,
                                            len(self._trainable_variables))
        # oldest first: q (the noise estimate's), the peak of a factor that follows the rate,
        # where the sparse steps began (the factor's step 4)
        additions = [self._second_moment.variables, self._step_factor.variables,
                     self._step_factor.since_variables]
        store, filled = filled_where_missing(store, self.variables, additions)
        super().load_own_variables(store)
        if any(id(q) in filled for q in self._second_moment.variables):
            self._second_moment.start_from(self._loss_scaling.base_optimizer)
        self._feedback.restored = True  # restored residuals: compare their worker count

    def rescale_residuals_after_restore(self):
        """Keep the residuals' sum over ranks when restored on another number of workers.

        Runs by itself at the first step after ``keras.models.load_model``/``load_weights``;
        call it (eagerly, on every rank) after restoring a ``tf.train.Checkpoint``. With
        ``exchange="auto"`` it also has the next dense step send the restored residuals (a
        fresh build's residuals count as sent, and ``tf.train.Checkpoint`` does not say it
        restored them).
        """
        if self.built:
            self._step.residuals_restored()
        self._feedback.rescale_after_restore(self.process_set)

    # ---- staleness: the averages in flight (sparse_hvd.steps.staleness) -------------------------

    def hold_pending(self):
        """With staleness: wait for the exchanges in flight and keep their averages in optimizer
        variables, so a checkpoint holds them (Keras' saving calls it; call it before
        ``tf.train.Checkpoint.save``). Eager; no collective."""
        self._step.hold_pending()

    def finalize_variable_values(self, var_list):
        # Keras calls this at the end of fit: with staleness, the last tau averages go in now;
        # and a rank whose data ran out early must not leave the others waiting in a step.
        self.apply_pending()
        self.assert_same_step(lockstep.FINISHED)
        self.inner_optimizer.finalize_variable_values(var_list)

    def apply_pending(self):
        """Apply every delayed average not applied yet, oldest first (eager, on every rank;
        the end of ``model.fit`` calls it, so the last ``staleness`` updates are not lost)."""
        self._step.apply_pending()

    def pending_steps(self) -> List[int]:
        """With staleness: the exchanged steps whose averages are not applied yet and not held
        in the slots, oldest first (empty without staleness)."""
        return self._step.pending_steps()

    def held_steps(self) -> List[int]:
        """With staleness: the steps whose averages the slots hold (written by
        :meth:`hold_pending` or restored from a checkpoint), sorted."""
        return self._step.held_steps()
