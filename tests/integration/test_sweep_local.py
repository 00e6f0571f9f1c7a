"""A real `-m` sweep of the three fine-tuning methods on local ranks, tracked by a real
`mlflow server`, as MLflow and its UI show it: one parent run with a child run per point,
readable names, summary metrics, data sets and logged models; a point that fails does not stop
the others, and running the sweep again in its directory resumes it under the same parent.

Then the link the sweep prints is opened in headless Chromium (Debian's, through Playwright) at
1600 x 1000, and what a person sees is checked: model-training mode with the saved view; on one
screen each point's status, method, trainable parameters, losses, speed, memory and duration,
rounded; the parent row with its best point's numbers; the loss chart with the three points;
a point's page with its own command and its side panel on screen; the compare page's default
plot on a measured metric. Screenshots go to the test's tmp dir (printed), and to
$LLAMA_FSDP_UI_SHOTS when set (the docs' pictures come from there)."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.faults import hooks
from tests.faults.conftest import MlflowServer
from tests import warm

pytestmark = [pytest.mark.slow]

METHODS = ["full", "lora", "qlora"]
SWEEP = ["-m", "finetune=full,lora,qlora", "train.max_steps=3", "save.every_steps=1",
         "tracking.system_metrics=true",
         "tracking.system_metrics_interval_s=1", "cluster.device=cpu", "eval.every_steps=3",
         "eval.max_batches=1", "eval.task_prompts=0", "train.warmup_steps=1",
         "train.callbacks=[tests.faults.hooks:crash]"]
WIDTH, HEIGHT = 1600, 1000


def _cli(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([warm.python(), "-m", "llama_fsdp", *args], cwd=cwd,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=900)


# session scope: under xdist the worker may run another module's tests between these, which
# tears a module fixture down and runs the whole sweep again (measured: set up twice, 86-117 s each)
@pytest.fixture(scope="session")
def sweep(tmp_path_factory):
    """The sweep against a real server, its first point (full) crashing at step 2 (once); then
    the same command again in the sweep's directory, which resumes the failed point."""
    cwd = tmp_path_factory.mktemp("sweep")
    server = MlflowServer(cwd).start()
    try:
        env = {hooks.CRASH: "rank=1,step=2", hooks.MARK: str(cwd / "fired")}
        args = [*SWEEP, f"tracking.uri={server.uri}"]
        first = _cli(cwd, *args, env=env)
        sweep_dir = next((cwd / "outputs" / "sweeps").glob("*/*"))
        client = MlflowClient(tracking_uri=server.uri)
        exp = client.get_experiment_by_name("llama_fsdp")
        before = {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}
        again = _cli(cwd, *args, f"hydra.sweep.dir={sweep_dir}", env=env)
        after = {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}
        yield {"cwd": cwd, "first": first, "again": again, "client": client, "exp": exp,
               "before": before, "after": after, "server": server}
    finally:
        server.kill()


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
    assert [k.info.run_name for k in kids] == [f"ft={m}" for m in METHODS]
    assert [k.info.status for k in kids] == ["FAILED", "FINISHED", "FINISHED"]
    assert parent.data.tags["failed_points"] == "1" and parent.info.status == "FINISHED"
    assert parent.data.tags["status"] == "1/3 failed"
    assert [k.data.tags["status"] for k in kids] == ["failed", "finished", "finished"]


def test_the_sweep_resumes_under_the_same_parent(sweep):
    again = sweep["again"]
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    parent, kids = _family(sweep["after"])
    assert parent.info.run_id == _family(sweep["before"])[0].info.run_id
    assert set(sweep["after"]) == set(sweep["before"])  # no new runs: the points continued
    assert [k.info.status for k in kids] == ["FINISHED"] * 3
    # the points that had finished are skipped, not started again: their runs logged 3 steps once
    log = again.stdout + again.stderr
    assert "point ft=lora finished in an earlier run of this sweep" in log
    assert "point ft=full finished" not in log
    assert [m.step for m in sweep["client"].get_metric_history(kids[1].info.run_id, "loss")] \
        == [1, 2, 3]
    assert parent.data.tags["failed_points"] == "0" and parent.data.tags["status"] == "finished"
    assert parent.data.params == {"finetune": "full,lora,qlora"}  # what the sweep varies
    assert parent.info.run_name == "sweep finetune=full,lora,qlora"
    artifacts = {a.path for a in sweep["client"].list_artifacts(parent.info.run_id)}
    assert {"sweep_summary.md", "sweep_summary.png"} <= artifacts
    assert "python -m llama_fsdp -m \\\n  finetune=full,lora,qlora \\\n" in \
        parent.data.tags["mlflow.note.content"]


