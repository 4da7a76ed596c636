"""The chunked distillation loss: chunked KL (+ CE) = unchunked, values and gradients."""
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, tiny_teacher

import tcal
from tcal.modules.distill_loss import chunked_distill_loss, final_hidden, lm_parts
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
