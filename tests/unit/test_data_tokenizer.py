"""The project tokenizer (SentencePiece → HF directory) and the record encoders."""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from llama_fsdp.config.schema import DataConfig
from llama_fsdp.data import build_tokenizer, synthetic_corpus
from llama_fsdp.data.formats import encode_chat, encode_prompt_response, encode_text
from llama_fsdp.data.tokenizer import PROJECT_VOCAB_SIZE, load_tokenizer, project_tokenizer_dir
from tests.conftest import mask_runs


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "data-cache"


@pytest.fixture(scope="module")
def tok(cache):
    return build_tokenizer(DataConfig(), cache)


def test_project_tokenizer_is_a_512_token_hf_directory(tok, cache):
    assert len(tok) == PROJECT_VOCAB_SIZE == 512
    path = project_tokenizer_dir(cache, synthetic_corpus)
    again = AutoTokenizer.from_pretrained(str(path))  # an ordinary HF tokenizer directory
    assert len(again) == 512 and type(again).__name__ == "LlamaTokenizer"
    specials = (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token)
    assert specials == ("<s>", "</s>", "<pad>", "<unk>")
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    assert tok("cat")["input_ids"][0] == tok.bos_token_id  # Llama convention for plain calls


def test_project_tokenizer_trained_once_and_reused(cache, tok):
    path = project_tokenizer_dir(cache, synthetic_corpus)
    stamp = (path / "tokenizer.json").stat().st_mtime_ns
    assert project_tokenizer_dir(cache, synthetic_corpus) == path
    assert (path / "tokenizer.json").stat().st_mtime_ns == stamp
    # a different corpus is a different tokenizer directory
    other = project_tokenizer_dir(cache, lambda: synthetic_corpus()[:500])
    assert other != path and len(AutoTokenizer.from_pretrained(str(other))) == 512


@pytest.mark.parametrize("text", [
    "### Instruction: Reverse the words.\n### Input: cat dog\n### Response:\nPlain ASCII 0123 {x}!",
    "unicode é ✓ 漢字 and emoji 🙂 fall back to bytes",
    "repeated   spaces\n\n\ttabs and trailing space ",  # (a leading space is dropped, as in Llama 2)
])
def test_round_trip(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_synthetic_words_are_single_tokens(tok):
    ids = tok(" cat dog wolf", add_special_tokens=False)["input_ids"]
    assert len(ids) == 3


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "cat"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<s><|system|>\nbe brief</s><|user|>\nhi</s><|assistant|>\ncat</s>"
    gen = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert gen.endswith("<|assistant|>\n") and text.startswith(gen)
    ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    assert tok.convert_ids_to_tokens(ids[:2]) == ["<s>", "<|system|>"]  # one BOS


def test_any_hf_tokenizer_directory_loads(tok, tmp_path, cache):
    tok.save_pretrained(tmp_path / "tk")
    loaded = load_tokenizer(str(tmp_path / "tk"), cache_dir=cache)
    assert len(loaded) == 512 and loaded.pad_token_id == 3
    with pytest.raises(ValueError, match="data.tokenizer="):
        load_tokenizer(str(tmp_path / "missing"), cache_dir=cache)


def test_prompt_response_mask(tok):
    ids, mask, plen, chars = encode_prompt_response(tok, "Q: x\n", "cat dog", train_on_prompt=False)
    assert chars == len("Q: x\n") + len("cat dog")
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert mask == [0] * plen + [1] * (len(ids) - plen)
    assert tok.decode(ids[plen:], skip_special_tokens=True).strip() == "cat dog"
    ids2, mask2, _, _ = encode_prompt_response(tok, "Q: x\n", "cat dog", train_on_prompt=True)
    assert ids2 == ids and mask2 == [0] + [1] * (len(ids) - 1)


def test_text_mask(tok):
    ids, mask, plen, _ = encode_text(tok, "hello there")
    assert plen == 0 and ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert mask == [0] + [1] * (len(ids) - 1)


def test_multi_turn_chat_masks_every_non_assistant_turn(tok):
    msgs = [{"role": "system", "content": "sys text"}, {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "cat"}, {"role": "user", "content": "second question"},
            {"role": "assistant", "content": "dog wolf"}]
    ids, mask, plen, _ = encode_chat(tok, msgs, train_on_prompt=False)
    # the ids are the ones inference sees, token for token
    assert ids == tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    # the targets are exactly the two assistant contents and their end-of-turn tokens
    spans = mask_runs(mask)
    assert len(spans) == 2
    assert [tok.decode(ids[a:b]) for a, b in spans] == ["cat</s>", "dog wolf</s>"]
    # the prompt for the final answer is what inference feeds: the generation prompt's ids
    prompt = tok.apply_chat_template(msgs[:4], tokenize=True, add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    assert plen == spans[-1][0] and ids[:plen] == prompt
    _, mask_all, _, _ = encode_chat(tok, msgs, train_on_prompt=True)
    assert mask_all == [0] + [1] * (len(ids) - 1)


def test_chat_needs_a_template(tok, tmp_path):
    tok.save_pretrained(tmp_path / "tk")
    bare = AutoTokenizer.from_pretrained(str(tmp_path / "tk"))
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_chat(bare, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                    train_on_prompt=False)




def test_small_corpus_is_filled_with_reserved_tokens(tmp_path):
    path = project_tokenizer_dir(tmp_path, lambda: ["cat dog"], vocab_size=1024)
    tk = AutoTokenizer.from_pretrained(str(path))
    assert len(tk) == 1024
    assert tk.convert_ids_to_tokens(1023).startswith("<|reserved_special_token_")
    assert tk.decode(tk("cat dog é", add_special_tokens=False)["input_ids"]) == "cat dog é"


def test_a_huge_single_line_record_is_cut_before_it_is_tokenized(tok):
    """Before (issue 63): a 50 MB one-line record was tokenized whole (3 minutes, 9.9 GB) to keep
    its first seq_len tokens. Now the tokenizer sees only the characters that can matter: the
    row is the same, the record still counts as truncated with all its characters, and the
    tokens counted are the cut text's."""
    from llama_fsdp.config.schema import DataConfig
    from llama_fsdp.data.formats import Encoder

    seq_len = 64
    line = " ".join(f"opposite{i % 89} of hot" for i in range(200_000))  # 4.6 MB, one line
    enc = Encoder(tok, "text", DataConfig(), seq_len, where=lambda i: f"record {i}")
    row = enc({"text": [line]}, [0])
    head = [tok.bos_token_id] + tok(line[:20_000], add_special_tokens=False)["input_ids"]
    assert row["input_ids"][0] == head[:seq_len]
    assert row["truncated"][0] and row["keep"][0] and row["chars"][0] == len(line)
    # the cut: 2 x (seq_len + 1) x the longest piece's characters (+1024); whole: ~1.2M tokens
    longest = max(len(p) for p in tok.get_vocab())
    assert seq_len < row["full_len"][0] <= 2 * (seq_len + 1) * longest + 1024
