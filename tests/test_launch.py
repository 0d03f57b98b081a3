"""launch.py, and the shape it keeps: every module may import it because it
imports none of them, and the project's imports run one way. Then launch.py at
work under torchrun: restarts, timeouts, and two agents meeting as two nodes."""
import ast
import datetime
import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import (ROOT, TINY, free_port, losses, read_metrics, run_bounded, run_on_ranks, run_together,
                      train_on_ranks)

MODULES = sorted(os.path.basename(f)[:-3] for f in glob.glob(os.path.join(ROOT, "*.py")))


def project_imports(module: str) -> set[str]:
    """The project modules `module` imports anywhere in its source (top level,
    inside functions, or under TYPE_CHECKING: a circle is a circle)."""
    tree = ast.parse(open(os.path.join(ROOT, module + ".py")).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & set(MODULES) - {module}


@pytest.mark.quick
def test_the_import_graph_has_no_circle():
    graph = {m: project_imports(m) for m in MODULES}
    order = []
    while graph:
        leaves = sorted(m for m, deps in graph.items() if not deps - set(order))
        assert leaves, f"a circle among {sorted(graph)}: {graph}"
        order += leaves
        graph = {m: deps for m, deps in graph.items() if m not in leaves}
    assert order[0] == "launch" and project_imports("launch") == set()
    assert project_imports("fused_kernels") == {"launch"}  # leaf maths: the kernels take no layout


@pytest.mark.quick
def test_no_module_uses_another_modules_private_names():
    """Modules meet through public names only (`fused_kernels.flash_attention_op`,
    not `fused_kernels._attn_forward`): a private name may change with its own
    module. context.py's ring called the kernels' private launchers (issue 70)."""
    reached = []
    for module in MODULES:
        tree, ours = ast.parse(open(os.path.join(ROOT, module + ".py")).read()), project_imports(module)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ours:
                names = [node.attr]
            elif isinstance(node, ast.ImportFrom) and node.module in ours:
                names = [alias.name for alias in node.names]
            else:
                continue
            reached += [f"{module}.py:{node.lineno} {name}" for name in names
                        if name.startswith("_") and not name.startswith("__")]
    assert not reached, reached


def reached_from(module: str) -> set[str]:
    """Every project module that `module`'s imports reach, itself included."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += project_imports(m)
    return seen


@pytest.mark.quick
def test_the_operational_module_and_the_evaluation_reach_nothing_of_train_py():
    """train_ops.py (the command line, logging, preemption) is train.py's helper,
    never its importer (train.main hands it train.train), and eval_tasks.py starts
    its processes from train_ops, so evaluating loads no training loop."""
    assert "train" not in reached_from("eval_tasks")
    assert "train" not in reached_from("train_ops") and "train_ops" in project_imports("train")


def calls_in(module: str) -> list[ast.Call]:
    tree = ast.parse(open(os.path.join(ROOT, module + ".py")).read())
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


@pytest.mark.quick
def test_rank_0_prints_in_one_form():
    """A note to the user is launch.say's (rank 0, once): no module of the
    training or evaluation prints for itself. launch.py holds say and the
    one-line errors; prepare.py is one process and prints its progress."""
    printing = {m for m in set(MODULES) - {"launch", "prepare"}
                if any(isinstance(c.func, ast.Name) and c.func.id == "print" for c in calls_in(m))}
    assert not printing, f"these modules print for themselves; use launch.say: {sorted(printing)}"


@pytest.mark.quick
def test_cps_loss_weight_is_made_in_one_place_and_applied_in_one():
    """context.split_batch gives each micro-batch its loss_weight and gpt.weighted_loss
    applies it; the step, the validation and the pipeline's last stage call that."""
    naming = {m for m in MODULES if any(isinstance(n, ast.Constant) and n.value == "loss_weight"
                                        for n in ast.walk(ast.parse(open(os.path.join(ROOT, m + ".py")).read())))}
    assert naming == {"context", "gpt"}


# Import names of packages installed beside a trainer, whether or not this
# machine has them: a module of ours with one of these names would be found
# first by any process whose sys.path starts at the project root (issue 68:
# kernels.py hid Hugging Face's `kernels`, which transformers 5.25 imports).
BESIDE_A_TRAINER = {"kernels", "evaluate", "datasets", "accelerate", "peft", "lm_eval", "triton_kernels",
                    "flash_attn", "liger_kernel", "transformer_engine", "apex"}


@pytest.mark.quick
def test_no_module_of_ours_shadows_an_installed_package():
    """A top-level module named as a package users install (any distribution on
    this machine, or one in BESIDE_A_TRAINER) hides that package from
    `python -c`, notebooks and pytest run at the root, and from any process
    that imported ours first. docs/tests.md says why the names are what they are."""
    import importlib.metadata
    import sysconfig
    installed = set(importlib.metadata.packages_distributions())
    stdlib = {os.path.splitext(f)[0] for f in os.listdir(sysconfig.get_paths()["stdlib"])}
    ours = set(MODULES) | {"tests", "bench", "docs"}
    clashes = {m: "installed" if m in installed else "the standard library" if m in stdlib else "beside a trainer"
               for m in ours & (installed | stdlib | BESIDE_A_TRAINER)}
    assert not clashes, f"rename these top-level modules, whose names other packages use: {clashes}"


def modules_loaded_by(imports: str, then: str = "") -> set[str]:
    """Every module a fresh interpreter holds after `import IMPORTS` and THEN."""
    code = f"import sys, {imports}\n{then}\nprint(' '.join(sys.modules))"
    return set(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.split())


@pytest.mark.quick
def test_a_rank_other_than_0_prints_a_mistake_only_if_rank_0_saw_none(monkeypatch, capsys):
    """report_usage_error on rank 1: where rank 0 has reported (its key in the
    store), or has already exited and taken the store with it (the wait fails at
    once: under load rank 1 can reach the wait after rank 0 and its launcher have
    gone), rank 1 exits 2 in silence; only a wait that runs its 10 s out (rank 0
    saw nothing wrong) makes it print its own mistake, naming its rank."""
    import torch.distributed as dist

    import launch

    class Store:
        def __init__(self, outcome):
            self.outcome = outcome

        def wait(self, keys, timeout):  # rank 0's key is there; or the store is gone; or 10 s pass
            if self.outcome != "reported":
                raise RuntimeError("Connection reset by peer" if self.outcome == "gone" else "Socket Timeout")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(launch, "global_rank", lambda: 1)
    for outcome, waited, printed in (("reported", 0, ""), ("gone", 0.5, ""),
                                     ("silent", 10, "train.py: error (rank 1): bad flag\n")):
        ticks = iter((100, 100 + waited))  # time.monotonic before and after the wait
        monkeypatch.setattr(launch.time, "monotonic", lambda: next(ticks))
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: Store(outcome))
        with pytest.raises(SystemExit) as stop:
            launch.report_usage_error(launch.UsageError("bad flag"), "train.py")
        assert stop.value.code == 2 and capsys.readouterr().err == printed, outcome


