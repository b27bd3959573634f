"""Steps to dense's validation loss: does the sparse exchange train like dense, step for step?

What it measures
    For each workload (``workloads.py``: a character LSTM and a transformer on the Python
    documentation, a CNN and a residual network with batch norm on MNIST digits, the digits
    MLP), each number of workers and each method, ``--seeds`` training runs under ``mpirun``
    (``steps_worker.py``), each with the same steps, per-worker batch, learning-rate schedule and
    inner optimizer (SGD with momentum 0.9 unless the method says otherwise; the ``_adam``
    workloads, ``charlm_adam``, ``cnn_adam`` and ``resnet_adam``, train the same models with
    Adam, the ``_plain_sgd`` ones with a plain SGD, the ``_nesterov`` ones with Nesterov's
    momentum, the ``_rmsprop`` ones with RMSprop, ``cnn_adagrad``, ``resnet_adagrad`` and
    ``cnn_nadam`` with Adagrad and Nadam, ``cnn_lion`` and ``resnet_lion`` with Lion). Rank
    0 records the validation loss every ``--eval-every`` steps.

The target rule
    1. Each curve is smoothed: the validation loss at an evaluation point is the mean of it and
       its two neighbours (the held-out sets are small; this keeps a single lucky evaluation
       from deciding).
    2. The target is dense's smoothed validation loss at half of the run (step S/2), the mean
       over dense's seeds.
    3. A run reaches it at step s: the first evaluation point at or below the target, linearly
       interpolated with the point before it. The steps ratio is s / (S/2); a run that never
       reaches it counts as S / (S/2) = 2 and is marked.
    4. Per method: the mean ratio over seeds and the largest; dense's own seeds give the noise
       (their ratios scatter around 1). Final validation loss: mean and min-max over seeds,
       against dense's min-max.
    Bytes: what each worker handed to Horovod over the whole run, as a share of a dense float32
    exchange (``communication_stats()``; a dense phase counts as dense).

Run
    .venv/bin/python scripts/benchmarks/bench_steps_to_loss.py --workloads cnn,charlm \\
        --workers 4,8 --methods dense,topk,default --seeds 0,1,2 --out results/steps
    .venv/bin/python scripts/benchmarks/bench_steps_to_loss.py --report results/steps \\
        --publish docs     # tables (Markdown), JSON and a plot from the runs so far

Time to dense's loss on an emulated cluster (``--rate``)
    With ``--rate 1gbit`` (or any tc rate) every worker count runs on an emulated cluster of
    that many workers (``scripts/emulated_cluster.py``: one network namespace per worker, each
    link shaped in both directions, MPI over TCP across the links), and the wrapper keeps the
    library's own default exchange (``exchange="auto"``: the run is what a user's run is,
    measured trials and a dense phase included; without ``--rate`` the sparse methods run the
    allgather, to measure what the sparse exchange does step for step). Each run then also
    gives its time to the target: the training time (evaluations left out, the first step's
    tracing included) at the step it reaches dense's loss, interpolated between evaluations.
    A run that never reaches it counts its whole training time and is marked. The speed-up is
    dense's mean time over the method's. Before each run the benchmark waits (at most
    ``--load-wait`` seconds) for the 1-minute load average to fall to ``--max-load`` and
    records it; the report marks a group with a run that started above it as not publishable,
    and ``--publish`` refuses it. Timed runs are kept apart from the loopback runs (their key
    has the link), so one ``--out`` may hold both.

Each finished run is appended to ``<out>/runs.jsonl`` at once, so a long benchmark can be
stopped and resumed (runs already there are skipped). Convergence does not depend on timing,
so the machine's load does not change the steps, only how long they take.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # scripts/: launching
sys.path.insert(0, HERE)

import emulated_cluster as ec  # noqa: E402  (standard library only)
import launching  # noqa: E402

# Adam's learning rate for each model: the best for dense of three (one process standing in for
# 4 workers, batch 64, seed 0, final validation loss): charlm 0.003 / 0.01 / 0.03 gave
# 1.68 / 1.39 / 1.35; cnn 0.0003 / 0.001 / 0.003 gave 0.119 / 0.063 / 0.045
ADAM_CHARLM_LR = 0.03
ADAM_CNN_LR = 0.003
# the transformer's, the same way (one process, batch 64, seed 0, 800 steps): 0.001 / 0.003
# gave 2.102 / 1.812; 0.01 / 0.03 were at 2.288 / 2.492 by step 640 / 600 (stopped there)
ADAM_CHARTF_LR = 0.003
# the wide CNN's SGD learning rate, chosen the same way: 0.02 / 0.05 / 0.1 gave 0.063 / 0.047 /
# 0.051
CNN_WIDE_LR = 0.05
# the residual network's, the same way (4 workers, seed 0): 0.02 / 0.05 / 0.1 gave 0.0574 /
# 0.0474 / 0.0484
RESNET_LR = 0.05
# ... and with Adam: 0.001 / 0.003 / 0.01 gave 0.0551 / 0.0467 / 0.0485
ADAM_RESNET_LR = 0.003

# the LSTM's SGD learning rate: dense at 4 workers, seed 0, 2.0 / 3.0 / 4.0 gave 1.4071 /
# 1.3498 / 1.5380; 3.0 is kept as a workload of its own (charlm_lr3), not the benchmark's rate:
# at 8 workers it left one seed of three of dense (and of the default) far behind the others
# (final 1.48 against 1.31-1.32; docs/steps_to_loss_charlm_lr3.md)
CHARLM_LR = 2.0

# Per workload: the inner optimizer (tuned for dense at 4 workers: the best of 3 learning
# rates), the run length and the evaluation interval; "model" names the data and model of
# workloads.py when the workload is another recipe (optimizer) for one of them.
SETTINGS = {
    "cnn": {"inner": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "steps": 800, "eval_every": 20},
    "cnn_wide": {"inner": {"name": "sgd", "lr": CNN_WIDE_LR, "momentum": 0.9}, "steps": 800,
                 "eval_every": 20},
    "charlm": {"inner": {"name": "sgd", "lr": CHARLM_LR, "momentum": 0.9, "clipnorm": 1.0},
               "steps": 800, "eval_every": 20},
    "resnet": {"inner": {"name": "sgd", "lr": RESNET_LR, "momentum": 0.9}, "steps": 800,
               "eval_every": 20},
    "mlp": {"inner": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "steps": 400, "eval_every": 10},
    # the same models trained with Adam, as many users would (learning rate: the best of 3)
    "charlm_adam": {"model": "charlm", "inner": {"name": "adam", "lr": ADAM_CHARLM_LR,
                                                 "clipnorm": 1.0},
                    "steps": 800, "eval_every": 20},
    "cnn_adam": {"model": "cnn", "inner": {"name": "adam", "lr": ADAM_CNN_LR}, "steps": 800,
                 "eval_every": 20},
    # the wide CNN (a model whose step the network bounds at 1 Gbit/s) with the CNN's Adam
    # learning rate (not tuned for it)
    "cnn_wide_adam": {"model": "cnn_wide", "inner": {"name": "adam", "lr": ADAM_CNN_LR},
                      "steps": 800, "eval_every": 20},
    "resnet_adam": {"model": "resnet", "inner": {"name": "adam", "lr": ADAM_RESNET_LR},
                    "steps": 800, "eval_every": 20},
    # a transformer trains with Adam: the best of 0.001 / 0.003 / 0.01 / 0.03 for dense
    "chartf": {"inner": {"name": "adam", "lr": ADAM_CHARTF_LR}, "steps": 800, "eval_every": 20},
    # ... or with AdamW, as most transformers are (GPT-style decay 0.1; Adam's rate, not tuned)
    "chartf_adamw": {"model": "chartf", "inner": {"name": "adamw", "lr": ADAM_CHARTF_LR,
                                                  "weight_decay": 0.1},
                     "steps": 800, "eval_every": 20},
}


def _with_inner(workload, **inner):
    """``workload``'s settings with these entries of its inner optimizer's replaced."""
    base = SETTINGS[workload]
    return {**base, "model": base.get("model", workload), "inner": {**base["inner"], **inner}}


# the LSTM at other rates, to measure how the default's gap depends on it; the CNN and the
# residual network at 1.5x their rates (dense's side of default_lr_x1.5)
SETTINGS.update({"charlm_lr3": _with_inner("charlm", lr=3.0),
                 "charlm_lr4": _with_inner("charlm", lr=4.0),
                 "cnn_lr075": _with_inner("cnn", lr=0.075),
                 "resnet_lr075": _with_inner("resnet", lr=0.075)})

# the three models under a plain SGD, where the defaults cut the gradient
# (sparsify="gradient") and take no factor; the rate the best for dense at 4 workers, seed 0
# (final validation loss): the CNN's 0.05 / 0.1 / 0.2 / 0.5 / 1.0 gave 0.1373 / 0.0947 /
# 0.0737 / 0.0846 / diverged, the residual network's 0.2 / 0.5 / 1.0 gave 0.0575 / 0.0500 /
# 0.0562, the LSTM's (clipnorm 1.0 as with momentum) 5 / 10 / 20 gave 1.9599 / 2.0199 / 1.8488
SETTINGS.update({"cnn_plain_sgd": _with_inner("cnn", lr=0.2, momentum=0.0),
                 "resnet_plain_sgd": _with_inner("resnet", lr=0.5, momentum=0.0),
                 "charlm_plain_sgd": _with_inner("charlm", lr=20.0, momentum=0.0)})

# the models under SGD with Nesterov's momentum at the momentum recipe's rates (what a user
# switching it on keeps), where the defaults are those of SGD's momentum (the factor too)
SETTINGS.update({f"{name}_nesterov": _with_inner(name, nesterov=True)
                 for name in ("cnn", "resnet", "charlm")})

# ... and under RMSprop (an optimizer that keeps a state per entry: the update cut), the rate
# the best for dense at 4 workers, seed 0 (final validation loss): the CNN's 0.0003 / 0.001 /
# 0.003 / 0.01 gave 0.1355 / 0.0650 / 0.0477 / 0.0523, the residual network's 0.0003 / 0.001 /
# 0.003 gave 0.0887 / 0.0487 / 0.0464 (its validation loss jumps about mid-run at either of the
# larger two), the LSTM's (clipnorm 1.0 as with SGD) 0.003 / 0.01 / 0.03 gave 2.0050 / 1.4225 /
# 1.3185 (larger not tried; Adam's best there is 0.03 too)
SETTINGS.update({f"{model}_rmsprop": {**SETTINGS[model], "model": model,
                                      "inner": {"name": "rmsprop", **inner}}
                 for model, inner in (("cnn", {"lr": 0.003}), ("resnet", {"lr": 0.003}),
                                      ("charlm", {"lr": 0.03, "clipnorm": 1.0}))})

# ... and under Adagrad and Nadam, the rate the best for dense at 4 workers, seed 0 (final
# validation loss): the CNN's Adagrad 0.01 / 0.03 / 0.1 / 0.3 gave 0.2489 / 0.1068 / 0.0716 /
# 0.0786, its Nadam 0.001 / 0.003 / 0.01 / 0.03 0.0652 / 0.0510 / 0.0429 / 0.0840; the residual
# network's Adagrad 0.03 / 0.1 / 0.3 0.0827 / 0.0523 / 0.0554; the CNN's Lion 0.0001 / 0.0003
# / 0.001 / 0.003 0.1682 / 0.0642 / 0.0789 / 0.0854, the residual network's Lion 0.0001 / 0.0003
# / 0.001 0.1019 / 0.0615 / 0.0706
SETTINGS.update({f"{model}_{name}": {**SETTINGS[model], "model": model,
                                     "inner": {"name": name, "lr": lr}}
                 for model, name, lr in (("cnn", "adagrad", 0.1), ("cnn", "nadam", 0.01),
                                         ("resnet", "adagrad", 0.1), ("cnn", "lion", 0.0003),
                                         ("resnet", "lion", 0.0003))})

# the behaviour before the warm-up default and the model-wide budget (explicitly off)
OLD = {"warmup_steps": 0, "budget": "layer"}
# the ablations measured per layer (before the model-wide budget became the default)
PER_LAYER = {"budget": "layer"}

# name -> (description, SparseDistributedOptimizer kwargs, or None for the hand-written dense
# allreduce; "inner" overrides the workload's inner optimizer)
METHODS = {
    "dense": ("Horovod grouped_allreduce of every gradient (the baseline)", None),
    "default": ("SparseDistributedOptimizer(opt, density=0.01): the library's defaults (the "
                "warm-up and one budget for the whole model)", {"density": 0.01}),
    "default_0.001": ("the defaults at density=0.001", {"density": 0.001}),
    "default_0.1": ("the defaults at density=0.1 (no warm-up: it starts at 10%)", {"density": 0.1}),
    "default_0.005": ("the defaults at density=0.005, between the measured 1% and 0.1%: the "
                      "400-step warm-up and the factor (1.65, 2.0), both interpolated",
                      {"density": 0.005}),
    "gradient": ("the defaults with sparsify='gradient': the averaged sparse gradient goes to "
                 "the inner optimizer (the default before sparsify existed)",
                 {"density": 0.01, "sparsify": "gradient"}),
    "gradient_25": ("the gradient cut with the warm-up from 25% (the default of two releases "
                    "ago, before the 10% start and sparsify)",
                    {"density": {"class_name": "warmup", "config": {
                        "density": 0.01, "initial_density": 0.25, "warmup_steps": 200}},
                     "sparsify": "gradient"}),
    "gradient_0.001": ("the gradient cut at density=0.001 (the previous default for SGD with "
                       "momentum; its published runs: the warm-up from 25%)",
                       {"density": 0.001, "sparsify": "gradient"}),
    "gradient_0.1": ("the gradient cut at density=0.1 (no warm-up: it starts at 10%)",
                     {"density": 0.1, "sparsify": "gradient"}),
    "update": ("the defaults with sparsify='update': each worker runs the inner optimizer on "
               "its own gradient and its update is cut, error-fed and averaged",
               {"density": 0.01, "sparsify": "update"}),
    "update_0.1": ("sparsify='update' at density=0.1 (no warm-up: it starts at 10%)",
                   {"density": 0.1, "sparsify": "update"}),
    "default_warmup_25": ("the defaults with the previous release's warm-up start: 25% -> 1% "
                          "over 200 steps (WarmupDensity(0.01, 0.25, 200))",
                          {"density": {"class_name": "warmup", "config": {
                              "density": 0.01, "initial_density": 0.25, "warmup_steps": 200}}}),
    "default_warmup_steps_400": ("the defaults with a 400-step warm-up at 1% (10% -> 1%, "
                                 "warmup_steps=400): does the slower fall that carried the "
                                 "factor at 0.1% help at 1% too? (the default since it did)",
                                 {"density": 0.01, "warmup_steps": 400}),
    "default_warmup_steps_200": ("the defaults with the 200-step warm-up at 1% of the releases "
                                 "before the 400-step one",
                                 {"density": 0.01, "warmup_steps": 200}),
    "default_clipnorm_2": ("the defaults with the inner optimizer's clipnorm 2.0 (the LSTM's 1.0 "
                           "times sqrt(4)): does the clipping of each worker's own gradient "
                           "under the update cut hold the LSTM back?",
                           {"density": 0.01, "inner": {"clipnorm": 2.0}}),
    "default_lr_1.4": ("the defaults with the inner optimizer's learning rate 1.4 (the LSTM's "
                       "0.7x)", {"density": 0.01, "inner": {"lr": 1.4}}),
    "default_momentum_0.8": ("the defaults with the inner SGD's momentum 0.8 instead of 0.9",
                             {"density": 0.01, "inner": {"momentum": 0.8}}),
    "default_lr_x1.5": ("the defaults with the workload's learning rate times 1.5 (dense keeps "
                        "its own; the dense route's variables step at 1.5x too) and "
                        "update_scale=1.0 (the defaults before it): does error feedback want "
                        "a larger step?",
                        {"density": 0.01, "lr_scale": 1.5, "update_scale": 1.0}),
    "default_lr_x1.25": ("default_lr_x1.5 at the factor 1.25 (update_scale=1.0)",
                         {"density": 0.01, "lr_scale": 1.25, "update_scale": 1.0}),
    "default_0.001_update_scale_1.5": ("the defaults at density=0.001 with update_scale=1.5 "
                                       "(the factor the default takes at 1% only)",
                                       {"density": 0.001, "update_scale": 1.5}),
    "default_update_scale_1": ("the defaults with update_scale=1.0 (the default before the "
                               "larger sparse step under SGD's momentum), to time the factor's "
                               "own work beside the default",
                               {"density": 0.01, "update_scale": 1.0}),
    "default_0.001_update_scale_2": ("the defaults at density=0.001 with update_scale=2.0: "
                                     "does a lower density, whose held entries wait longer, "
                                     "want a larger factor?",
                                     {"density": 0.001, "update_scale": 2.0}),
    "default_0.001_warmup_400": ("the defaults at density=0.001 with a 400-step warm-up: the "
                                 "density falls tenfold per 200 steps, as the 1% default's "
                                 "does, from 10% to 0.1% (warmup_steps=400)",
                                 {"density": 0.001, "warmup_steps": 400}),
    "default_0.001_warmup_400_update_scale_2": ("the defaults at density=0.001 with the "
                                                "400-step warm-up and update_scale=2.0",
                                                {"density": 0.001, "warmup_steps": 400,
                                                 "update_scale": 2.0}),
    "default_0.001_warmup_400_scale_grows": ("the defaults at density=0.001 with the 400-step "
                                             "warm-up and the 1% default's factor, "
                                             "update_scale=(1.5, 2.0)",
                                             {"density": 0.001, "warmup_steps": 400,
                                              "update_scale": [1.5, 2.0]}),
    "default_0.001_update_scale_3": ("the defaults at density=0.001 with update_scale=3.0",
                                     {"density": 0.001, "update_scale": 3.0}),
    "default_0.001_update_scale_grows": ("the defaults at density=0.001 with the 1% "
                                         "default's factor, update_scale=(1.5, 2.0): 1.5 at "
                                         "the largest rate so far, 2.0 as the rate falls to 0",
                                         {"density": 0.001, "update_scale": [1.5, 2.0]}),
    "default_0.001_update_scale_1_to_2": ("the defaults at density=0.001 with "
                                          "update_scale=(1.0, 2.0): dense's step at the peak "
                                          "rate, twice it as the rate falls to 0",
                                          {"density": 0.001, "update_scale": [1.0, 2.0]}),
    "default_update_scale_1.25_to_2": ("the defaults with update_scale=(1.25, 2.0): a smaller "
                                       "factor at the peak rate (where the CNN lags), the "
                                       "same 2.0 as the rate falls to 0",
                                       {"density": 0.01, "update_scale": [1.25, 2.0]}),
    "default_update_scale_1.5_to_2": ("the defaults with update_scale=(1.5, 2.0), SGD's "
                                      "momentum's factor at 1%, named (for an optimizer "
                                      "whose default is 1.0: RMSprop)",
                                      {"density": 0.01, "update_scale": [1.5, 2.0]}),
    "default_update_scale_2_const": ("the defaults with update_scale=2.0 at 1%: every sparse "
                                     "step twice the cut update's mean (Lion: the mean of N "
                                     "workers' signs is up to sqrt(N) smaller than the sign "
                                     "of their mean)", {"density": 0.01, "update_scale": 2.0}),
    "default_update_scale_2_to_3": ("the defaults with update_scale=(2.0, 3.0): 2 at the peak "
                                    "rate, 3 as it falls to 0", {"density": 0.01,
                                                                 "update_scale": [2.0, 3.0]}),
    "default_update_scale_3_to_4": ("the defaults with update_scale=(3.0, 4.0): 3 at the peak "
                                    "rate, 4 as it falls to 0", {"density": 0.01,
                                                                 "update_scale": [3.0, 4.0]}),
    "default_update_scale_3_const": ("the defaults with update_scale=3.0 at 1%",
                                     {"density": 0.01, "update_scale": 3.0}),
    "default_update_scale_4.25_const": ("the defaults with update_scale=4.25 at 1% (1.5 "
                                        "sqrt(8): the factor 3 of 4 workers scaled with "
                                        "sqrt(N))", {"density": 0.01, "update_scale": 4.25}),
    "default_update_scale_1.5_to_1.75": ("the defaults with update_scale=(1.5, 1.75): the "
                                         "factor at the peak rate as the default's, growing "
                                         "to 1.75, not 2.0, as the rate falls to 0",
                                         {"density": 0.01, "update_scale": [1.5, 1.75]}),
    "default_ramp_whole_warmup": ("the defaults with the factor reached over the whole "
                                  "density warm-up (200 steps), not its first quarter, so it "
                                  "grows as the density falls (step_factor.RAMP_SHARE = 1)",
                                  {"density": 0.01, "scale_ramp_share": 1}),
    "default_scale_grows_late": ("the defaults with the pair's factor growing only once the "
                                 "rate falls below half its peak: 1.5 down to half the peak "
                                 "rate, then linearly to 2.0 at 0 (step_factor.GROWS_BELOW = "
                                 "0.5)", {"density": 0.01, "scale_grows_below": 0.5}),
    "default_scale_follows_rate": ("the defaults with the factor's excess over 1 times the "
                                   "schedule's rate over its peak (a probe: the factor falls "
                                   "back to 1 as the cosine schedule's rate falls to 0)",
                                   {"density": 0.01, "update_scale": 1.5,
                                    "scale_follows_rate": True}),
    "default_scale_against_rate": ("the defaults with the factor's excess over 1 times 2 - the "
                                   "schedule's rate over its peak (a probe: 1.5 at the peak, "
                                   "2.0 as the rate falls to 0)",
                                   {"density": 0.01, "update_scale": 1.5,
                                    "scale_follows_rate": "against"}),
    "default_update_scale_1.5": ("the defaults with update_scale=1.5 (its runs in "
                                 "docs/steps_to_loss_update_scale.md: the averaged sparse "
                                 "update alone, no ramp; since, the whole step reached over "
                                 "the warm-up, and the default under SGD's momentum until it "
                                 "grew as the rate falls)",
                                 {"density": 0.01, "update_scale": 1.5}),
    "default_update_scale_1.5_all_cut": ("update_scale=1.5 with min_elements=64: every "
                                         "variable cut, so every step scaled (under SGD's "
                                         "momentum default_lr_x1.5's arithmetic)",
                                         {"density": 0.01, "update_scale": 1.5,
                                          "min_elements": 64}),
    "default_no_warmup": ("the defaults without the warm-up (warmup_steps=0): 1% from the first "
                          "step", {"density": 0.01, "warmup_steps": 0}),
    "default_margin_1.2": ("the defaults with auto's previous dense margin: a sparse step must "
                           "be 1.2x faster than dense's, not 1.5x (DENSE_WITHIN = 0.2)",
                           {"density": 0.01, "dense_within": 0.2}),
    "default_whole_margin": ("the defaults with auto's previous rule: the warm-up's trials "
                             "ask the whole 1.5x margin too (NOISE_WITHIN = DENSE_WITHIN)",
                             {"density": 0.01, "noise_within": 0.5}),
    "default_dense_first": ("the defaults with auto's first decision forced to dense (what a "
                            "noisy first trial or a fast link does inside the warm-up)",
                            {"density": 0.01, "first_decision": "dense"}),
    "default_late_switch": ("the defaults with exchange='auto' named in a run by steps, its "
                            "decisions forced: dense at the warm-up's first three trials, the "
                            "allgather from its fourth (the path of a 10 Gbit/s run whose late "
                            "trial read dense slow)",
                            {"density": 0.01, "exchange": "auto",
                             "decisions": ["dense", "dense", "dense", "allgather", "allgather"]}),
    "default_late_switch_factor": ("default_late_switch with the factor as before after a dense "
                                   "phase (step_factor.AFTER_DENSE_AT_RATE = False)",
                                   {"density": 0.01, "exchange": "auto",
                                    "after_dense_at_rate": False,
                                    "decisions": ["dense", "dense", "dense", "allgather",
                                                  "allgather"]}),
    "default_late_switch_scale_1": ("default_late_switch with update_scale=1.0 (no factor on "
                                    "the sparse steps)",
                                    {"density": 0.01, "exchange": "auto", "update_scale": 1.0,
                                     "decisions": ["dense", "dense", "dense", "allgather",
                                                   "allgather"]}),
    "default_auto_dense": ("the defaults with exchange='auto' choosing dense at every trial "
                           "of an 800-step run (decisions forced): what auto's dense steps "
                           "cost against Horovod's, its trials included",
                           {"density": 0.01, "decisions": ["dense"] * 5}),
    "default_early_switch": ("the defaults with exchange='auto' named in a run by steps, its "
                             "decisions forced: dense at the warm-up's first trial, the "
                             "allgather from its second (step 129)",
                             {"density": 0.01, "exchange": "auto",
                              "decisions": ["dense", "allgather", "allgather", "allgather",
                                            "allgather"]}),
    "default_early_switch_factor": ("default_early_switch with the factor as before after a "
                                    "dense phase (step_factor.AFTER_DENSE_AT_RATE = False)",
                                    {"density": 0.01, "exchange": "auto",
                                     "after_dense_at_rate": False,
                                     "decisions": ["dense", "allgather", "allgather",
                                                   "allgather", "allgather"]}),
    "default_recheck_dense": ("the defaults with auto's previous early re-check: dense runs "
                              "in it after any first loss (trial_rules.early_recheck 'all')",
                              {"density": 0.01, "early_recheck": "all"}),
    "default_hopeless_once": ("the defaults with auto's previous compute rule: one dense turn "
                              "read as compute-bound ends the trial (HOPELESS_RETIMES = 0)",
                              {"density": 0.01, "hopeless_retimes": 0}),
    "default_sign_margin_1.5": ("the defaults with auto's previous margin for Adam's signs: "
                                "their step must be 1.5x faster than dense's, as top-k's "
                                "(Exchange.dense_within None)", {"density": 0.01,
                                                                 "sign_dense_within": None}),
    "default_no_hold": ("the defaults with auto's previous re-check rule: the choice until "
                        "then is not held (measured.HOLD_WITHIN = 0)",
                        {"density": 0.01, "hold_within": 0.0}),
    "per_layer": ("the warm-up with a budget per layer (budget='layer': the previous default)",
                  {"density": 0.01, "budget": "layer"}),
    "per_layer_0.001": ("the previous default at 0.1%", {"density": 0.001, "budget": "layer"}),
    "topk": ("top-k 1%, error feedback, the inner momentum after the exchange (the default two "
             "releases ago)", {"density": 0.01, **OLD}),
    "topk_0.001": ("the old default at 0.1%", {"density": 0.001, **OLD}),
    "topk_0.05": ("the old default at 5%", {"density": 0.05, **OLD}),
    "warmup": ("DGC's warm-up: WarmupDensity 25% -> 1% over the first 20% of the steps",
               {"density": {"class_name": "warmup", "config": {
                   "density": 0.01, "initial_density": 0.25, "warmup_steps": "20%"}},
                **PER_LAYER}),
    "dense_start": ("dense (density 1) for the first 5% of the steps, then top-k 1%",
                    {"density": {"class_name": "dense_start", "config": {
                        "density": 0.01, "dense_steps": "5%"}}, **PER_LAYER}),
    "dgc": ("DGC's recipe: the warm-up default plus momentum correction with masking (inner SGD "
            "without momentum)",
            {"density": 0.01, "momentum_correction": 0.9, "inner": {"momentum": 0.0},
             **PER_LAYER}),
    "mc_masked": ("DGC momentum correction with masking (inner SGD without momentum)",
                  {"density": 0.01, "momentum_correction": 0.9, "warmup_steps": 0,
                   "inner": {"momentum": 0.0}, **PER_LAYER}),
    "mc": ("momentum correction without masking (inner SGD without momentum)",
           {"density": 0.01, "momentum_correction": 0.9, "momentum_masking": False,
            "warmup_steps": 0, "inner": {"momentum": 0.0}, **PER_LAYER}),
    "local_clip": ("the defaults with DGC's local gradient clipping (clipping='local')",
                   {"density": 0.01, "clipping": "local", **PER_LAYER}),
    "topk_noclip": ("top-k 1%, the inner optimizer without clipnorm",
                    {"density": 0.01, "inner": {"clipnorm": None}, **OLD}),
    "small_dense_32k": ("top-k 1%, variables under 32,768 entries dense",
                        {"density": 0.01, "min_elements": 32768, **OLD}),
    "model_budget": ("top-k 1% over the whole model (one cut for all layers)",
                     {"density": 0.01, **OLD, "budget": "model"}),
    "adaptive": ("LAGS: AdaptiveDensity(0.01, min 0.1%, max 10%), grouping='layerwise'",
                 {"density": {"class_name": "adaptive", "config": {
                     "density": 0.01, "min_density": 0.001, "max_density": 0.1}},
                  "grouping": "layerwise"}),
    "sign": ("exchange='sign': every entry of each worker's compensated update (gradient for "
             "a plain SGD) as its sign and a mean magnitude per 64 entries (one per variable "
             "before the twenty-sixth session), 1/26 of dense's bytes sent",
             {"exchange": "sign"}),
    "sign_mean": ("exchange='sign' with second_moment='mean_estimate': each worker's Adam "
                  "second moment corrected for its N times smaller batch",
                  {"exchange": "sign", "second_moment": "mean_estimate"}),
    "sign_own": ("exchange='sign' with second_moment='own': each worker's Adam divides by its "
                 "own second moment (the default with AdamW before it took the noise estimate)",
                 {"exchange": "sign", "second_moment": "own"}),
    "sign_noise": ("exchange='sign' with second_moment='noise_estimate': each worker's Adam "
                   "second moment corrected for its N times smaller batch, the noise read "
                   "over the second moment's own horizon",
                   {"exchange": "sign", "second_moment": "noise_estimate"}),
    "sign_per_variable": ("exchange='sign_per_variable' with the noise estimate: one float32 "
                          "scale per variable (the default before the scales per 64 entries)",
                          {"exchange": "sign_per_variable",
                           "second_moment": "noise_estimate"}),
    "topk_sign2": ("exchange='topk_sign2': the top 1% as they are, the next 9% (the band) as "
                   "their signs times their mean magnitude, the rest as theirs (two bits an "
                   "entry)", {"density": 0.01, "exchange": "topk_sign2"}),
    "topk_sign_pairs": ("exchange='topk_sign_pairs': the top 1% as they are and one sign for "
                        "each pair of other entries (the sign of their sum) times the "
                        "least-squares scale (half a bit an entry)",
                        {"density": 0.01, "exchange": "topk_sign_pairs"}),
    "topk_sign_pairs_0.001": ("exchange='topk_sign_pairs' at density=0.001: the top 0.1% as "
                              "they are and one sign for each pair of other entries",
                              {"density": 0.001, "exchange": "topk_sign_pairs"}),
    "topk_auto": ("exchange='auto' named: top-k 1% with auto among the top-k exchanges and "
                  "dense (the default with SGD's momentum before topk_sign)",
                  {"density": 0.01, "exchange": "auto"}),
    "topk_sign": ("exchange='topk_sign': the top 1% of each worker's compensated update as "
                  "it is and the sign of every other entry times their mean magnitude (the "
                  "default with SGD's momentum)", {"density": 0.01, "exchange": "topk_sign"}),
    "update_mean": ("the defaults (the update cut at 1%) with second_moment='mean_estimate'",
                    {"density": 0.01, "second_moment": "mean_estimate"}),
    "update_noise": ("the defaults (the update cut at 1%) with second_moment='noise_estimate' "
                     "(Adam's step corrected for its own gradient's noise; on Nadam: the "
                     "probe b5157df)",
                     {"density": 0.01, "second_moment": "noise_estimate"}),
    "small_dense": ("top-k 1%, variables under 16,384 entries dense (Paddle's rule)",
                    {"density": 0.01, "min_elements": 16384, **OLD}),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="cnn,charlm")
    parser.add_argument("--workers", default="4")
    parser.add_argument("--methods", default="dense,topk,default")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=None, help="override every workload's")
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "steps"))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--rate", default=None,
                        help="run on an emulated cluster with links of this rate (tc spelling, "
                             "e.g. 1gbit) and time each run to the target")
    parser.add_argument("--delay", default=None, help="one-way delay added to the links (netem)")
    parser.add_argument("--max-load", type=float, default=1.5,
                        help="timed runs: wait for the 1-minute load average to fall to this")
    parser.add_argument("--load-wait", type=float, default=600,
                        help="timed runs: seconds to wait for it at most")
    parser.add_argument("--name", default="steps_to_loss",
                        help="--publish writes NAME.{md,json,png}")
    parser.add_argument("--report", default=None, metavar="DIR",
                        help="only report the runs in DIR/runs.jsonl")
    parser.add_argument("--publish", default=None, metavar="DIR",
                        help="write steps_to_loss.{md,json,png} into DIR")
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.workers = [int(n) for n in args.workers.split(",") if n]
    args.methods = [m for m in args.methods.split(",") if m]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    for method in args.methods:
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    if args.rate is not None:
        try:
            ec.parse_rate(args.rate)
        except ValueError as error:
            parser.error(f"--rate: {error}")
    return args


def resolve_steps(value, steps):
    """``"5%"`` of ``steps`` as an int; numbers pass through."""
    if isinstance(value, str) and value.endswith("%"):
        return max(1, round(steps * float(value[:-1]) / 100))
    return value


# settings a method may set that steps_worker applies before the build: exchange="auto"'s, and
# the factor's schedule of the probes (scale_follows_rate, scale_grows_below, scale_ramp_share)
AUTO_SETTINGS = ("dense_within", "noise_within", "first_decision", "decisions", "early_recheck",
                 "hopeless_retimes", "sign_dense_within", "hold_within",
                 "scale_follows_rate", "scale_grows_below", "scale_ramp_share",
                 "after_dense_at_rate")


def options_for(workload, method, steps):
    """The worker's ``--options``: the inner optimizer and the wrapper's kwargs."""
    inner = dict(SETTINGS[workload]["inner"])
    wrapper = METHODS[method][1]
    if wrapper is None:
        return {"inner": inner, "wrapper": None}
    wrapper = json.loads(json.dumps(wrapper))
    inner.update(wrapper.pop("inner", {}))
    inner["lr"] = inner["lr"] * wrapper.pop("lr_scale", 1)
    margins = {key: wrapper.pop(key) for key in AUTO_SETTINGS if key in wrapper}
    density = wrapper.get("density")
    if isinstance(density, dict):
        config = density["config"]
        for key in ("warmup_steps", "dense_steps"):
            if key in config:
                config[key] = resolve_steps(config[key], steps)
    options = {"inner": inner, "wrapper": {"name": f"sparse_{method.replace('.', '_')}", **wrapper}}
    # auto's settings (steps.measured.DENSE_WITHIN, NOISE_WITHIN, the first decision; steps_worker)
    options.update(margins)
    return options


def git_head():
    import subprocess

    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_key(run):
    return (run["workload"], run["workers"], run.get("link"), run["method"], run["seed"])


def load_runs(out):
    path = os.path.join(out, "runs.jsonl")
    if not os.path.exists(path):
        return []
    runs = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                run = json.loads(line)
                runs[run_key(run)] = run  # a run repeated later replaces the earlier one
    return list(runs.values())


class Clusters:
    """One emulated cluster per worker count, built when first needed, torn down on exit
    (``--rate``); without ``--rate`` the jobs run on this machine's loopback."""

    def __init__(self, rate, delay):
        self.rate, self.delay = rate, delay
        self.open = {}
        self.links = {}

    def __enter__(self):
        if self.rate is not None:
            reason = ec.namespaces_unavailable()
            if reason:
                raise SystemExit(f"--rate {self.rate}: {reason}; an emulated cluster needs root "
                                 "and network namespaces")
            ec.exit_on_signals()
        return self

    def __exit__(self, *exc):
        for cluster in self.open.values():
            cluster.teardown()

    def command(self, workers, argv):
        if self.rate is None:
            return launching.mpirun_command(workers, launching.python_argv(argv),
                                            yield_when_idle=True)
        if workers not in self.open:
            cluster = ec.EmulatedCluster(workers, rate=self.rate, delay=self.delay)
            cluster.setup()
            self.open[workers] = cluster
            self.links[workers] = cluster.measured_link()
            print(f"[bench] {workers} workers on {self.rate} links: "
                  f"{self.links[workers]['throughput_mbit']:,.0f} Mbit/s measured, RTT "
                  f"{self.links[workers]['rtt_us']:.0f} us", flush=True)
        return self.open[workers].mpirun_command([sys.executable, "-u", *argv])


