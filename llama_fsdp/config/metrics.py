"""The names of the metrics a run logs that other code reads back (the sweep summary, the MLflow
view, the printed summary): one table, so a renamed metric is renamed everywhere.

Per logged step (train/loop.py): ``LOSS``, ``TOKENS_PER_SEC``, ``PEAK_MEMORY``, ... ; per eval:
``EVAL_LOSS``. At the end of a run, the steady-state figures under ``summary/`` (worker.py),
logged at step 0 so that MLflow charts them as one bar per run; the parameter counts at the
start (``TRAINABLE_PARAMS``, ``BASE_PARAMS``: the model's own weights, adapters not counted;
``TOTAL_PARAMS``: everything the model holds, adapters included).
"""
from __future__ import annotations

LOSS = "loss"
LR = "lr"
GRAD_NORM = "grad_norm"
TOKENS_PER_SEC = "tokens_per_sec"
TOKENS_PER_SEC_PER_DEVICE = "tokens_per_sec_per_device"
STEP_TIME = "step_time_s"
PEAK_MEMORY = "peak_memory_gb"
PEAK_MEMORY_RESERVED = "peak_memory_reserved_gb"  # CUDA's caching allocator's
MFU = "mfu"
RESTART = "restart"  # at the first step of a restarted or requeued run: how many times
SYSTEM_PREFIX = "system/"  # MLflow's system metrics, stepped by their samples, not by steps

# at eval steps: the held-out numbers, each a per-step name (or the task metric) after EVAL_PREFIX
EVAL_PREFIX = "eval_"
EVAL_LOSS = "eval_loss"
EXACT_MATCH = "exact_match"  # greedy answers to held-out prompts; per task kind after "/"
EVAL_EXACT_MATCH = "eval_exact_match"
EVAL_TIME = "eval_time_s"  # the eval's own seconds (plan/eval_cost.py estimates them in steps)

# at step 0: what the run is
TRAINABLE_PARAMS = "trainable_params"
BASE_PARAMS = "base_params"
TOTAL_PARAMS = "total_params"
GLOBAL_BATCH = "global_batch"
TOKENS_PER_STEP = "tokens_per_step"
LOCAL_PARAMS_RANK0 = "local_params_rank0"

SUMMARY_PREFIX = "summary/"
SUMMARY_TOKENS_PER_SEC = "summary/tokens_per_sec"
SUMMARY_TOKENS_PER_SEC_PER_DEVICE = "summary/tokens_per_sec_per_device"
SUMMARY_STEP_TIME = "summary/step_time_s"
SUMMARY_MFU = "summary/mfu"
SUMMARY_PEAK_MEMORY = "summary/peak_memory_gb"
SUMMARY_PREDICTED_PEAK_MEMORY = "summary/predicted_peak_memory_gb"  # the plan's, not measured
SUMMARY_FINAL_LOSS = "summary/final_loss"
SUMMARY_EVAL_LOSS = "summary/eval_loss"
SUMMARY_EVAL_EXACT_MATCH = "summary/eval_exact_match"
HARNESS_PREFIX = "harness/"  # eval.harness: harness/<task>/<metric> (and _stderr), lm-eval's scores

# objective=dpo (TRL's names): per log step, means over the step's pairs, and with "eval_" before
# them at eval steps; at the end, the last values the runs table shows
REWARDS_CHOSEN = "rewards/chosen"
REWARDS_REJECTED = "rewards/rejected"
REWARDS_MARGIN = "rewards/margin"
REWARDS_ACCURACY = "rewards/accuracy"
LOGPS_CHOSEN = "logps/chosen"
LOGPS_REJECTED = "logps/rejected"
DPO_METRICS = (REWARDS_CHOSEN, REWARDS_REJECTED, REWARDS_MARGIN, REWARDS_ACCURACY, LOGPS_CHOSEN,
               LOGPS_REJECTED)
# DPO's loss (a preference loss, ln 2 at the start) is logged to MLflow under its own names, so
# that a chart never draws it beside SFT's cross-entropy (tracking/tracker.py renames; the
# training code and the printed summary say "loss"); CANONICAL reads them back for comparisons
DPO_LOSS = "dpo_loss"
DPO_LOGGED_AS = {LOSS: DPO_LOSS, EVAL_LOSS: "eval_dpo_loss",
                 SUMMARY_FINAL_LOSS: "summary/final_dpo_loss",
                 SUMMARY_EVAL_LOSS: "summary/eval_dpo_loss"}
CANONICAL = {logged: name for name, logged in DPO_LOGGED_AS.items()}


def canonical(metrics: dict) -> dict:
    """A run's MLflow metrics with each objective's own loss names read as the generic ones
    (summary/eval_dpo_loss as summary/eval_loss): what a sweep's table and best point use."""
    return {**metrics, **{CANONICAL[k]: v for k, v in metrics.items() if k in CANONICAL}}


EVAL_REWARDS_ACCURACY = "eval_rewards/accuracy"
EVAL_REWARDS_MARGIN = "eval_rewards/margin"
SUMMARY_REWARD_ACCURACY = "summary/reward_accuracy"
SUMMARY_EVAL_REWARD_ACCURACY = "summary/eval_reward_accuracy"
DPO_SUMMARY = {SUMMARY_REWARD_ACCURACY: REWARDS_ACCURACY,
               "summary/reward_margin": REWARDS_MARGIN,
               SUMMARY_EVAL_REWARD_ACCURACY: EVAL_REWARDS_ACCURACY,
               "summary/eval_reward_margin": EVAL_REWARDS_MARGIN}


# Metrics under these prefixes are named at run time (a harness task's, MLflow's system
# metrics, exact match per task kind): any name under them may be asked for.
OPEN_PREFIXES = (HARNESS_PREFIX, SYSTEM_PREFIX, EVAL_EXACT_MATCH + "/")


def _known() -> frozenset[str]:
    fixed = {v for k, v in globals().items() if k.isupper() and isinstance(v, str)
             and not v.endswith(("/", "_"))}
    return frozenset(fixed | set(DPO_LOGGED_AS.values()) | set(DPO_SUMMARY)
                     | {EVAL_PREFIX + name for name in DPO_METRICS})


KNOWN = _known()  # every metric name this table gives a run (the open prefixes aside)
