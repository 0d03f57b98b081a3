"""Tests for fused_kernels.py: Triton FlashAttention-2, fused LayerNorm / RMSNorm and
the fused loss's row kernels, also as custom ops under torch.compile.

Without a GPU, conftest.py sets TRITON_INTERPRET=1 so the very same kernels
run on CPU tensors through Triton's interpreter (slow, hence tiny shapes).
Every kernel result is compared with a float64 PyTorch reference; the
tolerance scales with the dtype and with the size of the reference values.
Tests marked `gpu` run the compiled kernels at realistic sizes.
"""
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fused_kernels
import fused_loss
import parallel
from conftest import run_bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# relative-to-scale tolerance per dtype: |got - ref| <= TOL * max|ref|
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def assert_close(got, ref, dtype, what):
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    err = (got.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= TOL[dtype] * max(scale, 1e-6), f"{what}: max err {err:.3g} vs scale {scale:.3g}"


def attention_reference(q, k, v, do, causal=True, sm_scale=None):
    """Output and (dq, dk, dv) of SDPA computed in float64."""
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o64 = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, scale=sm_scale)
    o64.backward(do.double())
    return o64.detach(), q64.grad, k64.grad, v64.grad


def run_flash(q, k, v, do, **kw):
    q, k, v = [t.detach().requires_grad_() for t in (q, k, v)]
    o = fused_kernels.flash_attention(q, k, v, **kw)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def check_attention(B, H, T, D, dtype, causal=True, sm_scale=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = [torch.randn(B, H, T, D, generator=g).to(DEVICE, dtype) for _ in range(4)]
    got = run_flash(q, k, v, do, causal=causal, sm_scale=sm_scale)
    ref = attention_reference(q, k, v, do, causal=causal, sm_scale=sm_scale)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert_close(a, b, dtype, f"{name} (T={T}, D={D}, {dtype})")


# ---------------------------------------------------------------------------
# attention, on the interpreter (or GPU when present)

# Covers every head dim, every dtype, ragged T (37 is not a multiple of the
# 16-wide blocks), several blocks per sequence (T=64) and B > 1, without
# the full cross product (the interpreter is slow).
@pytest.mark.parametrize("B,H,T,D,dtype", [
    (1, 2, 37, 32, torch.float32),
    (2, 2, 64, 64, torch.float32),
    (1, 2, 16, 128, torch.float32),
    (1, 2, 37, 64, torch.float16),
    (2, 2, 37, 128, torch.bfloat16),
    (1, 2, 64, 32, torch.bfloat16),
])
@pytest.mark.quick
def test_flash_attention_matches_float64_sdpa(B, H, T, D, dtype):
    check_attention(B, H, T, D, dtype)


@pytest.mark.quick
def test_flash_attention_custom_scale_and_non_causal():
    check_attention(1, 2, 37, 32, torch.float32, causal=False, sm_scale=0.3)


def qkv_views(B, T, H, D, dtype=torch.float32):
    """q, k, v as the model makes them: (B, H, T, D) transposed views of one
    fused (B, T, 3*H*D) projection output, so none is contiguous."""
    qkv = torch.randn(B, T, 3 * H * D, device=DEVICE).to(dtype)
    return [t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2)]


@pytest.mark.parametrize("do_layout", ["model", "contiguous", "last-dim-strided"])
def test_flash_attention_accepts_non_contiguous_inputs(do_layout):
    B, T, H, D = 2, 37, 2, 32
    q, k, v = qkv_views(B, T, H, D)
    assert not q.is_contiguous()
    do = {"model": torch.randn(B, T, H, D).transpose(1, 2),      # grad of the (B, T, C) reshape
          "contiguous": torch.randn(B, H, T, D),
          "last-dim-strided": torch.randn(B, H, D, T).transpose(-1, -2)}[do_layout].to(DEVICE)
    for a, b in zip(run_flash(q, k, v, do), attention_reference(q, k, v, do)):
        assert_close(a, b, torch.float32, f"non-contiguous, do {do_layout}")


def test_flash_attention_reads_the_qkv_projection_in_place(monkeypatch):
    """No copies of q, k, v (or of the model's do): every kernel launch gets
    their own memory, and o and the gradients come out laid out as (B, T, H,
    D), so the model's reshape back to (B, T, C) is free too."""
    B, T, H, D = 2, 37, 2, 32
    qkv = torch.randn(B, T, 3 * H * D, device=DEVICE, requires_grad=True)
    q, k, v = [t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2)]
    do = torch.randn(B, T, H, D, device=DEVICE).transpose(1, 2)
    launches = []
    real_launch = fused_kernels._launch_attn

    def spy(name, num_rows, bh, *args, **kw):
        launches.append((name, [a.data_ptr() for a in args if torch.is_tensor(a)]))
        return real_launch(name, num_rows, bh, *args, **kw)

    monkeypatch.setattr(fused_kernels, "_launch_attn", spy)
    o = fused_kernels.flash_attention(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert [name for name, _ in launches] == ["fwd", "dkdv", "dq"]
    for name, ptrs in launches:
        assert ptrs[:3] == [q.data_ptr(), k.data_ptr(), v.data_ptr()], name
    assert launches[1][1][3] == launches[2][1][3] == do.data_ptr()  # DO, in dK/dV and dQ
    for t in (o, *grads):
        assert t.transpose(1, 2).is_contiguous()


@pytest.mark.quick
def test_first_query_attends_only_to_itself():
    # causal: output row 0 must equal v row 0 exactly, whatever the keys are
    q, k, v = [torch.randn(1, 2, 37, 32, device=DEVICE) for _ in range(3)]
    o = fused_kernels.flash_attention(q, k, v)
    torch.testing.assert_close(o[:, :, 0], v[:, :, 0], rtol=1e-6, atol=1e-6)


@pytest.mark.quick
@pytest.mark.parametrize("D", [16, 48, 256])
def test_unsupported_head_dim_is_a_clear_error(D):
    q = torch.randn(1, 2, 16, D, device=DEVICE)
    with pytest.raises(ValueError, match="head dims"):
        fused_kernels.flash_attention(q, q, q)


@pytest.mark.quick
def test_mismatched_shapes_are_a_clear_error():
    q = torch.randn(1, 3, 16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="k, v \\(B, G, T, D\\)"):
        fused_kernels.flash_attention(q, q[:, :, :8], q)
    with pytest.raises(ValueError, match="G dividing H"):  # 2 key/value heads for 3 query heads
        fused_kernels.flash_attention(q, q[:, :2], q[:, :2])


# Grouped-query attention: G key/value heads, each read by H/G query heads.
def attention_reference_gqa(q, k, v, do):
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o64 = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, enable_gqa=True)
    o64.backward(do.double())
    return o64.detach(), q64.grad, k64.grad, v64.grad


