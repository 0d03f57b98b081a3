"""Where the test suite's CPU time goes, test by test.

/usr/bin/time undercounts the suite: it sees only processes that were waited
for up to pytest, and the ranks of conftest.run_on_ranks are children of a
multiprocessing forkserver, which no one waits for. This pytest plugin
records, for each test (its setup, so a module fixture's first user, call and
teardown), the CPU seconds of the pytest process itself, of its waited-for
children (torchrun, `python train.py` ...) and of the forkserver with the
ranks it has reaped, one JSON line per test.

    PYTHONPATH=bench python -m pytest -q -n auto --dist loadfile -p suite_cpu   # -> SUITE_CPU (default /tmp/suite_cpu.jsonl, emptied first)
    python bench/suite_cpu.py /tmp/suite_cpu.jsonl                              # per file, then the slowest tests

A rank reaped after its test ended counts for the next test of that worker.
"""
import json
import os
import resource
import sys

import pytest

OUT = os.environ.get("SUITE_CPU", "/tmp/suite_cpu.jsonl")
_started = {}


def _forkserver_seconds() -> float:
    """utime + stime + cutime + cstime of this process's forkserver (0 if none)."""
    from multiprocessing import forkserver
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 3
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # fields 14-17


def _now() -> tuple[float, float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime, _forkserver_seconds()


def pytest_sessionstart(session):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the run's first process: a new file
        open(OUT, "w").close()


# Setup (where the test runs: an xdist worker, not the controller, which also
# sees each test's log hooks) to the end of its teardown.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _started[item.nodeid] = _now()


def pytest_runtest_logfinish(nodeid, location):
    before = _started.pop(nodeid, None)
    if before is None:  # xdist's controller, reporting a worker's test
        return
    after = _now()
    own, children, ranks = (b - a for a, b in zip(before, after))
    with open(OUT, "a") as f:
        f.write(json.dumps({"test": nodeid, "self": own, "children": children, "forkserver": ranks}) + "\n")


def summary(path: str, top: int = 25) -> None:
    rows = [json.loads(line) for line in open(path)]
    for r in rows:
        r["cpu"] = r["self"] + r["children"] + r["forkserver"]
    by_file = {}
    for r in rows:
        name = r["test"].split("::")[0]
        by_file[name] = by_file.get(name, 0.0) + r["cpu"]
    print(f"{len(rows)} tests, {sum(r['cpu'] for r in rows):,.0f} CPU-seconds")
    for name, seconds in sorted(by_file.items(), key=lambda kv: -kv[1]):
        print(f"{seconds:8.1f}  {name}")
    print(f"\nslowest {top}: CPU-seconds (pytest, its children, forkserver ranks)")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        print(f"{r['cpu']:8.1f}  ({r['self']:.0f}, {r['children']:.0f}, {r['forkserver']:.0f})  {r['test']}")


if __name__ == "__main__":
    summary(sys.argv[1] if len(sys.argv) > 1 else OUT)
