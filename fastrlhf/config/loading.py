"""YAML (1.2 floats) -> raw mapping -> ``--set`` overrides -> typed frozen dataclasses -> validated config."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from typing import Any, Literal, Union

import yaml

from .checks import validate
from .errors import ConfigError
from .model_checks import check_logit_terms
from .schema import SCHEMAS

__all__ = ["RENAMED_KEYS", "apply_overrides", "import_modules", "parse_config", "load_config", "config_to_dict"]

# Keys that changed name: old dotted key -> new dotted key. A config that still uses the old name fails with
# one line saying what it is called now (never silently ignored, never silently accepted).
RENAMED_KEYS: dict[str, str] = {
    "trainer.use_fused_loss": "trainer.fused_loss",
    "eval.prompts": "eval.data",
}


# --------------------------------------------------------------------------------------------
# YAML with 1.2-style numbers: PyYAML (YAML 1.1) reads `1e-5` as a string, a classic trap for learning rates,
# `010` as 8 (octal) and `1:30` as 90 (base 60). And a key given twice is an error, not the last one silently.
# --------------------------------------------------------------------------------------------

_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"


class _DuplicateKey(yaml.constructor.ConstructorError):
    def __init__(self, key, mark):
        super().__init__(problem=f"duplicate key {key}", problem_mark=mark)
        self.key = key


class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges defaults that keys may override
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise _DuplicateKey(key, key_node.start_mark)
                    seen.add(key)
                except TypeError:  # an unhashable key: the base class says so
                    pass
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        """YAML 1.2's integers (the resolver below lets only those through): decimal with leading zeros as
        written, 0o octal, 0x hex (underscores allowed, as 1.1 and the floats above allow them)."""
        text = str(self.construct_scalar(node)).replace("_", "")
        sign = -1 if text.startswith("-") else 1
        digits = text.lstrip("+-")
        base = {"0o": 8, "0x": 16}.get(digits[:2].lower(), 10)
        try:
            return sign * int(digits[2:] if base != 10 else digits, base)
        except ValueError:  # only an explicit !!int tag gets here with something else
            raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not an integer",
                                                    node.start_mark) from None


_Loader.add_constructor(_INT, _Loader.construct_yaml_int)
_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _ch in list("-+0123456789."):
    _Loader.yaml_implicit_resolvers[_ch] = [
        (tag, rx) for tag, rx in _Loader.yaml_implicit_resolvers.get(_ch, []) if tag not in (_FLOAT, _INT)
    ]
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
               r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)
_Loader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7][0-7_]*|0x[0-9a-fA-F][0-9a-fA-F_]*)$"),
                              list("-+0123456789"))


def _yaml_load(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except _DuplicateKey as exc:
        raise ConfigError("", f"{source}:{exc.problem_mark.line + 1}: duplicate key {exc.key}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError("", f"{where}: invalid YAML: {problem}") from None


# --------------------------------------------------------------------------------------------
# dict -> dataclass with type checks
# --------------------------------------------------------------------------------------------


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(value, tp, key: str):
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(key, f"expected one of {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {value!r}")
        if origin is not dict:  # a bare dict: anything, passed through (deepspeed.extra)
            return dict(value)
        _, value_tp = typing.get_args(tp)
        return {k: _coerce(v, value_tp, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(key, f"expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp} at {key}")  # a schema bug, not a user error


def _build(cls, raw, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(prefix, f"expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            dotted = _join(prefix, str(key))
            if dotted in RENAMED_KEYS:
                raise ConfigError(dotted, f"was renamed to {RENAMED_KEYS[dotted]}; use that key instead")
            close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.75)
            if close:  # a typo: name the key it most likely is
                raise ConfigError(dotted, f"unknown key; did you mean {_join(prefix, close[0])}?")
            known = ", ".join(sorted(fields))
            raise ConfigError(dotted, f"unknown key (known keys here: {known})")
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name in raw:
            kwargs[name] = _coerce(raw[name], hints[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(key, "missing required key")
    return cls(**kwargs)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# --------------------------------------------------------------------------------------------
# --set overrides
# --------------------------------------------------------------------------------------------


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``key.sub=value`` strings (values parsed as YAML; a mapping merges into the one it replaces; a list's
    item as ``key[i]``, e.g. ``reward.functions[0].weight=2``) to a raw config mapping."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError("--set", f"expected key=value, got {item!r}")
        dotted, text = item.split("=", 1)
        dotted = dotted.strip()
        steps = _override_steps(dotted)
        if not steps:
            raise ConfigError("--set", f"expected key=value (a list's item as key[0]), got {item!r}")
        value = _yaml_load(text, f"--set {dotted}") if text.strip() else None
        node = raw
        for i, step in enumerate(steps):
            if isinstance(step, int) and step >= len(node):
                raise ConfigError(_step_name(steps[:i]), f"has {len(node)} items, so --set {dotted} cannot apply")
            if i == len(steps) - 1:
                break
            child = node[step] if isinstance(step, int) else node.get(step)
            want = list if isinstance(steps[i + 1], int) else dict
            if child is None and want is dict:
                child = {}
            elif child is None:  # a list the file leaves out: its items cannot be set one by one
                raise ConfigError(_step_name(steps[: i + 1]), f"is not set in the config, so --set {dotted} cannot "
                                                               "apply: set the whole list")
            elif not isinstance(child, want):
                kind = "a list" if want is list else "a section"
                raise ConfigError(_step_name(steps[: i + 1]), f"is {child!r}, not {kind}, so --set {dotted} cannot "
                                                               "apply")
            # a copy: a YAML alias (critic: *ref) shares the mapping with its anchor, which --set leaves as is
            node[step] = child = want(child)
            node = child
        old = node[step] if isinstance(step, int) else node.get(step)
        node[step] = _merged(old, value)
    return raw


_OVERRIDE_PART = re.compile(r"([^.\[\]]+)((?:\[\d+\])*)")


def _override_steps(dotted: str) -> list[str | int]:
    """``a.b[0].c`` -> ``["a", "b", 0, "c"]``; ``[]`` when it is not such a key."""
    steps: list[str | int] = []
    for part in dotted.split("."):
        match = _OVERRIDE_PART.fullmatch(part)
        if match is None:
            return []
        steps += [match.group(1), *map(int, re.findall(r"\d+", match.group(2)))]
    return steps


def _step_name(steps: list[str | int]) -> str:
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps).lstrip(".")


def _merged(old, new):
    """``new`` set over ``old``: a mapping over a mapping sets only the keys it names, the others stay (as
    Hydra's overrides merge): ``--set rollout={n: 8}`` must not reset the file's other rollout settings."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}


# --------------------------------------------------------------------------------------------
# imports: user modules that register policy losses, advantage estimators, rewards
# --------------------------------------------------------------------------------------------


def _user_frame(exc: BaseException) -> str:
    """`` (file.py:12)``: the deepest frame of ``exc`` outside Python, its installed packages and fastrlhf
    (the user's own code), or ""."""
    import sys
    import traceback

    ours = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the fastrlhf package
    roots = tuple({os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, ours)})
    frame = None
    for entry in traceback.extract_tb(exc.__traceback__):
        if not entry.filename.startswith("<") and not os.path.realpath(entry.filename).startswith(roots):
            frame = entry
    return f" ({os.path.relpath(frame.filename)}:{frame.lineno})" if frame is not None else ""