@pytest.mark.parametrize("B,H,G,T,D,dtype", [
    (2, 4, 2, 37, 32, torch.float32),   # 2 query heads per key/value head, ragged T
    (1, 4, 1, 20, 64, torch.float32),   # multi-query attention: one shared head
    (1, 6, 2, 33, 32, torch.bfloat16),
])
@pytest.mark.quick
def test_grouped_query_flash_attention_matches_float64_sdpa(B, H, G, T, D, dtype):
    g = torch.Generator().manual_seed(0)
    q, do = [torch.randn(B, H, T, D, generator=g).to(DEVICE, dtype) for _ in range(2)]
    k, v = [torch.randn(B, G, T, D, generator=g).to(DEVICE, dtype) for _ in range(2)]
    got = run_flash(q, k, v, do)
    assert got[2].shape == k.shape  # dK, dV: summed over the query heads of each group
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, attention_reference_gqa(q, k, v, do)):
        assert_close(a, b, dtype, f"GQA {name} (H={H}, G={G}, {dtype})")


def test_grouped_query_attention_reads_the_shared_heads_in_place(monkeypatch):
    """The kernels index key/value head h // (H/G) themselves: K and V reach
    every launch as the caller's (B, G, T, D) memory, never expanded per
    query head, and the dK/dV kernel runs one program row per key/value head."""
    B, H, G, T, D = 2, 4, 2, 20, 32
    q = torch.randn(B, H, T, D, device=DEVICE, requires_grad=True)
    kv = torch.randn(B, T, 2 * G * D, device=DEVICE, requires_grad=True)  # as the model's views
    k, v = [t.view(B, T, G, D).transpose(1, 2) for t in kv.split(G * D, dim=2)]
    launches = []
    real_launch = fused_kernels._launch_attn

    def spy(name, num_rows, bh, *args, **kw):
        launches.append((name, bh, [a.data_ptr() for a in args[1:3]]))
        return real_launch(name, num_rows, bh, *args, **kw)

    monkeypatch.setattr(fused_kernels, "_launch_attn", spy)
    fused_kernels.flash_attention(q, k, v).sum().backward()
    assert [(name, bh) for name, bh, _ in launches] == [("fwd", B * H), ("dkdv", B * G), ("dq", B * H)]
    for name, _, ptrs in launches:
        assert ptrs == [k.data_ptr(), v.data_ptr()], name


# ---------------------------------------------------------------------------
# LayerNorm

