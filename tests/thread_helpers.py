"""Running a check on threads or in a child process: many threads at once
(all_right_from_threads), a forked child that may crash (run_in_forked_child), one
named thread (run_on_thread)."""
from __future__ import annotations


def all_right_from_threads(check, threads=4, calls=50):
    """True when check() is true on each of `calls` calls in each of `threads` threads
    running at once, all joined within 60 s (a native kernel's worker pool is used by
    one call at a time; the others start threads of their own)."""
    import threading

    wrong = []

    def work():
        for _ in range(calls):
            if not check():
                wrong.append(1)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=60)
    return not any(t.is_alive() for t in workers) and not wrong


def run_in_forked_child(target):
    """(exit code, what it put on the queue) of target(queue) run in a forked child,
    killed after 60 s (a child waiting on its parent's pool threads hangs until then)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=target, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
    return child.exitcode, queue.get(timeout=5) if child.exitcode == 0 else None


def run_on_thread(fn, name="worker", timeout=120):
    """fn() on a new thread called `name`; its result, or its exception raised here."""
    import threading

    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            out["error"] = e
    t = threading.Thread(target=run, name=name)
    t.start()
    t.join(timeout)
    if "error" in out:
        raise out["error"]
    return out.get("value")