def cwd_importable() -> None:
    """Make the current directory importable, as it is under ``python -m`` and the deepspeed launcher but not
    under the ``fastrlhf`` console script: for ``imports``, ``module:function`` rewards and tools. Last on the
    path, so that a user's file never shadows an installed module."""
    import sys

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())


def import_modules(names, key: str) -> None:
    """Import each module of ``names`` (``--import`` or the config's ``imports``), so that what it registers
    is known before the config is checked; the current directory is importable, as under ``python -m``.
    A module that fails to import is a one-line ConfigError naming it (``key[i]``)."""
    import importlib

    if not isinstance(names, list) or any(not isinstance(n, str) or not n.strip() for n in names):
        raise ConfigError(key, f"expected a list of module names, got {names!r}")
    cwd_importable()
    for i, name in enumerate(names):
        where = key if key.startswith("--") else f"{key}[{i}]"
        if name.endswith(".py") or os.sep in name:
            stem = os.path.splitext(os.path.basename(name))[0]
            raise ConfigError(where, f"{name!r} is a path; give a module name (e.g. {stem}) importable from the "
                                     "current directory or PYTHONPATH")
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 -- any failure of the user's module is a config error
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ConfigError(where, f"cannot import {name!r}: {type(exc).__name__}"
                                     f"{': ' + message if message else ''}{_user_frame(exc)}") from None


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def parse_config(raw: dict, command: str = "train", base_dir: str = ".", on_gpu: bool | None = None):
    """Build and validate the config of ``command`` (train | sft | rm) from a raw mapping.

    ``auto`` precision settings are then resolved for a GPU run when ``on_gpu`` (None: whether
    this machine has one), see ``fastrlhf.config.precision``.
    """
    cls = SCHEMAS[command]
    if raw is None:
        raise ConfigError("", "the config is empty")
    if not isinstance(raw, dict):
        raise ConfigError("", f"the config must be a mapping of keys, got {type(raw).__name__}")
    if command == "train" and isinstance(raw.get("algorithm"), str) and raw.get("algorithm") == "ppo":
        # An empty `critic:` section means "all defaults", which is how a PPO config says "use a value head".
        if "critic" in raw and raw["critic"] is None:
            raw = {**raw, "critic": {}}
    _check_command(raw, command)
    if "imports" in raw:  # before the config is built: what they register is looked up while checking it
        import_modules(raw["imports"], "imports")
    config = _build(cls, raw, "")
    folders = validate(config, base_dir) or {}
    from fastrlhf.config.precision import gpu_available, resolve_precision
    from fastrlhf.sequences.attention import resolve_attention

    on_gpu = gpu_available() if on_gpu is None else on_gpu
    _check_liger_kernels(config.model, on_gpu, folders)
    resolved = resolve_attention(resolve_precision(config, on_gpu), on_gpu)
    if config.model.attention == "auto":  # validated as auto: what packed rows drop is known only now
        for key, folder in folders.items():
            check_logit_terms(folder, config.trainer.packing, resolved.model.attention, key)
    return resolved


