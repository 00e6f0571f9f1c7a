"""A real `-m` sweep on local ranks, as MLflow and its UI show it: one parent run per sweep with
a child run per point, readable names, summary metrics, data sets and exported models; a point
that fails does not stop the others, and running the sweep again in its directory resumes it
under the same parent. The UI is driven in headless Chromium (Debian's, through Playwright)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from llama_fsdp.launchers.common import free_port
from tests.faults import hooks

pytestmark = [pytest.mark.slow]

SWEEP = ["-m", "train.batch_size=2,4", "train.max_steps=3", "save.every_steps=1",
         "save.export_hf=true", "tracking.system_metrics=true",
         "tracking.system_metrics_interval_s=1", "cluster.device=cpu", "eval.every_steps=0",
         "eval.task_prompts=0", "train.warmup_steps=1", "train.callbacks=[tests.faults.hooks:crash]"]


def _cli(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llama_fsdp", *args], cwd=cwd,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=900)


# session scope: under xdist the worker may run another module's tests between these, which
# tears a module fixture down and runs the whole sweep again (measured: set up twice, 86-117 s each)
@pytest.fixture(scope="session")
def sweep(tmp_path_factory):
    """The sweep, its first point crashing at step 2 (once); then the same command again in the
    sweep's directory, which resumes the failed point."""
    cwd = tmp_path_factory.mktemp("sweep")
    env = {hooks.CRASH: "rank=1,step=2", hooks.MARK: str(cwd / "fired")}
    first = _cli(cwd, *SWEEP, env=env)
    sweep_dir = next((cwd / "outputs" / "sweeps").glob("*/*"))
    client = MlflowClient(tracking_uri=f"sqlite:///{cwd}/outputs/mlflow.db")
    exp = client.get_experiment_by_name("llama_fsdp")
    before = {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}
    again = _cli(cwd, *SWEEP, f"hydra.sweep.dir={sweep_dir}", env=env)
    after = {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}
    return {"cwd": cwd, "first": first, "again": again, "client": client, "exp": exp,
            "before": before, "after": after}


def _family(runs: dict):
    parents = [r for r in runs.values() if r.data.tags.get("llama_fsdp.kind") == "sweep"]
    assert len(parents) == 1, [r.info.run_name for r in runs.values()]
    kids = [r for r in runs.values() if r.data.tags.get("mlflow.parentRunId") ==
            parents[0].info.run_id]
    return parents[0], sorted(kids, key=lambda r: r.info.run_name)


def test_a_failed_point_does_not_stop_the_sweep(sweep):
    first = sweep["first"]
    log = first.stdout + first.stderr
    assert first.returncode == 1, log[-3000:]
    assert "1 point(s) of sweep" in log and "to resume them" in log
    parent, kids = _family(sweep["before"])
    assert [k.info.run_name for k in kids] == ["batch_size=2", "batch_size=4"]
    assert [k.info.status for k in kids] == ["FAILED", "FINISHED"]
    assert parent.data.tags["failed_points"] == "1" and parent.info.status == "FINISHED"


def test_the_sweep_resumes_under_the_same_parent(sweep):
    again = sweep["again"]
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    parent, kids = _family(sweep["after"])
    assert parent.info.run_id == _family(sweep["before"])[0].info.run_id
    assert set(sweep["after"]) == set(sweep["before"])  # no new runs: the points continued
    assert [k.info.status for k in kids] == ["FINISHED", "FINISHED"]
    # the point that had finished is skipped, not started again: its run logged 3 steps once
    log = again.stdout + again.stderr
    assert "point batch_size=4 finished in an earlier run of this sweep" in log
    assert "point batch_size=2 finished" not in log
    assert [m.step for m in sweep["client"].get_metric_history(kids[1].info.run_id, "loss")] \
        == [1, 2, 3]
    assert parent.data.tags["failed_points"] == "0"
    assert parent.data.params == {"train.batch_size": "2,4"}  # what the sweep varies
    assert parent.info.run_name == "sweep train.batch_size=2,4"
    artifacts = {a.path for a in sweep["client"].list_artifacts(parent.info.run_id)}
    assert {"sweep_summary.md", "sweep_summary.png"} <= artifacts
    assert "-m train.batch_size=2,4" in parent.data.tags["mlflow.note.content"]


