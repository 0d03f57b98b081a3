"""DeepSpeed ZeRO (--deepspeed): importing DeepSpeed, its config from train.py's
flags, the model built (ZeRO-3: partitioned as it is built) and loaded, and
DeepSpeedTraining, the engine train.train_step drives as it drives
train.PlainTraining: how DeepSpeed begins a step, turns a micro-batch's loss
into gradients, and ends the step. Its checkpoints are in checkpoint.py.
"""
from __future__ import annotations

import math
import os
from contextlib import nullcontext
from unittest import mock

import torch
import torch.distributed as dist

import checkpoint
import launch
import parallel
import pipeline
from launch import UsageError, say
from config import TrainConfig, autocast, compile_options, json_switch, json_value, model_config
from gpt import GPT, Experts, init_weights, moe_layers

# ZeRO (Rajbhandari et al., 2020) removes the data-parallel redundancy of
# model states. With Psi parameters, fp32 AdamW (4 bytes each for weights,
# grads, and 2 x 4 bytes of moments = 16 Psi bytes) and D data-parallel ranks,
# each rank holds:
#     stage 0 (plain DDP)   16 Psi
#     stage 1 (optimizer)    8 Psi + 8 Psi / D      Adam moments sharded
#     stage 2 (+ grads)      4 Psi + 12 Psi / D     gradients reduce-scattered
#     stage 3 (+ params)     16 Psi / D             weights gathered per layer
# The model, AdamW, the learning-rate schedule, data, logging and MFU are the
# plain path's; DeepSpeed owns gradient averaging, accumulation, clipping,
# mixed precision and (sharded) checkpoints.


def import_deepspeed(device: torch.device):
    """Import DeepSpeed; off CUDA, with the CPU accelerator (picked at import)
    and without its shared-memory all-reduce op, a one-off ~100 s C++ build in
    the first initialize for what gloo does anyway."""
    if device.type != "cuda":
        os.environ["DS_ACCELERATOR"] = "cpu"
    import warnings
    # DeepSpeed calls torch collectives that torch marks deprecated, on every step.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    import deepspeed
    import deepspeed.ops
    if device.type != "cuda":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def check_deepspeed_precision(cfg: TrainConfig, accelerator) -> None:
    """DeepSpeed refuses a precision its accelerator does not report (on CPU,
    fp16 needs AVX512-FP16): say so in our words, before any rank builds a model."""
    for flag, supported in (("fp16", accelerator.is_fp16_supported), ("bf16", accelerator.is_bf16_supported)):
        if getattr(cfg, flag) and not supported():
            raise UsageError(f"--{flag} --deepspeed: DeepSpeed does not support {flag} on this device "
                             f"({accelerator.device_name()}); drop --{flag} (fp32), or use the other "
                             f"16-bit format, or train without --deepspeed")


class DeepSpeedMPU:
    """The "model parallel unit" DeepSpeed asks for, backed by parallel.py's
    groups. ZeRO averages and shards over the data-parallel group, DP x CP
    (the CP ranks of a replica train the same weights on different tokens,
    as Megatron-DeepSpeed's sequence-data-parallel group). The model-parallel
    group, TP x PP, holds one replica: the grad norm and the overflow flag are
    summed over it, and its rank names the checkpoint's files. Replicated
    params count once per TP rank (the norm asks for the tensor-parallel rank,
    Megatron-core's name), a stage's copy of the tied embedding not at all
    (`ds_pipe_replicated`)."""

    def get_model_parallel_rank(self):
        return parallel.layout.pp_rank * parallel.layout.tp_size + parallel.layout.tp_rank

    def get_model_parallel_world_size(self): return parallel.layout.pp_size * parallel.layout.tp_size
    def get_model_parallel_group(self): return parallel.layout.mp_group
    def get_data_parallel_rank(self): return dist.get_rank(parallel.layout.dp_cp_group)
    def get_data_parallel_world_size(self): return parallel.layout.dp_cp_size
    def get_data_parallel_group(self): return parallel.layout.dp_cp_group
    def get_tensor_model_parallel_rank(self): return parallel.layout.tp_rank
    def get_tensor_model_parallel_world_size(self): return parallel.layout.tp_size
    def get_tensor_model_parallel_group(self): return parallel.layout.tp_group

    def get_tensor_model_parallel_src_rank(self):
        return dist.get_rank() - parallel.layout.tp_rank  # TP groups are consecutive ranks


