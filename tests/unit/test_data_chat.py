"""Real tokenizers on real layouts: chat records tokenized exactly as apply_chat_template, the
model's own tokenizer picked up from model.path, vocabularies that do not fit refused.

The tokenizers are built here, once per module (no hub): a SentencePiece BPE model loaded as
``LlamaTokenizer`` (like Llama 2) and a byte-level BPE ``PreTrainedTokenizerFast`` (like GPT-2 /
Llama 3), each with ChatML, Llama-3, Llama-2 and a plain-text chat template.
"""
from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from llama_fsdp.config.schema import DataConfig
from llama_fsdp.data import build_data
from llama_fsdp.data.formats import ChatTemplateError, encode_chat
from tests.conftest import mask_runs

TEMPLATES = {
    "chatml": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "llama3": "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
    "llama2": "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}",
    # the generation prompt ends with a space, which merges with the answer's first word: the
    # assistant turn starts inside a token
    "plain": "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}",
}
# The same templates with {% generation %} around what the loss covers (they render identically),
# for comparing with the tokenizer's own assistant mask where it works.
GENERATION = {
    "chatml": "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "llama3": "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
    "llama2": "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{% generation %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endgeneration %}{% endif %}{% endfor %}",
    "plain": "{% for message in messages %}{{ message['role'] | capitalize }}: {% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}",
}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "llama2": "</s>", "plain": "</s>"}
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]

S, U, A = "system", "user", "assistant"


