"""Record formats (instruction, chat, text) turned into token ids with a loss mask.

The ``encode_*`` functions render one record into ``(ids, loss_mask, prompt_len)``:
``loss_mask[i]`` says whether token i is a training target and ``prompt_len`` is where the
answer the model should generate starts (0: no prompt).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from ..config import DataConfig

Encoded = tuple[list[int], list[int], int]  # ids, loss mask (0/1), prompt length


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
    return p + r, mask, len(p)


def encode_text(tok: PreTrainedTokenizerBase, text: str) -> Encoded:
    """BOS + text + EOS, every token a target."""
    ids = _bos(tok) + _ids(tok, text) + [tok.eos_token_id]
    return ids, [0] + [1] * (len(ids) - 1), 0


def encode_chat(tok: PreTrainedTokenizerBase, messages: list[dict], *,
                train_on_prompt: bool) -> Encoded:
    """A conversation through the tokenizer's chat template; the loss covers assistant turns.

    The template renders each growing prefix of the conversation (with a generation prompt
    before assistant turns); the text each step adds is one segment, tokenized on its own and
    masked unless it is an assistant turn. ``prompt_len`` is where the last assistant turn starts.
    """
    if not tok.chat_template:
        raise ValueError(f"tokenizer {tok.name_or_path!r} has no chat template; chat records "
                         "need one (set data.tokenizer to a chat tokenizer, or use data.format)")
    ids: list[int] = []
    mask: list[int] = []
    prompt_len = 0
    done = ""
    for i, m in enumerate(messages):
        is_answer = m["role"] == "assistant"
        if is_answer:
            head = (tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                    if i else "")
            done = _append_segment(tok, ids, mask, done, head, train_on_prompt)
            prompt_len = len(ids)
        full = tok.apply_chat_template(messages[:i + 1], tokenize=False)
        done = _append_segment(tok, ids, mask, done, full, is_answer or train_on_prompt)
    if mask:
        mask[0] = 0
    if messages[-1]["role"] != "assistant":
        prompt_len = 0  # no final answer to generate
    return ids, mask, prompt_len


def _append_segment(tok, ids: list[int], mask: list[int], done: str, text: str, target: bool) -> str:
    if not text.startswith(done):
        raise ValueError("the chat template does not render conversation prefixes as prefixes of "
                         "the whole; assistant turns cannot be located for loss masking")
    seg = _ids(tok, text[len(done):])
    ids += seg
    mask += [int(target)] * len(seg)
    return text


def detect_format(cfg: DataConfig, columns: list[str], where: str) -> str:
    """The record format: as configured, or by the columns present; checks the columns exist."""
    need = {"instruction": [cfg.instruction_column, cfg.output_column],
            "chat": [cfg.messages_column], "text": [cfg.text_column]}
    fmt = cfg.format
    if fmt == "auto":
        fmt = next((f for f in ("chat", "instruction", "text") if all(c in columns for c in need[f])),
                   None)
        if fmt is None:
            raise ValueError(
                f"{where}: cannot tell the record format from columns {sorted(columns)}; expected "
                f"{cfg.messages_column!r} (chat), {cfg.instruction_column!r}+{cfg.output_column!r} "
                f"(instruction) or {cfg.text_column!r} (text). Set data.format and the "
                "data.*_column names")
    elif fmt not in need:
        raise ValueError(f"data.format={fmt!r}: valid: {', '.join(DataConfig.FORMATS)}")
    missing = [c for c in need[fmt] if c not in columns]
    if missing:
        raise ValueError(f"{where}: format {fmt!r} needs column(s) {missing} (data.*_column); "
                         f"the records have columns {sorted(columns)}")
    return fmt


@dataclass(frozen=True)
class Encoder:
    """Turns a batch of records into ``input_ids`` / ``loss_mask`` / ``prompt_len`` rows
    (picklable, for ``datasets.map(num_proc=...)``)."""

    tokenizer: Any
    fmt: str
    cfg: DataConfig
    seq_len: int
    where: Any

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "loss_mask": [], "prompt_len": [], "truncated": [],
                                "task": []}
        tasks = batch.get("task")
        for j, index in enumerate(indices):
            try:
                ids, mask, prompt_len = self.encode({k: v[j] for k, v in batch.items()})
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{self.where(index)}: {e}") from None
            truncated = len(ids) > self.seq_len
            if truncated:
                if self.cfg.overlong == "error":
                    raise ValueError(f"{self.where(index)}: {len(ids)} tokens, longer than "
                                     f"train.seq_len={self.seq_len} (data.overlong=error; "
                                     "use truncate or drop, or raise train.seq_len)")
                if self.cfg.overlong == "drop":
                    continue
                ids, mask = ids[:self.seq_len], mask[:self.seq_len]
                prompt_len = min(prompt_len, self.seq_len)
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["prompt_len"].append(prompt_len)
            out["truncated"].append(truncated)
            out["task"].append(str(tasks[j]) if tasks is not None else "")
        return out

    def encode(self, rec: dict[str, Any]) -> tuple[list[int], list[int], int]:
        c, tok = self.cfg, self.tokenizer
        match self.fmt:
            case "instruction":
                instruction, output = _text(rec, c.instruction_column), _text(rec, c.output_column)
                inp = rec.get(c.input_column) or ""
                if not isinstance(inp, str):
                    raise TypeError(f"field {c.input_column!r} must be a string, "
                                    f"got {type(inp).__name__}")
                prompt = (c.prompt_template.format(instruction=instruction, input=inp) if inp
                          else c.prompt_template_no_input.format(instruction=instruction))
                return encode_prompt_response(tok, prompt, output, train_on_prompt=c.train_on_prompt)
            case "chat":
                return encode_chat(tok, _messages(rec, c.messages_column),
                                   train_on_prompt=c.train_on_prompt)
            case "text":
                return encode_text(tok, _text(rec, c.text_column))
        raise ValueError(f"unknown format {self.fmt!r}")


def _text(rec: dict[str, Any], col: str) -> str:
    v = rec.get(col)
    if not isinstance(v, str):
        raise TypeError(f"field {col!r} is missing or not a string (got {type(v).__name__})")
    return v


def _messages(rec: dict[str, Any], col: str) -> list[dict[str, str]]:
    msgs = rec.get(col)
    if not isinstance(msgs, list) or not msgs:
        raise TypeError(f"field {col!r} must be a non-empty list of messages")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise TypeError(f"field {col!r}: each message needs string 'role' and 'content', got {m!r}")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError(f"field {col!r}: no assistant turn, so nothing to learn")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]