def check_layer_norm(shape, dtype, weight_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = shape[-1]
    x = torch.randn(*shape, generator=g).mul(3).add(1).to(DEVICE, dtype).requires_grad_()
    w = torch.randn(N, generator=g).to(DEVICE, weight_dtype).requires_grad_()
    b = torch.randn(N, generator=g).to(DEVICE, weight_dtype).requires_grad_()
    y = fused_kernels.layer_norm(x, w, b, eps=1e-5)
    dy = torch.randn(y.shape, generator=g).to(DEVICE, dtype)
    y.backward(dy)
    x6, w6, b6 = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y6 = F.layer_norm(x6, (N,), w6, b6, 1e-5)
    y6.backward(dy.double())
    assert y.shape == x.shape
    assert_close(y.detach(), y6.detach(), dtype, "y")
    assert_close(x.grad, x6.grad, dtype, "dx")
    # dW/dB are summed over rows in fp32, then returned in the weights' dtype
    assert_close(w.grad, w6.grad, weight_dtype, "dw")
    assert_close(b.grad, b6.grad, weight_dtype, "db")


# 3-D input, N not a power of two (masked columns), more rows than backward
# programs (so each program folds several rows into its partial dW/dB),
# every dtype, and bf16/fp16 activations with fp32 weights (mixed precision).
@pytest.mark.parametrize("shape,dtype,weight_dtype", [
    ((2, 40, 100), torch.float32, torch.float32),
    ((13, 1000), torch.float32, torch.float32),
    ((6, 64), torch.float16, torch.float16),
    ((5, 3, 96), torch.bfloat16, torch.float32),
])
@pytest.mark.quick
def test_layer_norm_matches_float64(shape, dtype, weight_dtype):
    check_layer_norm(shape, dtype, weight_dtype)


def test_triton_layernorm_module_is_a_drop_in_for_nn_layernorm():
    torch.manual_seed(0)
    ref = torch.nn.LayerNorm(48).to(DEVICE)
    with torch.no_grad():
        ref.weight.normal_(), ref.bias.normal_()
    mod = fused_kernels.TritonLayerNorm(48).to(DEVICE)
    mod.load_state_dict(ref.state_dict())  # same keys, so checkpoints are interchangeable
    x = torch.randn(3, 5, 48, device=DEVICE)
    torch.testing.assert_close(mod(x), ref(x), rtol=1e-5, atol=1e-5)
    assert isinstance(mod, torch.nn.LayerNorm)


@pytest.mark.quick
def test_layer_norm_bad_weight_shape_is_a_clear_error():
    x = torch.randn(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weight and bias must have shape"):
        fused_kernels.layer_norm(x, torch.ones(16, device=DEVICE), torch.zeros(32, device=DEVICE))


# ---------------------------------------------------------------------------
# availability checks

# Fused residual add + LayerNorm: (s, y) = (x + r, LayerNorm(x + r)), and in
# backward both s and y receive gradients (s goes on along the residual stream).
def check_add_layer_norm(shape, x_dtype, r_dtype, weight_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = shape[-1]
    x = torch.randn(*shape, generator=g).mul(3).add(1).to(DEVICE, x_dtype).requires_grad_()
    r = torch.randn(*shape, generator=g).to(DEVICE, r_dtype).requires_grad_()
    w = torch.randn(N, generator=g).to(DEVICE, weight_dtype).requires_grad_()
    b = torch.randn(N, generator=g).to(DEVICE, weight_dtype).requires_grad_()
    s, y = fused_kernels.add_layer_norm(x, r, w, b, eps=1e-5)
    sum_dtype = torch.promote_types(x_dtype, r_dtype)
    ds, dy = [torch.randn(shape, generator=g).to(DEVICE, sum_dtype) for _ in range(2)]
    torch.autograd.backward([s, y], [ds, dy])
    x6, r6, w6, b6 = [t.detach().double().requires_grad_() for t in (x, r, w, b)]
    s6 = x6 + r6
    y6 = F.layer_norm(s6, (N,), w6, b6, 1e-5)
    torch.autograd.backward([s6, y6], [ds.double(), dy.double()])
    assert_close(s.detach(), s6.detach(), sum_dtype, "s")
    assert_close(y.detach(), y6.detach(), sum_dtype, "y")
    assert_close(x.grad, x6.grad, x_dtype, "dx")
    assert_close(r.grad, r6.grad, r_dtype, "dr")
    assert_close(w.grad, w6.grad, weight_dtype, "dw")
    assert_close(b.grad, b6.grad, weight_dtype, "db")


# fp32 stream + bf16 branch is what autocast produces (the Linear's output is
# bf16, the residual stream stays fp32); all-bf16 is the pure-bf16 case.
@pytest.mark.parametrize("shape,x_dtype,r_dtype,weight_dtype", [
    ((2, 40, 100), torch.float32, torch.float32, torch.float32),
    ((3, 5, 96), torch.float32, torch.bfloat16, torch.float32),
    ((7, 64), torch.bfloat16, torch.bfloat16, torch.float32),
    ((6, 64), torch.float16, torch.float16, torch.float16),
])
@pytest.mark.quick
def test_add_layer_norm_matches_float64(shape, x_dtype, r_dtype, weight_dtype):
    check_add_layer_norm(shape, x_dtype, r_dtype, weight_dtype)


@pytest.mark.quick
def test_add_layer_norm_equals_add_then_layer_norm_exactly_in_fp32():
    """The fused kernel is the unfused pair with one memory trip fewer: the
    same numbers as fused_kernels.layer_norm applied to x + r (same kernel maths)."""
    g = torch.Generator().manual_seed(1)
    x, r = [torch.randn(4, 9, 48, generator=g).to(DEVICE) for _ in range(2)]
    mod = fused_kernels.TritonLayerNorm(48).to(DEVICE)
    s, y = mod(x, residual=r)
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)
    torch.testing.assert_close(y, mod(x + r), rtol=0, atol=0)


def test_fused_residual_add_goes_through_the_module_call():
    """ZeRO-3 gathers a module's partitioned parameters in a forward pre-hook:
    the block's fused add + ln_2 must call the ln_2 module, not bypass it."""
    import gpt
    config = gpt.GPTConfig.from_preset("tiny", num_attention_heads=2, layernorm_impl="triton")
    block = gpt.Block(config).to(DEVICE)
    calls = []
    block.ln_2.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs),
                                         with_kwargs=True)
    x = torch.randn(2, 5, config.hidden_size, device=DEVICE)
    block(x)
    assert len(calls) == 1 and "residual" in calls[0]

def test_add_layer_norm_shape_mismatch_is_a_clear_error():
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="same shape"):
        fused_kernels.add_layer_norm(x, x[:1], torch.ones(32, device=DEVICE), torch.zeros(32, device=DEVICE))


def test_triton_usable_follows_device():
    assert fused_kernels.triton_usable(DEVICE)
    assert not fused_kernels.triton_usable(torch.device("meta"))


