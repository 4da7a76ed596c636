"""The chunked distillation loss: chunked KL (+ CE) = unchunked, values and gradients."""
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, tiny_teacher

import tcal
from tcal.modules.distill_loss import TeacherTargets, chunked_distill_loss, final_hidden, lm_parts, teacher_targets
from tcal.utils.errors import TcalError


@pytest.mark.parametrize("ce_weight", [0.0, 0.3])
@pytest.mark.parametrize("chunk,ckpt", [(5, True), (7, False), (37, True), (1000, True)])
def test_chunked_kl_equals_unchunked(ce_weight, chunk, ckpt):
    torch.manual_seed(0)
    N, D, V = 37, 16, 50
    hs = torch.randn(N, D, requires_grad=True)
    ht = torch.randn(N, D)
    head_s = torch.nn.Linear(D, V, bias=True)
    head_t = torch.nn.Linear(D, V, bias=False)
    labels = torch.randint(0, V, (N,))
    labels[::6] = -100

    loss, kl, ce = chunked_distill_loss(hs, head_s, ht, head_t, labels, ce_weight=ce_weight, chunk_rows=chunk,
                                        use_checkpoint=ckpt)
    loss.backward()
    g_hs, g_w, g_b = hs.grad.clone(), head_s.weight.grad.clone(), head_s.bias.grad.clone()

    hs.grad = None
    head_s.zero_grad()
    logp_s = F.log_softmax(head_s(hs), -1)
    logp_t = F.log_softmax(head_t(ht), -1).detach()
    ref_kl = F.kl_div(logp_s, logp_t, log_target=True, reduction="batchmean")
    ref_ce = F.cross_entropy(head_s(hs), labels, ignore_index=-100)
    ref = (1 - ce_weight) * ref_kl + ce_weight * ref_ce
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-6, rtol=1e-5)
    assert kl == pytest.approx(ref_kl.item(), rel=1e-5)
    if ce_weight:
        assert ce == pytest.approx(ref_ce.item(), rel=1e-5)
    tag = f"ce={ce_weight} chunk={chunk} ckpt={ckpt}"
    assert_close(g_hs, hs.grad, 1e-4, f"{tag} grad hidden")
    assert_close(g_w, head_s.weight.grad, 1e-4, f"{tag} grad head weight")
    assert_close(g_b, head_s.bias.grad, 1e-4, f"{tag} grad head bias")


@pytest.mark.parametrize("chunk,ckpt", [(5, True), (7, False), (1000, True)])
def test_kept_teacher_targets_give_the_same_loss_and_gradients(chunk, ckpt):
    torch.manual_seed(0)
    N, D, V = 24, 16, 50
    hs = torch.randn(N, D, requires_grad=True)
    ht = torch.randn(2, N // 2, D)  # (B, T, D): targets keep the leading dims
    head_s, head_t = torch.nn.Linear(D, V), torch.nn.Linear(D, V)
    labels = torch.randint(0, V, (N,))
    targets = teacher_targets(ht, head_t, chunk_rows=chunk)
    assert targets.probs.shape == (2, N // 2, V) and targets.neg_entropy.shape == (2, N // 2)
    assert torch.allclose(targets.probs.sum(-1), torch.ones(2, N // 2), atol=1e-6)
    results = []
    for teacher, t_head in ((ht.reshape(N, D), head_t), (targets.rows(), None)):
        hs.grad = None
        loss, kl, ce = chunked_distill_loss(hs, head_s, teacher, t_head, labels, ce_weight=0.3, chunk_rows=chunk,
                                            use_checkpoint=ckpt)
        loss.backward()
        results.append((loss.detach(), kl, ce, hs.grad.clone()))
    (l0, kl0, ce0, g0), (l1, kl1, ce1, g1) = results
    assert torch.allclose(l0, l1, rtol=1e-6) and kl1 == pytest.approx(kl0, rel=1e-6)
    assert ce1 == pytest.approx(ce0, rel=1e-6)
    assert_close(g1, g0, 1e-5, f"chunk={chunk} ckpt={ckpt} grad hidden")
    sub = targets[torch.tensor([1, 1])]  # rows of chosen sequences, as a training step picks them
    assert torch.equal(sub.probs[0], targets.probs[1]) and sub.rows().probs.shape == (N, V)
    with pytest.raises(TcalError, match="vocabular"):
        chunked_distill_loss(hs, torch.nn.Linear(D, V + 1), targets.rows(), None)
    assert TeacherTargets.nbytes(N, V) == N * (V + 1) * 4


def test_chunked_kl_is_zero_for_identical_models():
    torch.manual_seed(0)
    h = torch.randn(20, 8)
    head = torch.nn.Linear(8, 30)
    loss, kl, _ = chunked_distill_loss(h, head, h, head, chunk_rows=6)
    assert abs(kl) < 1e-6 and abs(loss.item()) < 1e-6
    with pytest.raises(TcalError, match="vocabular"):
        chunked_distill_loss(h, head, h, torch.nn.Linear(8, 31))


def test_lm_parts_and_final_hidden_give_the_logits():
    for model in (tiny_teacher("llama"), tcal.convert(tiny_teacher("qwen2"), keep=[0, 2])):
        base, head = lm_parts(model)
        x = torch.randint(0, 97, (2, 9))
        with torch.no_grad():
            assert_close(head(final_hidden(base, x)), model(x).logits, 1e-6, f"{type(model).__name__} logits")
