"""Secrets stay out of what a run writes and shows (torch-free; the CLI, the tracking tools and
the sweep summary use it).

- A tracking URI with credentials (``http://user:password@host``, ``?token=...``) is split: the
  URI without them is what the run stores, logs and hands to MLflow; the credentials go into
  this process's environment as MLflow reads them (``CREDENTIAL_ENV``), and every process
  that talks to MLflow inherits them from it: the local ranks, a SLURM job (sbatch passes the
  submitting environment on), the sweep's points. Nothing writes them to a file.
- Wherever a URI, a command line or a config value is shown or stored, ``redact`` hides
  ``user:password@``, secret query values, and the value of a secret's shell assignment
  (``export HF_TOKEN=...`` in cluster.setup: any variable whose name holds TOKEN, KEY, SECRET
  or PASSWORD); the job script and the ranks still get the real value.
- A config value that comes from ``${oc.env:VAR}`` is written (config.yaml, MLflow's params and
  its config artifact) as the interpolation, not as the value (``config_yaml``).
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

USERNAME, PASSWORD, TOKEN = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                             "MLFLOW_TRACKING_TOKEN")
CREDENTIAL_ENV = (USERNAME, PASSWORD, TOKEN)
# query parameters of a tracking URI that MLflow can take from the environment instead
QUERY_CREDENTIALS = {"token": TOKEN, "access_token": TOKEN, "password": PASSWORD}
# query parameters shown as *** wherever a URI is shown (and refused in a tracking URI, where
# MLflow has no environment variable to take them from)
SECRET_QUERY = (*QUERY_CREDENTIALS, "api_key", "apikey", "key", "secret", "client_secret",
                "sig", "signature", "auth")
# SQLAlchemy stores take the credentials in the URI itself: open_client puts them back (in
# memory only, from the environment)
DB_SCHEMES = ("postgresql", "mysql", "mssql", "oracle")

_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<info>[^/@\s?#]*)@")
_QUERY = re.compile(r"(?P<key>[?&;](?:%s)=)[^&;#\s]*" % "|".join(SECRET_QUERY), re.IGNORECASE)
# a shell assignment of a secret: NAME=value, NAME an environment variable's name holding one of
# SECRET_NAMES (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD)
SECRET_NAMES = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD")
_ASSIGNMENT = re.compile(r"(?<![A-Za-z0-9_])(?P<name>[A-Z0-9_]*(?:%s)[A-Z0-9_]*=)"
                         r"(?:\"[^\"]*\"|'[^']*'|[^\s;&|]+)" % "|".join(SECRET_NAMES))


class SecretInURI(ValueError):
    """A tracking URI carries a secret that MLflow cannot take from the environment."""


def redact(text: str) -> str:
    """``text`` with every URL's ``user:password@``, secret query values and secrets' shell
    assignments' values as ``***``."""
    text = _QUERY.sub(r"\g<key>***", _USERINFO.sub(r"\g<scheme>***@", text))
    return _ASSIGNMENT.sub(r"\g<name>***", text)


def split_credentials(uri: str) -> tuple[str, dict[str, str]]:
    """(the URI without credentials, the environment variables that carry them)."""
    if "://" not in uri:
        return uri, {}
    parts = urlsplit(uri)
    env: dict[str, str] = {}
    netloc = parts.netloc
    if "@" in netloc:
        info, netloc = netloc.rsplit("@", 1)
        user, _, password = info.partition(":")
        if user:
            env[USERNAME] = unquote(user)
        if password:
            env[PASSWORD] = unquote(password)
        uri = uri.replace(f"//{info}@", "//", 1)
    kept, dropped = [], False
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key.lower() in QUERY_CREDENTIALS:
            env[QUERY_CREDENTIALS[key.lower()]] = value
            dropped = True
        elif key.lower() in SECRET_QUERY:
            raise SecretInURI(f"tracking.uri={redact(uri)} carries ?{key}=, which MLflow cannot "
                              f"read from the environment and the run would write to its files:"
                              f" drop it and give the credentials as {', '.join(CREDENTIAL_ENV)}"
                              " in the environment (docs/mlflow.md)")
        else:
            kept.append((key, value))
    if dropped:
        head, _, rest = uri.partition("?")
        fragment = f"#{parts.fragment}" if parts.fragment else ""
        uri = head + (f"?{urlencode(kept)}" if kept else "") + fragment
    return uri, env


