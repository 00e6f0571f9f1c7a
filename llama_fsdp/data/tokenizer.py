"""Tokenizers: the model's own, any Hugging Face tokenizer, or the project tokenizer.

Which tokenizer encodes the data (``choose_tokenizer``), as TRL, axolotl and the HF Trainer do:

1. ``data.tokenizer`` when set (a tokenizer directory or a hub name);
2. else the tokenizer of ``model.path`` (the HF model directory being fine-tuned), with its chat
   template;
3. else, with no model path (a model trained from scratch, e.g. ``model=tiny``), the project
   tokenizer: a 512-piece SentencePiece BPE model trained once on the synthetic corpus, saved as
   an ordinary HF tokenizer directory (``LlamaTokenizer``, BOS / EOS / pad, byte fallback so no
   text is lost, a chat template) and cached under ``cache_dir/tokenizers`` keyed by everything
   it was trained from. It is made for the synthetic task: on real text it spends several times
   more tokens than a real model's tokenizer (the data module says so, with the measured rate).

``vocab_problem`` refuses a tokenizer whose ids do not fit the model's embedding.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from filelock import FileLock

from ..config.hf_dir import remote_code_problem
from ..config.manifest import cached_entry_ok, write_manifest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# The project tokenizer; conf/model/tiny.yaml's vocab_size must equal it.
PROJECT_VOCAB_SIZE = 512
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Each turn is "<|role|>\n" + content + EOS; a generation prompt ends with "<|assistant|>\n".
# Every rendering of a conversation prefix is a prefix of the next one, which the chat masking
# relies on (see formats.encode_chat).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# Bump when the training recipe below changes: it is part of the cache key.
_RECIPE_VERSION = 1
# Files that make a directory an HF tokenizer (any one is enough for AutoTokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass(frozen=True)
class TokenizerChoice:
    """Which tokenizer encodes the data, and why."""

    source: str  # "data.tokenizer" | "model.path" | "project"
    name_or_path: Optional[str]  # a directory or hub name; None for the project tokenizer

    @property
    def is_project(self) -> bool:
        return self.source == "project"

    def describe(self) -> str:
        if self.is_project:
            return f"the project tokenizer ({PROJECT_VOCAB_SIZE} pieces, made for the synthetic task)"
        return f"{self.name_or_path} ({self.source})"


def has_tokenizer_files(path: Path) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def choose_tokenizer(tokenizer: Optional[str], model_path: Optional[str]) -> TokenizerChoice:
    """data.tokenizer, else model.path's own tokenizer, else (no model path) the project one.

    A local model directory without tokenizer files is refused: ids from any other tokenizer
    would not mean what the pretrained embedding learnt.
    """
    if tokenizer:
        return TokenizerChoice("data.tokenizer", tokenizer)
    if model_path:
        local = Path(model_path).expanduser()
        if local.is_dir():
            if not has_tokenizer_files(local):
                raise ValueError(
                    f"model.path={model_path} has no tokenizer files ({', '.join(TOKENIZER_FILES)})"
                    ": its data must be tokenized with the tokenizer the model was trained with. "
                    "Set data.tokenizer to it (a tokenizer directory or hub name), or copy the "
                    "tokenizer files into the model directory")
            return TokenizerChoice("model.path", str(local))
        return TokenizerChoice("model.path", model_path)  # a hub name (the driver resolves it)
    return TokenizerChoice("project", None)


def _tokenizer_files(name_or_path: str) -> Optional[Path]:
    """The local directory of a tokenizer: the path itself, or a hub name's snapshot holding its
    tokenizer_config.json (fetched, not run); None where neither is at hand."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return local
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(name_or_path, "tokenizer_config.json")).parent
    except Exception:  # noqa: BLE001 - not on the hub (or offline): from_pretrained says why
        return None


