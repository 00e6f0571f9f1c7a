"""What may be unpickled from a checkpoint: DCP's ``.metadata`` only, and only into DCP's
metadata classes.

A DCP checkpoint's ``.metadata`` file is a pickle, and torch's ``FileSystemReader`` unpickles it
with no restriction: a checkpoint someone else wrote could run any code on ``resume=`` or in
``python -m llama_fsdp.convert``. Here it is read against ``ALLOWED``, the classes and functions
torch 2.11 and 2.13 put in it (the metadata dataclasses, the file-system reader's ``_StorageInfo``,
``torch.Size``, dtypes, the layout and memory-format encodings, the path of the checkpoint):

- ``scan`` walks the pickle's opcodes without running any (torch-free: the command line checks a
  checkpoint before launch with it): every global it names must be allowed;
- ``SafeUnpickler`` is the loader itself, refusing any other global as it reads (ranks, convert).

A refusal names the file and the global. Tensor data (``*.distcp``) is read by torch with
``weights_only=True`` (dcp._WeightsOnlyLoadPlanner), never unpickled freely.
"""
from __future__ import annotations

import io
import pickle
import pickletools
from pathlib import Path
from typing import Any

DTYPES = frozenset(
    "bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf complex128 "
    "complex32 complex64 double float float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn "
    "float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 "
    "int32 int4 int5 int6 int64 int7 int8 long qint32 qint8 quint2x4 quint4x2 quint8 short uint1 "
    "uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8".split())
_PATHS = frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"})
ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout from its name
    "torch": frozenset({"Size"}) | DTYPES,
    "pathlib": _PATHS,  # StorageMeta.checkpoint_id, as the writer was given it
    "pathlib._local": _PATHS,  # (Python 3.13's module of the same classes)
    "collections": frozenset({"OrderedDict"}),
}

_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
            "SHORT_BINSTRING"}
_MEMO_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}
_MEMO_GET = {"GET", "BINGET", "LONG_BINGET"}
_UNKNOWN = object()


class UnsafeCheckpoint(ValueError):
    """A checkpoint file would load something other than DCP's metadata classes."""


class DamagedCheckpoint(ValueError):
    """A checkpoint file that is not a whole pickle (truncated, overwritten): damaged, not
    hostile; resume skips it for the one before (dcp.Checkpointer.resume)."""


def _refuse(source: Any, what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"{source} is not a checkpoint llama_fsdp will read: unpickling it would load {what}, "
        "which is not one of DCP's metadata classes (llama_fsdp/checkpoint/pickles.py). A DCP "
        "checkpoint's .metadata is a pickle, and a crafted one runs code when it is loaded: "
        "use checkpoints of your own runs or from someone you trust (docs/checkpoints.md)")


def allowed(module: str, name: str) -> bool:
    return name in ALLOWED.get(module, ())


def scan(data: bytes, source: Any) -> None:
    """Raise UnsafeCheckpoint unless every global the pickle ``data`` names is ALLOWED; no
    opcode is run. A global whose name is not a plain string of the pickle (built another
    way) is refused too."""
    memo: dict[Any, Any] = {}
    tail: list[Any] = []  # what the latest ops pushed, as far as it is known
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in _STRINGS:
                tail.append(arg)
            elif name in _MEMO_GET:
                tail.append(memo.get(arg, _UNKNOWN))
            elif name in _MEMO_PUT:
                memo[arg] = tail[-1] if tail else _UNKNOWN
            elif name == "MEMOIZE":
                memo[len(memo)] = tail[-1] if tail else _UNKNOWN
            elif name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                if not allowed(module, attr):
                    raise _refuse(source, f"{module}.{attr}")
                tail.append(_UNKNOWN)
            elif name == "STACK_GLOBAL":
                module, attr = (tail[-2], tail[-1]) if len(tail) >= 2 else (_UNKNOWN, _UNKNOWN)
                if not (isinstance(module, str) and isinstance(attr, str)
                        and allowed(module, attr)):
                    shown = (f"{module}.{attr}" if isinstance(module, str)
                             and isinstance(attr, str) else "a global built at load time")
                    raise _refuse(source, shown)
                tail.append(_UNKNOWN)
            elif name in ("EXT1", "EXT2", "EXT4"):
                raise _refuse(source, f"the copyreg extension {arg}")
            elif name not in ("FRAME", "PROTO"):
                tail.append(_UNKNOWN)
    except (ValueError, EOFError) as e:
        if isinstance(e, UnsafeCheckpoint):
            raise
        raise DamagedCheckpoint(f"{source} is not a readable pickle ({e})") from None


class SafeUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only ALLOWED globals."""

    def __init__(self, file: Any, source: Any):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if not allowed(module, name):
            raise _refuse(self.source, f"{module}.{name}")
        return super().find_class(module, name)


def load_metadata(path: str | Path) -> Any:
    """A DCP ``.metadata`` file, scanned and then unpickled into DCP's classes only."""
    data = Path(path).read_bytes()
    scan(data, path)
    return SafeUnpickler(io.BytesIO(data), path).load()


def check_file(path: str | Path) -> str | None:
    """Why ``path`` (a checkpoint's .metadata) would load more than DCP's classes, or None
    (torch-free: what the command line asks before launch). A damaged or unreadable file is
    None here: resume skips it for an older checkpoint, as any damaged one."""
    try:
        scan(Path(path).read_bytes(), path)
    except UnsafeCheckpoint as e:
        return str(e)
    except (DamagedCheckpoint, OSError):
        return None
    return None
