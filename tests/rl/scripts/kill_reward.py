"""A reward function for the kill-and-resume tests: first completion token odd -> 1.0 (a signal a
random model has from step 1), and, once it has been called more than N times (a known point,
mid-step, after a checkpoint):

- ``FASTRLHF_TEST_KILL_AFTER_CALLS=N``: a SIGKILL of its own process;
- ``FASTRLHF_TEST_INTERRUPT_AFTER_CALLS=N``: a SIGINT of its own process (Ctrl-C), once;
- ``FASTRLHF_TEST_HANG_AFTER_CALLS=N``: it writes ``FASTRLHF_TEST_HANG_MARKER`` (a path) and then
  sleeps for good, a rank that stops answering with its sockets still open (the multi-node test
  then takes its node off the network and kills it, as a node that dies does);
- ``FASTRLHF_TEST_KILL_ONCE=path``: a SIGKILL at the first call once that file exists (a checkpoint's
  ``latest`` pointer: the step after that checkpoint, mid-step);
- ``FASTRLHF_TEST_NAN_CALLS=first-last``: NaN for the calls so numbered (a step the guard skips).
"""

import os
import signal
import time

_calls = 0


def reward(prompt_ids, completion_ids, meta):
    global _calls
    _calls += 1
    kill_after = int(os.environ.get("FASTRLHF_TEST_KILL_AFTER_CALLS", "0"))
    if kill_after and _calls > kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
    interrupt_after = int(os.environ.get("FASTRLHF_TEST_INTERRUPT_AFTER_CALLS", "0"))
    if interrupt_after and _calls == interrupt_after + 1:
        os.kill(os.getpid(), signal.SIGINT)
    hang_after = int(os.environ.get("FASTRLHF_TEST_HANG_AFTER_CALLS", "0"))
    if hang_after and _calls > hang_after:
        with open(os.environ["FASTRLHF_TEST_HANG_MARKER"], "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(60)
    marker = os.environ.get("FASTRLHF_TEST_KILL_ONCE")
    if marker and os.path.exists(marker):
        os.kill(os.getpid(), signal.SIGKILL)
    first, _, last = os.environ.get("FASTRLHF_TEST_NAN_CALLS", "").partition("-")
    if first and int(first) <= _calls <= int(last):
        return float("nan")
    return float(bool(completion_ids) and completion_ids[0] % 2 == 1)
