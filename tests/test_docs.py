"""README.md and docs/ agree with the code: every file and module they name exists, the README's commands
marked runnable on a CPU run (from a clean copy of the checkout), the config reference shows the schema's
defaults, the README's GRPO config is examples/grpo.yaml's, `--dry-run` leaves `auto` only what the README
says it leaves, `make bench` takes one duration everywhere, and no page sends users to the project's own
GPU-session files outside the maintainers' section."""

import ast
import dataclasses
import glob
import importlib.util
import os
import re
import subprocess

import pytest
import yaml
from helpers.clone import bare_clone, clone_env
from helpers.launch import run_group
from helpers.model_folders import fake_classifier_folder, fake_model_folder
from helpers.paths import ROOT

PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
# Names of what a run or the reader writes, not files of the checkout.
OUTPUTS = {"config.yaml", "metrics.jsonl", "config.json", "generation_config.json", "report.json", "report.md",
           "e2e.json", "my_loss.py", "my_rewards.py", "run.yaml", "prompts.jsonl", "hostfile"}
USER_FOLDERS = {"runs", "models", "data", "output_dir", "checkpoints", "final", "eval", "tensorboard", "wandb",
                ".venv", ".gpu-carry", ".vllm-carry"}
EXTENSIONS = (".py", ".md", ".yaml", ".yml", ".sh", ".c", ".json", ".jsonl", ".toml", ".txt", ".png", ".parquet")
CPU_RUNNABLE = "<!-- cpu-runnable"


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def checkout_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True, timeout=60).stdout.decode()
    return [p for p in out.split("\0") if p and os.path.exists(os.path.join(ROOT, p))]


def named_paths(text: str):
    """``(kind, token)`` for each markdown link target and each one-word code span of ``text``."""
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        yield "link", target
    for span in re.findall(r"`([^`\n]+)`", text):
        if " " not in span.strip():
            yield "code", span.strip()


def module_name_exists(dotted: str) -> bool:
    """``fastrlhf.a.b[.attr]``: a module of the package (``fastrlhf.kernels`` is ``kernels/``), and ``attr``
    (if any) defined at its top level."""
    parts = dotted.split(".")
    roots = {"fastrlhf": os.path.join(ROOT, "fastrlhf")}
    base = os.path.join(ROOT, "kernels") if parts[:2] == ["fastrlhf", "kernels"] else roots["fastrlhf"]
    rest = parts[2:] if parts[:2] == ["fastrlhf", "kernels"] else parts[1:]
    for i in range(len(rest), -1, -1):
        folder = os.path.join(base, *rest[:i])
        for path in (folder + ".py", os.path.join(folder, "__init__.py")):
            if os.path.isfile(path):
                names = rest[i:]
                if not names:
                    return True
                return len(names) == 1 and defines(path, names[0])
    return False


def section_fields() -> dict[str, set[str]]:
    """Config section -> the keys it has in any command (train, sft, rm), the renamed ones' old names too."""
    from fastrlhf.config import RENAMED_KEYS, schema

    classes = {"model": [schema.ModelConfig], "reference": [schema.ReferenceConfig], "critic": [schema.CriticConfig],
               "reward": [schema.RewardConfig], "rollout": [schema.RolloutConfig], "eval": [schema.EvalConfig],
               "data": [schema.DataConfig, schema.SFTDataConfig, schema.RMDataConfig],
               "trainer": [schema.TrainerConfig, schema.SFTTrainerConfig], "deepspeed": [schema.DeepSpeedConfig]}
    fields = {section: {f.name for cls in group for f in dataclasses.fields(cls)} for section, group in classes.items()}
    for old in RENAMED_KEYS:
        section, _, key = old.partition(".")
        fields[section].add(key)
    return fields


def module_stems() -> dict[str, list[str]]:
    """``stem`` -> the package's (and kernels') files named ``stem.py``."""
    stems = {}
    for folder in ("fastrlhf", "kernels"):
        for path in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True):
            stems.setdefault(os.path.basename(path)[:-3], []).append(path)
    return stems


def defines(path: str, name: str) -> bool:
    tree = ast.parse(open(path).read())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    return name in defined


def dotted_name_exists(token: str, fields: dict, stems: dict) -> bool:
    """``section.key`` (a config key, ``deepspeed.extra.x`` read as ``deepspeed.extra``), ``module.name`` (a
    function, class or constant of a module of the package, named by its file's stem) or another package's."""
    first, second = token.split(".")[:2]
    if second in fields.get(first, ()):
        return True
    if first not in fields and first not in stems and importlib.util.find_spec(first) is not None:
        return True  # another package's (torch.cuda.set_sync_debug_mode): not ours to check
    return any(defines(path, second) for path in stems.get(first, ()))


