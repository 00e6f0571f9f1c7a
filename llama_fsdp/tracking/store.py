"""The MLflow store: opening a client safely, where artifacts go, the link to the runs page."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

from ..config.rundir import name_problem

# MLflow's own HTTP retries would hold a call for minutes; the shipper retries instead.
FAST_FAIL_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
# MLflow prints "View run ... at <url>" for a run an http store ends: a link without the saved
# view and the model-training mode; the links this tool prints are runs_page's.
QUIET_ENV = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


def resolve_tracking_uri(uri: str, base: Path) -> str:
    """Make relative sqlite/file stores absolute so every rank and node writes the same one."""
    for scheme in ("sqlite:///", "file://"):
        if uri.startswith(scheme):
            path = os.path.expanduser(uri[len(scheme):])
            if path != uri[len(scheme):]:
                return scheme + path  # (~/x: the home's, never a folder named ~)
            if not os.path.isabs(path):
                return scheme + str((base / path).resolve())
    if "://" not in uri:  # a plain directory
        return str((base / os.path.expanduser(uri)).resolve())
    return uri


class NotAStore(ValueError):
    """tracking.uri names a SQLite file that holds something else than an MLflow store."""


# The tables every MLflow store has: a SQLite file without them is someone else's database.
MLFLOW_TABLES = frozenset({"alembic_version", "experiments", "runs", "metrics", "params"})


def _tables(db: Path, mode: str) -> set[str]:
    import sqlite3

    conn = sqlite3.connect(f"file:{db}?mode={mode}", uri=True)
    try:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        conn.close()


def sqlite_store_problem(db: Path, key: str = "tracking.uri",
                         fix: Optional[str] = None) -> Optional[str]:
    """Why the SQLite file ``db`` must not be opened as an MLflow store (MLflow would add its
    tables to it, and put an mlartifacts/ folder beside it), or None: it does not exist yet, is
    empty, or is an MLflow store. Read-only: the file is left as it is, byte for byte (but for
    the rollback of a killed writer's transaction, which SQLite makes before any read). ``key``:
    what names the file, ``fix`` what to do instead, said in the message."""
    import sqlite3

    if not db.exists() or (db.is_file() and db.stat().st_size == 0):
        return None
    if not db.is_file():
        return f"{key} names {db}, which is not a file"
    try:
        tables = _tables(db, "ro")
    except sqlite3.OperationalError as e:
        if "readonly" not in str(e):
            return f"{key} names {db}, which is not a SQLite database ({e})"
        try:  # a hot journal: a writer was killed mid-transaction (a rank's SIGKILL), and
            # reading needs its rollback first, as the next MLflow client would do (never a
            # file created: mode=rw)
            tables = _tables(db, "rw")
        except sqlite3.DatabaseError as e:
            return f"{key} names {db}, which is not a SQLite database ({e})"
    except sqlite3.DatabaseError as e:
        return f"{key} names {db}, which is not a SQLite database ({e})"
    if MLFLOW_TABLES <= tables:
        return None
    shown = ", ".join(sorted(tables)[:6]) + (" ..." if len(tables) > 6 else "")
    return (f"{key} names {db}, a SQLite database that is not an MLflow store (its "
            f"tables: {shown or 'none'}): MLflow would add its own tables to it. It is left as "
            "it is; " + (fix or "point tracking.uri at a new file (sqlite:///outputs/mlflow.db) "
                         "or at an MLflow store"))


def _store_lock(db: Path) -> str:
    """The lock that serializes a store's creation: in llama_fsdp's cache, not beside the store
    (a file of the user's gets nothing beside it); beside it where the cache is not writable."""
    import hashlib

    locks = _template_dir() / "locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
    except OSError:
        return str(db) + ".lock"
    return str(locks / f"sqlite-{hashlib.sha256(str(db.resolve()).encode()).hexdigest()[:16]}.lock")


def open_client(uri: str) -> Any:
    """An MlflowClient. Opening a sqlite store creates or migrates its schema, and two
    processes doing that at once leave it broken (a half-applied migration), as parallel sweep
    jobs on a fresh store would: the first open is serialized by a lock. A SQLite file that is
    not an MLflow store is never opened (NotAStore)."""
    from mlflow.tracking import MlflowClient

    from ..config.credentials import client_uri

    os.environ.update(QUIET_ENV)
    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=client_uri(uri))
    from filelock import FileLock

    db = Path(uri[len("sqlite:///"):])
    if (problem := sqlite_store_problem(db)) is not None:
        raise NotAStore(problem)
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(_store_lock(db)):
        if not db.exists():
            _new_sqlite_store(db)
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # the store is created and migrated here
    return client


def _template_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama_fsdp"


def _new_sqlite_store(db: Path) -> None:
    """A new sqlite store as a copy of an empty one this MLflow version made, with its default
    experiment's artifact location set as MLflow would have set it here. MLflow builds a fresh
    store by running its ~90 schema migrations, every time (benchmarks/cpu_runtime.md); the empty
    store is built that way once per MLflow version and machine (in ~/.cache/llama_fsdp) and
    copied after. Anything unexpected (no writable cache, another layout) leaves the store to MLflow."""
    import shutil
    import sqlite3

    import mlflow
    from filelock import FileLock

    try:
        cache = _template_dir()
        cache.mkdir(parents=True, exist_ok=True)
        template = cache / f"mlflow-{mlflow.__version__}-empty.db"
        with FileLock(str(template) + ".lock"):
            if not template.exists():
                tmp = template.with_suffix(".tmp")
                tmp.unlink(missing_ok=True)
                from mlflow.tracking import MlflowClient

                MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)
                tmp.replace(template)
        part = db.with_name(db.name + ".part")
        shutil.copyfile(template, part)
        now = int(time.time() * 1000)
        with sqlite3.connect(part) as conn:
            conn.execute("UPDATE experiments SET artifact_location = ?, creation_time = ?, "
                         "last_update_time = ? WHERE experiment_id = 0",
                         (_default_artifact_location(), now, now))
        conn.close()
        part.replace(db)
    except Exception as e:  # noqa: BLE001 - MLflow creates the store itself, as before
        import logging

        logging.getLogger(__name__).debug("no store template (%s): MLflow creates %s", e, db)
        db.with_name(db.name + ".part").unlink(missing_ok=True)


