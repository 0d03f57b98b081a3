"""Compile every Triton kernel config in fused_kernels.py ahead of time for an NVIDIA
GPU (H100, sm_90, by default) and check that each one fits the GPU.

Why: the kernels' correctness tests run on CPU through Triton's interpreter,
which never generates GPU code, and the development machine has no GPU. This
script is the evidence that the real GPU code builds: Triton compiles each
kernel to PTX and the bundled ptxas assembles it for the target, no device
needed. For every compile it records

* shared memory per block (what the launcher requests; it must not exceed the
  per-block limit: 232448 bytes = 227 KB on sm_90, 166912 on sm_80),
* registers per thread and spill bytes (STACK + LOCAL from cuobjdump: the
  stack frame ptxas sets up for values that do not fit in registers),
* ptxas's performance warnings (e.g. wgmma serialized for lack of registers).

It covers every attention kernel x autotune config x head dim (32, 64, 128)
x dtype (bf16, fp16, fp32), causal (the only mask the model uses), the
backward preprocess kernel, and LayerNorm forward/backward (plain and with
the fused residual add) for hidden sizes 768 to 16384, bf16 and fp32, with
the block size and warps fused_kernels._layer_norm_config picks. Arguments are
typed and specialised as the launchers in fused_kernels.py call them (see KERNELS).

A config over the shared-memory limit "does not fit": triton.autotune skips
it at run time, so that is fine as long as at least one config fits for every
(kernel, shape, dtype). The script exits non-zero, naming the combination,
when one has no fitting config, when a 16-bit attention config that autotune
keeps spills registers or has a ptxas performance warning (fp32 attention
spills in every config at head dim >= 64, and is reported, not failed), when
a compile fails for a reason other than resources, or when fused_kernels.py has a
`*_kernel` function with no entry in KERNELS below. It says nothing about speed: that needs a GPU
(bench/bench_kernels.py).

    python bench/check_compile.py                 # everything for H100: 549 compiles, ~55 min on 2 cores
    python bench/check_compile.py --quick         # bf16, worst-case config per kernel: ~30 s (CI test)
    python bench/check_compile.py --dtypes bf16 fp16   # skip fp32, the slow three quarters
    python bench/check_compile.py --arch 80       # A100
    python bench/check_compile.py --non-causal --per-config --jobs 4

Every run compiles from scratch into a temporary Triton cache, so that each
config really goes through ptxas and its log (performance warnings such as
serialized wgmma instructions) can be reported; ~/.triton/cache is untouched.
"""
import argparse
import contextlib
import io
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Callable

# fused_kernels.py decides at import time whether @triton.jit gives compilable GPU
# functions or interpreter objects; this script needs the former.
os.environ["TRITON_INTERPRET"] = "0"
# Triton 3.9 fuses mul+add into FMA unless told otherwise, and warns that the
# default will change; compile what the training run gets, without the warning.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import fused_kernels  # noqa: E402

MODULES = (fused_kernels,)  # where check_compile looks for *_kernel functions

# Largest dynamic shared memory one block may request (cudaDevAttrMax-
# SharedMemoryPerBlockOptin), the figure Triton's launcher checks against.
# sm_90 also reserves 1 KB per block for the system (cuobjdump's SHARED:1024),
# which is outside this limit.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
REGISTERS_PER_BLOCK = 65536  # 32-bit registers one block may use (sm_80/sm_90)

HEAD_DIMS = fused_kernels.SUPPORTED_HEAD_DIMS
ATTN_DTYPES = ("bf16", "fp16", "fp32")
LN_HIDDEN = (768, 1024, 1600, 4096, 8192, 16384)
LN_DTYPES = ("bf16", "fp32")
QUICK_LN_HIDDEN = (768, 16384)