def missing_paths(page: str, files: list[str]) -> list[str]:
    top = {f.split("/")[0] for f in files}
    fields, stems = section_fields(), module_stems()
    missing = []
    for kind, token in named_paths(read(page)):
        if kind == "link":
            target = token.split("#")[0]
            if target and not re.match(r"[a-z]+:", target) and not os.path.exists(
                    os.path.join(ROOT, os.path.dirname(page), target)):
                missing.append(token)
            continue
        token = re.sub(r"\(.*\)$", "", token).rstrip(",.;:")
        if re.fullmatch(r"fastrlhf(\.\w+)+", token):
            if not module_name_exists(token):
                missing.append(token)
            continue
        if re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+", token) and not token.endswith(EXTENSIONS):
            if not dotted_name_exists(token, fields, stems):
                missing.append(token)
            continue
        first = token.split("/")[0]
        if (re.search(r"[<>*$~{}]", token) or token.startswith(("/", "../shared/", "http")) or first in USER_FOLDERS
                or token in OUTPUTS):
            continue
        if first in top and "/" in token:  # a path from the checkout's root
            if not os.path.exists(os.path.join(ROOT, token)):
                missing.append(token)
        elif token.rstrip("/").endswith(EXTENSIONS):  # a file named by its name or its tail: it must exist
            tail = token.rstrip("/")
            if not any(f == tail or f.endswith("/" + tail) for f in files):
                missing.append(token)
    return missing


def test_every_file_and_module_the_docs_name_exists():
    files = checkout_files()
    missing = {page: found for page in PAGES if (found := missing_paths(page, files))}
    assert missing == {}


def cpu_runnable_blocks(text: str) -> list[list[str]]:
    """The commands of each fenced block right after a ``<!-- cpu-runnable ... -->`` line (comments and
    blank lines dropped, ``\\`` continuations joined)."""
    blocks = re.findall(r"^<!-- cpu-runnable[^\n]*-->\n```(?:bash|sh)?\n(.*?)^```", text, re.M | re.S)
    return [[line for line in block.replace("\\\n", " ").splitlines() if line.strip() and not
             line.lstrip().startswith("#")] for block in blocks]


# What --dry-run prints as `auto` on this machine: these four the README says stay `auto` until the run
# starts; the other three are per row, per algorithm and per step by design.
ENGINE_AUTO = {"rollout.engine", "rollout.kv_cache_bytes", "rollout.gpu_memory_utilization", "rollout.enforce_eager"}
DESIGN_AUTO = {"data.chat_template", "trainer.adv_estimator", "trainer.old_logprobs"}


def auto_keys(mapping: dict, prefix: str = "") -> set[str]:
    found = set()
    for key, value in mapping.items():
        if isinstance(value, dict):
            found |= auto_keys(value, f"{prefix}{key}.")
        elif value == "auto":
            found.add(f"{prefix}{key}")
    return found


@pytest.mark.slow
def test_the_readme_commands_marked_cpu_runnable_run_from_a_clean_copy(tmp_path):
    """Each line of each marked block, in order, from a copy of the checkout's files (nothing made yet), as a
    reader on a CPU machine types them; kept to seconds each."""
    blocks = cpu_runnable_blocks(read("README.md"))
    commands = [line for block in blocks for line in block]
    assert any("fastrlhf.modeling.tiny_chat" in c for c in commands) and any("--dry-run" in c for c in commands)
    clone = bare_clone(tmp_path / "fastrlhf")
    outputs = {}
    for command in commands:
        code, out = run_group(["bash", "-c", command], timeout=300, env=clone_env(clone), cwd=clone)
        assert code == 0, f"README.md: `{command}` exited {code}:\n{out[-3000:]}"
        outputs[command] = out

    # What --dry-run prints is what the README says about it.
    (dry_run,) = [out for command, out in outputs.items() if "--dry-run" in command]
    printed = yaml.safe_load("\n".join(line for line in dry_run.splitlines() if re.match(r"^[a-z_]+:|^  ", line)))
    assert auto_keys(printed) == ENGINE_AUTO | DESIGN_AUTO
    readme = " ".join(read("README.md").split())
    sentence = readme[readme.index("`--dry-run` prints the config"):][:600]
    assert all(f"`{key}`" in sentence or f"`{key.split('.')[1]}`" in sentence for key in ENGINE_AUTO), sentence
    for key in ("model.dtype", "rollout.dtype", "deepspeed.bf16", "model.attention"):  # resolved, as it says
        section, name = key.split(".")
        assert printed[section][name] != "auto" and f"`{key}`" in sentence


