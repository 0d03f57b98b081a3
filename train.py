r"""Pretrain a GPT on Megatron-format token data.

    torchrun --standalone --nproc_per_node 8 train.py --preset 124M \
        --data-path data/shakespeare_text_document --micro-batch-size 8 \
        --global-batch-size 256 --train-iters 5000 --bf16

The training loop, top to bottom:
  1. Distributed setup from torchrun's environment (nccl on GPU, gloo on CPU),
     tensor- and data-parallel groups (parallel.py).
  2. Data: datasets and a data-parallel sampler that resumes exactly.
  3. The step: gradient accumulation, mixed precision, clipping.
  4. Evaluation, logging (stdout, JSON lines, TensorBoard), MFU.
  5. The loop: preemption, loss checks, checkpoints, the final sample.
Elsewhere: the flags, model, AdamW and schedule (config.py), checkpoints and
weight export (checkpoint.py), DeepSpeed ZeRO (zero.py).
"""
from __future__ import annotations

import datetime
import json
import math
import os
import signal
import socket
import sys
import time
import traceback
import uuid
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import data as data_lib
import parallel
import zero
from config import (TrainConfig, build_model, build_optimizer, global_batch_at,
                    gradient_accumulation_steps, learning_rate, parse_args, with_run_length)
from data import to_device
from gpt import GPT, GPTConfig, count_parameters, flops_per_token
from gpt import generate
from prepare import load_tokenizer

EOD_TOKEN = 50256  # GPT-2's <|endoftext|>


# ----------------------------------------------------------------------------
# 1. Distributed setup
# ----------------------------------------------------------------------------

