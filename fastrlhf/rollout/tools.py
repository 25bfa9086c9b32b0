"""Tools a policy may call during a rollout, as TRL's ``GRPOTrainer`` takes them, and their calls.

* ``rollout.tools: [module:function, ...]``: plain Python functions (``def`` or ``async def``) with type hints
  and a Google-style docstring; their JSON schemas (``transformers.utils.get_json_schema``) go to the chat template's
  ``tools=``, so the prompt lists them as the model's own template lists tools.
* ``rollout.environment: module:Class``: TRL's ``environment_factory`` contract. One instance per
  episode; ``reset(**row)`` (the prompt row's columns) returns ``None`` or a string that is appended to
  the last user message; every public method other than ``reset`` and ``get_reward`` is a tool (bound
  to that episode's instance); the optional ``get_reward()`` scores the finished episode, logged as
  ``reward/<ClassName>``.

Calls are parsed from an assistant turn's text by a registered parser (:data:`TOOL_CALL_PARSERS`;
``hermes``: Qwen2.5/Qwen3's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) and run by
:func:`run_tool_call`, which never raises: a tool that raises, a malformed call (bad JSON, an unknown
tool, wrong arguments), a tool that runs past ``rollout.tool_timeout_s`` and a result that is not a
string each become the ``tool`` message's text, saying what went wrong, and an outcome the metrics count.
Each call runs on a thread of its own, and the episodes of a round make their calls at the same time (each
episode's in order): a tool function shared by every episode must be thread-safe.

A call that times out is interrupted where it runs Python code: :class:`ToolTimeout` is raised in its thread (a busy
loop, model-written code run by an ``exec`` tool, ends there instead of taking a share of the interpreter from the
training loop for the rest of the run). One inside a C call (a sleep, a socket, a regex) keeps running until that
returns; one that holds the interpreter lock all along (a catastrophic regex, a huge integer power) stalls the whole
rank past its timeout, which no thread can prevent: run such tools in a process of their own. While a call runs on,
its episode's environment is not called again (the next call would run alongside it on the same instance), and
once :data:`MAX_STUCK_CALLS` such calls are running no call is started at all, until some return: each refused
call's message says why (outcome :data:`REFUSED`), so a tool that hangs for good costs a bounded number of threads,
not one per call.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import re
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from fastrlhf.engine.guards import AgreedStepFailure

__all__ = ["MAX_STUCK_CALLS", "TOOL_CALL_PARSERS", "EnvironmentResetError", "Tool", "ToolCall", "Toolbox",
           "call_with_timeout", "environment_timeout", "load_toolbox", "on_callers_device", "parse_hermes",
           "register_tool_call_parser", "run_tool_call", "run_toolbox", "stuck_calls", "ToolTimeout"]


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from an assistant turn: ``name`` and ``arguments`` as the model wrote them, or
    ``error`` (the call could not be read: its text is in ``raw``). ``text``: the call as the turn's text has it,
    its tags included (the hermes block), which the assistant message's ``content`` leaves out where its
    ``tool_calls`` holds the call (a parser that does not set it: its ``raw`` is looked for instead)."""

    name: str | None
    arguments: dict | None
    raw: str = ""
    error: str | None = None
    text: str = ""

    def as_message_call(self) -> dict:
        """The call in a chat message's ``tool_calls`` (OpenAI / transformers form)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments or {}}}


ToolCallParser = Callable[[str], list[ToolCall]]
TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {}


def register_tool_call_parser(name: str):
    """Decorator: make ``fn(text) -> list[ToolCall]`` available as ``rollout.tool_parser: <name>``."""

    def decorator(fn: ToolCallParser) -> ToolCallParser:
        if name in TOOL_CALL_PARSERS and TOOL_CALL_PARSERS[name] is not fn:
            raise ValueError(f"a tool-call parser named {name!r} is already registered")
        TOOL_CALL_PARSERS[name] = fn
        return fn

    return decorator


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@register_tool_call_parser("hermes")
def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block of ``text`` (Qwen2.5/Qwen3's
    format; an unclosed last block is read too: a turn cut by its token budget still asked for a tool)."""
    calls = []
    for match in _HERMES.finditer(text):
        raw, text = match.group(1).strip(), match.group(0)
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            calls.append(ToolCall(None, None, raw, f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(None, None, raw, 'the tool call must be a JSON object {"name": ..., "arguments": '
                                                   '{...}}'))
            continue
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):  # some templates write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(obj["name"], None, raw, f"the arguments of {obj['name']!r} must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], arguments, raw, text=text))
    return calls


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    schema: dict


def _import(spec: str, key: str):
    """``package.module:attribute`` -> the attribute; a one-line ValueError naming ``key`` otherwise."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{key}: expected 'module:name', got {spec!r}")
    from fastrlhf.config.loading import cwd_importable

    module_name, attr = spec.split(":")
    cwd_importable()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 -- an import that fails in any way is a config error
        raise ValueError(f"{key}: cannot import module {module_name!r} for {spec!r} "
                         f"({type(exc).__name__}: {exc})") from None
    if not hasattr(module, attr):
        raise ValueError(f"{key}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def _tool(name: str, fn: Callable, key: str) -> Tool:
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # noqa: BLE001 -- transformers raises its own TypeErrors for each gap
        raise ValueError(f"{key}: tool {name!r} needs type hints and a Google-style docstring "
                         f"(Args: one line per argument) for its schema: {' '.join(str(exc).split())}") from None
    return Tool(name, fn, schema)


ENVIRONMENT_METHODS = ("reset", "get_reward")


def environment_tool_names(cls: type) -> list[str]:
    """The tools of a TRL environment class: its public methods other than ``reset`` and ``get_reward``."""
    return [name for name, member in inspect.getmembers(cls, callable)
            if not name.startswith("_") and name not in ENVIRONMENT_METHODS and not isinstance(member, type)]


@dataclass
class Toolbox:
    """The run's tools: plain functions (``rollout.tools``) and/or an environment class
    (``rollout.environment``), their schemas, and how calls are parsed and timed out."""

    functions: list[Tool] = field(default_factory=list)
    environment: type | None = None
    parser: str = "hermes"
    timeout_s: float = 5.0
    environment_schemas: list[dict] = field(default_factory=list)

    @property
    def schemas(self) -> list[dict]:
        """What the chat template's ``tools=`` receives."""
        return [t.schema for t in self.functions] + self.environment_schemas

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.functions] + [s["function"]["name"] for s in self.environment_schemas]

    def parse(self, text: str) -> list[ToolCall]:
        return TOOL_CALL_PARSERS[self.parser](text)

    def new_environment(self, row: dict | None = None, where: str = ""):
        """``(instance, text reset returned)`` for one episode (``(None, None)`` without an environment), made and
        reset with ``row`` under ``timeout_s``: a reset that hangs (a sandbox that never comes up) hung the rollout,
        and every other rank in its next collective. An EnvironmentResetError (one line, naming the class, the
        timeout and ``where``) for one that hangs or raises."""
        if self.environment is None:
            return None, None
        stage = ["making an instance"]

        def start():
            instance = self.environment()
            stage[0] = "reset()"
            return instance, instance.reset(**dict(row or {}))

        _MADE_UNDER[self.environment] = self.timeout_s
        result, exc, timed_out = call_with_timeout(start, {}, self.timeout_s, f"{self.environment.__name__}.reset")
        name = self.environment.__name__
        if timed_out:
            raise EnvironmentResetError(f"rollout.environment: {name} {stage[0]} did not return within "
                                        f"{self.timeout_s:g} s (rollout.tool_timeout_s){where}")
        if exc is not None:
            detail = " ".join(str(exc).split())
            raise EnvironmentResetError(f"rollout.environment: {name} {stage[0]} raised {type(exc).__name__}"
                                        f"{f': {detail}' if detail else ''}{where}") from exc
        return result

    def bound(self, environment) -> dict[str, Callable]:
        """Name -> callable for one episode: the functions, and the methods of its environment instance."""
        tools = {t.name: t.fn for t in self.functions}
        if environment is not None:
            tools.update({s["function"]["name"]: getattr(environment, s["function"]["name"])
                          for s in self.environment_schemas})
        return tools


