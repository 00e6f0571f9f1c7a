"""A Hugging Face model directory, torch-free: a hub name resolved to its local snapshot, and
its config.json in the model group's terms (the fields where the two differ).

The command line resolves ``model.path`` and checks it against the model group before any
process starts (prepare/, run/checks.py) without importing torch or transformers;
model.py builds the LlamaConfig from the same table.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from .schema import ModelConfig

# ModelConfig field -> config.json key: the one table for both directions (llama_config builds
# a LlamaConfig from a model group; hf_shape reads a config.json in the group's terms).
HF_FIELDS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
             "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
             "intermediate_size": "intermediate_size", "vocab_size": "vocab_size",
             "tie_word_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta",
             "rms_norm_eps": "rms_norm_eps"}
# What a config.json without the key means (LlamaConfig's defaults).
HF_DEFAULTS = {"tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")


def hf_shape(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json in ModelConfig's terms (old top-level rope keys and transformers 5's
    ``rope_parameters`` both understood)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    out = {field: hf.get(key, HF_DEFAULTS.get(field)) for field, key in HF_FIELDS.items()}
    if out["num_kv_heads"] is None:
        out["num_kv_heads"] = out["num_heads"]
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    kind = rope.get("rope_type") or rope.get("type") or "default"
    out["rope_scaling"] = None if kind == "default" else {
        "rope_type": kind, **{k: rope[k] for k in ROPE_SCALING_KEYS if k in rope}}
    return out


def model_shape(m: Any) -> dict[str, Any]:
    """ModelConfig (or a preset as a dict) in the same terms as hf_shape."""
    get = (lambda k, d=None: m.get(k, d)) if isinstance(m, dict) else (lambda k, d=None: getattr(m, k, d))
    out = {f: get(f, HF_DEFAULTS.get(f)) for f in HF_FIELDS}
    rs = get("rope_scaling")
    if rs is not None and not isinstance(rs, dict):
        rs = {k: getattr(rs, k) for k in ("rope_type", *ROPE_SCALING_KEYS)}
    out["rope_scaling"] = dict(rs) if rs else None
    return out


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) > 1e-9 * max(1.0, abs(float(a)))
        except (TypeError, ValueError):
            return True
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) & set(b)
        return any(_differs(a[k], b[k]) for k in keys) or a.get("rope_type") != b.get("rope_type")
    return a != b


def shape_diff(m: ModelConfig | dict, hf: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (model group value, config.json value)} for every field that differs."""
    ours, theirs = model_shape(m), hf_shape(hf)
    return {k: (ours[k], theirs[k]) for k in ours if _differs(ours[k], theirs[k])}


def resolve_hf_dir(path: str) -> Path:
    """A local HF directory as is; a hub name as its snapshot, downloaded if needed (json,
    chat templates, safetensors and tokenizer files only). The driver calls this before launch
    (prepare.resolve_model); ranks run offline and get the local directory."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, allow_patterns=["*.json", "*.jinja", "*.safetensors",
                                                        "tokenizer*"]))


def hub_name(path: str) -> str:
    """The hub name of a hub cache snapshot (``.../models--org--name/snapshots/<rev>`` ->
    ``org/name``), else ``path`` itself: what an export names as its base, so that it loads on
    another machine (prepare.resolve_model swaps a hub name for its local snapshot)."""
    p = Path(path)
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name[len("models--"):].replace("--", "/")
    return path


def read_config_json(path: Path) -> dict[str, Any]:
    """A model directory's config.json; ValueError naming the file when it is not JSON."""
    import json

    f = Path(path) / "config.json"
    try:
        out = json.loads(f.read_text())
    except RecursionError:
        raise ValueError(f"{f} nests JSON deeper than any config does: a damaged or hostile "
                         "file; fetch or write it again") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON ({e.msg} at line {e.lineno}, column "
                         f"{e.colno}): a damaged download or an edit; fetch or write it again")
    except UnicodeDecodeError:
        raise ValueError(f"{f} is not a text file: fetch or write it again") from None
    if not isinstance(out, dict):
        raise ValueError(f"{f} holds a JSON {type(out).__name__}, not the object of a model's "
                         "config")
    return out