def deepspeed_config(cfg: TrainConfig, dp_size: int, accum: int) -> dict:
    """DeepSpeed's JSON config: train.py's flags, over a --deepspeed_config's
    other keys (its values that flags also set are in cfg already: config.py)."""
    fp16 = {"enabled": cfg.fp16}
    if cfg.fp16:  # the loss scaler's flags where given, else DeepSpeed's defaults; its floor is an int there
        given = {"initial_scale_power": int(math.log2(cfg.initial_loss_scale)), "hysteresis": cfg.hysteresis,
                 "loss_scale_window": cfg.loss_scale_window,
                 "min_loss_scale": None if cfg.min_loss_scale is None else int(cfg.min_loss_scale)}
        fp16.update({key: value for key, value in given.items() if value is not None})
    ours = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": accum,
        # DeepSpeed counts each sample once per rank it averages over (the mpu's DP x CP ranks),
        # so its train_batch_size is cp times the global batch a user writes
        "train_batch_size": cfg.micro_batch_size * dp_size * accum * cfg.context_parallel_size,
        "gradient_clipping": cfg.clip_grad,
        "bf16": {"enabled": cfg.bf16},
        "fp16": fp16,
    }
    user = cfg.deepspeed_json or {}
    config = {**user, **ours}
    zero = dict(user.get("zero_optimization", {}))
    zero["stage"] = zero.get("stage", 1) if cfg.zero_stage is None else cfg.zero_stage
    if cfg.zero_offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    # unset (None): DeepSpeed's default, on at ZeRO-3 only, and stages take ZeRO 0 or 1
    overlap = json_value(cfg, "zero_optimization.overlap_comm", json_switch, zero.get("overlap_comm"))
    if cfg.pipeline_model_parallel_size > 1 and overlap:
        # ZeRO-1's overlapped reduction runs in backward hooks, and only at the accumulation
        # boundary, which the stages' schedule never sets: the ranks would never average.
        zero["overlap_comm"] = False
        say("overlap_comm: off over pipeline stages, as in DeepSpeed's own pipeline engine; "
            "the gradients are reduced once the stages' schedule ends")
    config["zero_optimization"] = zero
    for key in ("bf16", "fp16"):
        config[key] = {**user.get(key, {}), **ours[key]}
    if clips_itself(zero["stage"], cfg):
        config["gradient_clipping"] = 0.0
    # Our torch AdamW runs inside ZeRO (incl. offload: no DeepSpeed CPU-Adam build).
    config.update(zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)
    config.setdefault("steps_per_print", 10 ** 9)  # we log ourselves
    if cfg.deepspeed_config:
        check_as_deepspeed_reads(cfg, config)
    return config


def check_as_deepspeed_reads(cfg: TrainConfig, config: dict) -> None:
    """The sections DeepSpeed reads with its pydantic models, read so here
    first: a value it refuses (zero_optimization.reduce_bucket_size 1e30, an
    unknown key) is one line naming the key, not pydantic's report on every rank."""
    import pydantic
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    for section, model in (("zero_optimization", DeepSpeedZeroConfig), ("fp16", DeepSpeedFP16Config),
                           ("bf16", DeepSpeedBF16Config)):
        try:
            model(**config[section])
        except pydantic.ValidationError as e:
            error = e.errors()[0]
            key = ".".join(map(str, (section, *error["loc"])))
            raise UsageError(f"--deepspeed_config {cfg.deepspeed_config}: {key}={error['input']!r}: DeepSpeed "
                             f"refuses it ({error['msg']})") from None


