"""What eval.harness holds on rank 0's device (llama_fsdp/harness/): the export's weights,
loaded whole, and one batch of contexts through them (the logits in fp32, their log-softmax,
the KV cache of a generation). During training (eval.harness.every_steps) the rank's training
state stays beside it; at the end it is freed first."""
from __future__ import annotations

from ..config.precision import DTYPE_BYTES
from ..run.spec import RunSpec
from .full import full_state_bytes
from .lora import lora_state_bytes
from .shapes import count_params


def context_tokens(spec: RunSpec) -> int:
    """The context length the plan assumes: eval.harness.max_length, else train.seq_len (lm-eval
    pads a batch to its longest context, which for the usual tasks is well under either)."""
    return spec.eval.harness.max_length or spec.train.seq_len


def harness_bytes(spec: RunSpec, *, during_training: bool) -> int:
    h, m = spec.eval.harness, spec.model
    dtype = DTYPE_BYTES.get(spec.policy.param_dtype, 4) if spec.policy else 4
    weights = count_params(m) * dtype
    tokens = h.batch_size * context_tokens(spec)
    logits = tokens * m.vocab_size * 4 * 2  # fp32 logits and their log-softmax
    kv = 2 * tokens * m.num_layers * m.num_kv_heads * (m.hidden_size // max(m.num_heads, 1)) \
        * dtype
    hidden = 4 * tokens * max(m.hidden_size, m.intermediate_size) * dtype  # one layer's live
    held = 0
    if during_training:
        state = (lora_state_bytes if spec.finetune.adapters else full_state_bytes)(spec)
        held = sum(state)
    return held + weights + logits + kv + hidden
