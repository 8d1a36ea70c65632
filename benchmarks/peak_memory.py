"""A training step's peak memory, for benchmarks/nets_cpu.py and nets_torch.py: the
peak resident memory over some steps above the RSS before them (VmHWM after resetting
it through /proc/self/clear_refs, less VmRSS; Linux), and minigraph's tracemalloc peak
over one step."""
from __future__ import annotations


def mg_memory(net, step, warmup, steps):
    import tracemalloc

    for _ in range(warmup):
        step()
    drop_temporaries(net)
    tracemalloc.start()
    step()
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    drop_temporaries(net)
    return {"peak_mb": rss_peak(step, steps), "tracemalloc_mb": traced / 2**20}


def drop_temporaries(net):
    """Drop what minigraph keeps between steps besides the model, optimizer state and
    feeds: the values of temporaries (the fetched loss, the parameters' gradients),
    so the step's peak counts them. The kernels keep no work arrays between calls."""
    for s in (net.scope, *net.scopes.values()):
        for v in s.vars.values():
            if not v.persistable and not v.is_data:
                v.value = None


def rss_peak(step, steps):
    """MiB: the peak resident memory over `steps` calls of step() above the RSS before."""
    import gc

    gc.collect()
    before = proc_status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for _ in range(steps):
        step()
    return (proc_status("VmHWM") - before) / 1024


def proc_status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])         # kB
    raise KeyError(key)