@pytest.mark.quick
def test_preparing_data_loads_no_model_code():
    loaded = modules_loaded_by("prepare")
    assert not {"gpt", "fused_kernels", "fused_loss", "parallel", "pipeline", "checkpoint", "config", "train", "zero"} & loaded


# a plain checkpoint's file, with np.random's state (numpy's types), read as every load reads it
READ_A_PLAIN_CHECKPOINT = """
import os, tempfile, numpy, torch
where = tempfile.mkdtemp()
torch.save({"rng": {"numpy": numpy.random.get_state()}}, os.path.join(where, checkpoint.PLAIN_FILE))
with checkpoint.data_only_loads(where):
    torch.load(os.path.join(where, checkpoint.PLAIN_FILE))
"""


@pytest.mark.quick
def test_only_torch_dist_imports_pytorchs_distributed_checkpoint():
    """torch.distributed.checkpoint (DTensor's tables with it: about a second of
    every rank's start) is imported by the torch_dist functions when they run,
    not by train.py or eval_tasks.py; nor is DeepSpeed (its import, and on a CPU
    its warning line) by a plain checkpoint's load: only DeepSpeed's files hold its types."""
    loaded = modules_loaded_by("train, eval_tasks, checkpoint", then=READ_A_PLAIN_CHECKPOINT)
    assert "checkpoint" in loaded and "torch.distributed.checkpoint" not in loaded
    assert "deepspeed" not in loaded


# ----------------------------------------------------------------------------
# The default process group from torchrun's variables (init_distributed)

SLOW_JOIN = 1.0  # seconds rank 1 stays inside each two-rank gloo group it makes