def train(args):
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    done = {run_key(r) for r in load_runs(args.out)}
    env = launching.mpi_environment()
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    worker = os.path.join(HERE, "steps_worker.py")
    timed = args.rate is not None
    # seeds outermost: a partial benchmark has every method for the first seeds
    with Clusters(args.rate, args.delay) as clusters:
        for seed in args.seeds:
            for workload in args.workloads:
                for workers in args.workers:
                    for method in args.methods:
                        if (workload, workers, args.rate, method, seed) in done:
                            continue
                        steps = args.steps or SETTINGS[workload]["steps"]
                        tag = f"{workload}_np{workers}_{method}_s{seed}"
                        if timed:
                            tag += f"_{args.rate}"
                        result = os.path.join(args.out, "logs", tag + ".json")
                        command = clusters.command(workers, [
                            worker, "--workload", SETTINGS[workload].get("model", workload),
                            "--label", workload, "--method", method, "--seed", str(seed),
                            "--steps", str(steps),
                            "--eval-every", str(SETTINGS[workload]["eval_every"]),
                            "--exchange", "library" if timed else "allgather",
                            "--options", json.dumps(options_for(workload, method, steps)),
                            "--json", result])
                        load = (launching.wait_for_idle(args.max_load, args.load_wait) if timed
                                else None)
                        finished = launching.run_bounded(command, env, args.timeout)
                        with open(os.path.join(args.out, "logs", tag + ".log"), "w") as f:
                            f.write(finished.output)
                        if finished.returncode != 0 or not os.path.exists(result):
                            print(f"[bench] {tag}: FAILED (exit {finished.returncode}, "
                                  f"timed out: {finished.timed_out}); log in {args.out}/logs",
                                  flush=True)
                            continue
                        with open(result) as f:
                            run = json.load(f)
                        run["commit"] = git_head()
                        if timed:
                            run.update(link=args.rate, link_measured=clusters.links[workers],
                                       load_before=load, max_load=args.max_load)
                        with open(os.path.join(args.out, "runs.jsonl"), "a") as f:
                            f.write(json.dumps(run) + "\n")
                        print(f"[bench] {tag}: final val loss "
                              f"{run['curve'][-1]['val_loss']:.4f}, bytes "
                              f"{run['bytes_fraction']:.4f} of dense, identical replicas "
                              f"{run['replicas_identical']}, training {run['train_seconds']:.0f} s"
                              f"{'' if load is None else f', load before {load:.2f}'}, "
                              f"{finished.seconds:.0f} s", flush=True)


