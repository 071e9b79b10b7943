"""The AR drafts' CPU token draw: the C++ kernel against its torch reference (same tokens from the same uniforms,
log-probabilities to fp32 rounding) over bans, min-p, temperatures, vector tails and one-context rows (stride 0),
the draw's distribution, the launcher's checks and the "auto" fallback."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import sample_cpu as sc
from kernels.sample_cpu import draw_tokens, draw_tokens_ref

needs_kernel = pytest.mark.skipif(sc.draw_kernel() is None, reason="the CPU C++ kernels do not build here")


def _bans(rows: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    common = [0, 1, vocab - 1]
    return [common + torch.randint(vocab, (k % 4,), generator=gen).tolist() for k in range(rows)]


@needs_kernel
@pytest.mark.parametrize("rows,vocab", [(1, 96000), (8, 96000), (3, 17), (5, 16), (2, 1000)])
@pytest.mark.parametrize("temperature,min_p", [(0.8, 0.0), (1.0, 0.05), (0.3, 0.0), (2.0, 0.2)])
def test_draw_matches_ref(rows: int, vocab: int, temperature: float, min_p: float, gen: torch.Generator) -> None:
    logits = torch.randn(rows, vocab, generator=gen) * 4
    bans = _bans(rows, vocab, gen)
    logits[0, bans[0][0]] = 50.0  # a banned token that is the likeliest: the draw must come from the rest
    u = torch.rand(rows, generator=gen)
    want_tok, want_lp = draw_tokens_ref(logits, u, temperature, min_p, bans)
    tok, lp = draw_tokens(logits, u, temperature, min_p, bans, impl="cpp")
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    for k in range(rows):
        assert int(tok[k]) not in bans[k]


@needs_kernel
@pytest.mark.parametrize("rows,vocab", [(1, 96000), (8, 96000), (3, 17), (5, 16)])
def test_greedy_matches_ref(rows: int, vocab: int, gen: torch.Generator) -> None:
    """Temperature 0: the first largest allowed logit, ties included, whatever u and min-p say."""
    logits = torch.randn(rows, vocab, generator=gen).round()  # rounded: many ties for the top
    bans = _bans(rows, vocab, gen)
    logits[0, bans[0][0]] = 50.0  # the banned likeliest token loses to the best allowed one
    logits[-1, vocab // 2] = logits[-1, vocab - 2] = 40.0  # a tie at the top: the first one wins
    u = torch.rand(rows, generator=gen)
    want_tok, want_lp = draw_tokens_ref(logits, u, 0.0, 0.3, bans)
    tok, lp = draw_tokens(logits, u, 0.0, 0.3, bans, impl="cpp")
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    masked = logits.clone()
    for k, ids in enumerate(bans):
        masked[k, ids] = -math.inf
    assert torch.equal(tok, masked.argmax(-1)) and int(tok[-1]) == vocab // 2


@needs_kernel
def test_one_context_rows_and_the_edges_of_u(gen: torch.Generator) -> None:
    """Lanes drafting from one context's logits (an expanded row, stride 0) draw by their own uniforms; u = 0 takes
    the first token of positive weight and u just under 1 the last, never a cut or banned one."""
    row = torch.randn(1, 50, generator=gen)
    logits = row.expand(4, -1)
    u = torch.tensor([0.0, 0.25, 0.75, 1.0 - 2**-24])
    bans = [[0], [0], [0], [49]]
    tok, _ = draw_tokens(logits, u, 0.7, 0.0, bans, impl="cpp")
    want, _ = draw_tokens_ref(logits.contiguous(), u, 0.7, 0.0, bans)
    assert torch.equal(tok, want)
    assert tok[0] == 1 and tok[3] == 48  # the first and the last allowed token
    cut, _ = draw_tokens(logits, u, 1.0, 0.5, bans, impl="cpp")
    for k, t in enumerate(cut.tolist()):  # min-p counts from the likeliest token the row may write
        allowed = row[0].clone()
        allowed[bans[k]] = -math.inf
        assert t not in bans[k] and float(row[0, t]) >= float(allowed.max()) + math.log(0.5)


@needs_kernel
def test_the_draw_follows_the_tempered_distribution(gen: torch.Generator) -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 3.0]])
    temperature = 0.7
    n = 20000
    u = torch.rand(n, generator=gen)
    tok, lp = draw_tokens(logits.expand(n, -1), u, temperature, 0.0, [[4]] * n, impl="cpp")
    probs = torch.softmax(logits[0, :4] / temperature, dim=0)
    freq = torch.bincount(tok, minlength=5).float() / n
    assert freq[4] == 0
    torch.testing.assert_close(freq[:4], probs, atol=0.015, rtol=0)
    torch.testing.assert_close(lp, torch.log_softmax(logits[0], 0)[tok], rtol=1e-6, atol=1e-6)


def test_bad_inputs_raise(gen: torch.Generator) -> None:
    x = torch.randn(2, 8, generator=gen)
    u = torch.rand(2, generator=gen)
    with pytest.raises(ValueError, match="temperature"):
        draw_tokens(x, u, -0.5, impl="ref")
    with pytest.raises(ValueError, match="temperature"):
        draw_tokens(x, u, float("nan"), impl="ref")
    with pytest.raises(ValueError, match="min_p"):
        draw_tokens(x, u, 1.0, 1.5, impl="ref")
    with pytest.raises(ValueError, match="u must"):
        draw_tokens(x, torch.rand(3, generator=gen), 1.0, impl="ref")
    with pytest.raises(ValueError, match="fp32"):
        draw_tokens(x.double(), u, 1.0, impl="ref")
    with pytest.raises(ValueError, match="one list a row"):
        draw_tokens(x, u, 1.0, bans=[[0]], impl="ref")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        draw_tokens(x, u, 1.0, bans=[[8], []], impl="ref")
    with pytest.raises(ValueError, match="every token"):
        draw_tokens(x, u, 1.0, bans=[list(range(8)), []], impl="ref")
    with pytest.raises(ValueError, match="impl"):
        draw_tokens(x, u, 1.0, impl="triton")  # type: ignore[arg-type]


@pytest.mark.usefixtures("cpp_unbuilt")
def test_auto_falls_back_with_one_warning(gen: torch.Generator) -> None:
    x = torch.randn(3, 40, generator=gen)
    u = torch.rand(3, generator=gen)
    with pytest.warns(RuntimeWarning, match="no compiler"):
        tok, lp = draw_tokens(x, u, 0.9, bans=[[1], [], [2]])
    want = draw_tokens_ref(x, u, 0.9, 0.0, [[1], [], [2]])
    assert torch.equal(tok, want[0]) and torch.equal(lp, want[1])
    with pytest.raises(RuntimeError, match="unavailable"):
        draw_tokens(x, u, 0.9, impl="cpp")