def load_tokenizer(name_or_path: Optional[str], *, cache_dir: Path,
                   corpus: Optional[Callable[[], Iterable[str]]] = None,
                   source: str = "data.tokenizer") -> PreTrainedTokenizerBase:
    """An HF tokenizer: ``name_or_path`` through AutoTokenizer, or (None) the project tokenizer.

    ``corpus`` produces the project tokenizer's training text: its hash names the cached
    tokenizer, trained on it the first time. ``source`` names the setting the path came from,
    for errors. A tokenizer without a pad token gets its EOS as pad (labels mask padding by
    position, never by id, so this is safe).
    """
    from transformers import AutoTokenizer  # (the driver's warm path never loads a tokenizer)

    if name_or_path is None:
        if corpus is None:
            raise ValueError("the project tokenizer needs its training corpus (data.tokenizer is null)")
        path = project_tokenizer_dir(cache_dir, corpus)
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    else:
        local = _tokenizer_files(name_or_path)
        if local is not None and (code := remote_code_problem(local, source)) is not None:
            raise ValueError(code)
        try:
            tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{source}={name_or_path!r}: cannot load an HF tokenizer from it "
                             f"(a local tokenizer directory or a hub name): {e}") from e
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path or path} has no EOS token; records end with EOS")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def set_chat_template(tok: PreTrainedTokenizerBase, template: Optional[str]) -> None:
    """data.chat_template: the Jinja text, or a path to a file holding it, replaces the
    tokenizer's own template."""
    if not template:
        return
    if "{" not in template:  # every Jinja template has a "{{" or "{%": this is a file's path
        p = Path(template).expanduser()
        if not p.is_file():
            raise ValueError(f"data.chat_template={template!r}: neither a Jinja template nor an "
                             "existing file")
        template = p.read_text(encoding="utf-8")
    tok.chat_template = template


def token_id_bound(tok: PreTrainedTokenizerBase) -> int:
    """One more than the largest id the tokenizer can produce (its vocabulary and added tokens)."""
    vocab = tok.get_vocab()
    return max(len(tok), 1 + max(vocab.values(), default=-1))


def vocab_problem(tok: PreTrainedTokenizerBase, choice: TokenizerChoice,
                  vocab_size: int) -> Optional[str]:
    """Why ``tok``'s ids cannot feed a model of ``vocab_size`` embeddings (None: they can).

    Larger than the model is always refused (ids past the embedding). Smaller is fine for a
    pretrained model (embeddings are often padded), but the project tokenizer must match exactly:
    a model of another vocabulary with it means the model's own tokenizer was not found.
    """
    n = token_id_bound(tok)
    if n > vocab_size:
        if choice.source == "data.tokenizer":
            fix = ("use the model's own tokenizer (leave data.tokenizer unset with model.path, or "
                   "point data.tokenizer at the model's tokenizer)")
        else:
            fix = "use the tokenizer the model was trained with (data.tokenizer=<dir or hub name>)"
        return (f"tokenizer {choice.describe()} has {n} tokens but model.vocab_size={vocab_size}: "
                f"ids >= {vocab_size} would index past the model's embedding. Fix: {fix}; for a "
                f"model trained from scratch, set model.vocab_size={n}")
    if choice.is_project and n != vocab_size:
        return (f"tokenizer {choice.describe()} has {n} tokens but model.vocab_size={vocab_size}: "
                f"set model.vocab_size={n} (model=tiny) for the synthetic task, or set model.path "
                "to a Hugging Face model (its tokenizer is used) or data.tokenizer=<dir or hub name>")
    return None


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
    if cached_entry_ok(final, digests=True):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{final.name}.lock")):
        if cached_entry_ok(final, digests=True, damaged=(
                "the cached project tokenizer is damaged ({problem}): training it again")):
            return final
        log.info("training the project tokenizer (SentencePiece BPE, %d pieces) on %d lines -> %s",
                 vocab_size, len(lines), final)
        for stale in root.glob(f".{final.name}-*"):  # trainings killed midway
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        try:
            train_sentencepiece_tokenizer(lines, tmp, vocab_size=vocab_size)
            write_manifest(tmp, digests=True)  # last: it marks the tokenizer complete
            shutil.rmtree(final, ignore_errors=True)  # one from before manifests existed
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
    from transformers import AutoTokenizer, LlamaTokenizer

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
    if len(AutoTokenizer.from_pretrained(str(out_dir), trust_remote_code=False)) != vocab_size:
        raise RuntimeError(f"saved tokenizer in {out_dir} does not have {vocab_size} tokens")
