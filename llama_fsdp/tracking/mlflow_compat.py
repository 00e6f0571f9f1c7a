"""Every use of MLflow beyond its public API, in one place, for the releases it was read from.

MLflow's metric history is append-only: no client call, and no REST endpoint of its server,
deletes a metric point. A run resumed from a checkpoint trains again the steps its stopped
attempt logged past that checkpoint, and those steps must show once, the resumed attempt's. A
store MLflow reaches through SQLAlchemy (sqlite, PostgreSQL, MySQL, MSSQL URIs) is a database
this process opens itself: ``delete_points_after`` deletes the stopped attempt's points there,
through the store's own session and tables (``metrics``, ``latest_metrics``). An MLflow server
keeps its database to itself: ``deletes_points`` is False, and the resumed run does not log the
steps its history holds already (tracking/tracker.py).

``check_version`` says when the installed MLflow is not one of ``TESTED``.
"""
from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Optional

log = logging.getLogger(__name__)

TESTED = ((3, 17),)  # MLflow releases (major, minor) whose store tables this module reads
SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")  # SQLAlchemy URIs MLflow opens itself


# the distributions that install the ``mlflow`` module: the full one, and the client without
# the UI server (the GPU check's wheelhouse carries mlflow-skinny: scripts/offline_wheels.sh)
DISTRIBUTIONS = ("mlflow", "mlflow-skinny")


def mlflow_version() -> str:
    """The installed MLflow's version, whichever distribution installed it."""
    for name in DISTRIBUTIONS:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    import mlflow  # neither has metadata (a source tree on the path): the module says

    return str(mlflow.__version__)


def check_version() -> Optional[str]:
    """None when the installed MLflow is a tested release, else a warning to show."""
    have = mlflow_version()
    release = tuple(int(x) for x in have.split(".")[:2] if x.isdigit())
    if release in TESTED:
        return None
    return (f"mlflow {have} is not a release llama_fsdp's metric replacement was checked "
            f"against ({', '.join('.'.join(map(str, t)) for t in TESTED)}.x): it deletes a "
            "resumed run's replayed points in the store's own tables (tracking/mlflow_compat.py)")


def deletes_points(uri: str) -> bool:
    """Whether metric points of a run in the store at ``uri`` can be deleted from here."""
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower()
    return "://" in uri and scheme in SQL_SCHEMES


def delete_points_after(client: Any, run_id: str, step: int, *, keep_prefix: str) -> int:
    """Delete the run's metric points logged at steps after ``step`` (but those of the metrics
    named ``keep_prefix``..., whose step is not a training step), and set each affected metric's
    latest value to what is left; returns how many points went."""
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric

    if (warning := check_version()) is not None:
        log.warning("%s", warning)
    store = client._tracking_client.store
    with store.ManagedSessionMaker(read_only=False) as session:  # (3.x: a write session)
        later = session.query(SqlMetric).filter(
            SqlMetric.run_uuid == run_id, SqlMetric.step > step,
            ~SqlMetric.key.startswith(keep_prefix, autoescape=True))
        keys = sorted({k for (k,) in later.with_entities(SqlMetric.key).distinct()})
        deleted = later.delete(synchronize_session=False)
        for key in keys:
            newest = (session.query(SqlMetric)
                      .filter(SqlMetric.run_uuid == run_id, SqlMetric.key == key)
                      .order_by(SqlMetric.step.desc(), SqlMetric.timestamp.desc(),
                                SqlMetric.value.desc()).first())
            latest = (session.query(SqlLatestMetric)
                      .filter(SqlLatestMetric.run_uuid == run_id, SqlLatestMetric.key == key)
                      .one_or_none())
            if latest is None:
                continue
            if newest is None:
                session.delete(latest)
            else:
                latest.value, latest.step = newest.value, newest.step
                latest.timestamp, latest.is_nan = newest.timestamp, newest.is_nan
    return deleted


# --- a server reached without the user's credentials -------------------------------------------
# MlflowClient's REST store reads MLFLOW_TRACKING_TOKEN, the user and password (environment, then
# ~/.mlflow/credentials) for every call, whatever server its URI names. A store a run folder
# names, not the user (harness/store.py), is reached through a RestStore whose host credentials
# are the URI alone, and a run's artifact only where that same server keeps it.
ARTIFACTS_API = "/api/2.0/mlflow-artifacts/artifacts"  # MLflow's proxied artifact service


def anonymous_store(uri: str) -> Any:
    """MLflow's REST store at ``uri`` that sends no credentials."""
    from mlflow.store.tracking.rest_store import RestStore
    from mlflow.utils.rest_utils import MlflowHostCreds

    return RestStore(lambda: MlflowHostCreds(uri))


def put_text_anonymously(uri: str, artifact_uri: str, path: str, text: str) -> bool:
    """``text`` as the artifact ``path`` of a run whose artifacts the server at ``uri`` serves
    itself (``mlflow-artifacts:/...``), sending no credentials; False (nothing sent) when the
    run's artifacts live anywhere else (a bucket, another host)."""
    import posixpath
    from urllib.parse import urlsplit

    from mlflow.utils.rest_utils import MlflowHostCreds, augmented_raise_for_status, http_request

    parts = urlsplit(artifact_uri)
    if parts.scheme != "mlflow-artifacts" or parts.netloc:
        return False
    creds = MlflowHostCreds(uri.rstrip("/") + ARTIFACTS_API)
    resp = http_request(creds, posixpath.join("/", parts.path.lstrip("/"), path), "PUT",
                        data=text.encode(), extra_headers={"Content-Type": "application/json"})
    augmented_raise_for_status(resp)
    return True