# ---------------------------------------------------------------------------
# What gets compiled. A "case" is one shape/dtype a kernel is launched with
# (a dict such as {"D": 64, "dtype": "bf16", "causal": True}); for each case a
# kernel entry gives its argument types, the constexprs its launcher fixes,
# and the candidate configs (constexprs + launch options) autotuning chooses
# from.
#
# Argument types are Triton signature strings ("*bf16", "i32", "fp32"). An int
# argument whose value the launcher always knows is given as a sample value
# instead, and specialised the way Triton's launcher does at run time
# (multiples of 16 are marked divisible by 16, which enables vector loads).
# Pointers are always marked 16-byte aligned: torch allocations are, and the
# launchers pass .contiguous() tensors. This matters: unaligned pointers
# disable the cp.async pipeline and halve the shared memory the attention
# kernels use, which would make this check optimistic.
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    constexprs: dict  # e.g. {"BLOCK_M": 128, "BLOCK_N": 64}
    options: dict     # e.g. {"num_warps": 8, "num_stages": 3}; {} = Triton's defaults


@dataclass(frozen=True)
class Kernel:
    name: str                                # short name for the report
    function: str                            # the @triton.jit function in fused_kernels.py
    cases: Callable[[argparse.Namespace], list]
    args: Callable[[dict], dict]             # case -> {argument: type string or sample int}
    constexprs: Callable[[dict], dict]       # case -> constexprs fixed by the launcher
    configs: Callable[[dict], list]          # case -> [Config]


def from_autotune(triton_configs) -> list:
    """triton.Config -> Config: its constexprs, and the launch options it sets
    (warps, stages, and maxnreg etc. when given), as autotune launches it."""
    return [Config(dict(c.kwargs), {k: v for k, v in c.all_kwargs().items() if k not in c.kwargs})
            for c in triton_configs]


def attention_cases(opts):
    """Every head dim and dtype, causal; multi-head (GROUP 1, the GPT-2 shape)
    and grouped-query with 4 query heads a key/value head (16-bit only)."""
    return [{"D": d, "dtype": t, "causal": c, "group": g}
            for d, t, c in itertools.product(HEAD_DIMS, opts.dtypes, opts.causal)
            for g in ((1,) if t == "fp32" else (1, 4))]


def head_dim_cases(opts):
    return [{"D": d, "dtype": t} for d, t in itertools.product(HEAD_DIMS, opts.dtypes)]


def layer_norm_fwd_cases(opts):
    """Plain LayerNorm, and the fused residual add (HAS_RESIDUAL) with a
    residual of x's dtype or, under autocast, a bf16 branch output added into
    an fp32 residual stream; each as LayerNorm and as RMSNorm (RMS)."""
    dtypes = [t for t in LN_DTYPES if t in opts.dtypes]
    residuals = {"bf16": (None, "bf16"), "fp32": (None, "fp32", "bf16")}
    return [{"N": n, "dtype": t, "res": r, "rms": rms}
            for n, t, rms in itertools.product(opts.ln_hidden, dtypes, (False, True))
            for r in residuals[t]]


def layer_norm_bwd_cases(opts):
    """Plain LayerNorm, and the fused residual add's backward (HAS_DSUM), as
    LayerNorm and as RMSNorm (RMS). All tensors are in one dtype: that of
    the saved sum."""
    dtypes = [t for t in LN_DTYPES if t in opts.dtypes]
    return [{"N": n, "dtype": t, "dsum": d, "rms": rms}
            for n, t, d, rms in itertools.product(opts.ln_hidden, dtypes, (False, True), (False, True))]


def loss_cases(opts):
    return [{"N": 50304, "dtype": t} for t in LN_DTYPES if t in opts.dtypes]


def attention_constexprs(case):
    # as _attn_forward: exact fp32 products for fp32 inputs
    return {"HEAD_DIM": case["D"], "CAUSAL": case["causal"], "GROUP": case["group"],
            "DOT_PRECISION": "ieee" if case["dtype"] == "fp32" else "tf32"}


def layer_norm_fwd_args(case):
    # SUM holds x + res in the promoted dtype; without a residual the
    # launcher passes x itself for the unused RES and SUM. A bf16 residual
    # into an fp32 stream is autocast, where Y is written in bf16.
    x = case["dtype"]
    res = case["res"] or x
    out = "fp32" if "fp32" in (x, res) else x
    y = "bf16" if res == "bf16" else out
    return {"X": f"*{x}", "RES": f"*{res}", "W": "*fp32", "B": "*fp32", "Y": f"*{y}",
            "SUM": f"*{out}", "MEAN": "*fp32", "RSTD": "*fp32",
            "M": "i32", "N": case["N"], "eps": "fp32"}


