"""What the job does once, before any rank trains: the launchers call ``prepare_job``
(job.py) where their kind does the job's once-only duties (launchers/base.py; under torchrun,
inside the job: launchers/torchrun.py).

The run directory is owned first (one live launch per directory), and a run with nothing left
to train stops there. Everything that needs no process group happens here, so bad input fails
in seconds with the fix and ranks never wait behind a barrier:

- ``tracking.py``: the tracking store is reached (or the run refused, in about ten seconds),
  and the MLflow run is created (or continued), with its tags, params and datasets;
- ``model.py``: HF weights named by a hub id are downloaded once;
- ``data.py``: the data is read, validated, tokenized into the cache and packed exactly as the
  ranks will pack it (or, checked before, its record read back);
- ``job.py``: the order of it all, and the plan made again with the data's records.

The ranks then read prepared files only (they run with HF_HUB_OFFLINE=1).
"""