# Top-level keys of one command's config only: a config given to another command (`fastrlhf train --config sft.yaml`)
# is named as such, not reported as an unknown or a missing key.
_COMMAND_KEYS = {"algorithm": "train", "reward": "train", "rollout": "train", "kind": "rm", "num_labels": "rm"}


def _check_command(raw: dict, command: str) -> None:
    for key, owner in _COMMAND_KEYS.items():
        if key in raw and owner != command:
            raise ConfigError(key, f"is a key of `fastrlhf {owner}` configs: run this config with `fastrlhf {owner}`, "
                                   f"or remove {key} for `fastrlhf {command}`")
    data = raw.get("data")
    if command == "train" and "algorithm" not in raw and isinstance(data, dict) and "path" in data:
        raise ConfigError("algorithm", "missing required key, and data.path is the data of `fastrlhf sft` or `fastrlhf "
                                       "rm` (train reads data.prompts): run this config with one of those")


def _check_liger_kernels(model, on_gpu: bool, folders: dict | None = None) -> None:
    """``model.liger_kernels`` only where its Triton kernels can run, its package is installed, and it has kernels
    for the model type of each folder they patch (``folders``: model.path's config.json and those of the reference
    and critic, which load with ``model``'s settings; none: not read): at load, not in each rank's model loading,
    after the process group started (said once per rank)."""
    if not model.liger_kernels:
        return
    import importlib.util

    if not on_gpu:
        raise ConfigError("model.liger_kernels", "needs a CUDA device (Liger-Kernel's layers are GPU Triton "
                                                 "kernels); set false on a CPU")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("model.liger_kernels", "needs the liger-kernel package: pip install liger-kernel "
                                                 "(or set false)")
    from .model_checks import liger_apply_fn

    for key, folder in (folders or {}).items():
        model_type = folder.get("model_type")  # None: not read (fastrlhf plan), loading will say
        if model_type is not None:
            liger_apply_fn(model_type, key)


def load_config(path: str, command: str = "train", overrides: list[str] | None = None, on_gpu: bool | None = None,
                imports: list[str] | None = None):
    """Read a YAML run config, apply ``--set`` overrides, import ``imports`` (``--import``) and the config's
    own ``imports``, validate, resolve ``auto`` precision for a GPU run when ``on_gpu`` (None: this
    machine). The config's ``imports`` then lists both (``--import`` first), as the run's saved
    ``config.yaml`` does. Raises ConfigError (one line)."""
    if command not in SCHEMAS:
        raise ConfigError("", f"unknown command {command!r}; expected one of {', '.join(SCHEMAS)}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError("--config", f"cannot read {path}: not valid UTF-8 (line {line}, byte "
                                      f"0x{data[exc.start]:02x})") from None
    raw = _yaml_load(text, path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("", f"{path}: the config must be a mapping of keys, got {type(raw).__name__}")
    raw = apply_overrides(raw, list(overrides or []))
    if imports:
        import_modules(list(imports), "--import")
        listed = raw.get("imports") or []
        if isinstance(listed, list):
            raw["imports"] = [*imports, *(n for n in listed if n not in imports)]
    # Relative paths in a config mean "relative to the current directory", as on the command line.
    return parse_config(raw, command, base_dir=".", on_gpu=on_gpu)


def config_to_dict(config) -> dict:
    """Plain-data form of a config (for logging it next to the run's outputs)."""
    return dataclasses.asdict(config)