def layer_norm_config(case):
    block_n, rows, num_warps = fused_kernels._layer_norm_config(case["N"])
    return [Config({"BLOCK_N": block_n, "ROWS": rows}, {"num_warps": num_warps})]


# T (sequence length) is any value, so it is left unspecialised: the variant
# for lengths that are not multiples of 16, which generate() runs through.
# T_BUCKET is a power of two >= 16. LayerNorm weights are fp32 for bf16 and
# fp32 activations, as under the model's mixed precision; MEAN/RSTD/LSE/DELTA
# and the dW/dB partial sums are always fp32.
# Strides are sample values from GPT-2 124M at T=1024 (C=768, so q, k, v are
# views of the (B, T, 3C) projection and o is (B, T, H, D) in memory); like
# the real ones they are multiples of 16, which Triton specialises on.
def attention_args(c, grads=()):
    D, t = c["D"], c["dtype"]
    # K and V (any number of key/value heads: GROUP query heads each) are
    # views of the same projection as Q
    args = {"Q": f"*{t}", "K": f"*{t}", "V": f"*{t}", "LSE": "*fp32", "T": "i32", "H": "i32",
            "stride_qb": 1024 * 3 * 768, "stride_qh": D, "stride_qt": 3 * 768,
            "stride_kb": 1024 * 3 * 768, "stride_kh": D, "stride_kt": 3 * 768,
            "qk_scale": "fp32", "T_BUCKET": 1024}
    if not grads:  # forward: writes O
        return {**args, "O": f"*{t}", "stride_ob": 1024 * 768, "stride_oh": D, "stride_ot": 768}
    return {**args, "DO": f"*{t}", "DELTA": "*fp32", **{g: f"*{t}" for g in grads},
            "stride_dob": 1024 * 768, "stride_doh": D, "stride_dot": 768,
            "stride_gb": 1024 * 768, "stride_gh": D, "stride_gt": 768, "sm_scale": "fp32"}


def attention_configs(kernel_name):
    """The autotune candidates for a case, after the pruning autotune applies."""
    import torch
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    return lambda c: from_autotune([cfg for cfg in fused_kernels._attn_configs(kernel_name)
                                    if fused_kernels._keep_attn_config(cfg, kernel_name, c["D"], dtypes[c["dtype"]],
                                                                 c["group"])])


