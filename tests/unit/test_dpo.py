"""The DPO loss and the sequence log-probs it reads, without ranks: against numbers worked out
by hand, against a plain log-softmax over whole logits, and against TRL's own DPOTrainer on
the same tiny model and pairs (an independent oracle: its tokenization, its log-probs, its
loss)."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from llama_fsdp.config.schema import ObjectiveConfig
from llama_fsdp.objective.dpo import dpo_terms
from llama_fsdp.objective.loss import MODEL_KEYS, install, packed_sequence_logprobs
from tests.conftest import make_spec

# Two pairs: summed answer log-probs of the policy and the reference, chosen then rejected.
POLICY = torch.tensor([-5.0, -7.0, -3.0, -2.0])
REFERENCE = torch.tensor([-6.0, -6.0, -3.0, -3.0])
TOKENS = torch.tensor([2.0, 4.0, 1.0, 5.0])


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_sigmoid_loss_and_rewards_equal_the_hand_computed_ones():
    losses, m = dpo_terms(POLICY, REFERENCE, ObjectiveConfig(name="dpo", beta=0.1))
    # pair 0: log-ratios +1 (chosen), -1 (rejected): beta * d = 0.2; pair 1: 0 and +1: -0.1
    torch.testing.assert_close(losses, torch.tensor([_softplus(-0.2), _softplus(0.1)]))
    torch.testing.assert_close(m["rewards/chosen"], torch.tensor([0.1, 0.0]))
    torch.testing.assert_close(m["rewards/rejected"], torch.tensor([-0.1, 0.1]))
    torch.testing.assert_close(m["rewards/margin"], torch.tensor([0.2, -0.1]))
    assert m["rewards/accuracy"].tolist() == [1.0, 0.0]
    assert m["logps/chosen"].tolist() == [-5.0, -3.0]
    assert m["logps/rejected"].tolist() == [-7.0, -2.0]


def test_label_smoothing_and_ipo_equal_the_hand_computed_ones():
    smooth, _ = dpo_terms(POLICY, REFERENCE,
                          ObjectiveConfig(name="dpo", beta=0.1, label_smoothing=0.1))
    want = [0.9 * _softplus(-d) + 0.1 * _softplus(d) for d in (0.2, -0.1)]
    torch.testing.assert_close(smooth, torch.tensor(want))
    ipo, _ = dpo_terms(POLICY, REFERENCE, ObjectiveConfig(name="dpo", beta=0.1, loss="ipo"),
                       TOKENS)
    # per answer token: 1/2 - (-1)/4 = 0.75 and 0/1 - 1/5 = -0.2, each against 1/(2 beta) = 5
    torch.testing.assert_close(ipo, torch.tensor([(0.75 - 5) ** 2, (-0.2 - 5) ** 2]))


def test_a_policy_equal_to_its_reference_loses_ln2():
    losses, m = dpo_terms(POLICY, POLICY.clone(), ObjectiveConfig(name="dpo", beta=0.5))
    torch.testing.assert_close(losses, torch.full((2,), math.log(2)), rtol=1e-7, atol=0)
    assert m["rewards/margin"].tolist() == [0.0, 0.0] and m["rewards/accuracy"].sum() == 0


def test_objective_options_are_checked():
    from llama_fsdp.run.checks import objective_option_problems as problems

    assert problems(ObjectiveConfig(name="dpo", beta=0)) == ["objective.beta=0 must be > 0"]
    assert "objective.label_smoothing applies to objective.loss=sigmoid" in " ".join(
        problems(ObjectiveConfig(name="dpo", loss="ipo", label_smoothing=0.1)))
    assert "objective.beta set with objective=sft" in problems(ObjectiveConfig(beta=0.5))[0]
    assert "not one of sigmoid, ipo" in problems(ObjectiveConfig(name="dpo", loss="hinge"))[0]


# --- TRL's DPOTrainer as the oracle --------------------------------------------------------------

STANDARD = [{"prompt": "Opposite hot =", "chosen": " cold", "rejected": " wet"},
            {"prompt": "Add 2 + 3 =", "chosen": " 5", "rejected": " 6"},
            {"prompt": "Reverse cat dog =", "chosen": " dog cat", "rejected": " cat dog"}]
# the last one's prompt has an assistant turn of its own: never a target
CONVERSATIONAL = [{"prompt": [{"role": "user", "content": p["prompt"]}],
                   "chosen": [{"role": "assistant", "content": p["chosen"].strip()}],
                   "rejected": [{"role": "assistant", "content": p["rejected"].strip()}]}
                  for p in STANDARD[:2]] + [
    {"prompt": [{"role": "user", "content": "Opposite up ="},
                {"role": "assistant", "content": "down"},
                {"role": "user", "content": STANDARD[2]["prompt"]}],
     "chosen": [{"role": "assistant", "content": "dog cat"}],
     "rejected": [{"role": "assistant", "content": "cat dog"}]}]


@pytest.fixture(scope="module")
def models():
    """A tiny Llama (the policy) and a perturbed copy (the reference), on SDPA so that TRL
    runs them as they are."""
    from transformers import LlamaForCausalLM

    from llama_fsdp.model.llama import llama_config

    spec = make_spec(["model.attn_implementation=sdpa"])
    torch.manual_seed(0)
    policy = LlamaForCausalLM(llama_config(spec.model)).float().eval()
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy, reference


def _ours(records, policy, reference, tmp_path, beta):
    """Our data path (jsonl -> pairs in one packed row) and log-probs, and our loss."""
    from llama_fsdp.data import build_data

    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = make_spec(["objective=dpo", "data=jsonl", f"data.path={f}", "data.eval_fraction=0",
                      "model.attn_implementation=sdpa", f"objective.beta={beta}",
                      f"cache_dir={tmp_path}/cache"])
    data = build_data(spec.data, **spec.data_kwargs(dp_rank=0, announce=False))
    batch = data.train.batch(torch.arange(len(data.train)).numpy())
    with torch.no_grad():
        pol = packed_sequence_logprobs(policy, batch)
        ref = packed_sequence_logprobs(reference, batch)
    losses, m = dpo_terms(pol, ref, spec.objective)
    records = [data.train.store.record(int(d))[0].tolist() for d in batch["seq_records"]]
    return losses.mean().item(), {k: v.mean().item() for k, v in m.items()}, records, data


def _trl(records, policy, reference, tokenizer, tmp_path, beta):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, report_to=[], use_cpu=True,
                     bf16=False, per_device_train_batch_size=len(records), max_length=None)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args,
                         train_dataset=Dataset.from_list(records), processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        loss = trainer.compute_loss(policy, batch).item()
    # (logged under "eval": the models are in eval mode; Llama has no dropout)
    m = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    ds = trainer.train_dataset
    seqs = {(tuple(r["prompt_ids"] + r["chosen_ids"]), tuple(r["prompt_ids"] + r["rejected_ids"]))
            for r in ds}
    return loss, m, seqs


@pytest.mark.parametrize("layout", ["standard", "conversational"])
def test_loss_rewards_and_log_probs_equal_trl_dpo_trainer(models, tmp_path, layout):
    policy, reference = models
    records = STANDARD if layout == "standard" else CONVERSATIONAL
    loss, m, ours_ids, data = _ours(records, policy, reference, tmp_path, beta=0.5)
    trl_loss, trl, trl_ids = _trl(records, policy, reference, data.tokenizer, tmp_path, beta=0.5)
    # the same token ids for every sequence (TRL tokenizes prompt + answer and splits them)
    assert {(tuple(ours_ids[i]), tuple(ours_ids[i + 1])) for i in range(0, len(ours_ids), 2)} \
        == trl_ids
    assert abs(loss - math.log(2)) > 1e-3  # the reference differs: not the trivial loss
    assert loss == pytest.approx(trl_loss, rel=1e-5, abs=1e-6)
    for ours_key, trl_key in (("rewards/chosen", "rewards/chosen"),
                              ("rewards/rejected", "rewards/rejected"),
                              ("rewards/margin", "rewards/margins"),
                              ("rewards/accuracy", "rewards/accuracies"),
                              ("logps/chosen", "logps/chosen"),
                              ("logps/rejected", "logps/rejected")):
        assert m[ours_key] == pytest.approx(trl[trl_key], rel=1e-5, abs=1e-6), ours_key


def test_pair_log_probs_through_the_chunked_head_equal_a_whole_log_softmax(tmp_path):
    """DPO's sequence log-probs (loss.packed_sequence_logprobs) through train.loss=chunked's
    head, in chunks of 3 target tokens (the head never returns [tokens, vocab] logits), and
    through train.loss=full: each sequence's sum of a log_softmax over the whole logits, with
    the same gradients."""
    from transformers import LlamaForCausalLM

    from llama_fsdp.model.llama import llama_config

    torch.manual_seed(0)  # a model of its own: TRL's trainer changes the one it was given
    policy = LlamaForCausalLM(llama_config(make_spec(["model.attn_implementation=sdpa"]).model))
    *_, data = _ours(STANDARD, policy, policy, tmp_path, beta=0.5)
    batch = data.train.batch(torch.arange(len(data.train)).numpy())
    assert len(batch["target_index"]) > 3 * 2  # several chunks
    coef = torch.randn(batch["seq_records"].shape[0], generator=torch.Generator().manual_seed(0))
    chunked = copy.deepcopy(policy)
    install(chunked, chunk=3)
    out = {}
    for name, model in (("full", copy.deepcopy(policy)), ("chunked", chunked)):
        shapes = []  # what the output head returns: the logits, or the chunked log-probs
        model.get_output_embeddings().register_forward_hook(
            lambda mod, args, out: shapes.append(tuple(out.shape)))
        lp = packed_sequence_logprobs(model, batch)
        (lp * coef).sum().backward()
        out[name] = lp.detach(), {n: p.grad for n, p in model.named_parameters()}
        vocab = policy.config.vocab_size
        assert shapes == [(*batch["input_ids"].shape, vocab) if name == "full"
                          else tuple(batch["input_ids"].shape)], name
    whole_model = copy.deepcopy(policy)
    logits = whole_model(**{k: batch[k] for k in MODEL_KEYS if k in batch}).logits
    index = batch["target_index"]
    tokens = logits.float().log_softmax(-1).flatten(0, 1).index_select(0, index).gather(
        1, batch["labels"].flatten().index_select(0, index)[:, None]).squeeze(1)
    whole = tokens.new_zeros(len(coef)).index_add(0, batch["target_seq"], tokens)
    (whole * coef).sum().backward()
    assert (whole < 0).all()
    for name, (lp, grads) in out.items():
        torch.testing.assert_close(lp, whole.detach(), rtol=1e-5, atol=1e-5, msg=name)
        for n, p in whole_model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4,
                                       atol=1e-5 * p.grad.abs().max().item(), msg=f"{name} {n}")