def load_toolbox(tools=(), environment: str | None = None, parser: str = "hermes", timeout_s: float = 5.0,
                 key: str = "rollout.tools") -> Toolbox:
    """Import ``rollout.tools`` and ``rollout.environment`` and read their schemas; a one-line ValueError
    (``<key>: ...``; ``key`` names the functions' setting, ``data.tools`` for SFT) for one that does not import
    or has no schema. Imports no model."""
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"rollout.tool_parser: unknown parser {parser!r}; registered: "
                         f"{', '.join(sorted(TOOL_CALL_PARSERS))}")
    functions = []
    for spec in tools:
        fn = _import(spec, key)
        if not callable(fn) or isinstance(fn, type):
            raise ValueError(f"{key}: {spec!r} is not a function")
        functions.append(_tool(spec.split(":")[1], fn, key))
    env_cls, env_schemas = None, []
    if environment is not None:
        env_cls = _import(environment, "rollout.environment")
        if not isinstance(env_cls, type):
            raise ValueError(f"rollout.environment: {environment!r} is not a class")
        names = environment_tool_names(env_cls)
        if not names:
            raise ValueError(f"rollout.environment: {environment!r} has no public method to call as a tool")
        env_schemas = [_tool(name, getattr(env_cls, name), "rollout.environment").schema for name in names]
    toolbox = Toolbox(functions, env_cls, parser, float(timeout_s), env_schemas)
    seen = set()
    for name in toolbox.names:
        if name in seen:
            raise ValueError(f"{key}: two tools are named {name!r}")
        seen.add(name)
    return toolbox


def run_toolbox(config) -> Toolbox | None:
    """A run config's ``rollout.tools`` / ``rollout.environment`` imported and their schemas read, or None for
    single-turn rollouts; a ConfigError (one line) for one that does not import. Loads no model: the CLI calls it
    as it reads the config (``--dry-run`` too), before anything heavy."""
    from fastrlhf.config import ConfigError

    ro = config.rollout
    if not ro.tools and ro.environment is None:
        return None
    try:
        return load_toolbox(ro.tools, ro.environment, ro.tool_parser, ro.tool_timeout_s)
    except ValueError as exc:
        raise ConfigError("", str(exc)) from None


class EnvironmentResetError(AgreedStepFailure):
    """An episode's environment could not be made or reset: the rollout cannot go on without its prompt.

    One line (``summary``). A step that fails on any rank fails on every rank alike
    (``EpisodeRunner.start_on_every_rank``): the last good step is kept and ``--resume`` retries this one
    (``exit_code`` 1), as for a reward function that raised (:class:`fastrlhf.rl.rewards.RewardFunctionError`);
    ``exit_code`` 2: the run's data cannot work with the environment as written. ``local``: it failed on this rank.
    """

    said_as = "environment error"


# Outcomes of a call, as the metrics count them (a refused call: as a timeout).
OK, ERROR, TIMEOUT, REFUSED = "ok", "error", "timeout", "refused"

# Calls that ran past their timeout may go on running at most this many at once (plus the calls of one round): a
# tool that hangs for good left one thread behind per call, thousands over a run.
MAX_STUCK_CALLS = 64
_stuck_lock = threading.Lock()
_stuck: list[tuple[threading.Thread, str, int | None]] = []  # (thread, what it calls, id of its environment)
_MADE_UNDER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # environment class -> its tools' timeout


def stuck_calls() -> list[tuple[str, int | None]]:
    """``(name, id of its environment or None)`` of each call that ran past its timeout and is still running."""
    with _stuck_lock:
        _stuck[:] = [s for s in _stuck if s[0].is_alive()]
        return [(name, owner) for _, name, owner in _stuck]


def environment_timeout(environment) -> float | None:
    """The timeout (``rollout.tool_timeout_s``) of the toolbox that made ``environment``: its ``get_reward()``
    runs under it. None for an instance no toolbox made."""
    return _MADE_UNDER.get(type(environment))