def build_model_zero3(cfg: TrainConfig, ds, ds_config: dict, build_model) -> GPT:
    """Build the model under deepspeed.zero.Init, each layer partitioned over
    the data-parallel group (DP x CP) as soon as it is built: no rank holds the
    full model. GPT's own init then meets emptied partitions, so init_weights
    (the only random draws) is redone on each module gathered: the weights are
    train.build_model's. Under TP, GPT slices each layer's full weight after
    initializing it, so build_model builds it (1/tp slices plus one full layer
    at a time; deepspeed.initialize partitions)."""
    device = torch.device(ds.get_accelerator().device_name())  # what the kernels will run on
    if parallel.layout.tp_size > 1:
        return build_model(cfg, torch.device("cpu"), kernels_for=device)
    mcfg = model_config(cfg, device)
    torch.manual_seed(cfg.seed)
    parallel.model_parallel_seed(cfg.seed)
    with ds.zero.Init(data_parallel_group=parallel.layout.dp_cp_group, config_dict_or_path=ds_config):
        model = GPT(mcfg)
    each_module_gathered(model, ds, lambda _, module: init_weights(module, mcfg))
    return model


def each_module_gathered(model: GPT, ds, fn) -> None:
    """ZeRO-3: fn(name, module) for every module that owns parameters, with
    those gathered whole, one module at a time; what fn writes on rank 0 every
    rank's partition keeps."""
    for prefix, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if params:
            with ds.zero.GatheredParameters(params, modifier_rank=0):
                fn(prefix, module)


def load_weights(model: GPT, weights: dict, ds) -> None:
    """Full weights into a model that DeepSpeed has not wrapped yet; under
    ZeRO-3 (zero.Init, tp=1), one gathered module at a time."""
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        model.load_full_state_dict(weights)
        return

    @torch.no_grad()
    def copy(prefix, module):
        for name, p in module.named_parameters(recurse=False):
            p.copy_(weights[f"{prefix}.{name}" if prefix else name])

    each_module_gathered(model, ds, copy)


def expert_groups(model: GPT, optimizer):
    """Under expert parallelism, the context to build the engine in: DeepSpeed's MoE parameter groups, so
    ZeRO averages (over DP x CP) and partitions the experts over the ranks holding the same experts, our
    layout.expert_dp_group registered under DeepSpeed's name ("ep_size_2"); its norm counts each expert
    once. gpt.Experts stands for DeepSpeed's MoE class, by which it tells a model with experts."""
    lay = parallel.layout
    if lay.ep_size == 1:  # every rank holds every expert: averaged over DP x CP as the other weights
        return nullcontext()
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.runtime import engine
    from deepspeed.utils import groups
    name = f"ep_size_{lay.ep_size}"
    for registry, group in ((groups._EXPERT_PARALLEL_GROUP, lay.ep_group),
                            (groups._EXPERT_DATA_PARALLEL_GROUP, lay.expert_dp_group)):
        registry.clear()  # (an earlier run's, in this process)
        registry[name] = group
    for p in (p for p in model.parameters() if getattr(p, "expert_parallel", False)):
        p.allreduce, p.group_name = False, name  # DeepSpeed's marks of an expert weight
    optimizer.param_groups[:] = split_params_into_different_moe_groups_for_optimizer(
        [{**group, "name": str(i)} for i, group in enumerate(optimizer.param_groups)])
    return mock.patch.object(engine, "MoE", Experts)


