"""A full disk during a save and a corrupt newest checkpoint: the previous checkpoint stays and
is used; nothing trains on from garbage. Plus bad data, refused before any rank starts."""
from __future__ import annotations

import functools
import json
import shutil

import pytest
from mlflow.tracking import MlflowClient

from llama_fsdp.checkpoint.layout import latest_checkpoint, list_checkpoints
from llama_fsdp.tracking import read_run_file
from tests.faults import hooks
from tests.faults.conftest import logged_losses, logged_steps, run_dir
from tests.faults import conftest as faults

# a fault in the run's state, not in how its processes start or end: the command forked warm
run_cli = functools.partial(faults.run_cli, warm=True)

pytestmark = [pytest.mark.slow]

STEPS = ["train.max_steps=6", "save.every_steps=2", "save.keep_last=3"]
# the finished run: an 8-step schedule stopped after step 6 (stop_after keeps the schedule of
# max_steps), so that a run resumed from its step 4 to step 8 trains steps 5 and 6 as it did
FINISHED = ["train.max_steps=8", *STEPS[1:], "train.stop_after=6"]


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    code, log, _ = run_cli(tmp_path, *STEPS, "train.callbacks=[tests.faults.hooks:disk_full_at_save]",
                           env={hooks.DISK_FULL_STEP: "4"})
    assert code == 1, log[-3000:]
    assert "checkpoint step 4 could not be written to" in log
    assert "No space left on device" in log
    assert "the previous checkpoint step_000002 is intact and resume=auto continues from it" in log
    assert "The disk looks full: free space on" in log
    run = run_dir(tmp_path)
    # the partial step-4 files are gone, step 2 is whole, and resume=auto would take it
    assert [p.name for _, p in list_checkpoints(run)] == ["step_000002"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    assert latest_checkpoint(run).name == "step_000002"
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    assert client.get_run(read_run_file(run)["run_id"]).info.status == "FAILED"


@pytest.fixture(scope="session")
def finished_run_once(tmp_path_factory):
    """A run finished after 6 steps of 8 (FINISHED), with checkpoints at steps 2, 4 and 6 (its
    directory and MLflow store); the tests take copies."""
    cwd = tmp_path_factory.mktemp("finished")
    code, log, _ = run_cli(cwd, *FINISHED)
    assert code == 0, log[-3000:]
    return cwd


@pytest.fixture
def finished_run(finished_run_once, tmp_path):
    """A fresh copy of the finished run for each test (each damages its checkpoints and trains
    on): what one test does cannot change what the next one finds."""
    cwd = tmp_path / "corrupt"
    shutil.copytree(finished_run_once, cwd)
    run = run_dir(cwd)
    assert logged_steps(run) == list(range(1, 7))
    return cwd, run


def _truncate_a_data_file(ckpt) -> None:
    f = sorted(ckpt.glob("*.distcp"))[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(finished_run):
    cwd, run = finished_run
    _truncate_a_data_file(run / "checkpoints" / "step_000006")
    straight = dict(logged_losses(run))  # steps 1-6, uninterrupted
    before = logged_steps(run)
    code, log, _ = run_cli(cwd, *STEPS[1:], "train.max_steps=8", f"output_dir={run}")
    assert code == 0, log[-3000:]
    newest = run / "checkpoints" / "step_000006"
    assert f"checkpoint {newest} cannot be used ({newest}/__" in log  # the short file named
    assert "bytes, " in log and "were written); trying the one before" in log
    assert "resumed from" in log and "step_000004 at step 4" in log
    resumed = logged_losses(run)[len(before):]
    assert [s for s, _ in resumed] == [5, 6, 7, 8]  # the curve goes on from step 4
    # from step 4's weights, optimizer, schedule and data position: steps 5 and 6 are the
    # uninterrupted run's, bit for bit on the CPU (from anything else, the losses differ)
    assert resumed[:2] == [(5, straight[5]), (6, straight[6])], (resumed, straight)
    client = MlflowClient(tracking_uri=f"sqlite:///{cwd}/outputs/mlflow.db")
    tags = client.get_run(read_run_file(run)["run_id"]).data.tags
    assert tags["resume_step"] == "4"
    assert tags["resume_skipped"].startswith(f"step_000006: {newest}/__")


def test_no_readable_checkpoint_stops_instead_of_training_from_garbage(finished_run):
    cwd, run = finished_run
    for ckpt in (run / "checkpoints").iterdir():
        (ckpt / ".metadata").write_bytes(b"garbage")
        if (ckpt / "manifest.json").exists():
            (ckpt / "manifest.json").unlink()  # only DCP's own reading can tell now
    code, log, _ = run_cli(cwd, *STEPS[1:], "train.max_steps=10", f"output_dir={run}")
    assert code == 1, log[-3000:]
    assert "can be read" in log and "Start again with resume=retire" in log
    assert logged_steps(run) == list(range(1, 7))  # no step trained: the 6 there, as they were


def test_bad_data_is_refused_before_any_rank_starts(tmp_path):
    bad = tmp_path / "seed_tasks.jsonl"
    bad.write_text("".join(json.dumps({"id": f"t{i}", "name": "n", "instruction": "Do it",
                                       "instances": [{"input": "", "output": "done"}]}) + "\n"
                           for i in range(20)))
    code, log, seconds = run_cli(tmp_path, "data=jsonl", f"data.path={bad}", timeout=120)
    assert code == 2, log[-3000:]
    assert str(bad) in log and "instances" in log and "data.preprocess" in log
    assert not list((tmp_path / "outputs" / "runs").glob("*/*"))  # nothing launched
    print(f"refused in {seconds:.1f}s")


# --- checkpoints belong to a run ----------------------------------------------------------------


def _files(root) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_a_new_run_into_an_earlier_runs_folder_is_refused_and_nothing_of_it_goes(finished_run):
    """Before: resume=none here deleted step_2 and step_4 of the earlier run, pruned its own
    step_1 against their numbers, and left step_6 for a later resume=auto to continue."""
    cwd, run = finished_run
    before = _files(run / "checkpoints")
    code, log, _ = run_cli(cwd, "resume=none", "save.every_steps=1", "save.keep_last=1",
                           "train.stop_after=1", f"output_dir={run}")
    assert code == 2, log[-3000:]
    assert "holds the checkpoints of an earlier run (step_000002, step_000004, step_000006)" in log
    assert "resume=retire" in log and "Give a new output_dir" in log
    assert _files(run / "checkpoints") == before  # byte for byte, nothing moved
    assert "started" not in log  # refused before any rank


def test_retire_moves_an_earlier_runs_checkpoints_aside_and_the_new_run_prunes_only_its_own(
        finished_run):
    cwd, run = finished_run
    old = _files(run / "checkpoints")
    code, log, _ = run_cli(cwd, "resume=retire", "save.every_steps=1", "save.keep_last=1",
                           "train.max_steps=6", "train.stop_after=2", f"output_dir={run}")
    assert code == 0, log[-3000:]
    retired = [d for d in (run / "checkpoints" / "retired").iterdir()]
    assert len(retired) == 1 and f"checkpoints moved to {retired[0]}" in log
    assert _files(retired[0]) == {k: v for k, v in old.items()}  # every file, as it was
    own = [p.name for _, p in list_checkpoints(run)]
    assert own == ["step_000002"]  # keep_last=1 pruned its step 1, and only that
    from llama_fsdp.checkpoint.layout import checkpoint_run
    from llama_fsdp.config.rundir import read_identity

    new_id = read_identity(run)["run"]
    assert checkpoint_run(run / "checkpoints" / "step_000002") == new_id
    assert checkpoint_run(retired[0] / "step_000006") not in (None, new_id)
    # resume=auto continues the new run (its step 2), never the retired one's step 6
    code, log, _ = run_cli(cwd, "save.every_steps=1", "save.keep_last=1", "train.max_steps=6",
                           "train.stop_after=3", f"output_dir={run}")
    assert code == 0, log[-3000:]
    assert "step_000002 at step 2" in log and "step_000006" not in log
    assert read_identity(run)["run"] == new_id


def test_a_finished_run_relaunched_with_another_config_is_refused_not_skipped(finished_run):
    cwd, run = finished_run
    code, log, _ = run_cli(cwd, *FINISHED, "train.lr=0.001", f"output_dir={run}")
    assert code == 2, log[-3000:]
    # the run left train.lr to its recipe (3e-3 for the tiny model): the change names its value
    assert ("finished at step 6 with another config (train.lr: 3.0e-03 (recipe) -> 1.0e-03)"
            in log)
    assert "nothing to train" not in log
    code, log, _ = run_cli(cwd, *FINISHED, f"output_dir={run}")  # the same config: nothing to do
    assert code == 0 and "nothing to train" in log, log[-3000:]
    # the recipe's value given by name is the same run, not another config
    code, log, _ = run_cli(cwd, *FINISHED, "train.lr=0.003", f"output_dir={run}")
    assert code == 0 and "nothing to train" in log, log[-3000:]


def test_a_checkpoint_of_another_model_shape_is_refused_before_launch(finished_run):
    cwd, run = finished_run
    code, log, _ = run_cli(cwd, *STEPS[1:], "train.max_steps=8", "model.num_layers=3",
                           f"output_dir={run}")
    assert code == 2, log[-3000:]
    assert ("was saved by another model shape (num_layers: model.num_layers=3 but the "
            "checkpoint's is 4)") in log
    assert "started" not in log
