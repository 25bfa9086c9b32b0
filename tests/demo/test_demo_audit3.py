"""The demo's cache and report (audit 3): a cached pretrained model is redone when the code that made it changes or
its data files are gone, the report records the seeds it ran with, and every example config parses."""

import glob
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import yaml
from helpers.model_folders import fake_model_folder
from helpers.paths import ROOT

from fastrlhf.demo import evaluate as demo_evaluate
from fastrlhf.demo import pipeline
from fastrlhf.demo import script_doubling as task


class Reached(Exception):
    """Raised by a stub where the pipeline gets to the stage the test is about."""


EVALUATION = {
    "accuracy": 0.5,
    "right_number": 1.0,
    "per_script": {"digits": 0.5},
    "scripts": {"digits": 1.0},
    "samples": [],
    "n": 2,
}


def stub_stages(monkeypatch, calls: list, stop_at: str | None = None) -> None:
    """Every stage of run_demo as a stub that records its name in ``calls`` (and raises Reached at ``stop_at``):
    the pipeline's own caching and report logic runs, no model trains."""

    def record(name):
        calls.append(name)
        if name == stop_at:
            raise Reached(name)

    def write_data(data_dir, seed=0):
        record("write_data")
        os.makedirs(data_dir, exist_ok=True)
        for name in ("pretrain", "rl_prompts", "val", "eval"):
            with open(os.path.join(data_dir, f"{name}.jsonl"), "w"):
                pass

    def run_stage(name, cmd, log_path, metrics_path, total, progress, env, show=()):
        record(name)
        if name.startswith("RL"):
            with open(metrics_path, "w") as f:
                f.write(json.dumps({"step": 1, "reward_mean": 0.5, "time/generate": 1.0}) + "\n")
        return 1.0

    def prepare_for_prefixes(src, dst):
        record("prepare")
        os.makedirs(dst, exist_ok=True)

    def evaluate(model_dir, eval_path, progress=True, desc="evaluate"):
        record(desc)
        return EVALUATION

    config = SimpleNamespace(
        trainer=SimpleNamespace(max_steps=1, prompts_per_step=1), rollout=SimpleNamespace(n=1, engine="hf")
    )
    monkeypatch.setattr(pipeline.demo_data, "write_data", write_data)
    monkeypatch.setattr(pipeline.demo_data, "make_initial_model", lambda out_dir, seed=0, **shape: 1)
    monkeypatch.setattr(pipeline, "run_stage", run_stage)
    monkeypatch.setattr(pipeline, "resolved_config", lambda command, path, sets: config)
    monkeypatch.setattr(pipeline, "prepare_for_prefixes", prepare_for_prefixes)
    monkeypatch.setattr(demo_evaluate, "evaluate", evaluate)


def test_a_stamped_pretrained_model_is_reused_only_with_its_data_files(tmp_path, monkeypatch):
    """A stamp alone counted as cached: with data/ gone the demo went on to evaluate and stopped in a
    FileNotFoundError traceback (runs/demo/data/eval.jsonl) instead of redoing stage 1."""
    opts = pipeline.DemoOptions(workdir=str(tmp_path), progress=False)
    first: list = []
    stub_stages(monkeypatch, first, stop_at="evaluate (before)")
    with pytest.raises(Reached):
        pipeline.run_demo(opts)
    assert first[:3] == ["write_data", "pretrain", "prepare"]
    again: list = []
    stub_stages(monkeypatch, again, stop_at="evaluate (before)")
    with pytest.raises(Reached):
        pipeline.run_demo(opts)
    assert again == ["evaluate (before)"]  # stamp and data there: cached
    shutil.rmtree(tmp_path / "data")
    redone: list = []
    stub_stages(monkeypatch, redone, stop_at="evaluate (before)")
    with pytest.raises(Reached):
        pipeline.run_demo(opts)
    assert redone[:3] == ["write_data", "pretrain", "prepare"]


def test_the_pretrain_stamp_changes_with_the_task_vocabulary(tmp_path, monkeypatch):
    """The token ids live in the cached model's tokenizer and embeddings: a new vocabulary (or prompt format) must
    not reuse a model pretrained with the old one against data and rewards encoded with the new one."""
    opts = pipeline.DemoOptions(workdir=str(tmp_path))
    copy = tmp_path / "script_doubling.py"
    shutil.copy(task.__file__, copy)
    monkeypatch.setattr(pipeline, "PRETRAIN_CODE", (str(copy), pipeline.demo_data.__file__))
    before = pipeline.pretrain_key(opts)
    source = copy.read_text()
    old = 'VOCAB = PAD + BOS + EOS + DIGITS + SCRIPTS["lower"] + SCRIPTS["upper"] + "数字大写小:=_x"'
    assert old in source
    copy.write_text(source.replace(old, old.replace("数字大写小", "数字小写大")))
    assert pipeline.pretrain_key(opts) != before
    assert pipeline.pretrain_key(pipeline.DemoOptions(workdir=str(tmp_path), pretrain_seed=1)) != before