# ---- the target rule ---------------------------------------------------------------------------

def smoothed(curve):
    """(steps, losses): each evaluation's validation loss averaged with its neighbours."""
    steps = [p["step"] for p in curve]
    losses = [p["val_loss"] for p in curve]
    out = []
    for i in range(len(losses)):
        window = losses[max(0, i - 1):i + 2]
        out.append(sum(window) / len(window))
    return steps, out


def loss_at(curve, step):
    steps, losses = smoothed(curve)
    for (s0, l0), (s1, l1) in zip(zip(steps, losses), zip(steps[1:], losses[1:])):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return losses[-1]


def steps_to(curve, target):
    """The first (interpolated) step at which the smoothed loss is at or below ``target``."""
    steps, losses = smoothed(curve)
    for i, (s, l) in enumerate(zip(steps, losses)):
        if l <= target:
            if i == 0:
                return float(s)
            s0, l0 = steps[i - 1], losses[i - 1]
            return s0 + (s - s0) * (l0 - target) / (l0 - l)
    return None


def seconds_at(curve, step):
    """The training seconds (cumulative, evaluations left out) at ``step``, interpolated between
    the evaluations around it; None for a curve without timings."""
    points = [(p["step"], p["train_seconds"]) for p in curve if "train_seconds" in p]
    if not points:
        return None
    points = [(0, 0.0)] + [p for p in points if p[0] > 0]
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    return points[-1][1]


