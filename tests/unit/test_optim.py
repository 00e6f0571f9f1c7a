"""Low-bit AdamW before launch: the plan's state bytes and fixes, the 70B-on-one-node recipe,
the settings refused with their fix, the optimizer recorded in a checkpoint, quiet imports."""
from __future__ import annotations

import json
import logging

import pytest

from llama_fsdp import plan as P
from llama_fsdp.config.schema import OptimConfig
from llama_fsdp.plan import optimizer as O
from llama_fsdp.run.spec import ConfigError
from tests import conftest

GB = 10**9
# docs/planner.md's recipe: Llama 3 70B, full fine-tuning on one node of 8 x 80 GB GPUs
RECIPE_70B = ["model=70b", "cluster=slurm", "cluster.gpus_per_node=8", "precision=bf16",
              "checkpointing=full", "train.batch_size=1", "train.seq_len=2048"]


def kv_repeat_gb(spec) -> float:
    """What the docs' 70B numbers leave out on a torch whose varlen_attn has no enable_gqa
    (2.11, the GPU image's; read from torch's own signature here): flash varlen gets k and v
    repeated from the model's kv heads to every head, and the one layer recomputed in backward
    saves the copies: 2 tensors x (heads - kv heads) x head dim x the compute dtype's bytes per
    token of the micro-batch. 70B in bf16: 2 x 56 x 128 x 2 x 2048 tokens = 0.06 GB. The pages
    state the numbers of torch >= 2.12 (where it is 0); scripts/test_floor.sh runs these tests
    on 2.11."""
    import inspect

    import torch
    from torch.nn.attention.varlen import varlen_attn

    if "enable_gqa" in inspect.signature(varlen_attn).parameters:
        return 0.0
    m, t = spec.model, spec.train
    size = torch.empty((), dtype=getattr(torch, spec.policy.compute_dtype)).element_size()
    return 2 * (m.num_heads - m.num_kv_heads) * (m.hidden_size // m.num_heads) * size \
        * t.batch_size * t.seq_len / GB


def make_spec(*overrides: str):
    return conftest.make_spec(list(overrides), output_dir="/tmp/llama_fsdp_test/optim")


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_70b_on_one_node_of_8x80gb_fits_with_8bit_moments_not_adamw(gpu):
    """bf16 AdamW needs 82.5 GB per GPU (peak in the layers' backward: its fused step on CUDA
    holds no temporary; foreach's param-sized one made it 88.3 GB in the optimizer step);
    8-bit moments 65.2 GB, 4-bit 56.6 GB (peak in the layers' backward too), against 76.5 GB usable of 85.0 (10% margin): the numbers
    docs/planner.md states."""
    base = [*RECIPE_70B, "cluster.device=auto", f"cluster.gpu_type={gpu}"]
    adamw = P.make_plan(make_spec(*base))
    extra = kv_repeat_gb(adamw.spec)
    assert (round(adamw.predicted_peak_gb - extra, 1), adamw.peak_phase) == (82.5, "layers")
    assert adamw.capacity_bytes == 85 * GB and not adamw.fits
    with pytest.raises(P.PlanError) as err:
        P.check_fits(adamw.spec, adamw)
    extra = kv_repeat_gb(adamw.spec)
    for name, peak, margin, state in (("adamw8bit", 65.2, 11.3, 17.92),
                                      ("adamw4bit", 56.6, 19.9, 9.37)):
        plan = P.make_plan(make_spec(*base, f"optim={name}"))
        assert plan.fits and plan.peak_phase == "layers"
        assert round(plan.predicted_peak_gb - extra, 1) == peak
        assert round((plan.usable_bytes - plan.predicted_peak_bytes) / GB + extra, 1) == margin
        # AdamW's refusal lists it among the fixes, with this plan's peak
        kind = name[len("adamw"):-len("bit")]
        assert (f"  - optim={name} ({kind}-bit AdamW moments): {plan.predicted_peak_gb:.1f} GB "
                "(fits)") in str(err.value)
        assert round(plan.memory.optimizer / GB, 2) == state
        P.check_fits(plan.spec, plan)  # no error


def test_state_bytes_equal_the_bytes_torchao_allocated():
    """Tiny on 2 ranks, fp32: the bytes the prototype measured on rank 0 (codes + scales +
    code tables + the RMSNorm weights' full-precision moments), step counters left out."""
    spec = make_spec("optim=adamw8bit", "precision=fp32")
    assert O.optimizer_state_bytes(spec) == 3_407_872 + 53_248 + 61_440 + 9_216
    spec4 = make_spec("optim=adamw4bit", "precision=fp32")
    assert O.optimizer_state_bytes(spec4) == 1_823_488
    adamw = make_spec("precision=fp32")
    assert O.optimizer_state_bytes(adamw) == 2 * 4 * 1_705_088  # AdamW: as before


def test_the_low_bit_decision_holds_for_every_rank():
    """torchao's rule per local shard (>= 4096 elements, whole blocks), on every rank."""
    assert O.shard_numels((31, 256), 2) == [16 * 256, 15 * 256]
    assert not O.lowbit_everywhere(O.shard_numels((31, 256), 2), 256)  # 3840 < 4096
    assert O.lowbit_everywhere(O.shard_numels((513, 256), 2), 256)  # 257 and 256 rows
    assert not O.lowbit_everywhere(O.shard_numels((300, 100), 2), 256)  # 15000 % 256
    assert O.shard_numels((5, 4096), 4) == [2 * 4096, 1 * 4096, 0]  # a rank with no rows
    assert not O.lowbit_everywhere(O.shard_numels((5, 4096), 4), 256)
    rows = O.shards(make_spec("model=70b", "cluster.device=cpu", "cluster.nproc_per_node=8",
                              "optim=adamw4bit"))
    assert {n for n, low in rows if not low} == {8192 // 8}  # only the RMSNorm weights


def test_step_temporary_foreach_adamw_vs_one_parameter_at_a_time():
    """A pin of the plan's step temporaries: foreach AdamW's one param-sized temporary, and
    torchao's fp32 copies of the largest local parameter (6.5 for the compiled 4-bit step, 14
    eager). Those copy counts are constants of plan/optimizer.py; what real steps allocate is
    measured against the plan in tests/multirank/test_plan_memory.py (a compiled and an eager
    4-bit row, peaking in the optimizer step)."""
    adamw = make_spec("precision=fp32", "optim.fused=false")  # foreach: one param-sized copy
    low = make_spec("precision=fp32", "optim=adamw4bit")
    assert O.optimizer_step_bytes(adamw) == P.model_state_bytes(adamw)[0]
    largest = 768 * 256 // 2  # tiny's gate / up projection on 2 ranks
    assert O.optimizer_step_bytes(low) == int(6.5 * largest * 4)
    eager = make_spec("precision=fp32", "optim=adamw4bit", "optim.eager=true")
    assert O.optimizer_step_bytes(eager) == 14 * largest * 4


def test_fused_adamw_steps_as_foreach_does_with_no_step_temporary_in_the_plan():
    """optim.fused=true is torch's fused AdamW: after a few steps the parameters and moments
    match foreach's (the same math in one kernel), and the plan counts no param-sized
    temporary for its step."""
    import torch

    from llama_fsdp.config.schema import OptimConfig, TrainConfig
    from llama_fsdp.train.optimizer import build_optimizer

    t = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    out = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
        start = [p.detach().clone() for p in model.parameters()]
        opt = build_optimizer(model, t, OptimConfig(fused=fused))  # CPU: foreach unless True
        assert opt.defaults["fused"] is (True if fused else None)
        assert opt.defaults["foreach"] is (None if fused else True)
        for _ in range(4):
            loss = model(torch.randn(16, 32, generator=torch.Generator().manual_seed(1))).square()
            loss.sum().backward()
            opt.step()
            opt.zero_grad()
        assert all((p.detach() - s).abs().max() > 1e-3 for p, s in zip(model.parameters(), start))
        out[fused] = ([p.detach().clone() for p in model.parameters()],
                      [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()])
    for a, b in zip(out[False][0] + out[False][1], out[True][0] + out[True][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert O.optimizer_step_bytes(make_spec("precision=fp32", "optim.fused=true")) == 0
    assert O.optimizer_step_bytes(make_spec("precision=fp32")) == 0  # the default: fused
    assert O.optimizer_step_bytes(make_spec("precision=fp32", "optim.fused=false")) > 0
    # null (the default): fused on CUDA and the CPU, where it was measured faster; foreach on
    # other devices; either forced by true / false; never for torchao's steps
    assert OptimConfig().fused_on("cuda") and OptimConfig().fused_on("cpu")
    assert not OptimConfig().fused_on("mps") and not OptimConfig(fused=False).fused_on("cpu")
    assert OptimConfig(fused=True).fused_on("cpu") and not OptimConfig(fused=False).fused_on("cuda")
    assert not OptimConfig(bf16_stochastic_round=True).fused_on("cuda")
    assert not OptimConfig(name="adamw8bit", fused=True).fused_on("cuda")


@pytest.mark.parametrize("name", ["adamw", "adamw8bit"])
def test_stochastic_rounding_moves_bf16_parameters_by_updates_below_half_an_ulp(name):
    """A bf16 parameter at 1.5 (one ulp: 2**-7) stepped STEPS times by AdamW updates of
    lr = 1e-3 (a constant gradient: each update is lr), under half an ulp: rounded to nearest
    it never moves; with optim.bf16_stochastic_round an element moves one ulp with probability
    update / ulp, so the mean moves by the updates' sum, STEPS x lr, unbiased."""
    import torch

    from llama_fsdp.config.schema import OptimConfig, TrainConfig
    from llama_fsdp.train.optimizer import build_optimizer

    steps, lr = 20, 1e-3
    t = TrainConfig(lr=lr, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8)
    moved = {}
    for sr in (False, True):
        torch.manual_seed(0)
        holder = torch.nn.Module()
        holder.p = p = torch.nn.Parameter(torch.full((64, 128), 1.5, dtype=torch.bfloat16))
        opt = build_optimizer(holder, t, OptimConfig(name=name, bf16_stochastic_round=sr,
                                                     eager=True))
        for _ in range(steps):
            p.grad = torch.ones_like(p)
            opt.step()
        assert p.dtype == torch.bfloat16
        moved[sr] = 1.5 - p.detach().float()
    assert bool((moved[False] == 0).all()), moved[False].abs().max()
    mean = moved[True].mean().item()
    assert 0.8 * steps * lr < mean < 1.2 * steps * lr, mean  # 0.02: 2.6 ulps on average
    assert set(moved[True].unique().tolist()) <= {k * 2**-7 for k in range(steps + 1)}  # ulps


@pytest.mark.parametrize("overrides,needle", [
    (["optim.block_size=128"], "optim.block_size=128 sets the blocks of low-bit moments"),
    (["optim=adamw8bit", "optim.block_size=100"], "must be a power of two"),
    (["optim.bf16_stochastic_round=true", "precision=fp32"], "use precision=bf16"),
    (["optim=adamw4bit", "save.full_state_dict=true"], "drop save.full_state_dict"),
    (["optim=adamw8bit", "optim.fused=true"], "optim.fused=true is torch's fused AdamW, but "
                                              "optim=adamw8bit steps with torchao's"),
    (["optim.fused=true", "optim.bf16_stochastic_round=true", "precision=bf16"],
     "but optim.bf16_stochastic_round=true steps with torchao's"),
    (["optim=adamw8bit", "sharding.cpu_offload=true", *RECIPE_70B[1:3], "cluster.device=auto"],
     "drop sharding.cpu_offload, or use optim=adamw"),
])
def test_settings_torchao_cannot_run_are_refused_with_the_fix(overrides, needle):
    with pytest.raises(ConfigError) as err:
        make_spec(*overrides)
    assert needle in str(err.value)


def test_valid_settings_pass():
    for o in (["optim=adamw8bit", "optim.block_size=512"], ["optim=adamw4bit", "optim.eager=true"],
              ["optim=adamw", "optim.bf16_stochastic_round=true", "precision=bf16"],
              ["optim=adamw8bit", "optim.bf16_stochastic_round=true", "precision=bf16"]):
        spec = make_spec(*o)
        assert spec.optim.name == o[0].split("=")[1]
    spec = make_spec("optim=adamw4bit", "optim.block_size=64")
    assert spec.optim.block == 64 and "adamw4bit" in spec.run_name
    assert spec.overview()["optimizer"] == "adamw4bit"


def _fake_checkpoint(root, optim: OptimConfig | None, finetune=None):
    from llama_fsdp.checkpoint import layout
    from llama_fsdp.checkpoint.optim_meta import write_optim_meta

    path = layout.step_dir(root, 4)
    path.mkdir(parents=True)
    (path / layout.METADATA).write_bytes(b"")
    if optim is not None:
        write_optim_meta(path, optim, finetune)
    return path


def test_resuming_with_another_finetune_method_is_refused_before_launch(tmp_path):
    """A lora checkpoint holds the adapters alone, a full one every weight: resuming one with
    the other method (or other adapters) is refused before launch, with the overrides that
    fit; checkpoints written before the record are full fine-tuning's."""
    from llama_fsdp.config.schema import FinetuneConfig

    lora = _fake_checkpoint(tmp_path / "lora", OptimConfig(),
                            FinetuneConfig(method="lora", rank=8,
                                           target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ConfigError) as err:
        make_spec(f"resume={lora}")
    assert (f"{lora} holds what finetune 'lora, rank 8, on q_proj,v_proj' trains, not what "
            "'full' trains: resume with finetune=lora finetune.rank=8 "
            "finetune.target_modules=[q_proj,v_proj], or start afresh with resume=retire"
            ) in str(err.value)
    with pytest.raises(ConfigError, match="rank 16"):  # another rank
        make_spec(f"resume={lora}", "finetune=lora", "finetune.target_modules=[q_proj,v_proj]")
    # the fix, as the message writes it, resumes
    make_spec(f"resume={lora}", *"finetune=lora finetune.rank=8 "
              "finetune.target_modules=[q_proj,v_proj]".split())
    full = _fake_checkpoint(tmp_path / "full", None)  # no record: written by full fine-tuning
    make_spec(f"resume={full}")
    with pytest.raises(ConfigError, match="export it with save.export_hf=true"):
        make_spec(f"resume={full}", "finetune=qlora")


def test_resuming_with_another_optimizer_is_refused_before_launch(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "run", OptimConfig(name="adamw8bit"))
    assert json.loads((ckpt / "optimizer.json").read_text())["format"] == "adamw8bit, block 256"
    with pytest.raises(ConfigError) as err:
        make_spec(f"resume={ckpt}", "optim=adamw4bit")
    assert ("holds the state of optim 'adamw8bit, block 256', which optim 'adamw4bit, block 128' "
            "cannot read: resume with optim=adamw8bit, or start afresh with resume=retire"
            ) in str(err.value)
    make_spec(f"resume={ckpt}", "optim=adamw8bit")  # the same optimizer resumes
    with pytest.raises(ConfigError, match="optim.block_size=256"):  # another block size
        make_spec(f"resume={ckpt}", "optim=adamw8bit", "optim.block_size=128")
    # resume=auto in the run dir checks its newest checkpoint too
    with pytest.raises(ConfigError, match="cannot read"):
        conftest.make_spec(["resume=auto", "optim=adamw"], output_dir=tmp_path / "run")


def test_checkpoints_from_before_the_record_are_adamw(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "old", None)
    make_spec(f"resume={ckpt}")
    with pytest.raises(ConfigError, match="resume with optim=adamw,"):
        make_spec(f"resume={ckpt}", "optim=adamw8bit")


def test_torchao_import_noise_is_dropped_and_other_records_pass(caplog):
    import llama_fsdp  # noqa: F401 - installs the filters

    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: no CUDA")
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'X'> is an Enum subclass ... Calling register_constant() on Enum subclasses "
            "is deprecated and will be an error in a future release.")
        logging.getLogger("torchao").warning("a real torchao warning")
    assert [r.getMessage() for r in caplog.records] == ["a real torchao warning"]


def test_the_docs_recipe_commands_plan_what_the_docs_say():
    """The dry-run commands of docs/optimizer.md and docs/planner.md compose, and plan the
    peaks the pages state (the pages' numbers are the ones asserted above)."""
    import shlex

    docs = conftest.REPO / "docs"
    expected = {"adamw": 82.5, "adamw8bit": 65.2, "adamw4bit": 56.6}
    seen = 0
    for page in ("optimizer.md", "planner.md"):
        text = (docs / page).read_text()
        for line in text.splitlines():
            if not (line.startswith("python -m llama_fsdp model=70b cluster=slurm")
                    and "dry_run=true" in line):
                continue
            args = [a for a in shlex.split(line)[3:] if a != "dry_run=true"]
            spec = make_spec(*args, "cluster.device=auto")
            extra = kv_repeat_gb(spec)  # every peak is in the layers' backward
            peak = round(P.make_plan(spec).predicted_peak_gb - extra, 1)
            assert peak == expected[spec.optim.name] and f"{peak} GB" in text, (page, line)
            seen += 1
    assert seen == 2


def test_resume_auto_checks_the_run_directory_the_launch_writes_to(tmp_path):
    """Under torchrun the caller names the run directory (build_spec's output_dir), not the
    config: resume=auto's optimizer check looks there; an unreadable optimizer.json is named
    before launch instead of raising from the spec."""
    ckpt = _fake_checkpoint(tmp_path / "torchrun-job", OptimConfig(name="adamw8bit"))
    cfg = conftest.compose([f"output_dir={tmp_path / 'elsewhere'}", *conftest.CPU, "optim=adamw"])
    with pytest.raises(ConfigError, match="cannot read"):
        conftest.spec_of(cfg, launch_dir=tmp_path, output_dir=str(tmp_path / "torchrun-job"))
    (ckpt / "optimizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"optimizer.json is unreadable \(JSONDecodeError"):
        make_spec(f"resume={ckpt}")


def _in_compiled_once(directory, spans, name, hold_s, *, wait_s=600.0, fail=False,
                      entered=None):
    """A thread's 'first compiled step': compiled_once around hold_s of work; its span (start,
    end) and whether it finished. ``entered`` (an Event) is set when its step starts."""
    import time

    from llama_fsdp.train.optimizer import compiled_once

    start = None
    try:
        with compiled_once(directory, wait_s=wait_s):
            start = time.monotonic()
            if entered is not None:
                entered.set()
            time.sleep(hold_s)
            if fail:
                raise RuntimeError("the compile failed")
    except RuntimeError:
        pass
    spans[name] = (start, time.monotonic(), not fail)


def _threads(first, *rest):
    """``first``'s thread, and once its step has started (it holds the lock, or found a first
    step done and runs at once), the others': an order kept by an event, not by a stagger
    that a loaded machine can overrun."""
    import threading

    entered = threading.Event()
    args, kwargs = first
    threads = [threading.Thread(target=_in_compiled_once, args=args,
                                kwargs={**kwargs, "entered": entered})]
    threads[0].start()
    assert entered.wait(30), f"{args[2]} never started its step"
    threads += [threading.Thread(target=_in_compiled_once, args=a, kwargs=k) for a, k in rest]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(30)


def test_the_first_compiled_step_runs_alone_then_the_rest_at_once(tmp_path):
    """compiled_once: the first to come holds the others until its step is done (they then
    load what it compiled); once a first step has finished there, everyone runs at once. The
    flock is per open file, so threads stand in for the ranks of a node."""
    from llama_fsdp.train.optimizer import COMPILED

    spans: dict = {}
    _threads(((tmp_path, spans, "first", 1.0), {}), ((tmp_path, spans, "second", 0.0), {}))
    assert spans["second"][0] >= spans["first"][1], spans  # waited for the whole first step
    assert (tmp_path / COMPILED).exists()
    spans.clear()
    _threads(((tmp_path, spans, "a", 1.0), {}), ((tmp_path, spans, "b", 1.0), {}))
    assert spans["b"][0] < spans["a"][1], spans  # a finished first step: nobody waits


def test_a_failed_first_step_lets_the_next_process_compile_and_a_waiter_gives_up(tmp_path,
                                                                                 caplog):
    from llama_fsdp.train.optimizer import COMPILED

    spans: dict = {}
    _threads(((tmp_path, spans, "fails", 0.5), {"fail": True}))
    assert not spans["fails"][2] and not (tmp_path / COMPILED).exists()
    _threads(((tmp_path, spans, "fails", 1.0), {"fail": True}),
             ((tmp_path, spans, "b", 0.5), {}), ((tmp_path, spans, "c", 0.5), {}))
    first, then = sorted((spans["b"], spans["c"]))
    assert first[0] >= spans["fails"][1], spans  # the lock passed on when the holder failed
    assert then[0] >= first[1], spans  # to one of the others, alone: it compiles
    assert (tmp_path / COMPILED).exists()

    other = tmp_path / "other"
    spans.clear()
    with caplog.at_level(logging.WARNING, logger="llama_fsdp.train.optimizer"):
        _threads(((other, spans, "slow", 3.0), {}),
                 ((other, spans, "impatient", 0.0), {"wait_s": 0.5}))
    assert spans["impatient"][0] < spans["slow"][1], spans  # ran beside the holder
    assert "compiling here too" in caplog.text