# A model's or tokenizer's config that names classes of its own: transformers imports (runs) the
# directory's .py files for them when it is asked to trust remote code, and asks on a terminal.
REMOTE_CODE_KEYS = ("auto_map",)
CODE_CONFIGS = ("config.json", "tokenizer_config.json")


def remote_code_problem(path: Path, key: str) -> "str | None":
    """Why a model or tokenizer directory would run code of its own (``auto_map`` in its
    config.json or tokenizer_config.json), or None. llama_fsdp never runs it: transformers is
    always told not to trust remote code, and such a directory is refused before launch."""
    import json

    for name in CODE_CONFIGS:
        f = Path(path) / name
        try:
            cfg = json.loads(f.read_text()) if f.is_file() else {}
        except (OSError, ValueError, RecursionError):
            continue  # (an unreadable config.json is reported by its own check)
        found = [k for k in REMOTE_CODE_KEYS if isinstance(cfg, dict) and cfg.get(k)]
        if found:
            return (f"{key}={path}: its {name} names Python classes of its own ({found[0]}: "
                    f"{json.dumps(cfg[found[0]])[:200]}), which transformers would import and "
                    "run from the directory; llama_fsdp never runs a model's or tokenizer's own "
                    "code. Use a Llama directory whose classes transformers has (delete "
                    f"{found[0]} from {name} if the classes it names are transformers' own)")
    return None


MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header


# bytes per element of safetensors' dtypes
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                      "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
                      "F8_E5M2": 1}


def _entry_problem(name: str, entry: Any) -> "str | None":
    """Why one tensor's header entry is not a dtype, a shape and offsets whose length is the
    dtype's size times the shape's elements (a header that lies about them), or None."""
    if not isinstance(entry, dict):
        return f"{name}: not a tensor entry"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        return f"{name}: unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                              and d >= 0 for d in shape):
        return f"{name}: shape {shape!r} is not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(
            isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
        return f"{name}: data_offsets {offsets!r} are not two byte offsets"
    n = SAFETENSORS_DTYPES[dtype]
    for d in shape:
        n *= d
    if offsets[1] - offsets[0] != n:
        return (f"{name}: {dtype} {shape} is {n} bytes but its offsets span "
                f"{offsets[1] - offsets[0]}")
    return None


def header_problem(header: Any, data_bytes: int) -> "str | None":
    """Why a parsed safetensors header does not describe its data, entry by entry: dtype x shape
    = byte length, offsets sorted from 0 without overlap or gap, the last at the data's end."""
    if not isinstance(header, dict):
        return "the header is not a JSON object"
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, entry in entries.items():
        if (why := _entry_problem(name, entry)) is not None:
            return why
    at = 0
    for name, entry in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"]):
        start, end = entry["data_offsets"]
        if start != at:
            return (f"{name}: its data starts at byte {start}, not where the tensor before it "
                    f"ends ({at}): {'overlapping' if start < at else 'a gap between'} tensors")
        at = end
    if at != data_bytes:
        return f"the tensors' data ends at byte {at} of {data_bytes}"
    return None


def safetensors_problem(f: Path) -> "str | None":
    """None when ``f``'s header parses, describes its tensors truthfully (``header_problem``)
    and the file is as long as the header says (a truncated download or copy, or a header that
    lies, fails here, naming the file, rather than inside the ranks' loader)."""
    import json

    size = f.stat().st_size
    fix = "download or copy it again"
    with f.open("rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            return (f"{f} is not a safetensors file or is truncated ({size} bytes; its header "
                    f"length reads {n}): {fix}")
        try:
            header = json.loads(fh.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError,
                RecursionError) as e:
            return f"{f} has a damaged safetensors header ({type(e).__name__}: {e}): {fix}"
    expected = 8 + n + max(ends, default=0)
    if size < expected:
        return f"{f} has {size} bytes but its header describes {expected}: truncated; {fix}"
    if (why := header_problem(header, size - 8 - n)) is not None:
        return f"{f} has a safetensors header that does not describe its data ({why}): {fix}"
    return None


def llama_tensor_shape(name: str, hf: dict[str, Any]) -> "tuple[int, ...] | None":
    """The shape config.json gives a Llama weight of this name (None: a name it does not know,
    or a layer past num_hidden_layers, which ``tensor_shape_problems`` reports)."""
    s = hf_shape(hf)
    h, i, v = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    heads, kv = s["num_heads"], s["num_kv_heads"]
    d = hf.get("head_dim") or h // max(heads, 1)
    whole = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
             "model.norm.weight": (h,)}
    if name in whole:
        return whole[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None:
        return None
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (heads * d, h), "self_attn.k_proj.weight": (kv * d, h),
             "self_attn.v_proj.weight": (kv * d, h), "self_attn.o_proj.weight": (h, heads * d),
             "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
             "mlp.down_proj.weight": (h, i)}
    return layer.get(m.group(2))