SLOW_STEP = 4  # time_spent: a step over this many steady steps is a trace or a dense turn


def time_spent(run, step):
    """Where a run's time to ``step`` went, from rank 0's step times (None where the run did
    not keep that many): the steps' sum, what they would cost at the run's steady step, the
    first 20 steps' time and the excess of its steps over ``SLOW_STEP`` steady ones (traces
    and the trials' dense turns; the rest of the excess is the warm-up's higher density and
    the trials' other turns)."""
    times, steady = run.get("first_step_seconds") or [], run["median_step_seconds"]
    count = int(round(step))
    if count > len(times):
        return None
    spent = times[:count]
    return {"sum": sum(spent), "at_steady": steady * count, "first_20": sum(spent[:20]),
            "slow_excess": sum(t - steady for t in spent if t > SLOW_STEP * steady)}


def timing_row(mine, target):
    """A timed method's seconds to ``target`` per seed (a run that never reaches it: its whole
    training time), its steady-state step, where its time went (:func:`time_spent`) and the
    loads its runs started at."""
    seconds, spent = [], []
    for r in mine:
        reached = steps_to(r["curve"], target)
        step = r["steps"] if reached is None else reached
        seconds.append(seconds_at(r["curve"], step))
        spent.append(time_spent(r, step))
    return {"seconds_to_target": seconds,
            "seconds_to_target_mean": statistics.mean(seconds),
            "median_step_seconds": statistics.mean(r["median_step_seconds"] for r in mine),
            "time_spent": spent,
            "loads_before": [r.get("load_before") for r in mine],
            "decisions": [r.get("exchange_decisions") for r in mine]}