def strip_credentials(uri: str) -> str:
    return split_credentials(uri)[0]


def export_credentials(uri: str, environ: Any = None) -> str:
    """Move a URI's credentials into ``environ`` (this process's environment by default, which
    the processes it starts inherit); returns the URI without them."""
    clean, env = split_credentials(uri)
    (os.environ if environ is None else environ).update(env)
    return clean


def client_uri(uri: str, environ: Mapping[str, str] | None = None) -> str:
    """The URI to hand MlflowClient: a database store's credentials back in it from the
    environment (SQLAlchemy reads them from the URI only); any other URI as it is (MLflow's REST
    client reads the environment itself)."""
    e = os.environ if environ is None else environ
    parts = urlsplit(uri) if "://" in uri else None
    if parts is None or parts.scheme.split("+")[0] not in DB_SCHEMES or "@" in parts.netloc \
            or not e.get(USERNAME):
        return uri
    from urllib.parse import quote

    info = quote(e[USERNAME], safe="") + (f":{quote(e[PASSWORD], safe='')}" if e.get(PASSWORD)
                                          else "")
    return urlunsplit(parts._replace(netloc=f"{info}@{parts.netloc}"))


# --- the config as written ------------------------------------------------------------------


def _env_interpolation(raw: Any) -> bool:
    return isinstance(raw, str) and "${" in raw and "oc.env" in raw


def _keep_env(raw: Any, resolved: Any, secrets: list[str]) -> Any:
    """``resolved``, with every value that came from an environment variable (directly, or
    through an interpolation of one) as its interpolation from ``raw``."""
    if isinstance(resolved, dict) and isinstance(raw, dict):
        return {k: _keep_env(raw.get(k), v, secrets) for k, v in resolved.items()}
    if isinstance(resolved, list) and isinstance(raw, list) and len(raw) == len(resolved):
        return [_keep_env(r, v, secrets) for r, v in zip(raw, resolved)]
    if _env_interpolation(raw):
        return raw
    if isinstance(raw, str) and "${" in raw and any(s and s in str(resolved) for s in secrets):
        return raw  # an interpolation of a key whose value came from the environment
    return redact(resolved) if isinstance(resolved, str) else resolved


def _env_values(raw: Any, resolved: Any) -> list[str]:
    if isinstance(resolved, dict) and isinstance(raw, dict):
        return [s for k, v in resolved.items() for s in _env_values(raw.get(k), v)]
    if isinstance(resolved, list) and isinstance(raw, list) and len(raw) == len(resolved):
        return [s for r, v in zip(raw, resolved) for s in _env_values(r, v)]
    return [str(resolved)] if _env_interpolation(raw) and resolved not in (None, "") else []


def config_yaml(cfg: Any) -> str:
    """The composed config as a run writes it (config.yaml, MLflow's params and artifact):
    resolved, but with ``${oc.env:...}`` values kept as their interpolation, the tracking URI
    without credentials, and any other URL's credentials redacted."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    raw = OmegaConf.to_container(cfg, resolve=False)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    out = _keep_env(raw, resolved, _env_values(raw, resolved))
    tracking = out.get("tracking") if isinstance(out, dict) else None
    if isinstance(tracking, dict) and isinstance(tracking.get("uri"), str) \
            and not _env_interpolation(tracking["uri"]):
        tracking["uri"] = strip_credentials((resolved.get("tracking") or {})["uri"])
    return OmegaConf.to_yaml(OmegaConf.create(out))