class DeepSpeedTraining:
    """Model + our AdamW -> a DeepSpeed engine, resumed from --load; step and
    save as train.PlainTraining. A full resume reads DeepSpeed's own checkpoint
    (this layout only); with --no-load-optim or --finetune the weights alone
    come from a checkpoint of either kind and any layout, loaded before
    deepspeed.initialize copies its fp32 master weights. build_model,
    build_optimizer, clip_grad_norm_: train.py's, which imports this module."""
    saver = None  # its saves are synchronous (config.py refuses --async-save with --deepspeed)

    def __init__(self, cfg: TrainConfig, env: launch.Dist, accum: int, log, build_model, build_optimizer,
                 clip_grad_norm_):
        self.cfg, self.device, self.log = cfg, env.device, log
        # ZeRO-3's zero.Init swaps torch.nn.functional.linear for its own, process-wide, and
        # never swaps it back: close() does, so later models in this process compute as before.
        self.linear = torch.nn.functional.linear
        found = checkpoint.checkpoint_to_load(cfg, log)
        ds = import_deepspeed(env.device)
        check_deepspeed_precision(cfg, ds.accelerator.get_accelerator())
        ds.init_distributed(dist_backend="nccl" if env.device.type == "cuda" else "gloo")
        # Our groups, at any tp: else DeepSpeed clones the world, dropping --distributed-timeout-minutes.
        mpu = DeepSpeedMPU()
        config = deepspeed_config(cfg, parallel.layout.dp_size, accum)
        stage = config["zero_optimization"]["stage"]
        model = build_model_zero3(cfg, ds, config, build_model) if stage == 3 else build_model(cfg, env.device)
        for p in model.parameters():  # counted on the first stage (clip_grad_norm_'s rule)
            p.ds_pipe_replicated = getattr(p, "pipeline_copy", False)
        weights_only = found is not None and checkpoint.weights_only(cfg)
        if weights_only:
            weights, state = checkpoint.read_weights(found)
            load_weights(model, weights, ds)
        if cfg.recompute_activations:
            # DeepSpeed's recomputation; optionally each TP rank keeps 1/tp of the saved inputs.
            ds.checkpointing.configure(mpu, partition_activations=cfg.partition_activations)
            model.checkpoint_fn = ds.checkpointing.checkpoint
        # On CPU the unfused AdamW: with the fused CPU kernel a resumed ZeRO-2 run's
        # grad norms differ from the uninterrupted run's in the last bit.
        optimizer = build_optimizer(model, cfg, fused=env.device.type == "cuda")
        self.moe_layers = moe_layers(model)
        # No lr_scheduler: begin sets each step's learning rate (in samples, over the batch ramp).
        with expert_groups(model, optimizer):
            self.engine, _, _, _ = ds.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
        if cfg.compile and parallel.layout.pp_size == 1:
            # engine.module in place, after ZeRO's wrapping: the graphs see the partitioned model
            if stage == 3:  # GPT.head reads the head's weight (wte's, when tied) outside its module's call
                head = model.output_layer if model.config.untie_embeddings_and_output_weights else model.wte
                ds.zero.register_external_parameter(model, head.weight)
            kwargs = compile_options(cfg)
            self.engine.compile(backend=kwargs.pop("backend"), compile_kwargs=kwargs)
        if self.engine.dp_world_size != parallel.layout.dp_cp_size:  # a DeepSpeed that ignored our mpu
            raise RuntimeError(f"DeepSpeed shards over {self.engine.dp_world_size} ranks but the data-"
                               f"parallel x context-parallel size is {parallel.layout.dp_cp_size} "
                               f"(world / (tp x pp)): the mpu was not applied")
        self.raw = self.engine.module
        # under stages, our schedule runs the module's chunks (pipeline.Stage), not the engine
        self.model = self.engine if parallel.layout.pp_size == 1 else pipeline.Stage(self.raw)
        if cfg.compile and parallel.layout.pp_size > 1:
            self.model = torch.compile(self.model, **compile_options(cfg))
        self.clip_grad_norm_ = clip_grad_norm_  # train.py's (the plain engine's)
        # The engine runs its 16-bit module without autocast; our stages' schedule runs it as the plain engine's.
        self.precision = autocast(cfg, env.device) if parallel.layout.pp_size > 1 else nullcontext()
        self.scale = getattr(self.engine.optimizer, "scale_if_loss", None)  # ZeRO's, as in engine.backward
        self.averager = None  # under stages the engine averages after the schedule (finish)
        self.start = checkpoint.Start()  # where the run starts
        if weights_only:
            self.start = checkpoint.start_position(cfg, state, found.path, log)
        elif found is not None:
            self.start = checkpoint.load_deepspeed_checkpoint(cfg, self.engine, found, log)

    def begin(self, micro_batches: int, lr: float) -> None:
        """This step's batch size (--rampup-batch-size; as DeepSpeed counts it,
        over its DP x CP ranks) and learning rate; under stages, every backward
        of the schedule comes before the boundary."""
        ds_batch = micro_batches * self.cfg.micro_batch_size * parallel.layout.dp_cp_size
        if self.engine.train_batch_size() != ds_batch:
            self.engine.set_train_batch_size(ds_batch)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        if parallel.layout.pp_size > 1:
            self.engine.set_gradient_accumulation_boundary(False)

    def micro_batch(self, last: bool):
        """Before a micro-batch's forward: DeepSpeed averages the gradients, and
        steps, at the boundary it is told, the last micro-batch (said, not
        counted from the run's start: --rampup-batch-size changes the batch)."""
        self.engine.set_gradient_accumulation_boundary(last)
        return nullcontext()

    def backward(self, loss: torch.Tensor, micro_batches: int) -> None:
        """engine.backward divides the loss by the accumulation steps (begin set
        them to micro_batches), scales it under --fp16, and at the boundary
        averages the gradients. engine.step follows every backward and updates
        at the boundary only: that one is finish's, after our clipping."""
        self.engine.backward(loss)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()

    def finish(self):
        """The step's end: our clipping where DeepSpeed does not clip
        (clips_itself), then engine.step. Returns (grad norm, 1.0 if the step
        was skipped else 0.0): DeepSpeed's fp16 path skips an overflowing step
        itself, deciding over the model-parallel group (the mpu) as Megatron.

        Under stages (ZeRO 0 or 1), as in DeepSpeed's PipelineEngine: our
        schedule ran backward on the last stage's loss divided by the
        accumulation and passed through `scale`, as engine.backward does
        (config.py refuses the 16-bit optimizers that scale otherwise), and the
        gradients stayed local. So the tied embedding's are summed over its two
        stages, then DeepSpeed averages them over the data-parallel group."""
        engine = self.engine
        if parallel.layout.pp_size > 1:
            tied = pipeline.tied_embedding_copy(engine.module)
            if tied is not None:  # ZeRO-1 may hold the grad in its own accumulator
                grad = engine.optimizer.get_gradient_for_reduction(tied) \
                    if hasattr(engine.optimizer, "get_gradient_for_reduction") else tied.grad
                dist.all_reduce(grad, group=parallel.layout.embedding_group)
            engine.set_gradient_accumulation_boundary(True)
            engine.allreduce_gradients()
        grad_norm = None
        if clips_itself(engine.zero_optimization_stage(), self.cfg):
            max_norm = self.cfg.clip_grad if self.cfg.clip_grad > 0 else float("inf")
            grad_norm = self.clip_grad_norm_(engine.module.parameters(), max_norm)
        engine.step()  # clips where we did not, and then reports the norm
        if grad_norm is None:
            grad_norm = engine.get_global_grad_norm()
        return float(grad_norm), float(not engine.was_step_applied())

    def save(self, iteration: int, consumed: int) -> None:
        checkpoint.save_deepspeed_checkpoint(self.cfg, self.engine, iteration, consumed, self.log)

    def close(self) -> None:
        self.engine.destroy()  # without it ZeRO-3 under gloo sometimes aborts at exit
        torch.nn.functional.linear = self.linear


def clips_itself(stage: int, cfg: TrainConfig) -> bool:
    """Whether we clip (and measure) gradients, not DeepSpeed: its fp32 stage-0
    clipping sums the squared norms in float64 on the host, so its clip factor
    differs from the plain path's in the last bit, which Adam amplifies on
    near-zero gradients into a visible drift; and it reports no norm there."""
    return stage == 0 and not (cfg.bf16 or cfg.fp16)