def summarise(runs):
    """Per (workload, workers): the target and each method's ratios, final losses and bytes."""
    groups = {}
    for run in runs:
        groups.setdefault((run["workload"], run["workers"], run.get("link") or ""), []).append(run)
    summary = []
    for (workload, workers, link), members in sorted(groups.items()):
        dense = [r for r in members if r["method"] == "dense"]
        if not dense:
            continue
        half = dense[0]["steps"] / 2
        target = statistics.mean(loss_at(r["curve"], half) for r in dense)
        dense_final = [r["curve"][-1]["val_loss"] for r in dense]
        rows = []
        for method in dict.fromkeys(r["method"] for r in members):
            mine = sorted((r for r in members if r["method"] == method), key=lambda r: r["seed"])
            ratios, missed = [], 0
            for r in mine:
                s = steps_to(r["curve"], target)
                if s is None:
                    missed += 1
                    s = r["steps"]
                ratios.append(s / half)
            finals = [r["curve"][-1]["val_loss"] for r in mine]
            # where dense was when it had this method's final loss (None: dense never was)
            equivalent = [steps_to(d["curve"], statistics.mean(finals)) for d in dense]
            accuracies = [r["curve"][-1]["val_accuracy"] for r in mine]
            rows.append({
                "method": method,
                "description": METHODS.get(method, ("", None))[0],
                "seeds": [r["seed"] for r in mine],
                "ratios": ratios,
                "ratio_mean": statistics.mean(ratios),
                "ratio_max": max(ratios),
                "never_reached": missed,
                "final_loss_mean": statistics.mean(finals),
                "final_loss_min": min(finals),
                "final_loss_max": max(finals),
                "final_accuracy_mean": statistics.mean(accuracies),
                "dense_step_at_final_loss": (statistics.mean(equivalent)
                                             if None not in equivalent else None),
                "final_within_dense_spread": min(dense_final) - 1e-12 <= statistics.mean(finals)
                <= max(dense_final) + 1e-12,
                "bytes_fraction": statistics.mean(r["bytes_fraction"] for r in mine),
                "replicas_identical": all(r["replicas_identical"] for r in mine),
                **(timing_row(mine, target) if link else {}),
            })
        if link:
            dense_seconds = next(r for r in rows if r["method"] == "dense")["seconds_to_target_mean"]
            for row in rows:
                row["speedup_vs_dense"] = dense_seconds / row["seconds_to_target_mean"]
        loads = [r.get("load_before") for r in members if r.get("load_before") is not None]
        summary.append({"workload": workload, "workers": workers, "link": link or None,
                        "link_measured": members[0].get("link_measured"),
                        "steps": dense[0]["steps"],
                        "target_step": half, "target_loss": target,
                        "dense_final_min": min(dense_final), "dense_final_max": max(dense_final),
                        "max_load_before": max(loads) if loads else None,
                        "publishable": all(r.get("load_before", 0) <= r.get("max_load", 1e9)
                                           for r in members),
                        "rows": rows})
    return summary


