"""`python -m llama_fsdp.generate RUN_DIR_OR_HF_DIR "prompt"`: ask a trained model something.

    python -m llama_fsdp.generate outputs/runs/<day>/<time> "Opposite hot"
    python -m llama_fsdp.generate outputs/runs/<day>/<time>            # a chat: one line a turn
    python -m llama_fsdp.generate /models/Llama-3.2-1B-Instruct "Name three rivers" --sample

The prompt is put in the run's format (data.format of its config.yaml: its prompt template, or
the tokenizer's chat template, or the text as it is), exactly as training fed it, and the answer
ends at the end-of-turn token (the tokenizer's EOS, and <|eot_id|> where the vocabulary has
it). Greedy by default; --sample with --temperature and --top-p. The weights: the run's export
(merged under LoRA / QLoRA), a checkpoint (--step N, converted), or an adapter merged on the fly.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any, Optional

from .checks import finite_problem, run_command
from .models import ModelNotFound, resolve

log = logging.getLogger("llama_fsdp.generate")

FORMATS = ("instruction", "chat", "text")
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>")


def run_data_config(run_dir: Optional[Path]) -> dict[str, Any]:
    """The run's data node (its format and templates), from its config.yaml; ModelNotFound
    naming the file when it is not a run's config (not YAML, not a mapping)."""
    if run_dir is None:
        return {}
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    f = run_dir / "config.yaml"
    try:
        node = OmegaConf.load(f)
        data = node.get("data") if isinstance(node, DictConfig) else None
        if not isinstance(node, DictConfig) or not isinstance(data, (DictConfig, type(None))):
            raise ValueError("a YAML " + ("mapping whose data is not one" if isinstance(
                node, DictConfig) else f"{type(node).__name__}, not a mapping"))
        out = OmegaConf.to_container(data or {}, resolve=False) or {}
    except (OmegaConfBaseException, ValueError, OSError, RecursionError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ModelNotFound(f"{f} is not a run's config ({first}): give --format, or the "
                            "model folder itself (export/) instead of the run") from None
    return out


def pick_format(data: dict[str, Any], tok: Any, asked: Optional[str]) -> str:
    """--format; else the run's data.format (synthetic data is instruction records); else chat
    when the tokenizer has a chat template, else plain text."""
    if asked:
        return asked
    fmt = data.get("format")
    if data.get("name") == "synthetic" and fmt not in FORMATS:
        fmt = "instruction"  # the synthetic records are instruction records
    if fmt in FORMATS:
        return fmt
    return "chat" if getattr(tok, "chat_template", None) else "text"


def prompt_ids(text: str, history: list[dict[str, str]], *, fmt: str, tok: Any,
               data: dict[str, Any]) -> list[int]:
    """The prompt's token ids as training saw them (data/formats.py): BOS + the instruction
    template; or the chat template with the generation prompt; or BOS + the text."""
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    if fmt == "instruction":
        template = data.get("prompt_template_no_input") or "{instruction} ="
        return bos + tok(template.format(instruction=text), add_special_tokens=False)["input_ids"]
    if fmt == "chat":
        if data.get("chat_template"):  # the run's own template (the text, or a .jinja path)
            from ..data.tokenizer import set_chat_template

            set_chat_template(tok, data["chat_template"])
        messages = history + [{"role": "user", "content": text}]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok(rendered, add_special_tokens=False)["input_ids"]
    return bos + tok(text, add_special_tokens=False)["input_ids"]


def stop_ids(tok: Any) -> list[int]:
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    vocab = tok.get_vocab()
    return ids + [vocab[t] for t in END_OF_TURN if t in vocab and vocab[t] not in ids]


def answer(model: Any, tok: Any, ids: list[int], *, max_new_tokens: int, sample: bool,
           temperature: float, top_p: float, seed: int) -> tuple[str, bool]:
    """The model's answer to the prompt ids, and whether it ended at an end-of-turn token."""
    import torch

    torch.manual_seed(seed)
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    stops = stop_ids(tok)
    kwargs = dict(do_sample=True, temperature=temperature, top_p=top_p) if sample else \
        dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             eos_token_id=stops, pad_token_id=tok.pad_token_id
                             if tok.pad_token_id is not None else stops[0], **kwargs)
    new = out[0, len(ids):].tolist()
    ended = bool(new) and new[-1] in stops
    if ended:
        new = new[:-1]
    return tok.decode(new, skip_special_tokens=True).strip(), ended


def main(argv: Optional[list[str]] = None) -> int:
    return run_command(_main, argv)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m llama_fsdp.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="a run directory, one of its checkpoints, its "
                   "export, an HF model folder or a PEFT adapter folder")
    p.add_argument("prompt", nargs="*", help="the prompt(s); none: a chat on standard input")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="how the prompt is put (default: the run's data.format)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint at this step")
    p.add_argument("--device", default=None, help="cpu, cuda (default: cuda if any)")
    return p