KERNELS = [
    Kernel("attn_fwd", "_attn_fwd_kernel", attention_cases, attention_args,
           attention_constexprs, attention_configs("fwd")),
    Kernel("attn_bwd_preprocess", "_attn_bwd_preprocess_kernel", head_dim_cases,
           lambda c: {"O": f"*{c['dtype']}", "DO": f"*{c['dtype']}", "DELTA": "*fp32", "T": "i32",
                      "H": "i32", "stride_ob": 1024 * 768, "stride_oh": c["D"], "stride_ot": 768,
                      "stride_dob": 1024 * 768, "stride_doh": c["D"], "stride_dot": 768},
           # _attn_backward launches it with BLOCK_M=64, default warps/stages
           lambda c: {"HEAD_DIM": c["D"]}, lambda c: [Config({"BLOCK_M": 64}, {})]),
    Kernel("attn_bwd_dkdv", "_attn_bwd_dkdv_kernel", attention_cases,
           lambda c: attention_args(c, grads=("DK", "DV")),
           attention_constexprs, attention_configs("dkdv")),
    Kernel("attn_bwd_dq", "_attn_bwd_dq_kernel", attention_cases,
           lambda c: attention_args(c, grads=("DQ",)),
           attention_constexprs, attention_configs("dq")),
    Kernel("layer_norm_fwd", "_layer_norm_fwd_kernel", layer_norm_fwd_cases,
           layer_norm_fwd_args, lambda c: {"HAS_RESIDUAL": c["res"] is not None, "RMS": c["rms"]},
           layer_norm_config),
    # the fused loss's row passes over a chunk of logits (bf16 under autocast, fp32
    # without), at GPT-2's 50304-row vocabulary and the block the launcher picks
    Kernel("loss_row_stats", "_row_stats_kernel", loss_cases,
           lambda c: {"Z": f"*{c['dtype']}", "LABELS": "*i64", "MAX": "*fp32", "SUMEXP": "*fp32",
                      "TARGET": "*fp32", "V": 50304, "stride_z": 50304, "vocab_start": "i32"},
           lambda c: {}, lambda c: [Config({"BLOCK_V": 4096}, {})]),
    Kernel("loss_row_grad", "_row_grad_kernel", loss_cases,
           lambda c: {"Z": f"*{c['dtype']}", "LABELS": "*i64", "LSE": "*fp32", "WEIGHT": "*fp32",
                      "V": 50304, "stride_z": 50304, "vocab_start": "i32"},
           lambda c: {}, lambda c: [Config({"BLOCK_V": 4096}, {})]),
    Kernel("layer_norm_bwd", "_layer_norm_bwd_kernel", layer_norm_bwd_cases,
           lambda c: {"X": f"*{c['dtype']}", "W": "*fp32", "DY": f"*{c['dtype']}",
                      "DSUM": f"*{c['dtype']}", "DX": f"*{c['dtype']}", "MEAN": "*fp32",
                      "RSTD": "*fp32", "DW_PARTIAL": "*fp32", "DB_PARTIAL": "*fp32",
                      "M": "i32", "N": c["N"]},
           lambda c: {"HAS_DSUM": c["dsum"], "RMS": c["rms"]}, layer_norm_config),
]


def uncovered_kernels() -> list:
    """Launchable kernels in fused_kernels.py (by convention the
    @triton.jit functions named *_kernel; the others are helpers inlined into
    them) with no entry in KERNELS, so that a new kernel cannot silently go
    unchecked."""
    covered = {k.function for k in KERNELS}
    return sorted(name for module in MODULES for name, obj in vars(module).items()
                  if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel")
                  and name not in covered)


# ---------------------------------------------------------------------------
# Compiling one config (runs in a worker process)
# ---------------------------------------------------------------------------
def case_label(case) -> str:
    shape = f"D={case['D']}" if "D" in case else f"N={case['N']}"
    mask = {True: " causal", False: " non-causal"}.get(case.get("causal"), "")
    fused = f" +res {case['res']}" if case.get("res") else " +dsum" if case.get("dsum") else ""
    rms = " rms" if case.get("rms") else ""
    gqa = f" gqa{case['group']}" if case.get("group", 1) > 1 else ""
    return f"{shape} {case['dtype']}{mask}{gqa}{fused}{rms}"


def config_label(config: Config, metadata=None) -> str:
    short = {"BLOCK_M": "BM", "BLOCK_N": "BN", "ROWS": "R"}
    parts = [f"{short.get(k, k)}{v}" for k, v in config.constexprs.items()]
    warps = metadata.num_warps if metadata else config.options.get("num_warps", "?")
    stages = metadata.num_stages if metadata else config.options.get("num_stages", "?")
    return " ".join(parts + [f"w{warps}", f"s{stages}"])


def build_source(kernel: Kernel, case: dict, config: Config) -> ASTSource:
    fn = next(getattr(m, kernel.function) for m in MODULES if hasattr(m, kernel.function))
    constexprs = {**kernel.constexprs(case), **config.constexprs}
    given = {**kernel.args(case), **{name: "constexpr" for name in constexprs}}
    missing = [a for a in fn.arg_names if a not in given]
    extra = [a for a in given if a not in fn.arg_names]
    if missing or extra:  # fused_kernels.py changed the kernel's arguments
        raise ValueError(f"{kernel.function}({', '.join(fn.arg_names)}): the KERNELS entry "
                         f"lacks {missing} / has unknown {extra}; update bench/check_compile.py")
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        kind = given[name]
        if isinstance(kind, int):  # a sample value: specialise it as the launcher would
            signature[name] = "i32"
            if kind % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = kind
            if kind.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def cuda_tools() -> list:
    """Paths of the ptxas builds (one for sm_80-89, one for sm_90+) and the
    cuobjdump that Triton's wheel bundles; raises RuntimeError if one is missing."""
    nvidia = triton.knobs.nvidia
    return [nvidia.ptxas.path, nvidia.ptxas_blackwell.path, nvidia.cuobjdump.path]