def _groups_made_beside_a_slow_peer(port):
    """Start over from torchrun's variables, as train.py does, and let rank 1
    stay SLOW_JOIN s longer inside each two-rank gloo group's construction,
    after its sockets are connected. Rank 0 must not leave parallel.initialize
    before then: a rank that went on to destroy the group, or to exit, would
    close the socket under its peer ("Connection closed by peer"). Nor the
    making of --async-save's gloo group, on an NCCL run (no barrier switch)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import checkpoint
    import launch
    import parallel
    torch.cuda.is_available = lambda: False  # gloo, as on the CPU machines this runs on
    rank = dist.get_rank()
    dist.destroy_process_group()
    del os.environ["TORCH_DIST_INIT_BARRIER"]  # run_on_ranks' own: init_distributed must set it
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    launch.init_distributed()
    if rank == 1:
        class SlowToJoin(c10d.ProcessGroupGloo):
            def __init__(self, store, group_rank, size, *args, **kwargs):
                super().__init__(store, group_rank, size, *args, **kwargs)
                if size == 2:
                    time.sleep(SLOW_JOIN)
        c10d.ProcessGroupGloo = SlowToJoin
    start = time.monotonic()
    parallel.initialize(1)  # at T=1 on 2 ranks the data-parallel group is the one of two ranks
    waited = time.monotonic() - start
    assert rank == 1 or waited >= SLOW_JOIN, f"rank 0 left after {waited:.2f} s, while rank 1 was still joining"
    del os.environ["TORCH_DIST_INIT_BARRIER"]  # as init_distributed leaves it for NCCL
    start = time.monotonic()
    checkpoint.AsyncSave(datetime.timedelta(seconds=60), torch.optim.SGD([torch.zeros(1, requires_grad=True)]))
    waited = time.monotonic() - start
    assert rank == 1 or waited >= SLOW_JOIN, f"rank 0 left AsyncSave after {waited:.2f} s"


def test_no_rank_leaves_a_gloo_group_before_its_peers_have_joined():
    run_on_ranks(_groups_made_beside_a_slow_peer, free_port())


WAITS_FOR_A_PEER_THAT_NEVER_COMES = """
import datetime, sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
import launch
launch.sigterm_exits("stopped by SIGTERM")
store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(minutes=10))
print("waiting", flush=True)
store.get("a key no peer ever sets")  # inside C++, for up to 10 minutes
"""


def test_sigterm_ends_a_process_waiting_inside_c_at_once():
    """Python runs a signal handler only between two bytecodes of the main
    thread, so a process waiting inside C++ (a store, a collective) for a
    peer that never comes would not run one until its wait ends. Under
    launch.sigterm_exits (train.py before its loop) SIGTERM ends it within
    seconds, with its one line and status 143."""
    proc = subprocess.Popen([sys.executable, "-c", WAITS_FOR_A_PEER_THAT_NEVER_COMES.format(root=ROOT)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "waiting\n"
        time.sleep(0.5)  # inside store.get
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 143 and err.strip().splitlines() == ["stopped by SIGTERM"], err

# ----------------------------------------------------------------------------
# Restarts and timeouts: torchrun's elastic agent, --distributed-timeout-minutes


# The restart tests' run: 8 steps of global batch 8 on 2 processes.
RESTART_RUN = [*TINY, "--train-iters", "8", "--global-batch-size", "8", "--eval-interval", "0"]


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    """engine flags -> the losses of an uninterrupted 2-process run of the
    restart tests' 8 steps (RESTART_RUN), each engine's run once for them
    (on run_on_ranks' ranks: the launch under test is the restarted one)."""
    runs = {}

    def losses_of(engine):
        if tuple(engine) not in runs:
            metrics = tmp_path_factory.mktemp("uninterrupted") / "full.jsonl"
            train_on_ranks([*RESTART_RUN, "--data-path", corpus, *engine, "--metrics-file", str(metrics)], nproc=2)
            runs[tuple(engine)] = losses(metrics)
        return runs[tuple(engine)]
    return losses_of


KILL_RANK_1_AFTER_SAVE = """
import os, signal, sys
sys.path.insert(0, {root!r})
import checkpoint, train
real_save = checkpoint.save_checkpoint

real_ds_save = checkpoint.save_deepspeed_checkpoint

def die_after(iteration):
    marker = {marker!r}
    if iteration == {iteration} and os.environ["RANK"] == "1" and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # a dead node: no handler runs

def save_then_die(cfg, model, optimizer, scaler, iteration, consumed, log, *saver):
    real_save(cfg, model, optimizer, scaler, iteration, consumed, log, *saver)
    die_after(iteration)

def ds_save_then_die(cfg, engine, iteration, consumed, log):
    real_ds_save(cfg, engine, iteration, consumed, log)
    die_after(iteration)

checkpoint.save_checkpoint = save_then_die
checkpoint.save_deepspeed_checkpoint = ds_save_then_die
train.main(sys.argv[1:])
"""


@pytest.mark.parametrize("engine", [[], ["--deepspeed", "--zero-stage", "2"]], ids=["ddp", "zero2"])
def test_torchrun_restarts_a_killed_worker_and_resumes_exactly(corpus, uninterrupted, tmp_path, engine):
    """A worker killed (SIGKILL) after the iteration-4 checkpoint, under
    torchrun --max-restarts 2: the restarted workers meet again (each attempt
    rendezvous under its own store prefix), resume from that checkpoint, and
    the losses equal an uninterrupted run's bit for bit (plain DDP, and
    DeepSpeed ZeRO-2 with its own checkpoints)."""
    common = [*RESTART_RUN, "--data-path", corpus, *engine]
    script = tmp_path / "killer.py"
    script.write_text(KILL_RANK_1_AFTER_SAVE.format(root=ROOT, marker=str(tmp_path / "killed"), iteration=4))
    ckpt = str(tmp_path / "ckpt")
    args = [*common, "--save", ckpt, "--load", ckpt, "--save-interval", "2",
            "--metrics-file", str(tmp_path / "restarted.jsonl")]
    proc = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "--max-restarts=2", str(script), *args], 240, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (tmp_path / "killed").exists()  # it did die once
    assert "loaded checkpoint" in proc.stdout and "(iteration 4)" in proc.stdout
    restarted = read_metrics(tmp_path / "restarted.jsonl")
    assert [m["iteration"] for m in restarted] == list(range(1, 9))
    assert [m["loss"] for m in restarted] == uninterrupted(engine)