@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(cfg: TrainConfig) -> Dist:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and build the groups.

    Without torchrun this is a single process. nccl drives GPUs; gloo runs the
    same code on CPU so that every distributed path can be tested anywhere.
    """
    if cfg.domino or cfg.sequence_parallel:
        # One hardware queue: kernels start in launch order, so a collective
        # launched before a GEMM really runs beside it (see parallel._ColumnParallelLinearFunction). Read
        # when the CUDA context is created, so set it before touching the GPU.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = cfg.distributed_backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(minutes=cfg.distributed_timeout_minutes)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout, **elastic_store(rank, world, timeout))
    elif cfg.deepspeed and not dist.is_initialized():
        # DeepSpeed always needs a process group, even for one process, and
        # reads the launcher's variables: set what a 1-process launch would.
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    parallel.initialize(cfg.tensor_model_parallel_size, timeout)
    return Dist(rank, world, local_rank, device)


ATTEMPT_STORE_KEY = "/train.py/attempt_store"


def elastic_store(rank: int, world: int, timeout: datetime.timedelta) -> dict:
    """init_process_group's store under torchrun: a new one for each attempt.

    torchrun's agents host one key-value store for all the attempts of a job
    (TORCHELASTIC_USE_AGENT_STORE), and the workers exchange their addresses
    through it. After a restart (--max-restarts) the new workers would read
    the dead attempt's keys and connect to ranks that no longer exist (gloo
    hangs or is refused, NCCL reads a stale unique id). A key prefix per
    attempt would need a number that every node agrees on, and torchrun
    gives none: TORCHELASTIC_RESTART_COUNT counts the restarts of that node's
    own agent, and a node whose worker was healthy restarts it without
    counting. So rank 0 starts a store of its own for each attempt (as
    torchrun does with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and publishes
    its address with a fresh nonce; the other ranks use it once it answers
    with that nonce, which a dead attempt's address cannot. Elsewhere (the
    deepspeed launcher, plain env://) nothing changes."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    host = os.environ["MASTER_ADDR"]  # the node of global rank 0, whose agent hosts this store
    agent = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    if rank == 0:
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = uuid.uuid4().hex
        store.set("nonce", nonce)
        agent.set(ATTEMPT_STORE_KEY, f"{host} {store.port} {nonce}")
    else:
        store = join_attempt_store(agent, world, timeout)
    return {"store": store, "rank": rank, "world_size": world}


def join_attempt_store(agent, world: int, timeout: datetime.timedelta):
    """The store rank 0 started for this attempt (see elastic_store). The key
    may still hold a dead attempt's address, which refuses connections: read
    it again until the address answers with its own nonce."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        host, port, nonce = agent.get(ATTEMPT_STORE_KEY).decode().split()
        try:
            socket.create_connection((host, int(port)), timeout=5).close()  # cheap, quiet refusal
            store = dist.TCPStore(host, int(port), world, is_master=False,
                                  timeout=datetime.timedelta(seconds=30))
            if store.get("nonce").decode() == nonce:
                store.set_timeout(timeout)
                return store
        except (OSError, RuntimeError):  # refused, or not a store (a port reused since)
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no store of this attempt within "
                               f"{timeout.total_seconds():.0f} s (--distributed-timeout-minutes)")
        time.sleep(0.2)


# ----------------------------------------------------------------------------
# 2. Data
# ----------------------------------------------------------------------------

def eval_runs(cfg: TrainConfig) -> int:
    """How many times validation runs: every --eval-interval and once at the end."""
    return cfg.train_iters // cfg.eval_interval + 1 if cfg.eval_interval > 0 else 0


def eval_consumed(iteration: int, cfg: TrainConfig, global_batch: int) -> int:
    """Where in the validation set the evaluation at `iteration` starts: each run
    sees fresh samples, as in Megatron (run k at iteration k x --eval-interval,
    the extra final run after the last multiple)."""
    index = iteration // cfg.eval_interval - 1 if iteration % cfg.eval_interval == 0 \
        else cfg.train_iters // cfg.eval_interval
    return index * cfg.eval_iters * global_batch


def build_datasets(cfg: TrainConfig, global_batch: int):
    # The test split is left for offline evaluation; training reads train and valid.
    train_samples = cfg.train_samples or cfg.train_iters * global_batch
    num_samples = (train_samples, eval_runs(cfg) * cfg.eval_iters * global_batch, 0)
    build = lambda: data_lib.build_train_valid_test_datasets(
        data_path=cfg.data_path, split=cfg.split, num_samples=num_samples,
        seq_length=cfg.seq_length, seed=cfg.seed, cache_dir=cfg.data_cache_path,
        eod_token=EOD_TOKEN, reset_position_ids=cfg.reset_position_ids,
        eod_mask_loss=cfg.eod_mask_loss)
    if not dist.is_initialized():
        return build()
    # Rank 0 builds the index arrays and caches them on disk; the others then
    # load that cache instead of all computing the same arrays at once. If
    # rank 0 cannot (bad data), the others raise its error instead of crashing
    # in a collective that rank 0 never joins.
    outcome, error = [None], None
    if dist.get_rank() == 0:
        try:
            datasets = build()
        except (ValueError, FileNotFoundError) as e:
            outcome, error = [(type(e).__name__, str(e))], e
    dist.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[0] is not None:
        kind, message = outcome[0]
        raise {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}[kind](message)
    return datasets if dist.get_rank() == 0 else build()


def data_iterator(dataset, cfg: TrainConfig, consumed_samples: int):
    """Yields this rank's micro-batches, starting after `consumed_samples` (all ranks)."""
    sampler = data_lib.PretrainingSampler(
        total_samples=len(dataset), consumed_samples=consumed_samples,
        micro_batch_size=cfg.micro_batch_size,
        data_parallel_rank=parallel.dp_rank(), data_parallel_size=parallel.dp_size())
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                         num_workers=cfg.num_workers, pin_memory=torch.cuda.is_available())
    return iter(loader)


def check_batch(batch: dict, config: GPTConfig) -> dict:
    """Token ids and positions must index the embeddings. Checked here, on the
    host, where it is cheap: on a GPU an out-of-range id fails as an opaque
    device-side assert, and checking there costs a host sync per step."""
    vocab = "check the data's tokenizer against the model's vocabulary"
    parallel.check_ids([
        (f"batch {name}", batch[name], config.padded_vocab_size, vocab) for name in ("tokens", "labels")
    ] + [("batch position_ids", batch["position_ids"], config.max_position_embeddings,
          "check --seq-length against --max-position-embeddings")])
    return batch


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queue (host clocks then time real work); no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------
# 3. The training step
# ----------------------------------------------------------------------------

