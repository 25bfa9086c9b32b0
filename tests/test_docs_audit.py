"""docs/config.md against the code on two points a user acts on: what a resumed checkpoint must match, and the
defaults of the `trainer` settings every command shares (listed in prose, outside the checked YAML block)."""

import dataclasses
import os
import re

import yaml
from helpers.paths import ROOT


def config_md() -> str:
    with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
        return f.read()


def test_the_resume_bullet_names_every_setting_a_checkpoint_must_match():
    """A resume with another value of a RUN_IDENTITY setting is refused: the page says which, and that
    keep_checkpoints prunes (the bullet named neither)."""
    from fastrlhf.engine.checkpoint import RUN_IDENTITY

    bullet = re.search(r"^- `--resume` continues.*?(?=^- )", config_md(), re.M | re.S).group(0)
    missing = [key for key in (*RUN_IDENTITY, "trainer.keep_checkpoints", "trainer.lr") if f"`{key}`" not in bullet]
    assert missing == []


def test_the_shared_trainer_settings_show_their_defaults():
    """Each LoopConfig field in the "`trainer` settings every command shares" paragraph is followed by its
    schema default in parentheses (lr: the RL and SFT/RM defaults both)."""
    from fastrlhf.config import schema

    text = config_md()
    start = text.index("`trainer` settings every command shares")
    paragraph = text[start : text.index("\n\n", start)]
    wrong = []
    for f in dataclasses.fields(schema.LoopConfig):
        if f.default is dataclasses.MISSING:
            continue
        found = re.search(rf"`{f.name}` \(`?([^;:)`]+)", paragraph)
        if f.name == "lr":
            ok = found is not None and "1.0e-6 for RL" in found.group(1) and "1.0e-5 for SFT/RM" in paragraph
        else:
            ok = found is not None and yaml.safe_load(found.group(1).strip()) == f.default
        if not ok:
            wrong.append(f"{f.name}: {found.group(1) if found else 'no default shown'!r}, schema {f.default!r}")
    assert wrong == []
