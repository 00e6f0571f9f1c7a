"""The names of the metrics a run logs that other code reads back (the sweep summary, the MLflow
view, the printed summary): one table, so a renamed metric is renamed everywhere.

Per logged step (train.py): ``LOSS``, ``TOKENS_PER_SEC``, ``PEAK_MEMORY``, ... ; per eval:
``EVAL_LOSS``. At the end of a run, the steady-state figures under ``summary/`` (worker.py),
logged at step 0 so that MLflow charts them as one bar per run; the parameter counts at the
start (``TRAINABLE_PARAMS``, ``BASE_PARAMS``: the model's own weights, adapters not counted;
``TOTAL_PARAMS``: everything the model holds, adapters included).
"""
from __future__ import annotations

LOSS = "loss"
EVAL_LOSS = "eval_loss"
LR = "lr"
GRAD_NORM = "grad_norm"
TOKENS_PER_SEC = "tokens_per_sec"
STEP_TIME = "step_time_s"
PEAK_MEMORY = "peak_memory_gb"
MFU = "mfu"

TRAINABLE_PARAMS = "trainable_params"
BASE_PARAMS = "base_params"
TOTAL_PARAMS = "total_params"

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

# objective=dpo (TRL's names): per log step, means over the step's pairs, and with "eval_" before
# them at eval steps; at the end, the last values the runs table shows
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy",
               "logps/chosen", "logps/rejected")
SUMMARY_REWARD_ACCURACY = "summary/reward_accuracy"
SUMMARY_EVAL_REWARD_ACCURACY = "summary/eval_reward_accuracy"
DPO_SUMMARY = {SUMMARY_REWARD_ACCURACY: "rewards/accuracy",
               "summary/reward_margin": "rewards/margin",
               SUMMARY_EVAL_REWARD_ACCURACY: "eval_rewards/accuracy",
               "summary/eval_reward_margin": "eval_rewards/margin"}