def _run_clean(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_require_triton_on_cpu_without_interpreter_raises_helpful_error():
    code = (
        "import torch, fused_kernels\n"
        "try:\n"
        "    fused_kernels.require_triton('cpu')\n"
        "except ValueError as e:  # launch.UsageError\n"
        "    print('RAISED', e)\n"
    )
    out = _run_clean(code)
    assert out.returncode == 0, out.stderr
    assert "RAISED" in out.stdout
    assert "TRITON_INTERPRET=1" in out.stdout and "--attention-impl torch" in out.stdout


def test_module_imports_and_falls_back_without_triton():
    # sys.modules[name] = None makes `import triton` raise ImportError
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch, fused_kernels\n"
        "assert not fused_kernels.HAS_TRITON and not fused_kernels.triton_usable('cpu')\n"
        "q = torch.randn(1, 2, 8, 32)\n"
        "try:\n"
        "    fused_kernels.require_triton(q.device)\n"
        "except ValueError as e:  # launch.UsageError\n"
        "    print('RAISED', e)\n"
    )
    out = _run_clean(code)
    assert out.returncode == 0, out.stderr
    assert "not installed" in out.stdout


def test_cuda_autotuning_is_keyed_by_length_bucket_and_kept_on_disk():
    """On a GPU each attention launcher is a triton.autotune keyed by the T
    bucket, head dim, GQA group, mask and dot precision: generate() grows T
    one token per step, and keying on the exact T would re-benchmark every
    config at every step (seconds each). Triton writes the results beside
    the compiled kernels (cache_results), so a second run's first step reads
    them instead of timing every config again. Built here without the
    interpreter, as on a GPU (building needs no device)."""
    code = (
        "import fused_kernels\n"
        "for name, launcher in fused_kernels._LAUNCHERS.items():\n"
        "    print(name, launcher.keys, launcher.cache_results)\n"
    )
    out = _run_clean(code)
    assert out.returncode == 0, out.stderr
    for name in ("fwd", "dkdv", "dq"):
        assert f"{name} ['T_BUCKET', 'HEAD_DIM', 'GROUP', 'CAUSAL', 'DOT_PRECISION'] True" in out.stdout, \
            out.stdout


# ---------------------------------------------------------------------------
# RMSNorm: the LayerNorm kernels with their RMS switch (no mean, no bias)

