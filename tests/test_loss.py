"""The fused LM head + cross-entropy (gpt.fused_lm_loss) against the full-logits path.

The full path (F.linear to every logit, then parallel.vocab_parallel_cross_entropy)
is the reference: the fused loss must give the same loss and the same
gradients of the hidden states and of the (tied) weight, to 1e-5 in fp32,
whatever the chunking and with loss masks. Tensor-parallel (T=2) and Domino
runs are checked against the same reference in test_parallel.py. The Triton
row kernels run here through Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py without a GPU); on a GPU the model tests use them directly.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gpt
import kernels
import parallel
from gpt import GPT, GPTConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def single_rank():
    parallel.initialize(1)
    yield
    parallel.destroy()


def full_reference(h, weight, labels, loss_mask=None):
    """Today's path, written out: every logit, fp32 cross-entropy, masked mean."""
    token_loss = parallel.vocab_parallel_cross_entropy(h @ weight.t(), labels).flatten()
    if loss_mask is None:
        return token_loss.mean()
    mask = loss_mask.flatten().float()
    return (token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def loss_and_grads(fn, h, weight, labels, loss_mask=None):
    h, weight = h.detach().requires_grad_(), weight.detach().requires_grad_()
    value = fn(h, weight, labels, loss_mask)
    value.backward()
    return value.detach(), h.grad, weight.grad


def problem(N=37, C=24, V=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=g).to(DEVICE)
    weight = (0.3 * torch.randn(V, C, generator=g)).to(DEVICE)
    labels = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    return h, weight, labels


@pytest.mark.parametrize("chunk_tokens", [1, 5, 37, 1000])  # one token a chunk ... one chunk
@pytest.mark.parametrize("masked", [False, True])
def test_fused_loss_matches_full_logits_in_fp32(monkeypatch, chunk_tokens, masked):
    h, weight, labels = problem()
    monkeypatch.setitem(gpt.CHUNK_LOGITS, "cpu", chunk_tokens * weight.shape[0])
    mask = None
    if masked:
        mask = (torch.rand(labels.shape, generator=torch.Generator().manual_seed(1)) > 0.3).float()
        mask = mask.to(DEVICE)
    got = loss_and_grads(gpt.fused_lm_loss, h, weight, labels, mask)
    want = loss_and_grads(full_reference, h, weight, labels, mask)
    for name, a, b in zip(("loss", "dh", "dW"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_fully_masked_batch_gives_zero_loss_and_zero_grads():
    h, weight, labels = problem()
    value, dh, dw = loss_and_grads(gpt.fused_lm_loss, h, weight, labels,
                                   torch.zeros(labels.shape, device=DEVICE))
    assert value.item() == 0.0 and not dh.any() and not dw.any()


def test_fused_loss_scales_with_the_incoming_gradient():
    """Gradients are made in forward for d(loss) = 1 and scaled in backward:
    a loss scaler (fp16) or a 1/accumulation factor must reach them."""
    h, weight, labels = problem()
    _, dh1, dw1 = loss_and_grads(gpt.fused_lm_loss, h, weight, labels)
    _, dh3, dw3 = loss_and_grads(lambda *a: 3.0 * gpt.fused_lm_loss(*a), h, weight, labels)
    torch.testing.assert_close(dh3, 3 * dh1)
    torch.testing.assert_close(dw3, 3 * dw1)


def test_no_grad_evaluation_computes_only_the_loss():
    h, weight, labels = problem()
    with torch.no_grad():
        value = gpt.fused_lm_loss(h, weight, labels)
    torch.testing.assert_close(value, full_reference(h, weight, labels), rtol=1e-5, atol=0)


class MatmulDtypes(TorchDispatchMode):
    """Records the dtypes of every matrix multiply that runs inside it."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.seen |= {a.dtype for a in args if torch.is_tensor(a)}
        return func(*args, **(kwargs or {}))


def test_under_bf16_autocast_the_matmuls_are_bf16_and_the_loss_fp32():
    h, weight, labels = problem(C=64, V=512)
    with torch.autocast(h.device.type, dtype=torch.bfloat16):
        with MatmulDtypes() as matmuls:
            got = loss_and_grads(gpt.fused_lm_loss, h, weight, labels)
        want = loss_and_grads(full_reference, h, weight, labels)
    assert matmuls.seen == {torch.bfloat16}
    assert got[0].dtype == torch.float32 and got[1].dtype == h.dtype and got[2].dtype == weight.dtype
    for name, a, b in zip(("loss", "dh", "dW"), got, want):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 2e-2 * scale, name


def test_fp16_gradients_are_as_close_to_fp32_as_the_full_logits_path():
    """--fp16 at GPT-2's vocabulary with the default loss scale (2^16) and
    512 tokens: most softmax entries are far below fp16's smallest value
    once weighted by 1/512, and the scale itself does not fit fp16. The
    fused loss keeps its gradients in units of the largest token weight and
    scales in fp32, so it is as close to the fp32 gradients as the full
    logits are (which get the loss scale before anything is fp16), also on
    the embedding rows of tokens that are never a target."""
    V, scale = 50304, 2.0 ** 16
    h, weight, labels = problem(N=512, C=64, V=V)
    weight = weight * 0.25                                       # logits of a few units
    labels = labels.clamp(max=50256)

    def in_fp16(fn):
        def scaled_loss(*args):
            with torch.autocast(h.device.type, dtype=torch.float16):
                return fn(*args) * scale
        return scaled_loss

    want = loss_and_grads(full_reference, h, weight, labels)      # fp32
    fused = loss_and_grads(in_fp16(gpt.fused_lm_loss), h, weight, labels)
    full = loss_and_grads(in_fp16(full_reference), h, weight, labels)
    untargeted = torch.ones(V, dtype=torch.bool, device=h.device)
    untargeted[labels] = False

    def error(got, ref, rows=slice(None)):
        return ((got[rows] / scale - ref[rows]).norm() / ref[rows].norm()).item()
    for name, i in (("dh", 1), ("dW", 2)):
        assert torch.isfinite(fused[i]).all(), name
        assert error(fused[i], want[i]) <= 1.5 * error(full[i], want[i]), name
    assert error(fused[2], want[2], untargeted) <= 1.5 * error(full[2], want[2], untargeted)


# ---------------------------------------------------------------------------
# The Triton row kernels (interpreted on CPU) against their torch twins


@pytest.mark.parametrize("vocab_start", [0, 100])  # a vocab slice: some targets are elsewhere
@pytest.mark.parametrize("need_grads", [True, False])
def test_row_kernels_match_the_torch_row_maths(vocab_start, need_grads):
    """The Triton row kernels (interpreted on CPU) and the in-place torch ops
    give the same lse, target logit and, overwriting the chunk, gradient."""
    if not (kernels.HAS_TRITON and (DEVICE == "cuda" or kernels.INTERPRET)):
        pytest.skip("needs triton, and TRITON_INTERPRET=1 on CPU (set by conftest.py)")
    g = torch.Generator().manual_seed(0)
    z = (4 * torch.randn(9, 203, generator=g)).to(DEVICE)          # 203: a ragged last block
    labels = torch.randint(0, 400, (9,), generator=g).to(DEVICE)
    weight = torch.rand(9, generator=g).to(DEVICE)
    results = []
    for use_triton in (True, False):
        dz = z.clone()
        lse, target = gpt.chunk_lse_and_grad_(dz, labels, weight, vocab_start, need_grads,
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
# The model: loss_impl="fused" (the default) against loss_impl="full"


def test_gpt_fused_loss_matches_full_logits_loss_and_every_gradient():
    results = []
    for impl in ("full", "fused"):
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_preset("tiny", loss_impl=impl)).to(DEVICE)
        g = torch.Generator().manual_seed(3)
        x, y = (torch.randint(0, 50257, (2, 16), generator=g).to(DEVICE) for _ in range(2))
        mask = (torch.rand(2, 16, generator=g) > 0.25).float().to(DEVICE)
        value = model(x, labels=y, loss_mask=mask)
        value.backward()
        results.append((value.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_full, grads_full), (loss_fused, grads_fused) = results
    torch.testing.assert_close(loss_fused, loss_full, rtol=1e-5, atol=0)
    for name, g in grads_full.items():  # to 1e-5 of each gradient's scale
        torch.testing.assert_close(grads_fused[name], g, rtol=1e-5, atol=1e-5 * g.abs().max().item(),
                                   msg=lambda m: f"grad of {name}: {m}")


def test_unknown_loss_impl_is_a_clear_error():
    with pytest.raises(ValueError, match="loss_impl"):
        GPTConfig.from_preset("tiny", loss_impl="chunky")


@pytest.mark.gpu
def test_gpu_fused_loss_follows_full_logits_in_a_quarter_of_the_memory():
    """GPT-2 124M's head at micro-batch 8, seq 1024, under bf16 autocast (the
    Triton row kernels): the same loss and gradients to bf16 rounding, and at
    most a quarter of the full-logits path's peak memory for head + loss."""
    N, C, V = 8 * 1024, 768, 50304
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(N, C, device="cuda", generator=g)
    weight = 0.02 * torch.randn(V, C, device="cuda", generator=g)
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    results, peaks = [], []
    for fn in (full_reference, gpt.fused_lm_loss):
        hh, ww = h.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            value = fn(hh, ww, labels)
        value.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        results.append((value.detach(), hh.grad, ww.grad))
    for name, a, b in zip(("loss", "dh", "dW"), results[1], results[0]):
        assert (a.float() - b.float()).abs().max().item() <= 1e-2 * b.float().abs().max().item(), name
    assert 4 * peaks[1] <= peaks[0], f"peak bytes: fused {peaks[1]:,} vs full {peaks[0]:,}"
