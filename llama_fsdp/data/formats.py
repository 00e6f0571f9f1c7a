"""Record formats (instruction, chat, text) turned into token ids with a loss mask.

The ``encode_*`` functions render one record into an :class:`Encoded`: ``loss_mask[i]`` says
whether token i is a training target, ``prompt_len`` is where the answer the model should
generate starts (0: no prompt), ``chars`` the characters the tokens encode (for tokens per
character). ``detect_format`` picks the format from the columns and refuses, before any record
is tokenized, layouts it cannot map (naming the columns found and the fix).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional

from transformers import PreTrainedTokenizerBase

from ..config.schema import DataConfig


class Encoded(NamedTuple):
    ids: list[int]
    mask: list[int]  # 1: a training target
    prompt_len: int  # tokens before the (final) answer; 0: no prompt
    chars: int  # characters of text the ids encode (template included)


class ChatTemplateError(ValueError):
    """The chat template cannot be used to locate assistant turns exactly."""


def _ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] if text else []


def _bos(tok: PreTrainedTokenizerBase) -> list[int]:
    return [tok.bos_token_id] if tok.bos_token_id is not None else []


def encode_prompt_response(tok: PreTrainedTokenizerBase, prompt: str, response: str, *,
                           train_on_prompt: bool) -> Encoded:
    """BOS + prompt + response + EOS; the loss covers the response and EOS (and the prompt if asked).

    Prompt and response are tokenized separately so the boundary is exact; generation feeds the
    same prompt ids, so training and evaluation agree.
    """
    p = _bos(tok) + _ids(tok, prompt)
    r = _ids(tok, response) + [tok.eos_token_id]
    mask = [1 if train_on_prompt else 0] * len(p) + [1] * len(r)
    if mask:
        mask[0] = 0  # the first token is never a target (nothing precedes it)
    return Encoded(p + r, mask, len(p), len(prompt) + len(response))


def encode_text(tok: PreTrainedTokenizerBase, text: str) -> Encoded:
    """BOS + text + EOS, every token a target."""
    ids = _bos(tok) + _ids(tok, text) + [tok.eos_token_id]
    return Encoded(ids, [0] + [1] * (len(ids) - 1), 0, len(text))


# --- chat ----------------------------------------------------------------------------------------

def encode_chat(tok: PreTrainedTokenizerBase, messages: list[dict], *,
                train_on_prompt: bool, targets_from: int = 0) -> Encoded:
    """A conversation exactly as ``tok.apply_chat_template(messages)`` tokenizes it, with the loss
    on assistant turns (their content and end-of-turn token) only.

    The template renders the whole conversation once (``tokenize=False``) and that text is
    tokenized once, as ``apply_chat_template(tokenize=True)`` does (no special tokens added: the
    template writes BOS itself), so the ids are the ones inference sees, token for token. The
    assistant turns are located as character spans by rendering conversation prefixes:
    turn i starts where ``messages[:i]`` with the generation prompt stops agreeing with the whole,
    and ends where ``messages[:i+1]`` ends (less whitespace after a closing special token, such as
    ChatML's "<|im_end|>\\n"). A token is a target when its characters overlap a span, so a token
    that straddles the boundary (" Sure" after a prompt ending in a space) is one.

    Why not the tokenizer's own mask (``return_assistant_tokens_mask``): it needs
    ``{% generation %}`` blocks, which most templates lack, and (transformers 5.x) returns an
    all-zero mask for byte-level tokenizers when an assistant turn starts with a space.

    ``prompt_len`` is where the last assistant turn starts (0 when the conversation does not end
    with one). ``targets_from``: only assistant turns from this message on are targets (a
    preference pair's answer after its prompt turns). Needs a fast tokenizer (character offsets) and a template that renders every
    prefix of the conversation as a prefix of the whole (``ChatTemplateError`` otherwise).
    """
    if not tok.chat_template:
        raise ValueError(f"tokenizer {tok.name_or_path!r} has no chat template; chat records need "
                         "one: set data.chat_template (a Jinja template or a .jinja file), or use "
                         "a chat model's tokenizer (model.path / data.tokenizer)")
    if not tok.is_fast:
        raise ValueError(f"tokenizer {tok.name_or_path!r} is not a fast (tokenizers-backed) "
                         "tokenizer; chat records need one (a tokenizer.json) to locate "
                         "assistant turns by character offsets")
    if (problem := masking_problem(tok)) is not None:
        raise ChatTemplateError(problem)
    full = _render(tok, messages, generation_prompt=False)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    spans = assistant_spans(tok, messages, full)
    if targets_from:  # a preference answer: only the turns from message targets_from on
        spans = spans[sum(m["role"] == "assistant" for m in messages[:targets_from]):]
    mask = _overlap_mask(offsets, spans)
    prompt_len = 0
    if messages[-1]["role"] == "assistant" and spans:
        a, b = spans[-1]
        prompt_len = next((k for k, (s, e) in enumerate(_widen(offsets)) if s < b and e > a),
                          len(ids))
    if train_on_prompt:
        mask = [1] * len(ids)
    if mask:
        mask[0] = 0
    return Encoded(ids, mask, prompt_len, len(full))


# A chat template renders one conversation in milliseconds; one that runs this long loops
# without a useful end (two nested 100,000-step loops hung data preparation at 100% CPU).
RENDER_BUDGET_S = 10.0


class TemplateTimeout(Exception):
    """A chat template ran past RENDER_BUDGET_S for one conversation."""


@contextlib.contextmanager
def time_bound(seconds: float) -> Iterator[None]:
    """Raise TemplateTimeout in this (main) thread after ``seconds`` of wall time: a Jinja
    template is Python code, so the signal stops it at its next instruction. Elsewhere than a
    main thread (where signals cannot be set) the block runs unbounded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise TemplateTimeout(f"the chat template ran for more than {seconds:g} s on one "
                              "conversation (it loops without end, or loops over something "
                              "huge): fix the template, or set data.chat_template to one that "
                              "renders each conversation once")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _render(tok: PreTrainedTokenizerBase, messages: list[dict], *, generation_prompt: bool) -> str:
    with time_bound(RENDER_BUDGET_S):
        return tok.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=generation_prompt)


_MASKING: dict[str, Optional[str]] = {}  # chat template -> its masking_problem (asked once)
QUESTION, ANSWER = "What is two plus two?", "Four."


def masking_problem(tok: PreTrainedTokenizerBase) -> Optional[str]:
    """Why ``tok``'s chat template cannot tell a prompt from its answer, or None. It cannot when
    it renders a conversation the same with and without ``add_generation_prompt`` and ends
    every conversation, one that ends with an answer too, with the opening of an assistant
    turn (Meta's first Llama 3 template appends the assistant's header unconditionally): the
    answer's span would run into the next turn's header, so every record would train the
    model to open a new turn after answering. (A template without a generation prompt whose
    answers simply follow the prompt, as Llama 2's, masks fine.) Asked once per template."""
    template = tok.chat_template
    if template in _MASKING:
        return _MASKING[template]
    question = [{"role": "user", "content": QUESTION}]
    try:
        with_prompt = _render(tok, question, generation_prompt=True)
        without = _render(tok, question, generation_prompt=False)
        answered = _render(tok, [*question, {"role": "assistant", "content": ANSWER}],
                           generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this: the records say
        _MASKING[template] = None
        return None
    at = answered.rfind(ANSWER)
    q_end = answered.find(QUESTION) + len(QUESTION)
    # the text that opens the assistant's turn, and what follows the answer; an assistant
    # header in both: the template appends it whatever the conversation ends with
    opener, tail = answered[q_end:at], answered[at + len(ANSWER):]
    common = os.path.commonprefix([opener[::-1], tail[::-1]])[::-1]
    if with_prompt != without or at < 0 or q_end < len(QUESTION) or not common.strip():
        _MASKING[template] = None
        return None
    name = getattr(tok, "name_or_path", "") or "the tokenizer"
    _MASKING[template] = (
        f"the chat template of {name} renders a conversation the same with and without "
        f"add_generation_prompt, and ends every conversation, one that ends with an answer "
        f"too, with {common!r}: the opening of an assistant turn. The answers cannot be told "
        "from the next turn's header: every record would train the model to open a new turn "
        "after answering. Meta's first Llama 3 tokenizer_config.json (April 2024) has this "
        "template. Fix: set data.chat_template to a template that writes the assistant's "
        "header only when add_generation_prompt is true (docs/data.md gives Llama 3's, the "
        "one Meta's updated config has)")
    return _MASKING[template]


def assistant_spans(tok: PreTrainedTokenizerBase, messages: list[dict],
                    full: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the assistant turns in ``full`` (the rendering of the
    whole conversation): content and end-of-turn token, without the role header."""
    closers = tuple({t.content for t in tok.added_tokens_decoder.values()} | {tok.eos_token})
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tok, messages[:i], generation_prompt=False) if i else ""
        upto = _render(tok, messages[:i + 1], generation_prompt=False)
        if not (full.startswith(before) and full.startswith(upto)):
            raise ChatTemplateError(
                f"the chat template does not render the conversation up to message {i} as a "
                "prefix of the whole conversation (it rewrites earlier turns, e.g. drops their "
                "reasoning), so assistant turns cannot be located exactly. Fix: give each "
                "assistant turn its own record (the conversation up to it), or set "
                "data.chat_template to a template that keeps earlier turns as they are")
        prompted = _generation_prompt(tok, messages[:i])
        # the turn starts where the generation prompt stops agreeing with the whole (a prompt may
        # add text the rendered turn lacks, e.g. an empty "<think>\n")
        start = max(len(before), len(os.path.commonprefix([prompted, full])))
        end = len(upto)
        body = full[start:end].rstrip()
        if body != full[start:end] and body.endswith(closers):
            end = start + len(body)  # "<|im_end|>\n": the turn ends with its closing token
        spans.append((min(start, end), end))
    return spans


def _generation_prompt(tok: PreTrainedTokenizerBase, history: list[dict]) -> str:
    """``history`` rendered with the generation prompt; for an empty history, the template's
    output for no messages (some templates cannot render one: then nothing)."""
    try:
        return _render(tok, history, generation_prompt=True)
    except Exception:  # noqa: BLE001 - only an empty history can get here with a working template
        if history:
            raise
        return ""


def _widen(offsets) -> list[tuple[int, int]]:
    """Token character ranges; a zero-width range (a whitespace token whose offsets a byte-level
    tokenizer trimmed) stands for the character before it."""
    return [(s - 1, s) if s == e and s > 0 else (s, e) for s, e in offsets]


def _overlap_mask(offsets, spans: list[tuple[int, int]]) -> list[int]:
    return [int(any(s < b and e > a for a, b in spans)) for s, e in _widen(offsets)]


# --- layouts -------------------------------------------------------------------------------------

# Chat columns looked for when data.messages_column is absent (ShareGPT's name).
CHAT_FALLBACK_COLUMNS = ("conversations",)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
_FIX = ("Fix: name your columns with data.format and data.instruction_column / "
        "data.input_column / data.output_column / data.messages_column / data.text_column "
        "(e.g. data.output_column=<your answer column>), or reshape each record with a hook, "
        "data.preprocess=module:function (record -> record, list of records, or None to skip; "
        "README \"Your own data\")")


def describe_feature(f: Any) -> str:
    """A column's type in words: "string", "list of {input, output}", ..."""
    if f is None:
        return "?"
    if isinstance(f, dict):
        return "{" + ", ".join(f) + "}"
    if isinstance(f, (list, tuple)):
        return "list of " + (describe_feature(f[0]) if f else "?")
    inner = getattr(f, "feature", None)
    if inner is not None:
        return "list of " + describe_feature(inner)
    dtype = getattr(f, "dtype", None)
    if dtype is not None:
        return {"large_string": "string", "null": "always null"}.get(dtype, dtype)
    return type(f).__name__


def describe_columns(features: dict[str, Any]) -> str:
    return ", ".join(f"{c!r} ({describe_feature(f)})" for c, f in features.items())


def _list_item(f: Any) -> Any:
    if isinstance(f, (list, tuple)):
        return f[0] if f else None
    return getattr(f, "feature", None)


def _is_text(f: Any) -> bool:
    """A column the encoders read as text: strings (numbers too: CSV files type them)."""
    return getattr(f, "dtype", None) not in (None, "null", "bool", "binary", "large_binary")


def _is_messages(f: Any) -> bool:
    item = _list_item(f)
    keys = set(item) if isinstance(item, dict) else set()
    return {"role", "content"} <= keys or {"from", "value"} <= keys


def _nests_records(f: Any) -> bool:
    item = _list_item(f)
    return isinstance(item, dict) or isinstance(f, dict)


def detect_format(cfg: DataConfig, features: Any, where: str) -> tuple[str, DataConfig]:
    """The record format and the config the encoder reads columns by (the chat column may be
    ShareGPT's "conversations"): as configured, or by the columns present; refuses a layout it
    cannot map, naming the columns found (with their types) and the fix."""
    features = dict(features) if not isinstance(features, list) else {c: None for c in features}
    need = {"instruction": [cfg.instruction_column, cfg.output_column],
            "chat": [cfg.messages_column], "text": [cfg.text_column]}
    fmt = cfg.format
    if fmt == "auto" and cfg.messages_column not in features:
        fallback = next((c for c in CHAT_FALLBACK_COLUMNS if c in features
                         and (features[c] is None or _is_messages(features[c]))), None)
        if fallback:
            cfg = dataclasses.replace(cfg, messages_column=fallback)
            need["chat"] = [fallback]
    if fmt == "auto":
        fmt = next((f for f in ("chat", "instruction", "text")
                    if all(c in features for c in need[f])), None)
        if fmt is None and {"chosen", "rejected"} <= set(features):
            raise ValueError(f"{where}: this is preference data (columns 'chosen' and 'rejected'"
                             f"; found {describe_columns(features)}): use objective=dpo "
                             "(docs/dpo.md), or give each record one answer for supervised "
                             "fine-tuning")
        if fmt is None:
            raise ValueError(f"{where}: cannot tell the record format from its columns (layout "
                             f"not supported). Columns found: {describe_columns(features)}. "
                             f"{_expected(cfg)}{_hints(cfg, features)} {_FIX}")
    elif fmt not in need:
        raise ValueError(f"data.format={fmt!r}: valid: {', '.join(DataConfig.FORMATS)}")
    missing = [c for c in need[fmt] if c not in features]
    if missing:
        raise ValueError(f"{where}: format {fmt!r} needs column(s) {missing} (data.*_column); "
                         f"columns found: {describe_columns(features)}.{_hints(cfg, features)} "
                         f"{_FIX}")
    for c in need[fmt] + ([cfg.input_column] if fmt == "instruction" else []):
        f = features.get(c)
        if f is None or (c == cfg.input_column and getattr(f, "dtype", None) == "null"):
            continue  # untyped (a plain column list), or an optional input that is always empty
        ok = _is_messages(f) if fmt == "chat" else _is_text(f)
        if not ok:
            want = ("a list of {role, content} messages" if fmt == "chat" else "text")
            raise ValueError(f"{where}: column {c!r} ({describe_feature(f)}) should hold {want} "
                             f"for format {fmt!r}; columns found: {describe_columns(features)}."
                             f"{_hints(cfg, features)} {_FIX}")
    return fmt, cfg


def _expected(cfg: DataConfig) -> str:
    return (f"Supported: chat ({cfg.messages_column!r}: a list of {{role, content}} messages), "
            f"instruction ({cfg.instruction_column!r} + {cfg.output_column!r} text, optional "
            f"{cfg.input_column!r}), text ({cfg.text_column!r}).")


def _hints(cfg: DataConfig, features: dict[str, Any]) -> str:
    out = []
    nested = [c for c, f in features.items() if f is not None and _nests_records(f)
              and not _is_messages(f)]
    for c in nested:
        out.append(f" Column {c!r} nests records ({describe_feature(features[c])}) inside each "
                   "record: no data.*_column can point into it; flatten it with data.preprocess "
                   "(e.g. one record per element).")
    if cfg.instruction_column in features and cfg.output_column not in features:
        out.append(f" Found {cfg.instruction_column!r} but no {cfg.output_column!r} column.")
    return "".join(out)


# --- records -> tokens ---------------------------------------------------------------------------

# what an encoder gives per record (Encoder here, preference.PairEncoder per answer)
ROW_COLUMNS = ("input_ids", "loss_mask", "prompt_len", "truncated", "full_len", "targets",
               "chars", "keep", "task")

def char_bound(tok: PreTrainedTokenizerBase, seq_len: int) -> int:
    """Characters of a text field that can matter to its first ``seq_len`` tokens: no piece of
    the vocabulary spells more than its longest (a byte-level piece: one character a byte), so
    seq_len tokens span at most seq_len times that; twice over, so that a cut text still has
    more than seq_len tokens (the same overlong verdict) and the pre-tokenizer's split at the
    cut lies far past the tokens kept."""
    longest = max((len(p) for p in tok.get_vocab()), default=1)
    return 2 * (seq_len + 1) * max(longest, 1) + 1024


def cut_conversation(tok: PreTrainedTokenizerBase, messages: list[dict],
                     char_cap: Optional[int]) -> tuple[list[dict], Optional[int]]:
    """``messages`` with their contents cut to ``char_cap`` characters in all (each message
    keeps what is left of the budget, then its role with an empty content), and the whole
    conversation's rendered length; ``(messages, None)`` when nothing is cut. A 20 MB message
    was rendered and tokenized whole (minutes, GBs) to keep seq_len tokens.

    The template renders the contents (with headers, and may trim or drop some), so the cut is
    checked where it matters: the cut conversation must render the same as the whole for the
    first ``char_cap - 1024`` characters (twice what seq_len tokens can span, char_bound), else
    it is tokenized whole. Within that the ids, the loss mask and the last answer's start are
    the whole conversation's; the rendering still has more than seq_len tokens (the same
    truncate / drop / error verdict)."""
    if not char_cap or sum(len(m["content"]) for m in messages) <= char_cap:
        return messages, None
    left, out = char_cap, []
    for m in messages:
        content = m["content"][:left]
        left -= len(content)
        out.append({**m, "content": content})
    whole = _render(tok, messages, generation_prompt=False)
    agree = max(char_cap - 1024, 1)
    if len(whole) < agree or whole[:agree] != _render(tok, out, generation_prompt=False)[:agree]:
        return messages, None  # a template that does not render the contents as given
    return out, len(whole)


@dataclass(frozen=True)
class Encoder:
    """Turns a batch of records into token rows (picklable, for ``datasets.map(num_proc=...)``).

    Every record gives one row: ``input_ids`` / ``loss_mask`` (cut to ``seq_len`` when
    ``overlong=truncate``; empty when the record is to be dropped), ``prompt_len``, ``truncated``,
    ``full_len`` (tokens before any cut), ``targets`` (target tokens kept), ``chars``, ``keep``
    (false: dropped as overlong) and ``task``. The caller counts and filters.
    """

    tokenizer: Any
    fmt: str
    cfg: DataConfig
    seq_len: int
    where: Any
    # a text field is cut to this many characters before it is tokenized: a 50 MB line took
    # minutes and GBs to keep seq_len tokens. None: char_bound's (the ids kept are the same)
    char_cap: Optional[int] = None

    def __post_init__(self) -> None:
        if self.char_cap is None:
            object.__setattr__(self, "char_cap", char_bound(self.tokenizer, self.seq_len))

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {k: [] for k in ROW_COLUMNS}
        tasks = batch.get("task")
        for j, index in enumerate(indices):
            try:
                ids, mask, prompt_len, chars = self.encode({k: v[j] for k, v in batch.items()})
            except Exception as e:  # noqa: BLE001 - any failure is this record's: name it
                raise ValueError(f"{self.where(index)}: {_reason(e)}") from None
            full_len = len(ids)
            truncated = full_len > self.seq_len
            keep = True
            if truncated:
                if self.cfg.overlong == "error":
                    raise ValueError(f"{self.where(index)}: {full_len} tokens, longer than "
                                     f"train.seq_len={self.seq_len} (data.overlong=error; "
                                     "use truncate or drop, or raise train.seq_len)")
                if self.cfg.overlong == "drop":
                    ids, mask, keep = [], [], False
                else:
                    ids, mask = ids[:self.seq_len], mask[:self.seq_len]
                    prompt_len = min(prompt_len, self.seq_len)
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["prompt_len"].append(prompt_len)
            out["truncated"].append(truncated and keep)
            out["full_len"].append(full_len)
            out["targets"].append(int(sum(mask)))
            out["chars"].append(chars)
            out["keep"].append(keep)
            out["task"].append(str(tasks[j]) if tasks is not None else "")
        return out

    def encode(self, rec: dict[str, Any]) -> Encoded:
        c, tok = self.cfg, self.tokenizer
        cut = (lambda t: t[:self.char_cap]) if self.char_cap else (lambda t: t)  # noqa: E731
        match self.fmt:
            case "instruction":
                instruction, output = _text(rec, c.instruction_column), _text(rec, c.output_column)
                inp = rec.get(c.input_column)
                inp = "" if inp is None else inp
                if not isinstance(inp, (str, int, float)):
                    raise TypeError(f"field {c.input_column!r} must be text, got "
                                    f"{type(inp).__name__}")
                inp = str(inp)
                prompt = (c.prompt_template.format(instruction=instruction, input=inp) if inp
                          else c.prompt_template_no_input.format(instruction=instruction))
                enc = encode_prompt_response(tok, cut(prompt), cut(output),
                                             train_on_prompt=c.train_on_prompt)
                return enc._replace(chars=len(prompt) + len(output))
            case "chat":
                messages = _messages(rec, c.messages_column)
                cut_messages, whole = cut_conversation(tok, messages, self.char_cap)
                enc = encode_chat(tok, cut_messages, train_on_prompt=c.train_on_prompt)
                return enc if whole is None else enc._replace(chars=whole)
            case "text":
                text = _text(rec, c.text_column)
                return encode_text(tok, cut(text))._replace(chars=len(text))
        raise ValueError(f"unknown format {self.fmt!r}")


def _reason(e: Exception) -> str:
    if isinstance(e, (KeyError, TypeError, ValueError, AttributeError)):
        return str(e)
    return f"{type(e).__name__}: {e}"  # e.g. the chat template raised (jinja2 TemplateError)


def _text(rec: dict[str, Any], col: str) -> str:
    v = rec.get(col)
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        hint = (" (nested: flatten it with data.preprocess)" if isinstance(v, (list, dict))
                else "")
        raise TypeError(f"field {col!r} is missing or not a string (got {type(v).__name__})"
                        + hint)
    return str(v)


def _messages(rec: dict[str, Any], col: str) -> list[dict[str, str]]:
    """The record's messages as {role, content} (ShareGPT's {from, value} mapped)."""
    msgs = rec.get(col)
    if not isinstance(msgs, list) or not msgs:
        raise TypeError(f"field {col!r} must be a non-empty list of messages")
    out = []
    for m in msgs:
        if isinstance(m, dict) and m.get("role") is None and m.get("from") is not None:
            m = {"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m.get("value")}
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise TypeError(f"field {col!r}: each message needs string 'role' and 'content' "
                            f"(or ShareGPT's 'from' and 'value'), got {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"field {col!r}: no assistant turn, so nothing to learn")
    return out