def autocast(cfg: TrainConfig, device: torch.device):
    if cfg.bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if cfg.fp16:
        return torch.autocast(device.type, dtype=torch.float16)
    return nullcontext()


def train_step(model, optimizer, scaler, batches, cfg: TrainConfig, device, lr: float):
    """One optimizer step over `len(batches)` accumulated micro-batches.

    Returns (loss averaged over micro-batches and data-parallel ranks, grad
    norm, whether the step was skipped: 1.0 or 0.0), all on the device: the
    host never waits for the GPU here (the loop reads them at log intervals).
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        batch = to_device(batch, device)
        # DDP all-reduces gradients on every backward; skip that until the last
        # micro-batch so accumulation costs one all-reduce per step.
        last = i == len(batches) - 1
        sync = nullcontext() if last or not isinstance(model, DDP) else model.no_sync()
        with sync:
            with autocast(cfg, device):
                loss = model(batch["tokens"], position_ids=batch["position_ids"],
                             labels=batch["labels"], loss_mask=batch["loss_mask"])
            loss = loss / len(batches)
            (scaler.scale(loss) if scaler else loss).backward()
        total += loss.detach()
    params = [p for p in model.parameters() if p.grad is not None]
    if scaler:
        scaler.unscale_(params)
    max_norm = cfg.clip_grad if cfg.clip_grad > 0 else float("inf")
    grad_norm = parallel.clip_grad_norm_(params, max_norm)
    skipped = optimizer_step(optimizer, scaler, grad_norm)
    return parallel.all_reduce_mean(total, parallel.dp_group()), grad_norm, skipped


def optimizer_step(optimizer, scaler, grad_norm: torch.Tensor) -> torch.Tensor:
    """Update the weights unless the gradient norm is inf or NaN, decided on
    the device; returns found_inf (1.0 if the step was skipped, else 0.0).

    The decision must be the same on every rank. grad_norm is the norm of the
    whole model's gradients, all-reduced over the tensor-parallel group (and
    the gradients are already averaged over data parallelism), so an inf in
    one rank's shard makes it inf everywhere. (A rank deciding from its own
    shard would skip while its partner stepped, and replicated weights would
    drift apart; Megatron all-reduces found_inf over the model-parallel group
    for the same reason.) Without loss scaling (fp32, bf16) a non-finite
    gradient would turn every weight into NaN while the loss still looked fine.

    Reading the norm on the host would stall the GPU queue every step. Fused
    AdamW takes the flag as a tensor instead (as GradScaler hands it over):
    when it is 1 the kernel leaves weights, moments and step count alone."""
    found_inf = (~torch.isfinite(grad_norm)).float()
    optimizer.grad_scale, optimizer.found_inf = None, found_inf
    optimizer.step()
    del optimizer.grad_scale, optimizer.found_inf
    if scaler:
        scaler.update(found_inf)
    return found_inf


class LossScaler:
    """Dynamic loss scaling for --fp16 (Micikevicius et al., 2018), kept on
    the device: the loss is multiplied by `scale` before backward so that
    small gradients survive fp16, the gradients are divided by it after. On
    a non-finite step the scale halves; after `growth_interval` finite steps
    in a row it doubles. Unlike torch's GradScaler, the caller decides what
    is non-finite (the whole model's gradient norm, the same on every rank).
    The state dict has GradScaler's keys, so either one's checkpoints load."""

    def __init__(self, init_scale: float, device: torch.device, growth_interval: int = 2000):
        self.scale_ = torch.full((), init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_interval = growth_interval

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_

    def unscale_(self, params: list) -> None:
        torch._foreach_mul_([p.grad for p in params], self.scale_.reciprocal())

    def update(self, found_inf: torch.Tensor) -> None:
        grow = (self.growth_tracker + 1 >= self.growth_interval) & (found_inf == 0)
        factor = torch.where(found_inf > 0, 0.5, torch.where(grow, 2.0, 1.0))
        self.scale_.mul_(factor)
        self.growth_tracker.copy_(torch.where((found_inf > 0) | grow, 0, self.growth_tracker + 1))

    def state_dict(self) -> dict:  # a host read: at checkpoints only
        return {"scale": self.scale_.item(), "_growth_tracker": int(self.growth_tracker.item()),
                "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict) -> None:
        self.scale_.fill_(state["scale"])
        self.growth_tracker.fill_(state["_growth_tracker"])


@torch.no_grad()
def evaluate(model, dataset, cfg: TrainConfig, device, consumed: int, accum: int) -> float:
    """Mean loss over --eval-iters global batches, averaged over data-parallel ranks."""
    model.eval()
    it = data_iterator(dataset, cfg, consumed)
    losses = []
    for _ in range(cfg.eval_iters * accum):
        batch = to_device(next(it), device)
        with autocast(cfg, device):
            losses.append(model(batch["tokens"], position_ids=batch["position_ids"],
                                labels=batch["labels"], loss_mask=batch["loss_mask"]).float())
    model.train()
    return parallel.all_reduce_mean(torch.stack(losses).mean(), parallel.dp_group()).item()


# ----------------------------------------------------------------------------
# 4. Logging and MFU
# ----------------------------------------------------------------------------

# Dense (no sparsity) 16-bit tensor-core peak FLOP/s per device, bf16 with
# fp32 accumulation, as training runs. Keys are matched against
# torch.cuda.get_device_name(), most specific first; a GPU not listed gets no
# MFU (pass --peak-flops) rather than a guess. Sources: NVIDIA's data sheets
# (sparse figure / 2), and the architecture whitepapers for GeForce cards,
# whose fp32-accumulate rate is half their fp16-accumulate one.
PEAK_FLOPS = {
    "H200 NVL": 835e12,     # H200 data sheet: 1,671 TFLOPS sparse (NVL)
    "H200": 989e12,         # H200 data sheet: 1,979 TFLOPS sparse (SXM)
    "GH200": 989e12,        # GH200 data sheet: 1,979 TFLOPS sparse
    "H100 NVL": 835e12,     # H100 data sheet: 1,671 TFLOPS sparse (NVL, per GPU)
    "H100 PCIe": 756e12,    # H100 data sheet: 1,513 TFLOPS sparse (PCIe)
    "H100": 989e12,         # H100 data sheet: 1,979 TFLOPS sparse (SXM; "H100 80GB HBM3")
    "A100": 312e12,         # A100 data sheet: 312 dense (SXM and PCIe)
    "L40S": 362e12,         # L40S data sheet: 733 TFLOPS sparse
    "L40": 181e12,          # L40 data sheet: 362 TFLOPS sparse
    "L4": 121e12,           # L4 data sheet: 242 TFLOPS sparse
    "A10": 125e12,          # A10 data sheet: 250 TFLOPS sparse (not A10G: AWS gives no bf16 rate)
    "RTX 4090": 82.6e12,    # Ada whitepaper: 165.2 with fp16 accumulate, 82.6 with fp32
    "RTX 3090": 35.6e12,    # GA102 whitepaper: 71 with fp16 accumulate, 35.6 with fp32
    "V100-SXM2": 125e12,    # V100 data sheet: fp16 (no bf16), SXM2
    "V100-PCIE": 112e12,    # V100 data sheet: fp16 (no bf16), PCIe
}


def device_peak_flops(cfg: TrainConfig, device: torch.device) -> float | None:
    """Peak FLOP/s of one device: --peak-flops, else by GPU name; None on CPU."""
    if cfg.peak_flops:
        return cfg.peak_flops
    if device.type != "cuda":
        return None
    return peak_flops_by_name(torch.cuda.get_device_name(device))


def peak_flops_by_name(name: str) -> float | None:
    """PEAK_FLOPS of the first key the device name contains (specific names
    come first: "H100 PCIe" before "H100"); None for an unknown device."""
    if "A10G" in name:  # "A10" is in its name, but not its tensor rate
        return None
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


class Logger:
    """Prints, and writes the same figures to --metrics-file (JSON lines) and TensorBoard."""

    def __init__(self, cfg: TrainConfig, enabled: bool, resume: bool):
        self.enabled = enabled
        self.file = None
        self.tb = None
        if not enabled:
            return
        if cfg.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics_file)), exist_ok=True)
            self.file = open(cfg.metrics_file, "a" if resume else "w")
        if cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(cfg.tensorboard_dir, max_queue=cfg.tensorboard_queue_size)

    def print(self, msg: str) -> None:
        if self.enabled:
            print(msg, flush=True)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        parts = [f"iter {metrics['iteration']:>6d}", f"loss {metrics['loss']:.4f}",
                 f"lr {metrics['lr']:.3e}", f"grad norm {metrics['grad_norm']:.3f}",
                 f"tokens/s {metrics['tokens_per_sec']:,.0f}"]
        if metrics.get("mfu") is not None:
            parts.append(f"MFU {100 * metrics['mfu']:.1f}%")
        if metrics.get("skipped_iterations"):
            parts.append(f"skipped {metrics['skipped_iterations']} (non-finite grads)")
        if metrics.get("batch_size") is not None:
            parts.append(f"batch {metrics['batch_size']}")
        if "val_loss" in metrics:
            parts.append(f"val loss {metrics['val_loss']:.4f} (ppl {metrics['val_ppl']:.2f})")
        print(" | ".join(parts), flush=True)
        if self.file:
            self.file.write(json.dumps(metrics) + "\n")
            self.file.flush()
        if self.tb:
            for k, v in metrics.items():
                if k != "iteration" and v is not None:
                    name = {"val_loss": "valid/loss", "val_ppl": "valid/ppl"}.get(k, f"train/{k}")
                    self.tb.add_scalar(name, v, metrics["iteration"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


# ----------------------------------------------------------------------------
# 5. The loop
# ----------------------------------------------------------------------------

class Preemption:
    """Turns SIGTERM (a cluster's preemption notice) into a flag the loop checks.

    Every rank must stop (and save) at the same iteration, so the ranks vote
    with an all-reduce. Reading a vote right away would make the host wait
    for the GPU at every step, and the GPU would then idle while the host
    queues the next step. On CUDA each step's vote is therefore read one step
    later, once the next step is queued: the ranks still agree, one step
    after the signal."""

    def __init__(self, device: torch.device):
        self.device = device
        self.requested = False
        self.pending = None  # CUDA: (event, pinned host copy) of the last vote
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame):
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank, at the same iteration, once any rank got SIGTERM."""
        # torch.full fills on the device; torch.tensor would copy from pageable
        # host memory, which waits for the GPU.
        vote = torch.full((1,), float(self.requested), device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        if self.device.type != "cuda":
            return bool(vote.item())  # nothing queued on a CPU to keep busy
        host = torch.empty(1, pin_memory=True)
        host.copy_(vote, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        previous, self.pending = self.pending, (event, host)
        if previous is None:
            return False
        previous[0].synchronize()  # waits for the previous step only
        return bool(previous[1].item())


def check_losses(pending: list, logger: Logger, last_saved: int) -> float:
    """Read the (iteration, device loss) pairs queued since the last check in
    one host sync, stop the run at the first non-finite one, and return the
    latest value. Checked at log intervals and before every save, never per
    step: a per-step .item() would stall the GPU queue."""
    values = torch.stack([loss.float() for _, loss in pending]).tolist()
    for (iteration, _), value in zip(pending, values):
        if not math.isfinite(value):
            logger.print(f"error: loss is {value} at iteration {iteration}; stopping without "
                         f"saving (last good checkpoint: iteration {last_saved}). Lower --lr, "
                         f"raise --lr-warmup-iters, or use --bf16 instead of --fp16.")
            raise SystemExit(1)
    pending.clear()
    return values[-1]


def sample_text(model: GPT, cfg: TrainConfig, device) -> str:
    enc = load_tokenizer()  # FileNotFoundError if requirements.txt's BPE package is missing
    ids = torch.tensor([enc.encode_ordinary(cfg.sample_prompt)], device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)  # same on every tensor-parallel rank
    out = generate(model, ids, max_new_tokens=cfg.sample_tokens, temperature=0.8, top_k=200,
                         eos_token_id=EOD_TOKEN, generator=gen)
    return enc.decode([t for t in out[0].tolist() if t < EOD_TOKEN])


def main(argv: list[str] | None = None, entry=None, prog: str = "train.py") -> None:
    """Run entry(argv) (default: train.py's run) and turn a user's mistake
    into one line from rank 0, prefixed by prog (evaluate.py shares this)."""
    try:
        (entry or run)(argv)
    except (ValueError, FileNotFoundError) as e:
        if not raised_by_this_project(e):
            raise  # unexpected: keep the traceback
        exit_with_usage_error(e, prog)
    except RuntimeError as e:  # gloo's and torch.distributed's errors are RuntimeErrors
        if not is_collective_failure(e):
            raise
        exit_with_collective_failure(e, prog)


def raised_by_this_project(e: BaseException) -> bool:
    """Whether one of this project's own checks raised e (a `raise` in a file
    beside train.py): a mistake in the flags, the data or the checkpoint,
    whose message already says what to do. Errors from torch, DeepSpeed or
    anything else are bugs to debug, with their traceback."""
    return in_this_project(traceback.extract_tb(e.__traceback__)[-1].filename)


def in_this_project(filename: str) -> bool:
    """Whether a source file is one of this project's (beside train.py)."""
    return os.path.dirname(os.path.abspath(filename)) == os.path.dirname(os.path.abspath(__file__))


def exit_with_usage_error(e: Exception, prog: str = "train.py") -> None:
    """One line from rank 0, exit status 2, no traceback from every rank.

    Usually every rank hits the same check; the launcher (torchrun, deepspeed)
    stops the others as soon as rank 0 exits, so they wait a moment first. A
    rank still alive after that failed alone, and says so itself."""
    rank = int(os.environ.get("RANK", "0"))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Preemption's handler would keep it alive
    if rank != 0:
        time.sleep(3)
    where = "" if rank == 0 else f" (rank {rank})"
    print(f"{prog}: error{where}: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


def is_collective_failure(e: RuntimeError) -> bool:
    """A collective or the store that gave up on a peer: the process-group
    timeout (--distributed-timeout-minutes) ran out, or the peer's socket
    closed because it died. gloo raises a plain RuntimeError for both."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(
        s in text for s in ("Timed out waiting", "Connection closed by peer", "Connection reset by peer"))


def exit_with_collective_failure(e: RuntimeError, prog: str = "train.py") -> None:
    """Keep the traceback, then end with one line that says which collective
    gave up (the line of this project that waited on it) and what it means."""
    traceback.print_exc()
    ours = [f for f in traceback.extract_tb(e.__traceback__) if in_this_project(f.filename)]
    what, where = "a collective", ""
    if ours:
        frame = ours[-1]
        where = f" at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name} (`{frame.line}`)"
        if "backward" in frame.line:  # DDP and ZeRO reduce gradients from autograd hooks
            what = "the gradient all-reduce (run inside backward)"
    print(f"{prog}: error (rank {os.environ.get('RANK', '0')}): {what} failed{where}: "
          f"{str(e).splitlines()[0]}. Another rank stopped answering or died; its own log says "
          f"why. --distributed-timeout-minutes sets how long a collective waits.", file=sys.stderr, flush=True)
    sys.exit(1)


def run(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    if cfg.export_from:
        checkpoint.export_weights(cfg.export_from, cfg.export_to, cfg.export_format)
        print(f"exported {cfg.export_from} -> {cfg.export_to} ({cfg.export_format})")
        return
    env = init_distributed(cfg)
    train(cfg, env)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def train(cfg: TrainConfig, env: Dist) -> None:
    """The whole run in an initialized world (tests call it repeatedly in one world)."""
    cfg = with_run_length(cfg, parallel.dp_size())  # --train-samples -> iterations
    # The final global batch (evaluation uses it); with --rampup-batch-size a
    # step's own batch is global_batch_at(consumed), checked here for all steps.
    accum = gradient_accumulation_steps(cfg, parallel.dp_size())
    global_batch = cfg.micro_batch_size * parallel.dp_size() * accum
    if cfg.rampup_batch_size:
        start, increment, _ = cfg.rampup_batch_size
        for gbs in range(start, global_batch, increment):
            gradient_accumulation_steps(cfg, parallel.dp_size(), gbs)
    logger = Logger(cfg, enabled=env.is_main, resume=bool(cfg.load))
    if cfg.domino and parallel.tp_size() == 1:
        logger.print("--domino has nothing to overlap at tensor-parallel size 1: it is off")
    if env.device.type == "cuda" and not (cfg.bf16 or cfg.fp16):
        # Plain fp32 matmuls run on CUDA cores at a fraction of the tensor
        # cores' speed; TF32 keeps fp32 storage and range with a 10-bit
        # mantissa in the products (nanoGPT and Megatron train fp32 this way).
        torch.set_float32_matmul_precision("high")
        logger.print("fp32 on a GPU: matmuls and attention use TF32 tensor cores; "
                     "--bf16 is faster still")

    if cfg.deepspeed:  # zero.py: DeepSpeed owns the optimizer step and checkpoints
        model, iteration, consumed = zero.init_deepspeed(cfg, env.device, accum, logger.print)
        raw_model = model.module
        step = lambda batches, lr: zero.deepspeed_train_step(model, batches, cfg, env.device, lr)
        save = lambda it, consumed: checkpoint.save_deepspeed_checkpoint(cfg, model, it, consumed,
                                                                         logger.print)
    else:
        raw_model = build_model(cfg, env.device)
        optimizer = build_optimizer(raw_model, cfg)
        scaler = LossScaler(cfg.initial_loss_scale, env.device) if cfg.fp16 else None
        iteration, consumed = checkpoint.load_checkpoint(cfg, raw_model, optimizer, scaler,
                                                          logger.print)
        model = raw_model
        if cfg.compile:
            model = torch.compile(model)
        if parallel.dp_size() > 1:
            model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
                        process_group=parallel.dp_group())
        step = lambda batches, lr: train_step(model, optimizer, scaler, batches, cfg, env.device, lr)
        save = lambda it, consumed: checkpoint.save_checkpoint(cfg, raw_model, optimizer, scaler, it,
                                                               consumed, logger.print)
    if iteration > cfg.train_iters:
        raise ValueError(f"--load {cfg.load} is at iteration {iteration}, past this run's end "
                         f"(--train-iters/--train-samples: {cfg.train_iters} iterations): raise it to "
                         f"continue that run, or add --finetune to start a new run from its weights")
    train_ds, valid_ds, _ = build_datasets(cfg, global_batch)
    train_iter = data_iterator(train_ds, cfg, consumed)

    mcfg = raw_model.config
    flops_tok = flops_per_token(mcfg, cfg.seq_length)
    peak = device_peak_flops(cfg, env.device)
    if peak is None and env.device.type == "cuda":
        logger.print(f"MFU: unknown, {torch.cuda.get_device_name(env.device)!r} is not in "
                     f"train.PEAK_FLOPS; pass --peak-flops (dense bf16 FLOP/s of one GPU)")
    ramp = f" (ramped up from {cfg.rampup_batch_size[0]})" if cfg.rampup_batch_size else ""
    logger.print(f"model: {count_parameters(raw_model.config):,} parameters | world {env.world_size} = "
                 f"TP {parallel.tp_size()} x DP {parallel.dp_size()} | global batch {global_batch} "
                 f"= {cfg.micro_batch_size} x {parallel.dp_size()} x {accum} accumulation{ramp} | "
                 f"device {env.device}")

    # Within an iteration the host never waits for the GPU: the step's skip
    # decision stays on the device (optimizer_step); the losses, grad norm
    # and skip count are read only at log intervals, evaluations and saves
    # (check_losses), and the preemption vote a step late (Preemption).
    preempt = Preemption(env.device)
    pending_losses = []  # (iteration, loss on device) since the last check
    first_iteration = iteration + 1
    t0, tokens_since = time.time(), 0
    last_saved = iteration
    skipped = 0  # steps not applied since the last log: non-finite gradients (fp16 overflow)
    while iteration < cfg.train_iters:
        batch_size = global_batch_at(consumed, cfg, parallel.dp_size())
        lr = learning_rate(consumed, cfg, batch_size) if cfg.train_samples else learning_rate(iteration, cfg)
        micro_batches = gradient_accumulation_steps(cfg, parallel.dp_size(), batch_size)
        batches = [check_batch(next(train_iter), mcfg) for _ in range(micro_batches)]
        loss, grad_norm, skipped_now = step(batches, lr)
        skipped = skipped + skipped_now  # a device tensor: read at the next log
        iteration += 1
        consumed += batch_size
        tokens_since += batch_size * cfg.seq_length
        pending_losses.append((iteration, loss))
        last = iteration == cfg.train_iters
        eval_now = valid_ds is not None and cfg.eval_interval > 0 and (
            iteration % cfg.eval_interval == 0 or last)
        log_now = iteration % cfg.log_interval == 0 or last or eval_now
        if iteration == first_iteration:
            # The first step compiles (and, with Triton kernels, autotunes):
            # report it alone, and keep it out of the next logged tokens/s.
            synchronize(env.device)
            logger.print(f"first step (iteration {iteration}) took {time.time() - t0:.1f} s, "
                         f"compilation and autotuning included")
            if not log_now:
                t0, tokens_since = time.time(), 0
        stop = preempt.agreed() or (cfg.exit_interval and iteration % cfg.exit_interval == 0)
        save_now = cfg.save and (stop or last or (cfg.save_interval and iteration % cfg.save_interval == 0))
        if log_now or save_now:
            loss_value = check_losses(pending_losses, logger, last_saved)
        if log_now:
            synchronize(env.device)
            tps = tokens_since / max(time.time() - t0, 1e-9)
            metrics = {"iteration": iteration, "loss": loss_value, "lr": lr,
                       "grad_norm": float(grad_norm), "tokens_per_sec": tps,
                       "mfu": flops_tok * tps / (peak * env.world_size) if peak else None,
                       "skipped_iterations": int(skipped), "batch_size": batch_size,
                       "consumed_samples": consumed}
            if eval_now:
                metrics["val_loss"] = evaluate(model, valid_ds, cfg, env.device,
                                               eval_consumed(iteration, cfg, global_batch), accum)
                metrics["val_ppl"] = math.exp(min(metrics["val_loss"], 20.0))
            logger.log(metrics)
            t0, tokens_since, skipped = time.time(), 0, 0
        if save_now:
            save(iteration, consumed)
            last_saved = iteration
        if stop:
            logger.print(f"exiting at iteration {iteration}")
            break

    if iteration >= cfg.train_iters and cfg.sample_tokens > 0:
        try:
            text = sample_text(raw_model, cfg, env.device)
            logger.print("-" * 40 + " sample " + "-" * 40 + "\n" + text + "\n" + "-" * 88)
        except FileNotFoundError as e:  # no BPE package: training is done and saved, just say why
            logger.print(f"no sample printed: {e}")
    logger.close()
    if cfg.deepspeed:
        model.destroy()  # without it ZeRO-3 under gloo sometimes aborts at exit


if __name__ == "__main__":
    main()