def schema_default(cls, name):
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def test_the_rl_config_reference_shows_each_keys_default():
    """docs/config.md's block under "The RL run config": every key exists and shows the schema's default,
    except those marked required (which have none)."""
    from fastrlhf.config import schema

    text = read("docs/config.md")
    block = re.search(r"^# The RL run config.*?^```yaml\n(.*?)^```", text, re.M | re.S).group(1)
    shown = yaml.safe_load(block)
    required = {"algorithm", "output_dir", "model.path", "data.prompts", "trainer.max_steps", "reward.function"}
    sections = {"model": schema.ModelConfig, "reference": schema.ReferenceConfig, "critic": schema.CriticConfig,
                "reward": schema.RewardConfig, "data": schema.DataConfig, "rollout": schema.RolloutConfig,
                "trainer": schema.TrainerConfig, "eval": schema.EvalConfig, "deepspeed": schema.DeepSpeedConfig}
    wrong = []
    for key, value in shown.items():
        pairs = [(f"{key}.{k}", sections[key], k, v) for k, v in value.items()] if key in sections else [
            (key, schema.TrainConfig, key, value)]
        for dotted, cls, name, v in pairs:
            if dotted in required:
                assert schema_default(cls, name) is dataclasses.MISSING or dotted == "reward.function", dotted
                continue
            default = schema_default(cls, name)
            if default is dataclasses.MISSING or v != default:
                wrong.append(f"{dotted}: docs {v!r}, schema {default!r}")
    assert wrong == []
    sections_text = re.split(r"\n(?=[a-z_]+:)", block)  # each top-level key with its continuation lines
    for dotted in required:  # and the block says they are required
        (text,) = [t for t in sections_text if t.startswith(dotted.split(".")[0] + ":")]
        assert re.search(rf"{dotted.split('.')[-1]}: required|# required", text), dotted


def test_config_md_names_every_key_of_every_command():
    """Each key of the RL, SFT and RM configs appears in docs/config.md (forward_micro_batch, lora_dropout,
    SFT's and RM's data.max_len and RM's num_labels did not)."""
    import inspect

    from fastrlhf.config import schema

    text = read("docs/config.md")
    classes = [c for _, c in inspect.getmembers(schema, inspect.isclass)
               if dataclasses.is_dataclass(c) and c.__module__ == schema.__name__]
    assert len(classes) > 10
    missing = [f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c)
               if not re.search(rf"\b{f.name}\b", text)]
    assert missing == []


def test_the_readme_grpo_config_is_examples_grpo_yaml():
    """Each key of the README's GRPO block has examples/grpo.yaml's value (the schema's default where the
    example leaves a key out)."""
    from fastrlhf.config import schema

    block = re.search(r"A GRPO run, as `examples/grpo.yaml` sets it.*?```yaml\n(.*?)^```", read("README.md"),
                      re.M | re.S)
    shown, example = yaml.safe_load(block.group(1)), yaml.safe_load(read("examples/grpo.yaml"))
    sections = {f.name: f for f in dataclasses.fields(schema.TrainConfig)}
    classes = {"model": schema.ModelConfig, "reward": schema.RewardConfig, "data": schema.DataConfig,
               "rollout": schema.RolloutConfig, "trainer": schema.TrainerConfig, "deepspeed": schema.DeepSpeedConfig}
    for key, value in shown.items():
        assert key in sections, key
        if not isinstance(value, dict):
            assert value == example[key], key
            continue
        for sub, v in value.items():
            expected = example.get(key, {}).get(sub, schema_default(classes[key], sub))
            assert v == expected, f"{key}.{sub}: README {v!r}, examples/grpo.yaml {expected!r}"


def test_make_bench_takes_the_same_time_on_every_page():
    said = {}
    for page in ["README.md", "Makefile", "docs/performance.md"]:
        text = " ".join(read(page).split())
        for match in re.finditer(r"make bench(?!-).{0,200}?about (\d+) minutes|About (\d+) minutes on a quiet",
                                 text):
            said.setdefault(page, set()).add(match.group(1) or match.group(2))
    assert set(said) == {"README.md", "Makefile", "docs/performance.md"}, said
    assert len(set().union(*said.values())) == 1, said


def test_user_pages_leave_the_projects_gpu_session_files_to_the_maintainers_section():
    """``../shared/`` and ``.gpu-carry`` exist only in the project's own development sessions."""
    for page in [*PAGES, "Makefile"]:
        heading = ""
        for line in read(page).splitlines():
            if line.startswith("#") and page.endswith(".md"):
                heading = line
            if "../shared/" in line or ".gpu-carry" in line:
                assert "maintainers" in heading.lower(), f"{page}: {line}"


def test_config_md_says_which_rewards_combine_as_the_checks_do(tmp_path):
    """A per-sample function and a reward model together are refused; docs/config.md quotes the line."""
    from fastrlhf.config import ConfigError, parse_config

    fake_model_folder(tmp_path / "m", {"model_type": "qwen2"})
    fake_classifier_folder(tmp_path / "rm", "qwen2")
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2]}\n')

    def parse(reward):
        return parse_config({"algorithm": "grpo", "output_dir": "run", "model": {"path": "m"}, "reward": reward,
                             "data": {"prompts": "p.jsonl"}, "trainer": {"max_steps": 1}}, "train",
                            base_dir=str(tmp_path))

    with pytest.raises(ConfigError) as refused:
        parse({"function": "length", "model_path": "rm"})
    assert f"`config error: {refused.value}`" in " ".join(read("docs/config.md").split())
    fn = {"function": "my_rewards:fn"}
    parse({"functions": [fn], "function": "length"})  # each of the two with text rewards: accepted
    parse({"functions": [fn], "model_path": "rm"})