def test_the_report_records_the_seeds_threads_and_pretrained_model(tmp_path, monkeypatch):
    """Two reports of different seeds were indistinguishable: report.json held neither seed nor the thread count
    (the demo's results depend on both) nor which pretrained model (stamp) the run started from."""
    opts = pipeline.DemoOptions(workdir=str(tmp_path), progress=False, pretrain_seed=2, rl_seed=1, threads=1)
    stub_stages(monkeypatch, [])
    monkeypatch.setattr(pipeline, "_rollout_engine", lambda config, model_dir: "hf")
    pipeline.run_demo(opts)
    stub_stages(monkeypatch, [])
    pipeline.run_demo(opts)  # the second run: pretraining cached
    report = json.loads((tmp_path / "grpo-rule" / "report.json").read_text())
    run = report["run"]
    assert (run["pretrain_seed"], run["rl_seed"], run["threads"]) == (2, 1, 1)
    key = json.loads((tmp_path / "pretrained" / "demo_stamp.json").read_text())["key"]
    assert run["pretrain_key"] == key and run["pretrained_cached"] is True and run["pretrain_seconds"] == 1.0
    text = (tmp_path / "grpo-rule" / "report.md").read_text()
    assert f"Seeds: pretraining 2, RL 1; 1 threads; pretrained model {key} (cached, pretrained in 1 s)." in text


def _command(raw: dict, path: str) -> str:
    if "algorithm" in raw:
        return "train"
    return "rm" if "kind" in raw or os.path.basename(path) == "rm.yaml" else "sft"


# examples/*.yaml and examples/gpu/*.yaml have their own tests (tests/config); these run only in the slow
# end-to-end tests, so a schema change that breaks them would show only there.
NESTED = sorted(
    p for folder in ("demo", "arithmetic", "tools") for p in glob.glob(os.path.join(ROOT, "examples", folder, "*.yaml"))
)


@pytest.mark.parametrize("path", NESTED, ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "examples")))
def test_every_example_config_parses_with_the_current_schema(path, tmp_path):
    from fastrlhf.config import load_config
    from fastrlhf.modeling.tiny_chat import build_chat_tokenizer

    model = fake_model_folder(
        tmp_path / "model",
        {
            "model_type": "llama",
            "max_position_embeddings": 4096,
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 32000,
        },
    )
    build_chat_tokenizer().save_pretrained(model)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    raw = yaml.safe_load(open(path))
    sets = [f"model.path={model}", f"output_dir={tmp_path / 'out'}"]
    sets += [f"data.{k}={data}" for k in ("path", "prompts") if k in raw.get("data", {})]
    if "data" in raw.get("eval", {}):
        sets.append(f"eval.data={data}")
    config = load_config(path, _command(raw, path), sets)
    assert config.output_dir == str(tmp_path / "out")


def test_a_failed_stage_ends_the_output_with_its_one_line_summary(monkeypatch, capsys):
    """The summary (stage, exit code, log) used to come first, then 3000 characters of the log buried it: the
    terminal ended on the launcher's last line, with nothing saying what failed or what to do."""
    from fastrlhf.demo import __main__ as demo_main
    from fastrlhf.demo.stages import StageFailed

    def fail(opts):
        raise StageFailed("stage 'RL grpo' failed (exit 137); log: runs/demo/logs/grpo-rule.log\nTraceback\nlast")

    monkeypatch.setattr(pipeline, "run_demo", fail)
    assert demo_main.main(["--no-progress"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == ["Traceback", "last"]
    assert lines[-1].startswith("demo failed: stage 'RL grpo' failed (exit 137); log: runs/demo/logs/grpo-rule.log; ")
    assert "FRESH=1" in lines[-1] and len(lines) == 3


def test_a_failed_stage_quotes_whole_lines_of_its_log(tmp_path):
    import sys

    from fastrlhf.demo.stages import StageFailed, run_stage

    script = "import sys; [print(f'line {i:04d} ' + 'x' * 40) for i in range(200)]; sys.exit(3)"
    with pytest.raises(StageFailed) as failed:
        run_stage(
            "stage", [sys.executable, "-c", script], str(tmp_path / "stage.log"), None, None, False, dict(os.environ)
        )
    summary, _, tail = str(failed.value).partition("\n")
    assert summary.startswith("stage 'stage' failed (exit 3); log: ")
    assert tail.splitlines()[0].startswith("line 0") and tail.splitlines()[-1].startswith("line 0199")
    assert all(len(line) == len("line 0000 ") + 40 for line in tail.splitlines())


def test_the_tools_example_redoes_stage_1_when_its_data_files_are_gone(tmp_path, monkeypatch):
    """examples/tools/run.py's stage 1 counted as cached on its stamp alone: with data/ gone the next stage then
    read a missing file (pretraining: a FileNotFoundError traceback; GRPO: a config error)."""
    from examples.tools import data as tools_data
    from examples.tools import model as tools_model
    from examples.tools import run as tools_run

    written = []

    def write_data(out_dir, seed=0):
        written.append(seed)
        os.makedirs(out_dir, exist_ok=True)
        for name in ("pretrain-tool", "pretrain-direct", "sft-tool", "sft-direct", "rl", "val"):
            (tmp_path / "seed0" / "data" / f"{name}.jsonl").write_text("")

    def make_initial_model(out_dir, seed=0):
        os.makedirs(out_dir, exist_ok=True)
        return {"parameters": 1}

    monkeypatch.setattr(tools_data, "write_data", write_data)
    monkeypatch.setattr(tools_model, "make_initial_model", make_initial_model)
    tools_run.prepare(0, str(tmp_path), fresh=False)
    tools_run.prepare(0, str(tmp_path), fresh=False)
    assert len(written) == 1  # cached
    shutil.rmtree(tmp_path / "seed0" / "data")
    tools_run.prepare(0, str(tmp_path), fresh=False)
    assert len(written) == 2 and (tmp_path / "seed0" / "data" / "rl.jsonl").exists()