RANK_1_DIES_WHILE_RANK_0_IS_BUSY = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
import checkpoint, train
with open({starts!r}, "a") as f:  # the attempt as this node's agent counts it
    f.write(os.environ["RANK"] + " " + os.environ["TORCHELASTIC_RESTART_COUNT"] + "\\n")
first_attempt = not os.path.exists({marker!r})
real_save, real_step, steps = checkpoint.save_checkpoint, train.train_step, []

def save_then_die(cfg, model, optimizer, scaler, iteration, consumed, log, *saver):
    real_save(cfg, model, optimizer, scaler, iteration, consumed, log, *saver)
    if first_attempt and iteration == 4 and os.environ["RANK"] == "1":
        open({marker!r}, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # a dead node: no handler runs

def busy_step(*args, **kwargs):  # rank 0 computes step 5, not yet talking to rank 1
    steps.append(1)
    if first_attempt and len(steps) == 5 and os.environ["RANK"] == "0":
        time.sleep(10)
    return real_step(*args, **kwargs)

checkpoint.save_checkpoint, train.train_step = save_then_die, busy_step
train.main(sys.argv[1:])
"""


def test_two_nodes_restart_together_when_only_one_agent_counts_the_restart(corpus, uninterrupted, tmp_path):
    """Two torchrun agents (two nodes of one worker), --max-restarts 2. Node 1's
    worker dies after the iteration-4 save while node 0's is busy in step 5:
    node 1's agent counts a restart, node 0's agent restarts its healthy
    worker through the membership change and does not, so their
    TORCHELASTIC_RESTART_COUNT differ (recorded). The new workers still meet
    (rank 0's fresh store for the attempt), resume from iteration 4 and end
    on the uninterrupted run's losses, bit for bit (the plain DDP run of
    test_torchrun_restarts_a_killed_worker_and_resumes_exactly: the timeout
    changes no number)."""
    common = [*RESTART_RUN, "--data-path", corpus, "--distributed-timeout-minutes", "1"]
    script, starts = tmp_path / "node.py", tmp_path / "starts.txt"
    script.write_text(RANK_1_DIES_WHILE_RANK_0_IS_BUSY.format(
        root=ROOT, starts=str(starts), marker=str(tmp_path / "killed")))
    ckpt = str(tmp_path / "ckpt")
    port = free_port()
    agents = run_together([
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
         "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         "--rdzv-id=restart", "--max-restarts=2", str(script), *common, "--save", ckpt, "--load", ckpt,
         "--save-interval", "2", "--metrics-file", str(tmp_path / "restarted.jsonl")] for node in (0, 1)],
        400, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    outputs = [(agent.stdout, agent.stderr) for agent in agents]
    for agent in agents:
        assert agent.returncode == 0, agent.stdout[-2000:] + agent.stderr[-4000:]
    assert sorted(starts.read_text().split("\n")[:-1]) == ["0 0", "0 0", "1 0", "1 1"]
    assert "(iteration 4)" in outputs[0][0] + outputs[1][0]
    restarted = read_metrics(tmp_path / "restarted.jsonl")
    assert [m["iteration"] for m in restarted] == list(range(1, 9))
    assert [m["loss"] for m in restarted] == uninterrupted([])


RANK_1_STOPS_ANSWERING = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
import train
calls = []

def silent_at_step_3(real_step):
    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3 and os.environ["RANK"] == "1":
            # torchrun's SIGTERM ends it at once (train.py's preemption handler
            # would only note it, and torchrun would wait 30 s to SIGKILL it)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(600)  # alive but silent: a hung GPU, a stuck file system
        return real_step(*args, **kwargs)
    return step

train.train_step = silent_at_step_3(train.train_step)  # both engines' step
train.main(sys.argv[1:])
"""


@pytest.mark.parametrize("engine", [[], ["--deepspeed", "--zero-stage", "2"]], ids=["ddp", "zero2"])
def test_a_rank_that_stops_answering_ends_the_job_within_the_timeout(corpus, tmp_path, engine):
    """Rank 1 stops answering at iteration 3. With --distributed-timeout-minutes
    0.2 (12 s: a rank slowed by other test files on the same cores is not
    silent), rank 0's gradient all-reduce gives up after 12 s, and it says
    which collective failed, where, and why, in one line after the traceback;
    torchrun then stops the silent rank. Every group must carry the timeout:
    new_group does not inherit init_process_group's, and DDP on our
    data-parallel group, or ZeRO on the world clone DeepSpeed makes without an
    mpu, would wait out the silent rank (torch's default is 30 minutes)."""
    script = tmp_path / "silent.py"
    script.write_text(RANK_1_STOPS_ANSWERING.format(root=ROOT))
    args = [*TINY, "--data-path", corpus, "--train-iters", "6", "--global-batch-size", "8",
            "--eval-interval", "0", "--distributed-timeout-minutes", "0.2", *engine]
    start = time.monotonic()
    proc = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script), *args], 300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    # 12 s of timeout and start-up: far from 600 s
    assert elapsed < 120, elapsed
    last = [l for l in proc.stderr.splitlines() if l.startswith("train.py: error")]
    assert len(last) == 1, proc.stderr[-4000:]
    where = r"zero\.py:\d+ in backward \(`self\.engine\.backward\(loss\)`\)" if engine else \
        r"train\.py:\d+ in backward \(`\(self\.scale\(share\) if self\.scale else share\)\.backward\(\)`\)"
    assert re.match(r"train\.py: error \(rank 0\): the gradient all-reduce \(run inside backward\) "
                    f"failed at {where}: ", last[0]), last[0]
    assert "Timed out waiting 12000ms" in last[0]
    assert "--distributed-timeout-minutes" in last[0]