def on_callers_device() -> Callable[[], None]:
    """A function that puts the thread it runs on onto the caller's CUDA device, where CUDA is in use: a new thread
    starts on device 0 (CUDA's current device is per thread), so a tool computing on "cuda" put every rank's
    tensors on the first GPU."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return lambda: None
    device = torch.cuda.current_device()
    return lambda: torch.cuda.set_device(device)


def call_with_timeout(fn: Callable, arguments: dict, timeout_s: float, name: str = "", owner=None):
    """``(result, exception, timed_out)``. The call runs in a daemon thread, on the caller's CUDA device. One past
    ``timeout_s`` gets :class:`ToolTimeout` raised in it; one still running after that (inside a C call) is left
    behind, never keeps the process from exiting, and is counted in :func:`stuck_calls` (as ``name``, with
    ``owner``: the environment it calls into) until it returns."""
    box: dict = {}
    on_device = on_callers_device()

    def target():
        try:
            on_device()
            result = fn(**arguments)
            # An ``async def`` tool (TRL takes those too) runs to its end on this thread's own event loop.
            box["result"] = asyncio.run(_awaited(result)) if inspect.isawaitable(result) else result
        except BaseException as exc:  # noqa: BLE001 -- whatever a tool raises becomes its message
            box["error"] = exc

    thread = threading.Thread(target=target, name="fastrlhf-tool", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not thread.is_alive():
        return box.get("result"), box.get("error"), False
    if _interrupt(thread):
        thread.join(_INTERRUPT_GRACE_S)  # where it runs Python, it ends within a few switch intervals
    if thread.is_alive():
        with _stuck_lock:
            _stuck.append((thread, name, None if owner is None else id(owner)))
    return None, None, True


class ToolTimeout(BaseException):  # noqa: N818 -- not an Exception: a tool's own ``except Exception`` lets it through
    """Raised in a tool's thread once its call has run past ``rollout.tool_timeout_s``."""


_INTERRUPT_GRACE_S = 0.05


def _interrupt(thread: threading.Thread) -> bool:
    """Raise :class:`ToolTimeout` in ``thread`` at its next Python bytecode; whether it was still there to take it."""
    import ctypes

    set_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    hit = set_exc(ctypes.c_ulong(thread.ident), ctypes.py_object(ToolTimeout))
    if hit > 1:  # cannot happen for one live thread's id; undone as CPython's documentation asks
        set_exc(ctypes.c_ulong(thread.ident), None)
    return hit == 1


async def _awaited(awaitable):
    return await awaitable


def _refused(name: str, environment, timeout_s: float) -> str | None:
    """Why a call is not started (see the module docstring), or None. ``environment``: the episode's instance where
    the tool is one of its methods."""
    stuck = stuck_calls()
    mine = [n for n, owner in stuck if environment is not None and owner == id(environment)]
    if mine:
        return (f"Error: {name} was not called: {mine[0]} on this episode's environment ran past {timeout_s:g} s "
                f"and has not returned")
    if len(stuck) >= MAX_STUCK_CALLS:
        return (f"Error: {name} was not called: {len(stuck)} tool calls ran past {timeout_s:g} s "
                f"(rollout.tool_timeout_s) and have not returned")
    return None


def run_tool_call(call: ToolCall, tools: dict[str, Callable], timeout_s: float, environment=None
                  ) -> tuple[str, str]:
    """``(tool message text, outcome)`` of one call; never raises (see the module docstring). ``environment``: the
    episode's instance, whose methods are not called while one of its calls is stuck."""
    if call.error is not None:
        return f"Error: {call.error}", ERROR
    fn = tools.get(call.name)
    if fn is None:
        known = ", ".join(sorted(tools)) or "none"
        return f"Error: unknown tool {call.name!r} (tools: {known})", ERROR
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as exc:
        return f"Error: wrong arguments for {call.name}: {exc}", ERROR
    except ValueError:  # a callable whose signature cannot be read: let the call itself say
        pass
    owner = environment if environment is not None and getattr(fn, "__self__", None) is environment else None
    refused = _refused(call.name, owner, timeout_s)
    if refused is not None:
        return refused, REFUSED
    result, exc, timed_out = call_with_timeout(fn, call.arguments, timeout_s, call.name, owner)
    if timed_out:
        return f"Error: {call.name} did not return within {timeout_s:g} s", TIMEOUT
    if exc is not None:
        detail = " ".join(str(exc).split())
        return f"Error: {call.name} raised {type(exc).__name__}" + (f": {detail}" if detail else ""), ERROR
    if not isinstance(result, str):
        return (f"Error: {call.name} returned {type(result).__name__}, expected str: "
                f"{_shown(result)}"), ERROR
    return result, OK


def _shown(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
