"""What a piece of CPU code allocates, read from torch.profiler's allocation events (the plan's tests)."""


def allocated_peak(fn) -> int:
    """The most bytes allocated at once while ``fn`` runs, over what was allocated before: the running sum
    of the profiler's allocation (+) and free (-) events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak
