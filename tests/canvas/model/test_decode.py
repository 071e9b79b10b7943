"""`canvas.model.decode`: the few-op one-token step against the general path, and compiled against eager."""

from __future__ import annotations

import pytest
import torch

from canvas.env import DECODE_COMPILE
from canvas.model import DiffusionModel, KVCache, ModelConfig
from canvas.model.decode import DecodeCompiler, attach_compiler, compile_setting
from canvas.model.int8 import Scheme, quantize_decode


@pytest.fixture()
def model() -> DiffusionModel:
    torch.manual_seed(0)
    return DiffusionModel(ModelConfig.from_name("tiny")).eval()


def _greedy(model: DiffusionModel, cache: KVCache, first: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n greedy steps from `first` (B, 1) on (a copy of) `cache`: the logits (B, n, V) and the tokens (B, n)."""
    cache = cache.grown(cache.capacity)
    tok, logits, toks = first, [], []
    for _ in range(n):
        out, _ = model.encode(tok, cache=cache, logits="last")
        assert out is not None
        logits.append(out[:, -1])
        tok = out[:, -1].argmax(-1, keepdim=True)
        toks.append(tok[:, 0])
    return torch.stack(logits, 1), torch.stack(toks, 1)


def _prefixed(model: DiffusionModel, lengths: tuple[int, ...], room: int) -> tuple[KVCache, torch.Tensor]:
    """A left-padded cache of rows with prefixes of `lengths` (as the engine batches AR rows) and first tokens."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for n in lengths:
        _, c = model.encode(torch.randint(3, model.config.vocab_size, (1, n), generator=g), logits="none")
        rows.append((c, 0))
    return KVCache.aligned(rows, room), torch.randint(3, model.config.vocab_size, (len(lengths), 1), generator=g)


@pytest.mark.parametrize("lengths", [(5,), (3, 20, 9)])  # one row; padded rows, one past the window (16)
def test_few_op_step_equals_the_general_path(model: DiffusionModel, lengths: tuple[int, ...]) -> None:
    """Greedy tokens identical, logits within float rounding, through the window filling up and sliding."""
    n = 2 * model.config.sliding_window
    cache, first = _prefixed(model, lengths, n)
    model.decode_fast = False
    want, want_tok = _greedy(model, cache, first, n)
    model.decode_fast = True
    got, got_tok = _greedy(model, cache, first, n)
    assert torch.equal(got_tok, want_tok)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme", ["weight", "q8"])
def test_few_op_step_with_int8_weights_matches_the_general_int8_path(model: DiffusionModel, scheme: Scheme) -> None:
    """Same scheme, both paths: greedy tokens identical (q8: the fused CPU norms on the few-op side too)."""
    quantize_decode(model, scheme)
    cache, first = _prefixed(model, (4, 11), 12)
    model.decode_fast = False
    want, want_tok = _greedy(model, cache, first, 12)
    model.decode_fast = True
    got, got_tok = _greedy(model, cache, first, 12)
    assert torch.equal(got_tok, want_tok)
    # The activations are rounded to bf16 for the int8 kernel: a last-bit difference upstream can flip one rounding,
    # which random tiny weights amplify (the same tokens all the same).
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_compile_setting_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DECODE_COMPILE.name, raising=False)
    assert compile_setting() is False
    monkeypatch.setenv(DECODE_COMPILE.name, "On")
    assert compile_setting() is True
    assert compile_setting("off") is False
    monkeypatch.setenv(DECODE_COMPILE.name, "sometimes")
    with pytest.raises(ValueError, match=DECODE_COMPILE.name):
        compile_setting()


def test_steps_run_eagerly_until_the_compiled_step_is_ready(model: DiffusionModel) -> None:
    """A compiler that is not ready yet changes nothing: the step is the eager one, bit for bit."""
    cache, first = _prefixed(model, (6,), 4)
    want, _ = _greedy(model, cache, first, 4)
    model.decode_compile = DecodeCompiler(background=False)  # never warmed: nothing compiles
    got, _ = _greedy(model, cache, first, 4)
    assert not model.decode_compile.ready and torch.equal(got, want)


@pytest.mark.slow
def test_compiled_step_equals_the_eager_step(model: DiffusionModel) -> None:
    """torch.compile (inductor) of the step's halves, warmed on a background thread: logits allclose and greedy
    tokens identical to the eager step, fp32 and int8, at batch 1 and a padded batch of 3."""
    runs = {}
    for scheme in (None, "weight"):
        quantize_decode(model, scheme)  # type: ignore[arg-type]
        for lengths in ((7,), (3, 20, 9)):
            cache, first = _prefixed(model, lengths, 20)
            model.decode_compile = None
            runs[(scheme, lengths, "eager")] = _greedy(model, cache, first, 20)
    quantize_decode(model, None)
    compiler = attach_compiler(model)  # warms in the background
    assert compiler.wait(timeout=1800) and compiler.error is None and compiler.compile_s is not None
    compiler.stance = "default"  # compile the int8 variants too (a server would run them eagerly)
    for scheme in (None, "weight"):
        quantize_decode(model, scheme)  # type: ignore[arg-type]
        for lengths in ((7,), (3, 20, 9)):
            cache, first = _prefixed(model, lengths, 20)
            got, got_tok = _greedy(model, cache, first, 20)
            want, want_tok = runs[(scheme, lengths, "eager")]
            assert torch.equal(got_tok, want_tok), (scheme, lengths)
            # fp32: float rounding of fused ops; int8: the bf16 rounding of the activations moves with the fusion
            # too, and random tiny weights amplify it through every layer (still the same tokens).
            tol = 1e-4 if scheme is None else 2e-2
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=f"{scheme} {lengths}")


def test_a_full_window_rotates_and_every_reader_sees_it_in_order(model: DiffusionModel) -> None:
    """Steps past the window leave the sliding buffers rotated (`ring`); the denoiser, a grown copy, an aligned
    batch and a longer encode after them all see what a cache encoded in one pass holds."""
    g = torch.Generator().manual_seed(3)
    V, W = model.config.vocab_size, model.config.sliding_window
    ids = torch.randint(3, V, (2, W + 9), generator=g)
    _, cache = model.encode(ids[:, :W], cache=model.new_cache(2, W + 12), logits="none")
    for i in range(W, W + 5):
        model.encode(ids[:, i : i + 1], cache=cache, logits="none")
    assert cache.ring == 5  # the prefix filled the window (W - 1 slots): every step rotated it
    _, whole = model.encode(ids[:, : W + 5], cache=model.new_cache(2, W + 12), logits="none")
    canvas = torch.randint(3, V, (2, 6), generator=g)
    torch.testing.assert_close(model.denoise(canvas, cache.grown(W + 12)), model.denoise(canvas, whole))
    assert cache.ring == 0  # grown put it back in order
    for i in range(W + 5, W + 7):
        model.encode(ids[:, i : i + 1], cache=cache, logits="none")
    assert cache.ring != 0
    got, _ = model.encode(ids[:, W + 7 :], cache=cache, logits="all")  # the general path, two tokens
    want, _ = model.encode(ids, logits="all")
    assert got is not None and want is not None
    torch.testing.assert_close(got, want[:, W + 7 :], rtol=1e-4, atol=1e-4)
    model.encode(ids[:, -1:], cache=cache, logits="none")
    assert cache.ring == 1
    batch = KVCache.aligned([(cache, 1)], 2)  # puts the source back in order, then copies it
    row = torch.cat([ids[1:], ids[1:, -1:]], dim=1)  # what row 1 of `cache` has seen (the last token twice)
    _, alone = model.encode(row, cache=model.new_cache(1, W + 12), logits="none")
    assert cache.ring == 0 and batch.ring == 0
    for i in range(len(cache.layers)):
        torch.testing.assert_close(batch.read(i), alone.read(i), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lengths", [(5, 9), (9, 20)])  # inside the window; one context past it (the ring)
def test_copies_of_a_context_are_read_from_their_leader(model: DiffusionModel, lengths: tuple[int, int]) -> None:
    """Lanes aligned from one context share its slots (`KVCache.shared`): steps read them from the group's leader
    (zeroing every other row's copy changes nothing), give what the same cache without sharing gives, and a ring
    step takes the overwritten slot out of the shared range."""
    g = torch.Generator().manual_seed(4)
    V, W = model.config.vocab_size, model.config.sliding_window
    ctxs = [model.encode(torch.randint(3, V, (1, n), generator=g), logits="none")[1] for n in lengths]
    rows = [(ctxs[0], 0)] * 3 + [(ctxs[1], 0)] * 2  # two contexts: lanes 0-2 of the first, 3-4 of the second
    steps = torch.randint(3, V, (5, W + 4), generator=g)  # each lane its own tokens

    def run(cache: KVCache) -> torch.Tensor:
        out = []
        for i in range(steps.shape[1]):
            logits, _ = model.encode(steps[:, i : i + 1], cache=cache, logits="last")
            assert logits is not None
            out.append(logits[:, -1])
        return torch.stack(out, 1)

    shared = KVCache.aligned(rows, steps.shape[1])
    assert shared.shared is not None and shared.shared.leader.tolist() == [0, 0, 0, 3, 3]
    hi = shared.shared.hi
    poisoned = KVCache.aligned(rows, steps.shape[1])
    for lk in poisoned.layers:
        n = shared.shared.full if not lk.sliding else hi
        for b in (1, 2, 4):
            lk.k[b, :, :n] = 0
            lk.v[b, :, :n] = 0
    plain = KVCache.aligned(rows, steps.shape[1])
    plain.shared = None
    want = run(plain)
    got = run(shared)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(run(poisoned), got, rtol=1e-5, atol=1e-5)
    assert shared.shared is not None
    if max(lengths) + steps.shape[1] > W:  # the window filled: the ring took slots from the front
        assert shared.shared.lo > 0 and shared.shared.lo in (shared.ring, hi)  # walked past (or through) them
    else:
        assert shared.shared.lo == 0


def test_rows_of_distinct_sources_share_nothing(model: DiffusionModel) -> None:
    g = torch.Generator().manual_seed(5)
    ctxs = [model.encode(torch.randint(3, model.config.vocab_size, (1, 6), generator=g), logits="none")[1]
            for _ in range(2)]
    assert KVCache.aligned([(ctxs[0], 0), (ctxs[1], 0)], 4).shared is None
    cache = KVCache.aligned([(ctxs[0], 0), (ctxs[0], 0)], 4)
    assert cache.shared is not None
    model.encode(torch.randint(3, model.config.vocab_size, (2, 2), generator=g), cache=cache, logits="none")
    assert cache.shared is None  # the general path may move slots: sharing is dropped