def tensor_shape_problems(f: Path, hf: dict[str, Any]) -> list[str]:
    """A safetensors file's Llama weights whose shapes are not config.json's (a transposed
    weight, a vocabulary of 1024 rows against a vocab_size of 512, a layer it lacks)."""
    import json

    with f.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    layers = hf.get("num_hidden_layers")
    out = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if (m := re.match(r"model\.layers\.(\d+)\.", name)) and isinstance(layers, int) \
                and int(m.group(1)) >= layers:
            out.append(f"{f}: {name} is a layer config.json does not have "
                       f"(num_hidden_layers={layers})")
            continue
        want = llama_tensor_shape(name, hf)
        if want is not None and tuple(entry["shape"]) != tuple(want):
            out.append(f"{f}: {name} has shape {tuple(entry['shape'])}, but config.json gives it "
                       f"{tuple(want)}")
    return out[:5]


# The largest value a config.json shape field may hold: larger than any model's (Llama 3.1 405B:
# 126 layers, 53,248 intermediate, 128,256 vocabulary), small enough that planning one allocates
# nothing absurd.
SHAPE_BOUNDS = {"hidden_size": 1 << 17, "num_hidden_layers": 1 << 12,
                "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12,
                "intermediate_size": 1 << 20, "vocab_size": 1 << 24}


def hf_config_problems(hf: dict[str, Any], f: Path) -> list[str]:
    """config.json's values of the kinds a Llama config holds: each shape a whole number in
    [1, SHAPE_BOUNDS], tie_word_embeddings true or false, rope_theta and rms_norm_eps positive
    numbers (a string "256" is named as a string, not compared with 256)."""
    out = []
    for key, bound in SHAPE_BOUNDS.items():
        value = hf.get(key)
        if value is None and key == "num_key_value_heads":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= bound:
            what = f"a {type(value).__name__} ({value!r})" if not isinstance(value, int) \
                or isinstance(value, bool) else f"{value}"
            out.append(f"{f}: {key} is {what}, not a whole number in [1, {bound:,}]: the file "
                       "is damaged or not a Llama config; fetch or fix it")
    tie = hf.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        out.append(f"{f}: tie_word_embeddings is {tie!r}, not true or false")
    for key in ("rope_theta", "rms_norm_eps"):
        value = hf.get(key, 1.0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) \
                or not math.isfinite(value) or value <= 0:
            out.append(f"{f}: {key} is {value!r}, not a positive number")
    return out


def model_file_problems(path: Path) -> list[str]:
    """A local model directory's files, checked before any process starts: config.json parses
    and holds a Llama config's kinds of values, every *.safetensors header parses, describes
    its tensors truthfully, gives the Llama weights config.json's shapes, and its file has the
    length the header says, and an index names only files that are there. Each problem names
    its file."""
    import json

    path = Path(path)
    out, hf = [], None
    try:
        hf = read_config_json(path)
        out += hf_config_problems(hf, path / "config.json")
    except (ValueError, OSError) as e:
        out.append(str(e))
    files = sorted(path.glob("*.safetensors"))
    headers = [p for f in files if (p := safetensors_problem(f))]
    out += headers
    if hf is not None and not out:
        out += [p for f in files for p in tensor_shape_problems(f, hf)][:5]
    for index in sorted(path.glob("*.safetensors.index.json")):
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            out.append(f"{index} is not a safetensors index ({type(e).__name__}: {e})")
            continue
        out += [f"{index} names {name}, which is not in {path}" for name in sorted(files)
                if not (path / name).is_file()]
    return out
