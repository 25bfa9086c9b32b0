"""A reward for the resume audit's runs: first completion token odd -> 1.0; NaN for the calls numbered in
``FASTRLHF_TEST_NAN_CALLS`` (``first-last``, a skipped step); a SIGKILL of its own process once called more than
``FASTRLHF_TEST_KILL_AFTER_CALLS`` times, or at the first call once the file ``FASTRLHF_TEST_KILL_ONCE`` exists
(a checkpoint's ``latest`` pointer: the step after that checkpoint, mid-step)."""

import os
import signal

_calls = 0


def reward(prompt_ids, completion_ids, meta):
    global _calls
    _calls += 1
    kill_after = int(os.environ.get("FASTRLHF_TEST_KILL_AFTER_CALLS", "0"))
    if kill_after and _calls > kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
    marker = os.environ.get("FASTRLHF_TEST_KILL_ONCE")
    if marker and os.path.exists(marker):
        os.kill(os.getpid(), signal.SIGKILL)
    first, _, last = os.environ.get("FASTRLHF_TEST_NAN_CALLS", "").partition("-")
    if first and int(first) <= _calls <= int(last):
        return float("nan")
    return float(bool(completion_ids) and completion_ids[0] % 2 == 1)