def _m(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = [
    [_m(S, "be brief"), _m(U, "hello world"), _m(A, "Sure, the cat."), _m(U, "why?"),
     _m(A, "Because the dog.")],
    [_m(U, "question?"), _m(A, " hello\nthere 漢 🙂  ")],  # leading space, trailing spaces, bytes
    [_m(U, "q"), _m(A, "🙂 ok"), _m(U, "and then"), _m(A, "\n- item\n- item")],
    [_m(U, "say the stop token"), _m(A, "it is <|im_end|> or </s> ok")],  # special-token text
    [_m(U, "a"), _m(A, "b"), _m(U, "c"), _m(A, "d"), _m(U, "e")],  # ends with a user turn
    [_m(U, "empty answer"), _m(A, "")],
]


def _corpus() -> list[str]:
    r = random.Random(0)
    words = ("the cat dog wolf answer question hello world please explain why how what model "
             "train token sure here is a short reply about data and code python list sort fine "
             "tuning loss mask chat user assistant system you are helpful be brief yes no maybe "
             "thanks great idea test value").split()
    lines = []
    for _ in range(400):
        s = " ".join(r.choice(words) for _ in range(r.randint(3, 18)))
        lines.append(s.capitalize() + r.choice([".", "?", "!", ":", ",", " 42.", "\n", " (x)",
                                                "\n\n- item"]))
    return lines + ["[INST] hello [/INST] Sure, here is the answer. </s>", "Assistant: hi there",
                    "User: question?"] * 5


def build_tokenizers(out: Path) -> dict[str, Path]:
    """``{"sp-chatml": dir, "bl-llama3": dir, ...}``: 2 tokenizer kinds x 4 templates."""
    import sentencepiece as spm
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    lines = _corpus()
    sp_src = out / "sp_src"
    sp_src.mkdir(parents=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(sp_src / "sp"), vocab_size=400,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, num_threads=1, minloglevel=2, hard_vocab_limit=False)
    os.replace(sp_src / "sp.model", sp_src / "tokenizer.model")
    bl = ByteLevelBPETokenizer(add_prefix_space=False, trim_offsets=True)
    bl.train_from_iterator(lines, vocab_size=600, min_frequency=2,
                           special_tokens=["<s>", "</s>", "<unk>"])
    dirs = {}
    for name, template in TEMPLATES.items():
        sp = LlamaTokenizer.from_pretrained(str(sp_src), legacy=False, add_bos_token=True)
        fast = PreTrainedTokenizerFast(tokenizer_object=bl._tokenizer, bos_token="<s>",
                                       eos_token="</s>", unk_token="<unk>")
        for kind, tok in (("sp", sp), ("bl", fast)):
            tok.add_special_tokens({"additional_special_tokens": SPECIALS})
            tok.chat_template = template
            tok.save_pretrained(str(out / f"{kind}-{name}"))
            dirs[f"{kind}-{name}"] = out / f"{kind}-{name}"
    return dirs


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict[str, Path]:
    return build_tokenizers(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")




def _reference_ids(tok, conv) -> list[int]:
    return tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]


@pytest.mark.parametrize("name", [f"{k}-{t}" for k in ("sp", "bl") for t in TEMPLATES])
def test_chat_ids_are_apply_chat_template_ids_and_targets_are_assistant_turns(toks, name):
    tok = AutoTokenizer.from_pretrained(str(toks[name]))
    eot = END_OF_TURN[name.split("-")[1]]
    for conv in CONVERSATIONS:
        ids, mask, prompt_len, _ = encode_chat(tok, conv, train_on_prompt=False)
        assert ids == _reference_ids(tok, conv), conv  # exactly, token for token
        # every target run is one assistant turn: its content, then its end-of-turn token
        answers = [m["content"] for m in conv if m["role"] == A]
        runs = [tok.decode(ids[a:b]) for a, b in mask_runs(mask)]
        assert len(runs) == len(answers), (conv, runs)
        for run, answer in zip(runs, answers):
            assert run.endswith(eot) and run[:-len(eot)].strip() == answer.strip(), (run, answer)
        # the final answer's prompt is what inference feeds: the history + generation prompt
        if conv[-1]["role"] == A:
            prompt = tok.apply_chat_template(conv[:-1], tokenize=True, add_generation_prompt=True,
                                             return_dict=True)["input_ids"]
            assert prompt_len == mask_runs(mask)[-1][0]
            # (a prompt ending in a space: that space is part of the answer's first token)
            assert ids[:prompt_len] == prompt[:prompt_len]
            assert len(prompt) - prompt_len <= 1
        else:
            assert prompt_len == 0


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_mask_equals_the_tokenizers_generation_mask(toks, template):
    """Where transformers' own assistant mask works ({% generation %} templates, SentencePiece),
    ours is the same mask."""
    tok = AutoTokenizer.from_pretrained(str(toks[f"sp-{template}"]))
    for conv in CONVERSATIONS:
        ids, mask, _, _ = encode_chat(tok, conv, train_on_prompt=False)
        hf = tok.apply_chat_template(conv, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True,
                                     chat_template=GENERATION[template])
        assert hf["input_ids"] == ids
        want = list(hf["assistant_masks"])
        want[0] = 0  # the first token is never a target
        assert mask == want, conv


def test_template_that_rewrites_earlier_turns_is_refused(toks):
    tok = AutoTokenizer.from_pretrained(str(toks["bl-chatml"]))
    # drops the reasoning of earlier assistant turns, as Qwen3's template does
    tok.chat_template = (
        "{% for message in messages %}{% set c = message['content'] %}{% if message['role'] == "
        "'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="prefix of the whole conversation.*Fix"):
        encode_chat(tok, [_m(U, "a"), _m(A, "<think>x</think>b"), _m(U, "c"), _m(A, "d")],
                    train_on_prompt=False)


# --- model.path brings its tokenizer ------------------------------------------------------------

def _model_dir(path: Path, tokenizer_dir: Path | None) -> Path:
    """An HF model directory: config.json (+ the tokenizer's files)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 640}))
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
    return path


def _jsonl(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    return path


CHATS = [{"messages": [_m(U, f"question {i}: why?"), _m(A, f" Because {i} 🙂"),
                       _m(U, "and?"), _m(A, "Sure, the cat.")]} for i in range(30)]


def test_model_path_tokenizer_and_template_encode_chat_data(toks, cache, tmp_path, caplog):
    model = _model_dir(tmp_path / "model", toks["bl-chatml"])
    tok = AutoTokenizer.from_pretrained(str(model))
    f = _jsonl(tmp_path / "chat.jsonl", CHATS)
    with caplog.at_level(logging.INFO, logger="llama_fsdp.data"):
        dm = build_data(DataConfig(name="jsonl", path=str(f)), seq_len=128, micro_batch=2,
                        dp_rank=0, dp_world=1, seed=0, cache_dir=cache, vocab_size=640,
                        model_path=str(model))
    assert dm.info.tokenizer_source == "model.path" and dm.info.tokenizer == str(model)
    assert dm.info.params()["derived.tokenizer"] == str(model)
    assert f"tokenizer {model} (model.path)" in caplog.text
    assert "project tokenizer" not in caplog.text
    # every stored record is exactly what apply_chat_template gives for its conversation
    store = dm.train.store
    stored = {tuple(store.record(i)[0].tolist()) for i in range(len(store))}
    expected = {tuple(_reference_ids(tok, r["messages"])) for r in CHATS}
    assert len(store) == 28 and stored <= expected  # 2 of 30 held out (eval_fraction 0.05)
    ids, mask = store.record(0)
    assert tok.decode(ids[mask > 0]).count("<|im_end|>") == 2


def test_data_tokenizer_overrides_model_path_and_says_so(toks, cache, tmp_path, caplog):
    model = _model_dir(tmp_path / "model", toks["bl-chatml"])
    f = _jsonl(tmp_path / "chat.jsonl", CHATS)
    with caplog.at_level(logging.WARNING, logger="llama_fsdp.data"):
        dm = build_data(DataConfig(name="jsonl", path=str(f), tokenizer=str(toks["sp-chatml"])),
                        seq_len=128, micro_batch=2, dp_rank=0, dp_world=1, seed=0,
                        cache_dir=cache, vocab_size=640, model_path=str(model))
    assert dm.info.tokenizer_source == "data.tokenizer"
    assert dm.info.tokenizer == str(toks["sp-chatml"])
    assert "replaces model.path's own tokenizer" in caplog.text


def test_tokenizer_larger_than_the_model_is_refused(toks, cache, tmp_path):
    model = _model_dir(tmp_path / "model", toks["bl-chatml"])
    n = len(AutoTokenizer.from_pretrained(str(model)))
    assert n > 256
    f = _jsonl(tmp_path / "chat.jsonl", CHATS)
    with pytest.raises(ValueError, match=rf"has {n} tokens but model.vocab_size=256: ids >= 256 "
                                         rf".*model.vocab_size={n}"):
        build_data(DataConfig(name="jsonl", path=str(f)), seq_len=128, micro_batch=2, dp_rank=0,
                   dp_world=1, seed=0, cache_dir=cache, vocab_size=256, model_path=str(model))


def test_model_path_without_tokenizer_is_refused(cache, tmp_path):
    model = _model_dir(tmp_path / "bare", None)
    f = _jsonl(tmp_path / "chat.jsonl", CHATS)
    with pytest.raises(ValueError, match=r"bare has no tokenizer files.*Set data.tokenizer"):
        build_data(DataConfig(name="jsonl", path=str(f)), seq_len=128, micro_batch=2, dp_rank=0,
                   dp_world=1, seed=0, cache_dir=cache, vocab_size=640, model_path=str(model))


def test_chat_template_for_a_tokenizer_without_one(toks, cache, tmp_path):
    model = _model_dir(tmp_path / "base", toks["bl-plain"])
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in model.glob("chat_template.*"):
        extra.unlink()
    assert not AutoTokenizer.from_pretrained(str(model)).chat_template
    f = _jsonl(tmp_path / "chat.jsonl", CHATS)
    build = dict(seq_len=128, micro_batch=2, dp_rank=0, dp_world=1, seed=0, cache_dir=cache,
                 vocab_size=640, model_path=str(model))
    with pytest.raises(ValueError, match=r"chat\.jsonl: record \d+ .*no chat template.*"
                                         r"data\.chat_template"):
        build_data(DataConfig(name="jsonl", path=str(f)), **build)
    jinja = tmp_path / "chatml.jinja"
    jinja.write_text(TEMPLATES["chatml"])
    dm = build_data(DataConfig(name="jsonl", path=str(f), chat_template=str(jinja)), **build)
    ids = dm.train.store.record(0)[0].tolist()
    assert "<|im_start|>assistant\n" in dm.tokenizer.decode(ids)


def test_sharegpt_conversations_are_chat(toks, cache, tmp_path):
    model = _model_dir(tmp_path / "model", toks["sp-llama3"])
    tok = AutoTokenizer.from_pretrained(str(model))
    recs = [{"conversations": [{"from": "human", "value": f"hi {i}"},
                               {"from": "gpt", "value": f"hello {i}"}]} for i in range(20)]
    f = _jsonl(tmp_path / "sharegpt.jsonl", recs)
    dm = build_data(DataConfig(name="jsonl", path=str(f), eval_fraction=0), seq_len=64,
                    micro_batch=2, dp_rank=0, dp_world=1, seed=0, cache_dir=cache, vocab_size=640,
                    model_path=str(model))
    assert dm.info.format == "chat"
    want = _reference_ids(tok, [_m(U, "hi 0"), _m(A, "hello 0")])
    assert dm.train.store.record(0)[0].tolist() == want


# --- the driver: checked before launch ----------------------------------------------------------

def _hf_model_dir(path: Path, tokenizer_dir: Path, vocab_size: int) -> Path:
    """A directory model.path accepts (model=tiny's shape with ``vocab_size``, config.json +
    safetensors) holding the tokenizer of ``tokenizer_dir``."""
    import dataclasses

    import torch
    from safetensors.torch import save_file

    from llama_fsdp.config.schema import model_preset
    from llama_fsdp.model.llama import llama_config

    path.mkdir(parents=True)
    m = dataclasses.replace(model_preset("tiny"), vocab_size=vocab_size)
    llama_config(m).save_pretrained(str(path))
    # (the head alone, shaped as config.json says: the tokenizer is what these tests check)
    save_file({"lm_head.weight": torch.zeros(vocab_size, m.hidden_size)},
              str(path / "model.safetensors"))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
    return path


def test_driver_uses_the_model_tokenizer_and_refuses_one_too_large(toks, cache, tmp_path,
                                                                     spec_factory):
    from llama_fsdp.prepare.errors import PrepareError
    from llama_fsdp.prepare.data import check_data

    f = _jsonl(tmp_path / "chat.jsonl", CHATS)
    model = _hf_model_dir(tmp_path / "m512", toks["bl-chatml"], 512)
    spec = spec_factory([f"cache_dir={cache}", "data=jsonl", f"data.path={f}",
                         f"model.path={model}"])
    dm = check_data(spec)
    assert (dm.info.tokenizer, dm.info.tokenizer_source) == (str(model), "model.path")
    tok = AutoTokenizer.from_pretrained(str(model))
    assert dm.train.store.record(0)[0].tolist() in [_reference_ids(tok, r["messages"])
                                                    for r in CHATS]
    small = _hf_model_dir(tmp_path / "m256", toks["bl-chatml"], 256)
    spec = spec_factory([f"cache_dir={cache}", "data=jsonl", f"data.path={f}",
                         f"model.path={small}", "model.vocab_size=256"])
    with pytest.raises(PrepareError, match=r"^data: tokenizer .*m256 \(model.path\) has \d+ "
                                           r"tokens but model.vocab_size=256"):
        check_data(spec)


# --- a template that cannot mask: Meta's first Llama 3 template --------------------------------

# Meta-Llama-3-8B-Instruct's tokenizer_config.json as first released (April 2024): the
# assistant's header is appended whatever add_generation_prompt says.
LLAMA3_FIRST = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content "
                "= '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ "
                "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set "
                "content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{{ "
                "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]


def docs_llama3_template() -> str:
    """The corrected template docs/data.md gives (its ```jinja block)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    block = text.split("```jinja\n", 1)[1].split("```", 1)[0]
    return block.rstrip("\n")


def llama3_tokenizer(out: Path, template: str) -> Path:
    """A Llama-3-format tokenizer made here: byte-level BPE with Llama 3's special tokens (BOS
    <|begin_of_text|>, end of turn <|eot_id|>) and ``template`` as its chat template."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bl = ByteLevelBPETokenizer(add_prefix_space=False, trim_offsets=True)
    bl.train_from_iterator(_corpus(), vocab_size=600, min_frequency=2,
                           special_tokens=LLAMA3_SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=bl._tokenizer, bos_token="<|begin_of_text|>",
                                  eos_token="<|eot_id|>", pad_token="<|end_of_text|>")
    tok.chat_template = template
    tok.save_pretrained(str(out))
    return out


SINGLE = [{"messages": [_m(U, f"question {i}: why?"), _m(A, f"Because {i}.")]}
          for i in range(30)]
PAIRS = [{"prompt": [_m(U, f"question {i}?")], "chosen": [_m(A, f"Yes {i}, the cat.")],
          "rejected": [_m(A, f"No {i}.")]} for i in range(30)]


def _prepare(spec_factory, cache, model, f, *extra):
    from llama_fsdp.prepare.data import check_data

    return check_data(spec_factory([f"cache_dir={cache}", "data=jsonl", f"data.path={f}",
                                    f"model.path={model}", "model.vocab_size=640", *extra]))


@pytest.mark.parametrize("records", ["single-turn", "multi-turn", "dpo pairs"])
def test_a_template_that_always_appends_the_assistant_header_is_refused_before_launch(
        cache, tmp_path, spec_factory, records):
    from llama_fsdp.prepare.errors import PrepareError

    model = _hf_model_dir(tmp_path / "llama3-first",
                          llama3_tokenizer(tmp_path / "tok", LLAMA3_FIRST), 640)
    recs, extra = {"single-turn": (SINGLE, []), "multi-turn": (CHATS, []),
                   "dpo pairs": (PAIRS, ["objective=dpo"])}[records]
    f = _jsonl(tmp_path / "data.jsonl", recs)
    with pytest.raises(PrepareError) as e:
        _prepare(spec_factory, cache, model, f, *extra)
    msg = str(e.value)
    # names the tokenizer, what the template does, and the fix; not the earlier wrong blame
    assert "llama3-first" in msg and "<|start_header_id|>assistant<|end_header_id|>\\n\\n'" in msg
    assert "same with and without add_generation_prompt" in msg
    assert "data.chat_template" in msg and "docs/data.md" in msg
    assert "rewrites earlier turns" not in msg and "prefix of the whole" not in msg


def test_the_docs_llama3_template_masks_exactly_the_answers(cache, tmp_path, spec_factory):
    """The same tokenizer with data.chat_template= the docs' corrected template: chat records
    and pairs train exactly each answer's tokens and its <|eot_id|>, never a header."""
    model = _hf_model_dir(tmp_path / "llama3-first",
                          llama3_tokenizer(tmp_path / "tok", LLAMA3_FIRST), 640)
    jinja = tmp_path / "llama3.jinja"
    jinja.write_text(docs_llama3_template())
    fixed = AutoTokenizer.from_pretrained(str(model))
    fixed.chat_template = jinja.read_text()
    header = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert fixed.apply_chat_template([_m(U, "q")], tokenize=False) + header == \
        fixed.apply_chat_template([_m(U, "q")], tokenize=False, add_generation_prompt=True)
    for recs, extra in ((CHATS, []), (SINGLE, []), (PAIRS, ["objective=dpo"])):
        f = _jsonl(tmp_path / f"{len(extra)}-{recs[0].__class__.__name__}-{id(recs)}.jsonl", recs)
        dm = _prepare(spec_factory, cache, model, f, f"data.chat_template={jinja}", *extra)
        for i in range(4):
            rec = dm.train.store.record(i)
            ids, mask = rec[0].tolist(), rec[1].tolist()
            assert ids == fixed.apply_chat_template(_conversation(recs, ids, fixed),
                                                    tokenize=True, return_dict=True)["input_ids"]
            spans = [fixed.decode(ids[a:b]) for a, b in mask_runs(mask)]
            answers = [m["content"].strip() + "<|eot_id|>"
                       for m in _conversation(recs, ids, fixed) if m["role"] == A]
            want = answers if not extra else answers[-1:]  # a pair: its answer's turn
            assert spans == want, (spans, want)
            assert not any("<|start_header_id|>" in s for s in spans)


def _conversation(recs, ids, tok):
    """The record (conversation, or prompt + answer of a pair) whose encoding is ``ids``."""
    text = tok.decode(ids)
    for r in recs:
        convs = ([r["messages"]] if "messages" in r else
                 [r["prompt"] + r["chosen"], r["prompt"] + r["rejected"]])
        for c in convs:
            if tok.apply_chat_template(c, tokenize=False) == text:
                return c
    raise AssertionError(f"no record renders as {text!r}")


def _big(n_chars: int) -> str:
    words = " ".join(f"opposite{i % 89} of hot" for i in range(n_chars // 15 + 1))
    return words[:n_chars]


@pytest.mark.parametrize("name", [f"{k}-{t}" for k in ("sp", "bl") for t in TEMPLATES])
@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_a_huge_chat_record_keeps_the_rows_of_the_uncut_path(toks, name, overlong):
    """Chat records are cut before the template renders and the tokenizer reads them (issue 63
    item 13), and the row is the uncut path's: ids, loss mask, the last answer's start, the
    verdict, the record's characters. A huge message in each position (system, the user's
    prompt, the answer), and a budget spent before the last turns (their contents emptied)."""
    from llama_fsdp.data.formats import Encoder, char_bound

    tok = AutoTokenizer.from_pretrained(str(toks[name]))
    seq_len, cfg = 64, DataConfig(overlong=overlong)
    huge = _big(3 * char_bound(tok, seq_len))
    convs = [[_m(S, huge), _m(U, "hello"), _m(A, "Sure.")],
             [_m(U, huge), _m(A, "Sure.")],
             [_m(U, "hello world"), _m(A, huge), _m(U, "why?"), _m(A, "Because.")],
             [_m(U, "q"), _m(A, huge[:char_bound(tok, seq_len) - 10]), _m(U, huge), _m(A, "ok")]]
    cut = Encoder(tok, "chat", cfg, seq_len, where=str)
    whole = Encoder(tok, "chat", cfg, seq_len, where=str, char_cap=0)  # 0: nothing is cut
    for conv in convs:
        a, b = cut({"messages": [conv]}, [0]), whole({"messages": [conv]}, [0])
        assert b["full_len"][0] > 3 * seq_len and a["full_len"][0] < b["full_len"][0] / 2
        # (a dropped row's prompt_len is never read: cache._tokenize leaves the row out first)
        for k in ("input_ids", "loss_mask", "truncated", "targets", "chars", "keep") + \
                (("prompt_len",) if b["keep"][0] else ()):
            assert a[k] == b[k], (k, conv[0]["role"], [len(m["content"]) for m in conv])


def test_a_20mb_chat_record_prepares_in_seconds(toks):
    """Before (issue 63 item 13, for chat records): a 4.7 MB message took 23.6 s and 2.3 GB to
    keep 64 tokens (its 4.4M tokens counted); 20 MB: about four times that. Now the template
    and the tokenizer see char_bound's characters; the row is the one of the same record with
    its message cut to 20,000 characters, tokenized whole."""
    import time

    from llama_fsdp.data.formats import Encoder, char_bound

    tok = AutoTokenizer.from_pretrained(str(toks["bl-chatml"]))
    huge = _big(20_000_000)
    enc = Encoder(tok, "chat", DataConfig(), 64, where=str)
    t0 = time.monotonic()
    row = enc({"messages": [[_m(S, "be brief"), _m(U, huge), _m(A, "Sure.")]]}, [0])
    seconds = time.monotonic() - t0
    head = Encoder(tok, "chat", DataConfig(), 64, where=str, char_cap=0)(
        {"messages": [[_m(S, "be brief"), _m(U, huge[:20_000]), _m(A, "Sure.")]]}, [0])
    for k in ("input_ids", "loss_mask", "prompt_len", "truncated", "targets", "keep"):
        assert row[k] == head[k], k
    assert len(huge) == 20_000_000 < row["chars"][0]
    assert 64 < row["full_len"][0] <= char_bound(tok, 64)  # what the tokenizer read
    assert seconds < 10, seconds  # (about 0.5 s here; the uncut path: minutes)