def option_problems(args: argparse.Namespace) -> list[str]:
    """The options and the prompts, before any weights are read."""
    out = [p for p in (finite_problem("--temperature", args.temperature, low=0, low_open=True),
                       finite_problem("--top-p", args.top_p, low=0, low_open=True)) if p]
    if math.isfinite(args.top_p) and args.top_p > 1:
        out.append(f"--top-p {args.top_p} must be in (0, 1]")
    if args.max_new_tokens < 1:
        out.append(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    for n, text in enumerate(args.prompt, 1):
        if (bad := not_utf8(text)) is not None:
            out.append(f"prompt {n} is not UTF-8 text ({bad}): give it as UTF-8")
    if not args.prompt and sys.stdin is None:
        out.append("no prompt, and standard input is closed: give the prompt as an argument, "
                   "or one per line on standard input")
    return out


def not_utf8(text: str) -> Optional[str]:
    """Where a command-line string holds bytes that were not UTF-8 (Python keeps them as lone
    surrogates), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"character {e.start + 1}"
    return None


def fit(ids: list[int], max_new_tokens: int, context: Optional[int], what: str) -> \
        tuple[Optional[int], Optional[str]]:
    """The new tokens the model's context leaves after the prompt (with a warning when fewer
    than asked), or an error when the prompt fills it."""
    if context is None or len(ids) + max_new_tokens <= context:
        return max_new_tokens, None
    if len(ids) >= context:
        return None, (f"{what} is {len(ids):,} tokens, more than the model's context of "
                      f"{context:,} (max_position_embeddings in config.json): shorten it")
    left = context - len(ids)
    log.warning("%s is %d tokens of the model's %d: the answer stops at %d new tokens", what,
                len(ids), context, left)
    return left, None


def _main(argv: Optional[list[str]]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s",
                        datefmt="%H:%M:%S")
    if problems := option_problems(args):
        for line in problems:
            log.error("%s", line)
        return 2
    import torch

    from . import load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        with resolve(args.model, step=args.step) as found:
            log.info("model: %s", found.what)
            data = run_data_config(found.run_dir)
            model, tok = load_model(found.hf_dir, device=device)
    except ModelNotFound as e:
        log.error("%s", e)
        return 2
    context = getattr(model.config, "max_position_embeddings", None)
    fmt = pick_format(data, tok, args.format)
    log.info("prompt format: %s", fmt)
    opts = dict(sample=args.sample, temperature=args.temperature, top_p=args.top_p,
                seed=args.seed)
    if args.prompt:
        prompts = [prompt_ids(text, [], fmt=fmt, tok=tok, data=data) for text in args.prompt]
        fits = [fit(ids, args.max_new_tokens, context, f"prompt {n}")
                for n, ids in enumerate(prompts, 1)]
        if errors := [e for _, e in fits if e]:  # every prompt checked before any answer
            for line in errors:
                log.error("%s", line)
            return 2
        for ids, (new, _) in zip(prompts, fits):
            out, _ = answer(model, tok, ids, max_new_tokens=new, **opts)
            print(out, flush=True)
        return 0
    return _chat(model, tok, fmt=fmt, data=data, context=context,
                 max_new_tokens=args.max_new_tokens, opts=opts)


def _chat(model: Any, tok: Any, *, fmt: str, data: dict[str, Any], context: Optional[int],
          max_new_tokens: int, opts: dict[str, Any]) -> int:
    """One prompt a line of standard input (a chat: each turn with the ones before under the
    chat format). A line that is not UTF-8, or too long for the context, is named and skipped;
    the exit code says so (2)."""
    history: list[dict[str, str]] = []  # a chat: the turns so far (chat format)
    interactive = sys.stdin.isatty()
    skipped, n = 0, 0
    while True:
        if interactive:
            print("> ", end="", flush=True)
        raw = sys.stdin.buffer.readline()
        if not raw:
            return 2 if skipped else 0
        n += 1
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            log.error("standard input, line %d: not UTF-8 text (byte %d): skipped", n,
                      e.start + 1)
            skipped += 1
            continue
        if not text:
            continue
        ids = prompt_ids(text, history, fmt=fmt, tok=tok, data=data)
        new, error = fit(ids, max_new_tokens, context, f"standard input, line {n}"
                         + (" with the chat before it" if history else ""))
        if error:
            log.error("%s: skipped", error)
            skipped += 1
            continue
        out, _ = answer(model, tok, ids, max_new_tokens=new, **opts)
        print(out, flush=True)
        if fmt == "chat":
            history += [{"role": "user", "content": text}, {"role": "assistant", "content": out}]


if __name__ == "__main__":
    sys.exit(main())