# ----------------------------------------------------------------------------
# Two nodes: two torchrun agents meeting by rendezvous


def test_two_torchrun_agents_form_one_job_like_two_nodes(corpus, tmp_path):
    """Two torchrun agents on this machine stand in for two nodes of 2 processes,
    meeting by c10d rendezvous (the multi-node launch of docs/training.md and slurm.sh).
    torchrun numbers ranks node by node, so each TP=2 group lies inside one
    agent: the losses equal one agent's 4-process run, and only global rank 0
    prints, writes the metrics and writes TensorBoard."""
    common = [*TINY, "--data-path", corpus, "--train-iters", "4", "--global-batch-size", "8",
              "--micro-batch-size", "4", "--tensor-model-parallel-size", "2", "--eval-interval", "0"]
    train_on_ranks([*common, "--metrics-file", str(tmp_path / "one_agent.jsonl")], nproc=4)
    port = free_port()
    args = [*common, "--metrics-file", str(tmp_path / "two_agents.jsonl"),
            "--tensorboard-dir", str(tmp_path / "tb")]
    agents = run_together([
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
         "--nproc_per_node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         "--rdzv-id=two-nodes", os.path.join(ROOT, "train.py"), *args] for node in (0, 1)],
        300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    outputs = [(agent.stdout, agent.stderr) for agent in agents]
    for agent in agents:
        assert agent.returncode == 0, agent.stdout[-2000:] + agent.stderr[-4000:]
    assert losses(tmp_path / "two_agents.jsonl") == losses(tmp_path / "one_agent.jsonl")
    printed = [sum(l.startswith("iter ") for l in out.splitlines()) for out, _ in outputs]
    assert sorted(printed) == [0, 4]  # one agent hosts global rank 0, which alone prints
    assert len(glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))) == 1