def _default_artifact_location() -> str:
    """Experiment 0's artifact location as MLflow sets it when it creates a store here."""
    from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    from mlflow.tracking._tracking_service.utils import _SERVER_ARTIFACT_ROOT_ENV_VAR
    from mlflow.utils.uri import append_to_uri_path, resolve_uri_if_local

    root = os.environ.get(_SERVER_ARTIFACT_ROOT_ENV_VAR, DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH)
    return str(append_to_uri_path(resolve_uri_if_local(root), "0"))


def artifact_location(uri: str, experiment: str) -> Optional[str]:
    """Artifacts of a sqlite store live beside it (outputs/mlartifacts), not in ./mlruns of
    whatever directory the run was started from. Servers keep their own default."""
    if not uri.startswith("sqlite:///"):
        return None
    from urllib.parse import quote

    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    # one folder per experiment, whatever its name ("a/b", "../x" stay inside mlartifacts/)
    folder = experiment if name_problem("", experiment) is None else quote(experiment, safe="")
    if folder in ("", ".", ".."):
        folder = quote(folder, safe="").replace(".", "%2E") or "%00"
    return (db.parent / "mlartifacts" / folder).resolve().as_uri()


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as MLflow params: {"train": {"lr": 1}} -> {"train.lr": 1}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def ui_command(uri: str) -> str:
    """The `mlflow ui` command that serves a file store (sqlite) to one person's browser: one
    web worker where MLflow's ui takes --workers (3.x, where ui is server): it answers in about
    7 s instead of 12 with its default four, 10 processes instead of 15
    (benchmarks/mlflow_ui_startup.md)."""
    from .mlflow_compat import mlflow_version

    workers = " --workers 1" if int(mlflow_version().split(".")[0]) >= 3 else ""
    return f"mlflow ui --backend-store-uri {uri}{workers}"


def runs_page(uri: str, experiment_id: str, base: str = "http://127.0.0.1:5000",
              view: Optional[str] = None) -> str:
    """The URL of the experiment's runs table in model-training mode with the llama_fsdp view,
    or the saved view ``view`` (for a sqlite store: as `mlflow ui` serves it)."""
    from .view import VIEW, runs_query

    host = uri if uri.startswith("http") else base
    return f"{host}/#/experiments/{experiment_id}/runs?{runs_query(view or VIEW)}"