def test_points_carry_summary_metrics_data_sets_models_and_their_command(sweep):
    client = sweep["client"]
    _, kids = _family(sweep["after"])
    for k in kids:
        m = k.data.metrics
        assert {"summary/tokens_per_sec", "summary/tokens_per_sec_per_device",
                "summary/peak_memory_gb", "summary/predicted_peak_memory_gb",
                "summary/final_loss"} <= set(m)
        assert any(key.startswith("system/cpu_utilization") for key in m)
        assert k.data.tags["mlflow.note.content"].startswith("```\npython -m llama_fsdp -m")
        inputs = {d.dataset.name: d for d in k.inputs.dataset_inputs}
        assert set(inputs) == {"synthetic-train", "synthetic-eval"}
        assert json.loads(inputs["synthetic-train"].dataset.profile)["num_rows"] > 1000
        outputs = k.outputs.model_outputs
        assert len(outputs) == 1
        model = client.get_logged_model(outputs[0].model_id)
        assert model.source_run_id == k.info.run_id and model.status.to_proto() == 2  # READY
    exp = client.get_experiment(sweep["exp"].experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "finetuning"
    assert "summary/tokens_per_sec" in exp.tags["mlflow.sharedViewState.llama_fsdp"]


def test_the_exported_point_is_its_trained_start(sweep):
    """The GPU tests' checks of a run (tests/gpu/test_gpu_run.py), by the same helpers, on the
    point that finished (3 steps, a checkpoint every step, exported): the export is its last
    checkpoint's model and its step-0 weights moved by training."""
    from tests.gpu.test_gpu_run import assert_export_is_the_trained_start

    _, kids = _family(sweep["after"])
    point = kids[1]
    assert point.info.run_name == "batch_size=4" and point.info.status == "FINISHED"
    assert_export_is_the_trained_start(Path(point.data.tags["output_dir"]),
                                       Path(point.data.tags["export_dir"]), 3)


def _ui_available() -> str | None:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed"
    return None if shutil.which("chromium") else "Debian's chromium is not installed"


@pytest.fixture(scope="session")
def ui(sweep):
    reason = _ui_available()
    if reason:
        if os.environ.get("LLAMA_FSDP_REQUIRE_UI"):
            pytest.fail(reason)
        pytest.skip(reason)
    port = free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    proc = subprocess.Popen([str(mlflow), "ui", "--backend-store-uri",
                             f"sqlite:///{sweep['cwd']}/outputs/mlflow.db", "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], cwd=sweep["cwd"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:  # the server goes, however the browser's teardown ends
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run",
                "--disable-dev-shm-usage"])
            ctx = browser.new_context(viewport={"width": 1800, "height": 1000})
            ctx.add_init_script("localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');"
                                "localStorage.setItem("
                                "'mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');")
            yield base, ctx.new_page()
            browser.close()
    finally:
        os.killpg(proc.pid, 9)


ROW = '.ag-center-cols-container .ag-row[row-id="{}"]'


def _shot(page, name: str) -> None:
    out = os.environ.get("LLAMA_FSDP_UI_SHOTS")  # where the README's screenshots come from
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(out) / name))


def test_the_ui_shows_the_sweep_as_one_row_with_its_points(sweep, ui):
    """What a person looks for: the runs table opens (with the view the framework saved) on
    the sweep as one row; expanded, its points; the summary metrics as columns."""
    from llama_fsdp.tracking import runs_page

    base, page = ui
    parent, kids = _family(sweep["after"])
    page.goto(runs_page(base, sweep["exp"].experiment_id))
    page.wait_for_selector(ROW.format(parent.info.run_id), timeout=90_000)
    assert all(page.locator(ROW.format(k.info.run_id)).count() == 0 for k in kids)
    page.locator(f'.ag-row[row-id="{parent.info.run_id}"] [col-id="attributes.`Run Name`"] '
                 "button").first.click()
    for k in kids:
        page.wait_for_selector(ROW.format(k.info.run_id), timeout=20_000)
    # the run name column is pinned on the left: a row's cells live in two containers
    name_cell = page.locator(f'.ag-row[row-id="{kids[0].info.run_id}"] '
                             '[col-id="attributes.`Run Name`"]')
    assert "batch_size=2" in name_cell.first.inner_text().splitlines()  # after its color chip
    header = page.locator('.ag-header-cell[col-id="metrics.`summary/tokens_per_sec`"]')
    assert header.count() == 1
    value = page.locator(f'{ROW.format(kids[1].info.run_id)} '
                         '[col-id="metrics.`summary/tokens_per_sec`"]').first.inner_text()
    assert float(value.replace(",", "")) > 0
    dataset = page.locator(f'{ROW.format(kids[1].info.run_id)} [col-id="attributes.`Dataset`"]')
    assert "synthetic-train" in dataset.first.inner_text()
    _shot(page, "mlflow_runs.png")


def test_the_compare_view_plots_the_swept_values_against_the_summary_metrics(sweep, ui):
    """Compare the sweep's points: the parallel-coordinates plot starts from what the sweep
    varied (the only params that differ); a person adds tokens/s to it from the metrics box."""
    base, page = ui
    _, kids = _family(sweep["after"])
    ids = json.dumps([k.info.run_id for k in kids])
    page.goto(f"{base}/#/compare-runs?runs={ids}&experiments="
              f"{json.dumps([sweep['exp'].experiment_id])}")
    page.wait_for_selector("text=Run details", timeout=90_000)
    for k in kids:
        assert page.get_by_text(k.info.run_name, exact=True).count() >= 1
    plot = page.locator(".js-plotly-plot").first
    plot.wait_for(timeout=30_000)
    assert "train.batch_size" in plot.inner_text()  # the default axes: the swept key
    metrics_box = page.locator(".ant-select, [class*='select']").filter(
        has_text="summary/predicted_peak_memory_gb").first
    metrics_box.click()
    page.keyboard.type("summary/tokens_per_sec")
    page.keyboard.press("Enter")
    page.keyboard.press("Escape")
    page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot')].some("
                           "p => p.textContent.includes('summary/tokens_per_sec'))", timeout=30_000)
    assert "summary/predicted_peak_memory_gb" in plot.inner_text()
    _shot(page, "mlflow_compare.png")
