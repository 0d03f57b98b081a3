"""The test harness's own promise: no launch waits forever. A command or a
group of ranks that hangs fails its test after the bound, with the stack of
every process it started, and leaves none of them running. A rank that a
signal kills (a segfault) fails its test with that rank's stack."""
import os
import sys
import time

import pytest

from conftest import ROOT, run_bounded, run_on_ranks, torchrun

# A worker that starts a grandchild in a session of its own (as torchrun
# starts its workers), then both wait forever.
HANG = """
import subprocess, sys, time
grandchild = subprocess.Popen(
    [sys.executable, "-c", "import time\\ndef grandchild_waits():\\n    time.sleep(1000)\\ngrandchild_waits()"],
    start_new_session=True)
print("grandchild pid:", grandchild.pid, flush=True)
def child_waits():
    time.sleep(1000)
child_waits()
"""


def test_a_hung_command_fails_with_every_process_stack_and_leaves_none_running():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="still running after 4 s") as failure:
        run_bounded([sys.executable, "-c", HANG], 4)
    assert time.monotonic() - start < 30
    message = str(failure.value)
    assert "in child_waits" in message and "in grandchild_waits" in message
    grandchild = int(message.split("--- stdout ---")[1].split(":")[1].split()[0])
    assert _gone(grandchild)


def _gone(pid, seconds=5):
    """pid has exited (a zombie not yet reaped counts), within a few seconds of its SIGKILL."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def _rank_one_waits_forever():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        time.sleep(1000)
    dist.barrier()  # rank 0 waits here for rank 1


def test_hung_ranks_fail_with_each_ranks_stack():
    with pytest.raises(AssertionError, match="still running on its ranks after 5 s") as failure:
        run_on_ranks(_rank_one_waits_forever, timeout=5)
    message = str(failure.value)
    assert "--- rank 0's stacks ---" in message and "--- rank 1's stacks ---" in message
    assert message.count("_rank_one_waits_forever") >= 2  # each rank's stack names where it waits


def _rank_one_fails():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("rank 1's own mistake")
    dist.barrier()  # rank 0 would fail here, a victim of rank 1


def test_a_failed_rank_is_reported_by_its_own_error():
    """The report leads with the rank that failed first, not with whichever
    rank torch looked at first (often a peer failing in a collective)."""
    with pytest.raises(AssertionError, match="_rank_one_fails failed on its ranks") as failure:
        run_on_ranks(_rank_one_fails)
    message = str(failure.value)
    assert "--- rank 1's error, 0.0 s after the first ---" in message
    assert "ValueError: rank 1's own mistake" in message


# Rank 1 dies of a signal; rank 0, stopped by torchrun, then prints far more
# than a failure message keeps of the tail, as real victims' tracebacks do.
SEGFAULT = """
import os, signal, sys, time
def rank_one_dies_of_a_segfault():
    os.kill(os.getpid(), signal.SIGSEGV)
def victim(*_):
    sys.stderr.write("RuntimeError: Connection closed by peer\\n" * 500)
    sys.exit(1)
signal.signal(signal.SIGTERM, victim)
if os.environ["RANK"] == "1":
    time.sleep(1)  # rank 0 is up, its handler in place
    rank_one_dies_of_a_segfault()
time.sleep(60)
"""


def test_a_rank_killed_by_a_signal_fails_with_its_stack_whatever_the_others_print(tmp_path):
    script = tmp_path / "segfault.py"
    script.write_text(SEGFAULT)
    with pytest.raises(AssertionError, match="the first fatal error") as failure:
        torchrun(str(script), nproc=2, timeout=60)
    message = str(failure.value)
    assert "Segmentation fault" in message and "in rank_one_dies_of_a_segfault" in message
    assert message.count("Connection closed by peer") > 100  # the tail is still shown


# A quick test of 1 s, another test, and a 1 s fixture they share; the other test comes first.
TIER = """
import time
import pytest

@pytest.fixture(scope="module")
def built():
    time.sleep(1)  # a fixture's cost is charged to the first test that uses it

def test_slow_first_in_the_file(built):
    pass

@pytest.mark.quick
def test_quick(built):
    time.sleep(1)
"""


def test_the_quick_tier_cannot_grow_past_its_budget_unnoticed(tmp_path):
    """A full run (CI's) fails where the quick tests' own time, shared by 2
    workers, passes QUICK_BUDGET_S, and says so; a quick test runs first in
    its file, so a fixture it shares is charged to it (as in the tier's own
    run); a run of the tier alone reports its wall time against the budget."""
    (tmp_path / "test_tier.py").write_text(TIER)
    run = lambda budget, *args: run_bounded(  # this conftest as a plugin (-p), on a suite of one file
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", *args, str(tmp_path)],
        60, cwd=tmp_path, env={**os.environ, "QUICK_BUDGET_S": str(budget), "PYTEST_ADDOPTS": "",
                               "PYTHONPATH": os.path.join(ROOT, "tests")})
    over = run(0.8)  # 2 s of quick test time / 2 workers > 0.8 s; without the fixture's 1 s it would pass
    assert over.returncode == 1 and "quick tier: 1 tests" in over.stdout and "over budget, FAILED" in over.stdout
    tier = run(0.8, "-m", "quick")
    assert tier.returncode == 0 and "s wall (budget 0.8 s on 2 cores)" in tier.stdout, tier.stdout