def markdown(summary):
    lines = []
    for group in summary:
        link = group["link"]
        title = f"### {group['workload']}, {group['workers']} workers, {group['steps']} steps"
        if link:
            measured = group["link_measured"] or {}
            title += (f", {link} links (measured {measured.get('throughput_mbit', 0):,.0f} Mbit/s, "
                      f"RTT {measured.get('rtt_us', 0):.0f} us)")
        lines += [
            title,
            "",
            f"Target: dense's smoothed validation loss at step {group['target_step']:.0f}, "
            f"{group['target_loss']:.4f} (mean of dense's seeds). Dense's final loss over the "
            f"seeds: {group['dense_final_min']:.4f}-{group['dense_final_max']:.4f}.",
            "",
        ]
        if link:
            lines += [
                f"The load average before the runs was at most {group['max_load_before']:.2f}"
                f"{'' if group['publishable'] else ' (above the limit: NOT publishable)'}. "
                "The sparse runs use the library's default exchange (`auto`). Replicas "
                "bit-identical at the end of every run: "
                f"{all(r['replicas_identical'] for r in group['rows'])}.", "",
                "| method | time to target, mean (per seed) | speed-up vs dense | "
                "steps ratio, mean (per seed) | steady step | final val loss, mean "
                "(min-max) | bytes / dense | exchanges chosen |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        else:
            lines += ["| method | steps ratio, mean (per seed) | final val loss, mean (min-max) | "
                      "dense's step at that loss | final accuracy | bytes / dense | identical "
                      "replicas |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
        for row in group["rows"]:
            per_seed = ", ".join(f"{r:.2f}" for r in row["ratios"])
            missed = f", {row['never_reached']} never reached" if row["never_reached"] else ""
            ratio = f"{row['ratio_mean']:.2f} ({per_seed}{missed})"
            final = (f"{row['final_loss_mean']:.4f} ({row['final_loss_min']:.4f}-"
                     f"{row['final_loss_max']:.4f})")
            if link:
                seconds = ", ".join(f"{t:.0f}" for t in row["seconds_to_target"])
                lines.append(
                    f"| {row['method']} | {row['seconds_to_target_mean']:.0f} s ({seconds}) | "
                    f"{row['speedup_vs_dense']:.2f}x | {ratio} | "
                    f"{row['median_step_seconds'] * 1e3:.0f} ms | {final} | "
                    f"{row['bytes_fraction']:.4f} | {chosen_exchanges(row['decisions'])} |")
                continue
            lines.append(
                f"| {row['method']} | {ratio} | {final} | "
                f"{'-' if row['dense_step_at_final_loss'] is None else format(row['dense_step_at_final_loss'], '.0f')} | "
                f"{row['final_accuracy_mean']:.4f} | "
                f"{row['bytes_fraction']:.4f} | {row['replicas_identical']} |")
        lines += time_spent_table(group["rows"]) if link else []
        lines.append("")
    lines += ["Methods:", ""]
    seen = dict.fromkeys(r["method"] for g in summary for r in g["rows"])
    lines += [f"- `{m}`: {METHODS.get(m, ('?', None))[0]}" for m in seen]
    return "\n".join(lines) + "\n"


def time_spent_table(rows):
    """The timed runs' :func:`time_spent`, mean of the seeds (only methods whose every run
    kept its step times to the target)."""
    kept = [(row, row["time_spent"]) for row in rows
            if row.get("time_spent") and None not in row["time_spent"]]
    if not kept:
        return []
    lines = ["", "Where the time to the target went (rank 0's step times, mean of the seeds): "
             "the steps' sum, the same steps at the run's steady step, the first 20 steps, and "
             f"the excess of the steps over {SLOW_STEP}x the steady one (traces, the trials' "
             "dense turns).", "",
             "| method | steps' sum | at the steady step | first 20 steps | slow steps' excess |",
             "| --- | --- | --- | --- | --- |"]
    for row, spent in kept:
        mean = {key: statistics.mean(s[key] for s in spent) for key in spent[0]}
        lines.append(f"| {row['method']} | {mean['sum']:.1f} s | {mean['at_steady']:.1f} s | "
                     f"{mean['first_20']:.1f} s | {mean['slow_excess']:.1f} s |")
    return lines


def chosen_exchanges(decisions):
    """auto's choices over a method's runs, e.g. ``dense@1 allgather@200`` per seed; ``-``
    where the method made none (dense, or an explicit exchange)."""
    per_run = []
    for run in decisions or []:
        if run:
            per_run.append(" ".join(f"{choice}@{step}" for step, _, choice in run))
    return "; ".join(per_run) if per_run else "-"


def plot(runs, summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary), figsize=(5.5 * len(summary), 4), squeeze=False)
    for ax, group in zip(axes[0], summary):
        for row in group["rows"]:
            mine = [r for r in runs if (r["workload"], r["workers"], r.get("link"), r["method"])
                    == (group["workload"], group["workers"], group["link"], row["method"])]
            steps, _ = smoothed(mine[0]["curve"])
            mean = [statistics.mean(smoothed(r["curve"])[1][i] for r in mine)
                    for i in range(len(steps))]
            if group["link"]:  # timed runs: against the training time, the mean over seeds
                x = [statistics.mean(seconds_at(r["curve"], s) for r in mine) for s in steps]
                label = f"{row['method']} ({row['speedup_vs_dense']:.2f}x dense's speed)"
            else:
                x, label = steps, f"{row['method']} ({row['ratio_mean']:.2f})"
            ax.plot(x, mean, label=label)
        ax.axhline(group["target_loss"], color="grey", lw=0.8, ls="--")
        if not group["link"]:
            ax.axvline(group["target_step"], color="grey", lw=0.8, ls=":")
        ax.set_title(f"{group['workload']}, {group['workers']} workers"
                     + (f", {group['link']}" if group["link"] else ""))
        ax.set_xlabel("training seconds" if group["link"] else "step")
        ax.set_ylabel("validation loss (smoothed, mean of seeds)")
        low = group["target_loss"]
        ax.set_ylim(low * 0.7, low * 2.5)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(out, publish, name="steps_to_loss"):
    runs = load_runs(out)
    summary = summarise(runs)
    text = markdown(summary)
    print(text)
    if publish:
        loaded = [f"{g['workload']} x{g['workers']} {g['link']}" for g in summary
                  if not g["publishable"]]
        if loaded:
            raise SystemExit(f"not published: runs of {', '.join(loaded)} started on a loaded "
                             "machine (above --max-load); re-run them")
        os.makedirs(publish, exist_ok=True)
        with open(os.path.join(publish, name + ".md"), "w") as f:
            f.write(text)
        commits = sorted({r.get("commit") for r in runs if r.get("commit")})
        with open(os.path.join(publish, name + ".json"), "w") as f:
            json.dump({"commits": commits, "summary": summary, "runs": runs}, f, indent=1)
            f.write("\n")
        plot(runs, summary, os.path.join(publish, name + ".png"))


def main(argv=None):
    args = parse_args(argv)
    if args.report:
        report(args.report, args.publish, args.name)
        return 0
    started = time.time()
    train(args)
    print(f"[bench] all runs in {time.time() - started:.0f} s", flush=True)
    report(args.out, args.publish, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
