"""Tokenizers: any Hugging Face tokenizer, or the project tokenizer trained once.

Any Hugging Face tokenizer loads through ``AutoTokenizer`` (a local directory or a hub name).
The embedded default is the project tokenizer: a 512-piece SentencePiece BPE model trained once
on the synthetic corpus, saved as an ordinary HF tokenizer directory (``LlamaTokenizer``, BOS /
EOS / pad, byte fallback so no text is lost, a chat template) and cached under
``cache_dir/tokenizers`` keyed by everything it was trained from.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Optional

from filelock import FileLock
from transformers import AutoTokenizer, LlamaTokenizer, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# The project tokenizer; conf/model/tiny.yaml's vocab_size must equal it.
PROJECT_VOCAB_SIZE = 512
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Each turn is "<|role|>\n" + content + EOS; a generation prompt ends with "<|assistant|>\n".
# Every rendering of a conversation prefix is a prefix of the next one, which the chat masking
# relies on (see encode_chat).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# Bump when the training recipe below changes: it is part of the cache key.
_RECIPE_VERSION = 1


def load_tokenizer(name_or_path: Optional[str], *, cache_dir: Path,
                   corpus: Optional[Callable[[], Iterable[str]]] = None) -> PreTrainedTokenizerBase:
    """An HF tokenizer: ``name_or_path`` through AutoTokenizer, or (None) the project tokenizer.

    ``corpus`` produces the project tokenizer's training text: its hash names the cached
    tokenizer, trained on it the first time. A tokenizer without a pad token gets its EOS as pad (labels
    mask padding by position, never by id, so this is safe).
    """
    if name_or_path is None:
        if corpus is None:
            raise ValueError("the project tokenizer needs its training corpus (data.tokenizer is null)")
        path = project_tokenizer_dir(cache_dir, corpus)
        tok = AutoTokenizer.from_pretrained(str(path))
    else:
        try:
            tok = AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as e:
            raise ValueError(f"data.tokenizer={name_or_path!r}: cannot load an HF tokenizer from it "
                             f"(a local tokenizer directory or a hub name): {e}") from e
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path or path} has no EOS token; records end with EOS")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """A hash of everything that decides how the tokenizer encodes (part of the data cache key)."""
    h = hashlib.sha256()
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # a slow tokenizer: its vocabulary and class stand in for the model
        h.update(json.dumps(tok.get_vocab(), sort_keys=True).encode())
    h.update(type(tok).__name__.encode())
    h.update(json.dumps([tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok),
                         tok.chat_template], sort_keys=True, default=str).encode())
    return h.hexdigest()


# --- the project tokenizer ------------------------------------------------------------------

def project_tokenizer_dir(cache_dir: Path, corpus: Callable[[], Iterable[str]],
                          vocab_size: int = PROJECT_VOCAB_SIZE) -> Path:
    """Train the project tokenizer once into ``cache_dir/tokenizers`` and return its directory.

    Safe when several ranks call it at once: one trains under a file lock, into a temporary
    directory renamed into place, and the others find the finished directory.
    """
    lines = list(corpus())
    key = hashlib.sha256(json.dumps([_RECIPE_VERSION, vocab_size, lines]).encode()).hexdigest()
    root = Path(cache_dir) / "tokenizers"
    final = root / f"project-{vocab_size}-{key[:16]}"
    if (final / "tokenizer_config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{final.name}.lock")):
        if (final / "tokenizer_config.json").exists():
            return final
        log.info("training the project tokenizer (SentencePiece BPE, %d pieces) on %d lines -> %s",
                 vocab_size, len(lines), final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        try:
            train_sentencepiece_tokenizer(lines, tmp, vocab_size=vocab_size)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def train_sentencepiece_tokenizer(lines: list[str], out_dir: Path, *, vocab_size: int) -> None:
    """Train SentencePiece BPE on ``lines`` and save an HF tokenizer of exactly ``vocab_size``.

    Ids 0-3 are <unk> <s> </s> <pad>, then the chat role tokens; byte fallback makes every
    string encodable. If the corpus is too small for ``vocab_size`` learned pieces, the rest is
    filled with reserved special tokens (as Llama 3 does), so ``len(tokenizer) == vocab_size``.
    """
    import sentencepiece as spm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Every printable ASCII character gets its own piece, not a byte fallback.
    coverage = [string.ascii_letters + string.digits + string.punctuation + " "]
    prefix = out_dir / "spm"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(coverage + lines), model_prefix=str(prefix),
        vocab_size=vocab_size, hard_vocab_limit=False, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, user_defined_symbols=list(ROLE_TOKENS),
        byte_fallback=True, character_coverage=1.0, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        max_sentence_length=1 << 16, num_threads=1, minloglevel=2,
    )
    os.replace(f"{prefix}.model", out_dir / "tokenizer.model")
    os.remove(f"{prefix}.vocab")
    # transformers converts the .model to a tokenizers-backed LlamaTokenizer (BPE, byte fallback)
    tok = LlamaTokenizer.from_pretrained(str(out_dir), pad_token="<pad>", add_bos_token=True,
                                         legacy=False)
    missing = vocab_size - len(tok)
    if missing < 0:
        raise RuntimeError(f"SentencePiece produced {len(tok)} pieces, more than {vocab_size}")
    if missing:
        tok.add_special_tokens({"additional_special_tokens": [
            f"<|reserved_special_token_{i}|>" for i in range(missing)]},
            replace_extra_special_tokens=False)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out_dir))
    if len(AutoTokenizer.from_pretrained(str(out_dir))) != vocab_size:
        raise RuntimeError(f"saved tokenizer in {out_dir} does not have {vocab_size} tokens")