def _assert_four_digits_of(shown: float, exact: float) -> None:
    """``shown`` is ``exact`` to 4 significant digits (7317.475 -> 7317): at most 4 digits, and
    within half a unit of the 4th of ``exact``."""
    from decimal import Decimal

    digits = Decimal(repr(shown)).normalize().as_tuple().digits
    unit = 10.0 ** (math.floor(math.log10(abs(exact))) - 3)
    assert len(digits) <= 4 and abs(shown - exact) <= unit / 2 * (1 + 1e-9), (shown, exact)


def test_points_carry_summary_metrics_data_sets_models_and_their_own_command(sweep):
    from llama_fsdp.tracking.view import SHOWN, model_name

    client = sweep["client"]
    _, kids = _family(sweep["after"])
    assert len(kids) == len(METHODS), [k.info.run_name for k in kids]  # zip would pass on none
    for method, k in zip(METHODS, kids):
        m = k.data.metrics
        assert {"summary/tokens_per_sec", "summary/tokens_per_sec_per_device",
                "summary/peak_memory_gb", "summary/predicted_peak_memory_gb",
                "summary/final_loss", "summary/eval_loss"} <= set(m)
        # one value per run (step 0): MLflow charts it as a bar, not a line of one dot
        assert client.get_metric_history(k.info.run_id, "summary/tokens_per_sec")[-1].step == 0
        _assert_four_digits_of(m["tokens per sec"], m["summary/tokens_per_sec"])
        assert any(key.startswith("system/cpu_utilization") for key in m)
        # the point's own command, one override per line, not the whole sweep's
        note = k.data.tags["mlflow.note.content"]
        assert f"\n  finetune={method} \\\n" in note and "full,lora,qlora" not in note
        assert "python -m llama_fsdp \\\n" in note and " -m \\" not in note
        inputs = {d.dataset.name: d for d in k.inputs.dataset_inputs}
        assert set(inputs) == {"synthetic-train", "synthetic-eval"}
        assert json.loads(inputs["synthetic-train"].dataset.profile)["num_rows"] > 1000
        artifacts = {a.path for a in client.list_artifacts(k.info.run_id)}
        assert {"config.yaml", "plan.txt"} <= artifacts
        # the adapter, always; full: the HF export (save.export_hf's default for the tiny model)
        (output,) = k.outputs.model_outputs
        model = client.get_logged_model(output.model_id)
        assert model.source_run_id == k.info.run_id and model.status.to_proto() == 2  # READY
        assert model.name == model_name(f"ft={method}", k.data.tags["sweep_id"])
        # the model's page lists the run's final numbers as the runs table rounds them (the
        # exact summary/* metrics stay the run's)
        linked = {x.key: x.value for x in model.metrics}
        assert linked == {s.name: m[s.name] for s in SHOWN if s.name in m}, linked
        assert {"final loss", "eval loss", "tokens per sec", "peak GB"} <= set(linked)
        _assert_four_digits_of(linked["tokens per sec"], m["summary/tokens_per_sec"])
        assert "summary/tokens_per_sec" not in linked
    exp = client.get_experiment(sweep["exp"].experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "finetuning"
    assert "tokens per sec" in exp.tags["mlflow.sharedViewState.llama_fsdp"]


# --- in the browser --------------------------------------------------------------------------


def test_the_exported_point_is_its_trained_start(sweep, tmp_path):
    """The GPU tests' checks of a run (tests/gpu/test_gpu_run.py), by the same helpers, on the
    full point (crashed, then resumed; 3 steps, a checkpoint every step), its last checkpoint
    exported by `python -m llama_fsdp.convert`: the export is that checkpoint's model and its
    step-0 weights moved by training."""
    from llama_fsdp.checkpoint import layout
    from tests.gpu.test_gpu_run import assert_export_is_the_trained_start

    _, kids = _family(sweep["after"])
    (point,) = [k for k in kids if k.info.run_name == "ft=full"]
    assert point.info.status == "FINISHED"
    run_dir, export = Path(point.data.tags["output_dir"]), tmp_path / "export"
    r = subprocess.run([warm.python(), "-m", "llama_fsdp.checkpoint.convert",
                        str(layout.step_dir(run_dir, 3)), str(export)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_export_is_the_trained_start(run_dir, export, 3)


def _ui_available() -> str | None:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed"
    return None if shutil.which("chromium") else "Debian's chromium is not installed"


@pytest.fixture(scope="session")
def page(sweep, tmp_path_factory):
    """One Chromium page at 1600 x 1000 on the sweep's server."""
    reason = _ui_available()
    if reason:
        if os.environ.get("LLAMA_FSDP_REQUIRE_UI"):
            pytest.fail(reason)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # the flags that keep Chromium off the network it would call home to at every start
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage"])
        ctx = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
        ctx.add_init_script("localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');"
                            "localStorage.setItem("
                            "'mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');")
        page = ctx.new_page()
        page.set_default_timeout(60_000)
        page.shots = tmp_path_factory.mktemp("ui_shots")  # type: ignore[attr-defined]
        yield page
        browser.close()


def _shot(page, name: str) -> None:
    path = page.shots / name
    page.screenshot(path=str(path))
    print(f"screenshot: {path}")
    out = os.environ.get("LLAMA_FSDP_UI_SHOTS")  # where the docs' pictures come from
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / name)


def _printed_links(sweep) -> list[str]:
    """The links to MLflow's UI the sweep's two commands printed (the tool's and MLflow's)."""
    out = "".join(sweep[k].stdout + sweep[k].stderr for k in ("first", "again"))
    return re.findall(r"https?://\S+/#/experiments/\S*", out)


ROW = '.ag-center-cols-container .ag-row[row-id="{}"]'
# what a person compares runs on: on the first screen, in this order
FIRST_SCREEN = {"tags.`status`": "status", "params.`finetune.method`": "finetune.method",
                "metrics.`trainable M`": "trainable M", "metrics.`trainable pct`": "trainable pct",
                "metrics.`final loss`": "final loss", "metrics.`eval loss`": "eval loss",
                "metrics.`tokens per sec`": "tokens per sec", "metrics.`MFU pct`": "MFU pct",
                "metrics.`peak GB`": "peak GB", "metrics.`planned GB`": "planned GB",
                "duration": "Duration"}


def _cell(page, run_id: str, col: str) -> str:
    return page.locator(f'{ROW.format(run_id)} [col-id="{col}"]').first.inner_text().strip()


def _open_runs_table(page, sweep):
    """The printed link, then the sweep's row expanded: its parent row and point rows."""
    parent, kids = _family(sweep["after"])
    page.goto(_printed_links(sweep)[-1])
    page.wait_for_selector(ROW.format(parent.info.run_id))
    if page.locator(ROW.format(kids[0].info.run_id)).count() == 0:
        page.locator(f'.ag-row[row-id="{parent.info.run_id}"] [col-id="attributes.`Run Name`"] '
                     "button").first.click()
    for k in kids:
        page.wait_for_selector(ROW.format(k.info.run_id))
    return parent, kids


def test_every_printed_link_opens_model_training_mode_with_the_saved_view(sweep, page):
    from llama_fsdp.tracking.view import runs_query

    parent, _ = _family(sweep["after"])
    links = _printed_links(sweep)  # the points' and the sweep's: the sweep's own view
    assert links and all(link.startswith(sweep["server"].uri) and
                         link.endswith(runs_query(parent.data.tags["sweep_id"]))
                         for link in links), links
    _open_runs_table(page, sweep)
    side = page.locator("aside").first.inner_text()
    # model-training mode: runs, models and the registry; not GenAI's evaluations and judges
    assert "Model registry" in side and "Models" in side, side
    assert "Evaluation runs" not in side and "Judges" not in side, side
    assert page.get_by_text(f"llama_fsdp: {parent.data.tags['sweep_id']}").count() >= 1


def test_the_sweeps_view_shows_its_runs_alone_its_swept_key_first(sweep, page):
    """The sweep's link: its parent and points only (a run outside the sweep is in the
    experiment's view, not in the sweep's), the swept key's column before the status."""
    from llama_fsdp.tracking.view import RUNS_QUERY

    client, exp = sweep["client"], sweep["exp"]
    outsider = client.create_run(exp.experiment_id, run_name="outside the sweep")
    client.set_terminated(outsider.info.run_id)
    try:
        parent, kids = _open_runs_table(page, sweep)
        assert page.locator(ROW.format(outsider.info.run_id)).count() == 0

        def x(col: str) -> float:
            return page.locator(f'.ag-header-cell[col-id="{col}"]').first.bounding_box()["x"]

        assert x("params.`finetune.method`") < x("tags.`status`") < x("metrics.`final loss`")
        _shot(page, "mlflow_sweep_view.png")
        page.goto(f"{sweep['server'].uri}/#/experiments/{exp.experiment_id}/runs?{RUNS_QUERY}")
        page.wait_for_selector(ROW.format(outsider.info.run_id))  # the experiment's view has it
    finally:
        client.delete_run(outsider.info.run_id)


def test_a_models_page_shows_the_runs_numbers_rounded(sweep, page):
    """The logged model's page lists the numbers the runs table shows, rounded as there."""
    _, kids = _family(sweep["after"])
    point = kids[0]
    model_id = point.outputs.model_outputs[0].model_id
    page.goto(f"{sweep['server'].uri}/#/experiments/{sweep['exp'].experiment_id}/models/"
              f"{model_id}")
    page.get_by_text("tokens per sec").first.wait_for()
    text = page.locator("main").first.inner_text() if page.locator("main").count() else \
        page.inner_text("body")
    tps = point.data.metrics["tokens per sec"]
    assert f"{tps:g}" in text, text[:3000]
    exact = repr(point.data.metrics["summary/tokens_per_sec"])
    assert exact not in text and "summary/tokens_per_sec" not in text, text[:3000]
    _shot(page, "mlflow_model.png")


def test_one_screen_shows_what_the_points_differ_in_rounded(sweep, page):
    from llama_fsdp.tracking.view import SHOWN

    parent, kids = _open_runs_table(page, sweep)
    # the points sit under their parent: the rows right after it
    index = {r.info.run_id: int(page.locator(ROW.format(r.info.run_id)).first
                                .get_attribute("row-index")) for r in (parent, *kids)}
    assert sorted(index[k.info.run_id] for k in kids) == [index[parent.info.run_id] + i
                                                          for i in (1, 2, 3)]
    right = 0.0
    for col, header in FIRST_SCREEN.items():
        cell = page.locator(f'.ag-header-cell[col-id="{col}"]')
        if header == "MFU pct" and not any(header in k.data.metrics for k in kids):
            assert cell.count() == 0  # no MFU on a CPU: MLflow has no column for it
            continue
        assert cell.count() == 1, col
        box = cell.bounding_box()
        assert box is not None and 0 <= box["x"] and box["x"] + box["width"] <= WIDTH, (col, box)
        assert cell.inner_text().strip() == header
        # the whole header shows: its text ends inside the box that clips it
        assert cell.locator('[data-testid^="sort-header-"]').first.evaluate(
            "s => s.scrollWidth <= s.clientWidth && s.getBoundingClientRect().right <= "
            "s.parentElement.getBoundingClientRect().right"), col
        right = max(right, box["x"] + box["width"])
    for col in ("attributes.`Dataset`", "attributes.`Models`"):  # after what runs differ in
        cell = page.locator(f'.ag-header-cell[col-id="{col}"]')  # (off screen: not rendered)
        box = cell.bounding_box() if cell.count() else None
        assert box is None or box["x"] >= right - 1, (col, box)
    shown = {s.name for s in SHOWN}
    for method, k in zip(METHODS, kids):
        assert _cell(page, k.info.run_id, "tags.`status`") == "finished"
        assert _cell(page, k.info.run_id, "params.`finetune.method`") == method
        for col, header in FIRST_SCREEN.items():
            if header not in shown:
                continue
            value = k.data.metrics.get(header)
            if header == "MFU pct" and value is None:
                continue
            assert value is not None, (k.info.run_name, header)
            text = _cell(page, k.info.run_id, col)  # the rounded copy: not 7317.475065965187
            assert float(text) == value and len(text) <= 6, (col, text)
        pct = float(_cell(page, k.info.run_id, "metrics.`trainable pct`"))
        assert pct == 100.0 if method == "full" else 0 < pct < 10
    # the parent's row: its best point's numbers (the lowest eval loss), that point's own
    best = min(kids, key=lambda k: (k.data.metrics["summary/eval_loss"], k.info.run_name))
    for col in ("metrics.`tokens per sec`", "metrics.`final loss`", "metrics.`eval loss`",
                "metrics.`peak GB`"):
        assert _cell(page, parent.info.run_id, col) == _cell(page, best.info.run_id, col), col
    assert _cell(page, parent.info.run_id, "tags.`status`") == "finished"
    assert parent.data.tags["best point"] == best.info.run_name
    assert parent.data.tags["best by"] == "lowest summary/eval_loss"
    _shot(page, "mlflow_runs.png")


CARD = '[data-testid="experiment-view-compare-runs-card"]'


def _charts(page) -> dict[str, list[tuple[str, str, int]]]:
    """The chart cards on screen (MLflow renders those near the viewport): title -> its
    Plotly traces (run, chart type, number of points)."""
    return page.evaluate(f"""() => Object.fromEntries([...document.querySelectorAll('{CARD}')]
        .map(c => [c.innerText.split('\\n')[0].trim(),
                   ((c.querySelector('.js-plotly-plot') || {{}}).data || [])
                       .map(d => [d.name, d.type, (d.x || []).length])]))""")


def test_the_charts_start_with_the_loss_of_the_three_points_and_show_the_summary_as_bars(
        sweep, page):
    _, kids = _open_runs_table(page, sweep)
    page.locator('label:has(input[value="CHART"])').first.click()
    page.wait_for_function(f"() => [...document.querySelectorAll('{CARD}')].some("
                           "c => c.querySelector('.js-plotly-plot .trace'))")
    charts = _charts(page)
    assert list(charts)[:2] == ["loss", "eval_loss"], list(charts)  # the first two charts
    lines = {name for name, kind, points in charts["loss"] if kind == "scatter" and points == 3}
    assert lines == {k.info.run_name for k in kids}, charts["loss"]  # steps 1-3 of each point
    _shot(page, "mlflow_loss.png")
    page.locator(".du-bois-light-collapse-header", has_text="Model metrics").first.click()
    page.wait_for_function(f"() => [...document.querySelectorAll('{CARD}')].some("
                           "c => c.innerText.startsWith('summary/'))")
    summary = _charts(page)["summary/tokens_per_sec"]
    assert [(kind, points) for _, kind, points in summary] == [("bar", 3)], summary  # a bar each


def test_a_points_page_shows_its_own_command_and_keeps_its_side_panel(sweep, page):
    _, kids = _open_runs_table(page, sweep)
    lora = kids[1]
    # as a person gets there: the point's name in the runs table
    page.locator(f'.ag-row[row-id="{lora.info.run_id}"] [col-id="attributes.`Run Name`"] a',
                 has_text="ft=lora").first.click()
    about = page.get_by_text("About this run").first
    about.wait_for()
    box = about.bounding_box()
    assert box is not None and box["x"] + box["width"] <= WIDTH, box
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTH
    description = page.locator("pre, code").filter(has_text="python -m llama_fsdp").first
    text = description.inner_text()
    assert "\n  finetune=lora \\\n" in text and "full,lora,qlora" not in text, text
    _shot(page, "mlflow_run.png")


def test_the_compare_page_plots_a_measured_metric_by_default(sweep, page):
    _, kids = _family(sweep["after"])
    ids = json.dumps([k.info.run_id for k in kids])
    page.goto(f"{sweep['server'].uri}/#/compare-runs?runs={ids}&experiments="
              f"{json.dumps([sweep['exp'].experiment_id])}")
    plot = page.locator(".js-plotly-plot").first
    plot.wait_for()
    text = plot.inner_text()
    assert "finetune.method" in text  # the default axes: what the sweep varied ...
    assert "loss" in text  # ... against a measured metric, not a planned figure
    assert "predicted" not in text and "planned" not in text, text