def check_rms_norm(shape, x_dtype, weight_dtype, fused_add, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = shape[-1]
    x = torch.randn(*shape, generator=g).mul(3).add(1).to(DEVICE, x_dtype).requires_grad_()
    r = torch.randn(*shape, generator=g).to(DEVICE, x_dtype).requires_grad_()
    w = torch.randn(N, generator=g).to(DEVICE, weight_dtype).requires_grad_()
    ds, dy = [torch.randn(shape, generator=g).to(DEVICE, x_dtype) for _ in range(2)]
    x6, r6, w6 = [t.detach().double().requires_grad_() for t in (x, r, w)]
    s6 = x6 + r6 if fused_add else x6
    y6 = s6 * torch.rsqrt(s6.pow(2).mean(-1, keepdim=True) + 1e-5) * w6  # the definition
    if fused_add:
        s, y = fused_kernels.add_layer_norm(x, r, w, None, eps=1e-5)
        torch.autograd.backward([s, y], [ds, dy])
        torch.autograd.backward([s6, y6], [ds.double(), dy.double()])
        assert_close(s.detach(), s6.detach(), x_dtype, "s")
        assert_close(r.grad, r6.grad, x_dtype, "dr")
    else:
        y = fused_kernels.layer_norm(x, w, None, eps=1e-5)
        y.backward(dy)
        y6.backward(dy.double())
    assert_close(y.detach(), y6.detach(), x_dtype, "y")
    assert_close(x.grad, x6.grad, x_dtype, "dx")
    assert_close(w.grad, w6.grad, weight_dtype, "dw")


@pytest.mark.parametrize("shape,x_dtype,weight_dtype", [
    ((2, 40, 100), torch.float32, torch.float32),   # N not a power of two
    ((13, 1000), torch.float32, torch.float32),
    ((5, 3, 96), torch.bfloat16, torch.float32),    # autocast-like: bf16 rows, fp32 weight
])
@pytest.mark.quick
@pytest.mark.parametrize("fused_add", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_rms_norm_matches_float64(shape, x_dtype, weight_dtype, fused_add):
    check_rms_norm(shape, x_dtype, weight_dtype, fused_add)


def test_triton_rmsnorm_module_is_a_drop_in_for_nn_rmsnorm():
    torch.manual_seed(0)
    ref = torch.nn.RMSNorm(48, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        ref.weight.normal_()
    mod = fused_kernels.TritonRMSNorm(48, eps=1e-5).to(DEVICE)
    mod.load_state_dict(ref.state_dict())  # same key, so checkpoints are interchangeable
    x, r = torch.randn(3, 5, 48, device=DEVICE), torch.randn(3, 5, 48, device=DEVICE)
    torch.testing.assert_close(mod(x), ref(x), rtol=1e-5, atol=1e-5)
    s, y = mod(x, residual=r)
    torch.testing.assert_close(y, ref(x + r), rtol=1e-5, atol=1e-5)
    assert isinstance(mod, torch.nn.RMSNorm) and mod.fuses_residual_add


# ---------------------------------------------------------------------------
# the fused loss's row kernels (through fused_loss.span_lse_and_grad_) against their torch twins

@pytest.mark.quick
@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("vocab_start", [0, 100])  # a vocab slice: some targets are elsewhere
@pytest.mark.parametrize("need_grads", [True, False])
def test_row_kernels_match_the_torch_row_maths(vocab_start, need_grads):
    """The Triton row kernels (interpreted on CPU) and the in-place torch ops
    give the same lse, target logit and, overwriting the chunk, gradient."""
    if not (fused_kernels.HAS_TRITON and (DEVICE == "cuda" or fused_kernels.INTERPRET)):
        pytest.skip("needs triton, and TRITON_INTERPRET=1 on CPU (set by conftest.py)")
    g = torch.Generator().manual_seed(0)
    z = (4 * torch.randn(9, 203, generator=g)).to(DEVICE)          # 203: a ragged last block
    labels = torch.randint(0, 400, (9,), generator=g).to(DEVICE)
    weight = torch.rand(9, generator=g).to(DEVICE)
    results = []
    for use_triton in (True, False):
        dz = z.clone()
        lse, target = fused_loss.span_lse_and_grad_(dz, labels, weight, vocab_start, need_grads,
                                                  triton_kernels=use_triton)
        results.append((lse, target, dz))
    (lse, target, dz), (lse_t, target_t, dz_t) = results
    local = labels - vocab_start
    here = (local >= 0) & (local < z.shape[1])
    want_lse = torch.logsumexp(z, dim=-1)
    want_target = torch.where(here, z.gather(1, local.clamp(0, 202)[:, None]).squeeze(1), 0.0)
    for got in (lse, lse_t):
        torch.testing.assert_close(got, want_lse, rtol=1e-5, atol=1e-6)
    for got in (target, target_t):
        torch.testing.assert_close(got, want_target, rtol=1e-6, atol=0)
    if need_grads:
        want_dz = weight[:, None] * (torch.softmax(z, dim=-1) -
                                     torch.nn.functional.one_hot(local.clamp(0, 202), 203) * here[:, None])
        for got in (dz, dz_t):
            torch.testing.assert_close(got, want_dz, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------
# whole model: triton vs torch implementations give the same loss and grads

# head dim 32 (the kernels support 32/64/128); "llama": RoPE on q, k before
# the Triton attention, RMSNorm kernels, SwiGLU, 2 query heads sharing 1 K/V head.
@pytest.mark.parametrize("options", [
    pytest.param({}, marks=pytest.mark.quick), dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             untie_embeddings_and_output_weights=True, disable_bias_linear=True,
             num_query_groups=1, rotary_percent=0.5)], ids=["gpt2", "llama"])
def test_gpt_tiny_triton_matches_torch(options):
    import gpt
    overrides = dict(num_layers=2, hidden_size=64, num_attention_heads=2, **options)
    torch.manual_seed(0)
    ref_model = gpt.GPT(gpt.GPTConfig.from_preset("tiny", **overrides)).to(DEVICE)
    tri_model = gpt.GPT(gpt.GPTConfig.from_preset(
        "tiny", attention_impl="triton", layernorm_impl="triton", **overrides)).to(DEVICE)
    tri_model.load_state_dict(ref_model.state_dict())
    idx = torch.randint(0, 50257, (2, 37), device=DEVICE)  # ragged length
    labels = torch.randint(0, 50257, (2, 37), device=DEVICE)
    losses = []
    for model in (ref_model, tri_model):
        loss = model(idx, labels=labels)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    ref_grads = dict(ref_model.named_parameters())
    for name, p in tri_model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"grad of {name}: {m}")


def test_train_py_runs_the_triton_path(corpus):
    """--attention-impl/--layernorm-impl triton run through train.py on CPU under
    the interpreter (how tests and readers step through a kernel)."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "--preset", "tiny", "--num-attention-heads", "2",
         "--attention-impl", "triton", "--layernorm-impl", "triton", "--seq-length", "24",
         "--micro-batch-size", "2", "--train-iters", "2", "--eval-interval", "0", "--log-interval", "1",
         "--sample-tokens", "0", "--data-path", corpus, "--split", "1,0,0"],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "iter      2" in out.stdout


# ---------------------------------------------------------------------------
# The Triton kernels as custom ops under torch.compile (on CPU
# through Triton's interpreter, conftest.py)


OPS = ["flash_attention", "flash_attention-mha-noncausal", "layer_norm", "rms_norm", "add_layer_norm",
       "add_rms_norm", "loss_row_stats", "loss_row_grad_", "parallel_after"]


def _op_cases():
    """(op, args) for every custom op (OPS), at tiny shapes."""
    import fused_kernels
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape, grad=True: torch.randn(*shape, generator=g).requires_grad_(grad)  # noqa: E731
    q, k, v = rand(1, 4, 20, 32), rand(1, 2, 20, 32), rand(1, 2, 20, 32)   # grouped-query
    x, res, w, b = rand(3, 5, 48), rand(3, 5, 48), rand(48), rand(48)
    z, labels = rand(6, 40, grad=False), torch.randint(0, 40, (6,), generator=g)
    return {
        "flash_attention": (fused_kernels.flash_attention_op, (q, k, v, True, 0.2)),
        "flash_attention-mha-noncausal": (fused_kernels.flash_attention_op, (q, q.detach().requires_grad_(),
                                                                         rand(1, 4, 20, 32), False, 0.1)),
        "layer_norm": (fused_kernels.layer_norm_op, (x, None, w, b, 1e-5, None)),
        "rms_norm": (fused_kernels.layer_norm_op, (x, None, w, None, 1e-5, None)),
        "add_layer_norm": (fused_kernels.layer_norm_op, (x, res, w, b, 1e-5, None)),
        "add_rms_norm": (fused_kernels.layer_norm_op, (x, res, w, None, 1e-5, None)),
        "loss_row_stats": (fused_kernels.loss_row_stats, (z, labels, 10)),
        "loss_row_grad_": (fused_kernels.loss_row_grad_, (z.clone(), labels, z.logsumexp(-1), torch.rand(6, generator=g), 0)),
        "parallel_after": (torch.ops.parallel.after, (x.detach(), res.detach())),  # backward only
    }


@pytest.mark.parametrize("name", OPS)
def test_custom_ops_trace_with_fake_tensors(name):
    """torch.library.opcheck: the op's schema, its fake (shape-only)
    implementation against the real kernel's outputs (shapes, strides,
    dtypes), its autograd registration, and AOTAutograd tracing it with fake
    tensors and dynamic shapes, then running it, against eager."""
    op, args = _op_cases()[name]
    torch.library.opcheck(op, args)


def _triton_gpt(**options):
    from gpt import GPT, GPTConfig
    parallel.destroy()
    parallel.initialize(1)
    torch.manual_seed(0)
    return GPT(GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=2, max_position_embeddings=16,
                         vocab_size=100, padded_vocab_size=128, attention_impl="triton",
                         layernorm_impl="triton", **options))


@pytest.mark.parametrize("options", [pytest.param({}, marks=pytest.mark.quick),
                                     dict(position_embedding_type="rope", normalization="RMSNorm",
                                              swiglu=True, num_query_groups=1)], ids=["gpt2", "llama"])
def test_model_with_triton_kernels_compiles_whole(options):
    """The model with the Triton attention and LayerNorm/RMSNorm (fused add)
    compiles with no graph break, and a step's loss and gradients equal
    eager mode's. Before the kernels were custom ops, Dynamo traced into the
    launchers (here into Triton's interpreter) and failed."""
    ids = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(0))

    def step(model, forward):
        forward(ids[:, :-1], labels=ids[:, 1:]).backward()
        return {n: p.grad for n, p in model.named_parameters()}
    want = step(model := _triton_gpt(**options), model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = step(model := _triton_gpt(**options), torch.compile(model, backend="aot_eager", fullgraph=True))
    assert not torch._dynamo.utils.counters["graph_break"]
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_fused_loss_row_kernels_compile_whole():
    """The fused loss's Triton row passes inside a compiled graph (no graph
    break) give eager mode's statistics and in-place gradient."""
    g = torch.Generator().manual_seed(0)
    z, labels, weight = torch.randn(8, 40, generator=g), torch.randint(0, 40, (8,), generator=g), torch.rand(8, generator=g)

    def passes(z):
        lse, target = fused_loss.span_lse_and_grad_(z, labels, weight, 0, triton_kernels=True)
        return lse, target, z
    want = passes(z.clone())
    torch._dynamo.reset()
    got = torch.compile(passes, backend="aot_eager", fullgraph=True)(z.clone())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_autocast_adds_no_cast_around_the_custom_kernels():
    """Under bf16 autocast the compiled graphs feed the custom kernels with
    no cast (the custom ops have no autocast rule, and the kernels take the
    dtypes they are given: attention the 16-bit q, k, v; LayerNorm the fp32
    residual stream, writing its output in bf16 for the next GEMM), and no
    cast follows a forward kernel."""
    import operator
    from test_parallel import _capturing_backend
    graphs = []
    ids = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch.autocast("cpu", torch.bfloat16):
        loss = torch.compile(_triton_gpt(), backend=_capturing_backend(graphs))(ids[:, :-1], labels=ids[:, 1:])
    loss.backward()
    casts = ("aten._to_copy", "prims.convert_element_type")
    kernel_nodes = 0
    for graph, phase in zip(graphs, ("forward", "backward")):
        for node in graph.nodes:
            if not str(node.target).startswith("fused_kernels."):
                continue
            kernel_nodes += 1
            assert not [a for a in node.all_input_nodes if str(a.target).startswith(casts)], (phase, node)
            users = [w for u in node.users for w in ([u] if u.target is not operator.getitem else u.users)]
            if phase == "forward":  # (backward casts the fused add's gradient to the branch's bf16)
                assert not [u for u in users if str(u.target).startswith(casts)], (phase, node)
    assert kernel_nodes == 14  # 7 forward (2 x (LN, attention, add+LN) + ln_f), 7 backward


def _kernels_of(code: str) -> list:
    """The kernels Inductor's generated code calls, in order (bench/bench_compile.py)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from bench_compile import CALL
    return [m.group(1) for line in code[code.index("def call("):].splitlines() if (m := CALL.match(line))]


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_inductor_fuses_the_mlp_epilogues(swiglu):
    """Inductor compiles the MLP's activation into one kernel besides the
    GEMMs: forward bias + tanh-GeLU (on CPU the bias rides in the addmm) or
    SwiGLU's silu(gate) * up, where eager mode runs two or three; backward
    the activation's gradient with the fc bias's sum, two kernels besides
    the GEMMs where eager mode runs three (GeLU) or six (SwiGLU)."""
    from torch._inductor.utils import run_and_get_code
    from gpt import GPTConfig, MLP
    parallel.destroy()
    parallel.initialize(1)
    mlp = MLP(GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=2, swiglu=swiglu))
    x = torch.randn(2, 16, 64, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(mlp)
    _, (forward, backward) = run_and_get_code(lambda: compiled(x).sum().backward())
    gemm = re.compile(r"(extern_kernels|aten|torch\.ops\.aten)\.(addmm|mm|bmm)$")
    forward, backward = ([k for k in _kernels_of(code) if not gemm.match(k)] for code in (forward, backward))
    assert len(forward) == 1, forward
    assert len(backward) <= 2, backward


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, dict(position_embedding_type="rope", normalization="RMSNorm",
                                              swiglu=True, num_query_groups=1)], ids=["gpt2", "llama"])
def test_gpu_inductor_compiles_the_model_with_the_triton_kernels(options):
    """On a GPU, Inductor compiles the model with the Triton kernels (and the
    fused loss's row passes) whole: no graph break, and bf16 autocast training
    steps follow eager mode's."""
    from gpt import GPT, GPTConfig
    parallel.destroy()
    parallel.initialize(1)

    def build():
        torch.manual_seed(0)
        return GPT(GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=2, max_position_embeddings=256,
                             vocab_size=1000, padded_vocab_size=1024, attention_impl="triton",
                             layernorm_impl="triton", **options)).cuda()
    ids = torch.randint(0, 1000, (4, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def losses(model, forward):
        """Three steps' losses, and the first step's gradients by name."""
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out, first = [], None
        for _ in range(3):
            with torch.autocast("cuda", torch.bfloat16):
                loss = forward(ids[:, :-1], labels=ids[:, 1:])
            loss.backward()
            first = first or {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out, first
    want, want_grads = losses(model := build(), model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got, got_grads = losses(model := build(), torch.compile(model, fullgraph=True))
    assert not torch._dynamo.utils.counters["graph_break"]
    # torch 2.11 once compiled the fused loss to all-zero gradients (bench/RESULTS.md, 2026-11-27)
    off = {n: ((got_grads[n] - g).norm() / g.norm()).item() for n, g in want_grads.items()}
    assert max(off.values()) < 5e-2, off  # bf16 rounding; zero gradients give 1
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0)


# ---------------------------------------------------------------------------
# GPU: compiled kernels at training sizes

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("T", [1000, 4096, 16000])  # 1k, 4k, 16k; two of them ragged
def test_gpu_attention_long_sequences(T, D, dtype):
    """Forward and dq, dk, dv against float64 SDPA, q/k/v as views of a QKV
    projection (the layout the model passes)."""
    B, H = (2, 4) if T <= 4096 else (1, 2)
    g = torch.Generator().manual_seed(T + D)
    qkv = torch.randn(B, T, 3 * H * D, generator=g).to(DEVICE, dtype)
    q, k, v = [t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2)]
    do = torch.randn(B, T, H, D, generator=g).to(DEVICE, dtype).transpose(1, 2)
    got = run_flash(q, k, v, do)
    ref = attention_reference(q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        assert_close(a, b, dtype, f"{name} (T={T}, D={D}, {dtype})")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_attention_ragged_length_other_dtypes(dtype):
    check_attention(2, 3, 1000, 64, dtype)  # 1000: not a multiple of any block size


@pytest.mark.gpu
def test_gpu_fp32_attention_uses_tf32_only_when_torch_does():
    """fp32 inputs: exact IEEE dots by default (matches float64 to 1e-4);
    with torch.set_float32_matmul_precision("high") the kernels use TF32 like
    torch's matmuls, which is faster and visibly less exact."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = [torch.randn(2, 4, 1024, 64, generator=g).to(DEVICE) for _ in range(4)]
    ref = attention_reference(q, k, v, do)[0]
    errors = {}
    for precision in ("highest", "high"):
        torch.set_float32_matmul_precision(precision)
        try:
            out = fused_kernels.flash_attention(q, k, v)
        finally:
            torch.set_float32_matmul_precision("highest")
        errors[precision] = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert errors["highest"] < 1e-5, errors
    assert 1e-5 < errors["high"] < 1e-2, errors


@pytest.mark.gpu
@pytest.mark.parametrize("N", [768, 1024, 1600, 2048, 4096, 8192])
def test_gpu_layer_norm_wide(N):
    check_layer_norm((4096, N), torch.bfloat16, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [768, 1024, 1600, 2048, 4096, 8192])
def test_gpu_add_layer_norm_autocast_dtypes(N):
    # fp32 residual stream + bf16 branch output: the dtypes under bf16 autocast
    check_add_layer_norm((4096, N), torch.float32, torch.bfloat16, torch.float32)


@pytest.mark.gpu
def test_gpu_layer_norm_writes_the_autocast_dtype_with_the_same_rounding():
    """Under autocast TritonLayerNorm writes its output in bf16: what the next
    matmul would have made of the fp32 output. Not bit for bit: the bf16-out
    kernel is compiled separately and may fuse multiply-adds differently, so
    the fp32 value before rounding can differ in its last bit and, rarely,
    round to the neighbouring bf16 number (seen on an H100, 2026-11-23)."""
    ln = fused_kernels.TritonLayerNorm(1024).to(DEVICE)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    x = torch.randn(4096, 1024, device=DEVICE)
    r = torch.randn(4096, 1024, device=DEVICE, dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, (s, y2) = ln(x), ln(x, residual=r)
    assert y.dtype == y2.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_rounded_alike(y, ln(x).to(torch.bfloat16))
    assert_rounded_alike(y2, ln(x, residual=r)[1].to(torch.bfloat16))


def assert_rounded_alike(a, b):
    """bf16 tensors that agree except for a few elements one bf16 step apart
    (eps * |b| >= one step at b's exponent). Near zero, where w * xhat + b
    cancels, fp32's absolute error (~1e-7 of the terms) is more than a step
    of the small result: allow that absolutely."""
    a, b = a.detach().float(), b.detach().float()
    tol = torch.finfo(torch.bfloat16).eps * b.abs() + 1e-5
    worst = ((a - b).abs() - tol).argmax()
    assert ((a - b).abs() <= tol).all(), (a.flatten()[worst].item(), b.flatten()[worst].item())
    assert (a == b).float().mean() > 0.99


def _zipf_batches(steps, B, T, vocab=2000, seed=0):
    """Token batches from a fixed Zipf distribution over `vocab` ids: a
    model can learn it within a few dozen steps, so the loss visibly falls."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    probs = 1.0 / torch.arange(1, vocab + 1, device=DEVICE, dtype=torch.float32)
    return [torch.multinomial(probs, B * (T + 1), replacement=True, generator=g).view(B, T + 1)
            for _ in range(steps)]


@pytest.mark.gpu
def test_gpu_gpt2_124m_trains_with_triton_kernels_like_torch():
    """GPT-2 124M at seq 1024, 50 AdamW steps under bf16 autocast: the default
    CUDA path (Triton attention and LayerNorm, fused residual adds, bf16
    LayerNorm outputs) follows the torch kernels' losses, and the loss falls."""
    import gpt
    STEPS, B, T = 50, 8, 1024
    batches = _zipf_batches(STEPS, B, T)
    runs, init = {}, None
    for impl in ("torch", "triton"):
        torch.manual_seed(0)
        config = gpt.GPTConfig.from_preset("124M", attention_impl=impl, layernorm_impl=impl)
        model = gpt.GPT(config).to(DEVICE)
        if init is None:
            init = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(init)  # same starting point for both
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
        losses = []
        for tokens in batches:
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], labels=tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        runs[impl] = torch.stack(losses).tolist()
        del model, opt
    tri, ref = torch.tensor(runs["triton"]), torch.tensor(runs["torch"])
    assert tri[-5:].mean() < tri[:5].mean() - 2.0, runs["triton"]
    rel = ((tri - ref).abs() / ref).tolist()
    assert max(rel) < 2e-2 and sum(rel) / len(rel) < 5e-3, list(zip(runs["triton"], runs["torch"]))


# ---------------------------------------------------------------------------
# GPU code generation, checked without a GPU

def test_every_kernel_compiles_for_h100_quick():
    """The interpreter tests above never generate GPU code. bench/check_compile.py
    --quick compiles each kernel for H100 (sm_90) ahead of time, Triton to PTX
    and the bundled ptxas to a cubin, no device needed, with its worst-case
    config (largest tiles, most pipeline stages; smaller configs only if that
    one does not fit), bf16, and checks shared memory against H100's limit.
    It runs in a subprocess because this process imported kernels with
    TRITON_INTERPRET=1, which makes the kernels uncompilable."""
    try:
        import triton
        triton.knobs.nvidia.ptxas_blackwell.path  # the ptxas Triton uses for sm_90
        triton.knobs.nvidia.cuobjdump.path
    except ImportError:
        pytest.skip("triton is not installed")
    except (AttributeError, RuntimeError) as exc:
        pytest.skip(f"Triton's bundled ptxas/cuobjdump are not available: {exc}")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = run_bounded([sys.executable, os.path.join("bench", "check_compile.py"), "--quick"], 600,
                      cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    for name in ("attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq",
                 "layer_norm_fwd", "layer_norm_bwd"):
        assert f"| {name} |" in out.stdout, f"{name} missing from:\n{out.stdout}"
    assert "OK: every kernel has a config that compiles and fits sm_90" in out.stdout


def test_layer_norm_output_in_the_autocast_dtype_leaves_training_unchanged(monkeypatch):
    """Under bf16 autocast TritonLayerNorm hands on its output already in bf16
    (on a GPU the kernel writes it narrow: half the bytes, no cast kernel).
    Every LayerNorm in the model feeds a matmul that autocast would cast to
    bf16 anyway, so five training steps give the same losses, bit for bit, as
    the output left in fp32 (the path before); the residual stream stays fp32."""
    import parallel
    from gpt import GPT, GPTConfig
    parallel.initialize(1)
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=2, max_position_embeddings=32,
                       vocab_size=500, padded_vocab_size=512, layernorm_impl="triton")
    tokens = torch.randint(0, 500, (2, 17), generator=torch.Generator().manual_seed(0))

    def train_five_steps():
        torch.manual_seed(0)
        model = GPT(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out_dtypes, losses = set(), []
        model.ln_f.register_forward_hook(lambda m, i, o: out_dtypes.add(o.dtype))
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], labels=tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, out_dtypes

    narrow, dtypes = train_five_steps()
    assert dtypes == {torch.bfloat16}
    monkeypatch.setattr(fused_kernels, "_autocast_dtype", lambda x: None)  # the fp32 output of before
    wide, dtypes = train_five_steps()
    assert dtypes == {torch.float32}
    assert narrow == wide


# ---------------------------------------------------------------------------
# autotune results persist across runs

AUTOTUNE_PROBE = """
import sys, torch
sys.path.insert(0, {root!r})
import fused_kernels
qkv = torch.randn(4, 1024, 3, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
q, k, v = qkv.unbind(2)
fused_kernels.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).sum().backward()
torch.cuda.synchronize()
"""


@pytest.mark.gpu
def test_gpu_a_second_run_reuses_the_first_runs_autotune_results(tmp_path):
    """Two processes share a Triton cache: the first times the configs of the
    three attention kernels, the second finds every result on disk. Triton
    prints a line for each kernel it times under TRITON_PRINT_AUTOTUNING=1, and
    none for a result read from its cache (Triton 3.6 and 3.9 alike; the
    listener hook of later versions is missing from 3.6, the GPU image's)."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"), "TRITON_PRINT_AUTOTUNING": "1"}
    timed = [subprocess.run([sys.executable, "-c", AUTOTUNE_PROBE.format(root=ROOT)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600, check=True
                            ).stdout.count("Triton autotuning for function") for _ in range(2)]
    assert timed == [3, 0], timed  # forward, dK/dV and dQ timed once, then read back