def resource_usage(cubin: bytes, workdir: str) -> dict:
    """Registers and spill bytes of the one kernel in a cubin, from cuobjdump:
    read from the binary itself, so it holds whatever ptxas's log looks like."""
    path = os.path.join(workdir, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    cuobjdump = triton.knobs.nvidia.cuobjdump.path  # bundled with Triton (or TRITON_CUOBJDUMP_PATH)
    out = subprocess.run([cuobjdump, "--dump-resource-usage", path],
                         capture_output=True, text=True, check=True).stdout
    usage = {key: int(re.search(rf"\b{key}:(\d+)", out).group(1)) for key in ("REG", "STACK", "LOCAL")}
    return {"regs": usage["REG"], "spill": usage["STACK"] + usage["LOCAL"]}


def ptxas_warnings(log: str) -> list:
    """ptxas's performance warnings, e.g. "wgmma.mma_async instructions are
    serialized due to insufficient register resources": the kernel runs, but
    its matmuls lose their overlap, which the register count alone hides."""
    found = re.findall(r"Potential Performance Loss:\s*(.*)", log)
    return sorted({re.sub(r" for the function '\w+'", "", w).strip() for w in found})


def is_resource_error(exc: Exception) -> bool:
    """Errors that mean "this config is too big", which the autotuner skips too."""
    if isinstance(exc, triton.OutOfResources):
        return True
    text = str(exc).lower()
    return "ptxas" in type(exc).__name__.lower() and ("resource" in text or "too much" in text)


def compile_configs(task) -> list:
    """Compile a case's configs in order. With first_fit, stop at the first
    config that fits (quick mode: worst case first, smaller ones only if it
    does not fit). Returns one record per compile."""
    kernel_name, case, configs, first_fit, arch, shared_limit = task
    kernel = next(k for k in KERNELS if k.name == kernel_name)
    target = GPUTarget("cuda", arch, 32)
    records = []
    with tempfile.TemporaryDirectory() as workdir:
        for config in configs:
            rec = {"kernel": kernel_name, "case": case_label(case), "config": config_label(config),
                   "status": "error", "shared": None, "regs": None, "spill": None, "why": "",
                   "warnings": []}
            start = time.perf_counter()
            log = io.StringIO()  # Triton prints the ptxas log (TRITON_DUMP_PTXAS_LOG) here
            try:
                with contextlib.redirect_stdout(log):
                    compiled = triton.compile(build_source(kernel, case, config), target=target,
                                              options=dict(config.options))
                rec["warnings"] = ptxas_warnings(log.getvalue())
                meta = compiled.metadata
                rec.update(config=config_label(config, meta), shared=meta.shared,
                           **resource_usage(compiled.asm["cubin"], workdir))
                threads = meta.num_warps * 32
                if meta.shared > shared_limit:
                    rec.update(status="too big", why=f"shared {meta.shared} > {shared_limit}")
                # registers are handed out in steps of 8 per thread; ptxas keeps
                # within the block's share (the PTX names the thread count), so
                # this only guards against a launch the driver would refuse
                elif -(-rec["regs"] // 8) * 8 * threads > REGISTERS_PER_BLOCK:
                    rec.update(status="too big", why=f"{rec['regs']} regs x {threads} threads")
                else:
                    rec["status"] = "fits"
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                rec.update(status="too big" if is_resource_error(exc) else "error",
                           why=f"{type(exc).__name__}: {first_line}"[:300])
            rec["seconds"] = time.perf_counter() - start
            records.append(rec)
            if first_fit and rec["status"] == "fits":
                break
    return records


# ---------------------------------------------------------------------------
# Driver: build the tasks, run them in a pool, summarise
# ---------------------------------------------------------------------------
def worst_case_first(configs) -> list:
    """Largest tiles, then most pipeline stages (both grow shared memory), then
    fewest warps (most registers per thread)."""
    def size(c):
        tile = 1
        for name, value in c.constexprs.items():
            if name.startswith("BLOCK") or name == "ROWS":
                tile *= value
        return (tile, c.options.get("num_stages", 0), -c.options.get("num_warps", 0))
    return sorted(configs, key=size, reverse=True)


def make_tasks(opts) -> list:
    tasks = []
    for kernel in KERNELS:
        for case in kernel.cases(opts):
            configs = kernel.configs(case)
            if opts.quick:
                tasks.append((kernel.name, case, worst_case_first(configs), True, opts.arch,
                              opts.shared_limit))
            else:
                tasks += [(kernel.name, case, [c], False, opts.arch, opts.shared_limit)
                          for c in configs]
    return tasks


def summarise(records, opts) -> list:
    """Print one row per (kernel, case); return the problems that fail the run."""
    groups = {}
    for rec in records:
        groups.setdefault((rec["kernel"], rec["case"]), []).append(rec)
    order = {k.name: i for i, k in enumerate(KERNELS)}

    def group_key(key):
        kernel, case = key
        nums = [int(n) for n in re.findall(r"\d+", case.split()[0])]
        return order[kernel], nums, case

    kb = lambda b: f"{b / 1024:.0f}" if b >= 10240 else f"{b / 1024:.1f}"  # noqa: E731
    print("| kernel | case | configs fit / compiled | shared KB (min-max) "
          "| max regs | spills | ptxas performance warnings |")
    print("|---|---|---|---|---|---|---|")
    problems, too_big, spilled, warned = [], [], [], []
    for key in sorted(groups, key=group_key):
        recs = groups[key]
        built = [r for r in recs if r["shared"] is not None]
        fits = [r for r in recs if r["status"] == "fits"]
        shared = sorted(r["shared"] for r in built)
        shared_txt = f"{kb(shared[0])}-{kb(shared[-1])}" if shared else "-"
        if shared and shared[0] == shared[-1]:
            shared_txt = kb(shared[0])
        regs = max((r["regs"] for r in built), default=None)
        spills = [r for r in built if r["spill"]]
        spill_txt = (f"{len(spills)} configs, up to {max(r['spill'] for r in spills)} B"
                     if spills else "none")
        warns = [r for r in built if r["warnings"]]
        warn_txt = f"{len(warns)} configs" if warns else "none"
        print(f"| {key[0]} | {key[1]} | {len(fits)} / {len(recs)} | {shared_txt} "
              f"| {regs if regs is not None else '-'} | {spill_txt} | {warn_txt} |")
        too_big += [r for r in recs if r["status"] == "too big"]
        spilled += spills
        warned += warns
        for r in recs:
            if r["status"] == "error":
                problems.append(f"{r['kernel']} {r['case']} [{r['config']}] failed to compile: {r['why']}")
        if not fits:
            problems.append(f"{key[0]} {key[1]}: no config fits the sm_{opts.arch} limits")
        if key[0].startswith("attn_") and "fp32" not in key[1]:
            # 16-bit attention is what models train with: every config that
            # autotune may pick must run without spills or serialized wgmma
            problems += [f"{r['kernel']} {r['case']} [{r['config']}]: autotune keeps it, but it "
                         f"{'spills ' + str(r['spill']) + ' B' if r['spill'] else 'has ptxas warnings'}: "
                         f"drop it from fused_kernels.py's ATTN_CONFIGS / _D128 / GQA_DKDV_CONFIGS"
                         for r in built if r["spill"] or r["warnings"]]

    if too_big:
        print("\nConfigs that do not fit (triton.autotune skips them on the GPU):")
        for r in too_big:
            print(f"  {r['kernel']} {r['case']} [{r['config']}]: {r['why']}")
    if spilled:
        print("\nConfigs that spill registers to local memory (they run, slowly):")
        for r in spilled:
            print(f"  {r['kernel']} {r['case']} [{r['config']}]: {r['regs']} regs, {r['spill']} B spilled")
    if warned:
        print("\nConfigs with ptxas performance warnings:")
        for r in warned:
            print(f"  {r['kernel']} {r['case']} [{r['config']}]: {'; '.join(r['warnings'])}")
    if opts.per_config:
        print("\n| kernel | case | config | status | shared B | regs | spill B | s |")
        print("|---|---|---|---|---|---|---|---|")
        for r in sorted(records, key=lambda r: (group_key((r["kernel"], r["case"])), r["config"])):
            print(f"| {r['kernel']} | {r['case']} | {r['config']} | {r['status']} | {r['shared']} "
                  f"| {r['regs']} | {r['spill']} | {r['seconds']:.1f} |")
    return problems


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x10: 90 = H100, 80 = A100")
    p.add_argument("--shared-limit", type=int, default=None,
                   help="shared memory bytes per block (default: known value for --arch)")
    p.add_argument("--quick", action="store_true",
                   help="bf16 only, the worst-case config per kernel and head dim, LayerNorm at "
                        f"{' and '.join(map(str, QUICK_LN_HIDDEN))}")
    p.add_argument("--dtypes", nargs="+", choices=ATTN_DTYPES, default=None,
                   help="input dtypes (default: all; bf16 with --quick). fp32 is ~3/4 of the "
                        "full run's time: its tiles are twice as large and spill heavily")
    p.add_argument("--non-causal", action="store_true", help="also compile the non-causal variants")
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="worker processes")
    p.add_argument("--per-config", action="store_true", help="also print one row per compile")
    opts = p.parse_args(argv)
    if opts.shared_limit is None:
        if opts.arch not in SHARED_LIMIT:
            p.error(f"no known shared-memory limit for sm_{opts.arch}; pass --shared-limit")
        opts.shared_limit = SHARED_LIMIT[opts.arch]
    if opts.dtypes is None:
        opts.dtypes = ("bf16",) if opts.quick else ATTN_DTYPES
    opts.causal = (True, False) if opts.non_causal else (True,)
    opts.ln_hidden = QUICK_LN_HIDDEN if opts.quick else LN_HIDDEN
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    try:
        cuda_tools()
    except RuntimeError as exc:
        sys.exit(f"check_compile.py: {exc} (Triton's bundled CUDA tools are missing)")
    missing = uncovered_kernels()
    tasks = make_tasks(opts)
    n_configs = sum(len(t[2]) for t in tasks)
    mode = "quick: worst-case config first" if opts.quick else "every autotune config"
    print(f"## Ahead-of-time compile for sm_{opts.arch} (triton {triton.__version__}, {mode}; "
          f"shared limit {opts.shared_limit} B)\n", flush=True)
    print(f"{len(tasks)} tasks, up to {n_configs} compiles, {opts.jobs} workers",
          file=sys.stderr, flush=True)

    start = time.perf_counter()
    records = []
    # A fresh Triton cache, so that every config really goes through ptxas
    # (not an old artifact) and ptxas's log, with its performance warnings, is
    # there to read; the workers inherit these variables.
    with tempfile.TemporaryDirectory(prefix="check_compile_cache_") as cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
        os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
        with ProcessPoolExecutor(max_workers=opts.jobs) as pool:
            futures = [pool.submit(compile_configs, t) for t in tasks]
            for done, future in enumerate(as_completed(futures), 1):
                records += future.result()
                if done % 25 == 0 or done == len(futures):
                    print(f"  [{done}/{len(futures)}] {time.perf_counter() - start:.0f} s",
                          file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start

    problems = summarise(records, opts)
    problems += [f"{name}: fused_kernels.py defines it but bench/check_compile.py has no KERNELS "
                 f"entry for it" for name in missing]
    fits = sum(r["status"] == "fits" for r in records)
    print(f"\n{len(records)} compiles in {elapsed:.0f} s with {opts.jobs} workers: {fits} fit, "
          f"{sum(r['status'] == 'too big' for r in records)} too big, "
          f"{sum(r['status'] == 'error' for r in records)} errors.")
    if problems:
        print("\nFAILED:\n" + "\n".join(f"  {p}" for p in problems))
        return 1
    print(f"OK: every kernel has a config that compiles and fits sm_{opts.arch}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
