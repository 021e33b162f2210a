"""The suite's `alone` mark (tests/alone.py) on several processes: a marked test
waits for the tests running beside it, and none starts while it waits or runs.
Threads stand in for the workers (each holds its own open file, as a process
would)."""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace

import alone


def item(marked: bool, run: str):
    config = SimpleNamespace(workerinput={"testrunuid": run})
    return SimpleNamespace(config=config, get_closest_marker=lambda name: marked or None)


def test_an_alone_test_waits_for_the_others_and_holds_back_the_next():
    run, events = uuid.uuid4().hex, []
    in_first, release_first = threading.Event(), threading.Event()

    def first():
        with alone.turn(item(False, run)):
            events.append("first in")
            in_first.set()
            release_first.wait(5)
            events.append("first out")

    def marked():
        with alone.turn(item(True, run)):
            events.append("alone in")
            time.sleep(0.2)
            events.append("alone out")

    def later():
        with alone.turn(item(False, run)):
            events.append("later in")

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert in_first.wait(5)
    threads.append(threading.Thread(target=marked))
    threads[1].start()
    time.sleep(0.2)  # the alone test is waiting for the first, holding the gate
    threads.append(threading.Thread(target=later))
    threads[2].start()
    time.sleep(0.2)
    assert events == ["first in"]  # neither the alone test nor a new one started
    release_first.set()
    for t in threads:
        t.join(5)
    assert events == ["first in", "first out", "alone in", "alone out", "later in"]


def test_unmarked_tests_run_side_by_side():
    run, inside = uuid.uuid4().hex, threading.Barrier(2, timeout=5)

    def test():
        with alone.turn(item(False, run)):
            inside.wait()  # both inside at once, or the barrier breaks

    threads = [threading.Thread(target=test) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(6)
    assert not inside.broken
