"""Which MLflow store ``python -m llama_fsdp.evaluate`` logs a run's scores into, decided before
any weights are read. A run folder is data, not authority: its ``tracking/run.json`` names a
store, and a copied or crafted folder can name anyone's. The user's credentials
(MLFLOW_TRACKING_TOKEN, user and password) go only to a store the user named: ``--tracking-uri``,
or MLFLOW_TRACKING_URI when it is the store the folder names. A store only the folder names is
reached without them, and only where the training path would reach it unasked: an MLflow server
on this machine (loopback), or a SQLite file that is already an MLflow store (never a database of
someone else's, never a new file). Anything else is refused with the flag that names it.
"""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional
from urllib.parse import urlsplit

from ..config.credentials import SecretInURI, export_credentials, redact, split_credentials
from ..config.rundir import RunDir
from ..tracking.spool import read_run_file
from ..tracking.store import resolve_tracking_uri, sqlite_store_problem

URI_ENV = "MLFLOW_TRACKING_URI"  # the store a user configured for MLflow in the environment
SQLITE = "sqlite:///"


class StoreRefused(ValueError):
    """The run folder names a store evaluate will not log into unasked: one line, with the fix."""


@dataclass(frozen=True)
class Store:
    uri: str  # without credentials
    run_id: str
    credentials: bool  # whether the user's credentials go with each call
    why: str  # where the URI came from, said to the user

    def shown(self) -> str:
        """The host (or file) logged to, where it came from, and whether credentials go."""
        sent = "your credentials sent" if self.credentials else "no credentials sent"
        return f"{where(self.uri)} ({self.why}; {sent})"


def where(uri: str) -> str:
    """The host and port of a server's URI, or the file of a SQLite store (no credentials)."""
    if uri.startswith(SQLITE):
        return uri
    parts = urlsplit(uri)
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}" if parts.netloc else redact(uri)


def is_loopback(uri: str) -> bool:
    host = urlsplit(uri).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def same_store(a: str, b: str, base: Path) -> bool:
    """Whether two tracking URIs name one store (credentials, case of the host, a default port,
    a trailing slash and a relative SQLite path aside)."""
    return _canonical(a, base) == _canonical(b, base)


def _canonical(uri: str, base: Path) -> str:
    uri = resolve_tracking_uri(split_credentials(uri)[0], base)
    if uri.startswith(SQLITE):
        return SQLITE + str(Path(uri[len(SQLITE):]).resolve())
    parts = urlsplit(uri)
    if parts.scheme in ("http", "https"):
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}{parts.path.rstrip('/')}"
    return uri.rstrip("/")


def choose_store(run_dir: Path, asked: Optional[str], *, environ: Optional[Mapping[str, str]] = None,
                 base: Optional[Path] = None) -> Optional[Store]:
    """The store to log into (None: the run has no MLflow run), or StoreRefused."""
    base = base or Path.cwd()
    environ = os.environ if environ is None else environ  # at the call: never a stale mapping
    info = read_run_file(run_dir)
    run_id, named = info.get("run_id"), info.get("tracking_uri")
    if not isinstance(run_id, str) or not run_id or not isinstance(named, str) or not named:
        return None
    source = RunDir(run_dir).run_file
    try:
        named = split_credentials(named)[0]  # a folder's credentials are never used either
        if asked:  # the user's own: its credentials (in it, or in the environment) go with it
            uri = resolve_tracking_uri(export_credentials(asked), base)
            store = Store(uri, run_id, True, "--tracking-uri")
        elif environ.get(URI_ENV) and same_store(environ[URI_ENV], named, base):
            export_credentials(environ[URI_ENV])  # (the user's URI may carry them)
            store = Store(resolve_tracking_uri(named, base), run_id, True, URI_ENV)
        else:
            store = Store(resolve_tracking_uri(named, base), run_id, False, f"named by {source}")
    except SecretInURI as e:
        raise StoreRefused(f"{e}; or --no-mlflow") from None
    _check(store, source, environ.get(URI_ENV))
    return store


def _check(store: Store, source: Path, configured: Optional[str]) -> None:
    fix = (f"to log there, name it yourself: --tracking-uri {redact(store.uri)}; or score without "
           "logging: --no-mlflow")
    if store.uri.startswith(SQLITE):
        db = Path(store.uri[len(SQLITE):])
        named_by = str(source) if not store.credentials else store.why
        if not db.is_file():
            raise StoreRefused(f"{named_by} names the MLflow store {store.uri}, which does not "
                               "exist here: evaluate "
                               "never creates a store. Give the run's store with --tracking-uri "
                               "sqlite:///<its file>, or --no-mlflow")
        if (problem := sqlite_store_problem(db, named_by, fix="give the run's store with "
                                            "--tracking-uri, or --no-mlflow")) is not None:
            raise StoreRefused(problem)
        return
    if store.credentials:
        return
    if urlsplit(store.uri).scheme in ("http", "https") and is_loopback(store.uri):
        return
    now = f"{URI_ENV}={where(configured)}" if configured else f"{URI_ENV} is not set"
    raise StoreRefused(f"{source} names the MLflow store {where(store.uri)}, which is not the "
                       f"store you configured ({now}): a run folder's store is used unasked only "
                       "on this machine (loopback) or as a SQLite file, and never gets your "
                       f"credentials; {fix}")
