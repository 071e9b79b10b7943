"""Editor gaps in the FIM data: rest-of-line and sentence middles end where the line or sentence ends and are followed
by `<end>`, code keeps its indentation exactly, llama.cpp's layout puts the cursor line after `<mid>`; the code
sources, the held-out packages and the markup-free prose of the corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from canvas.convert.fim import fim_tokens, word_boundaries
from canvas.training.clean import has_markup, strip_markup
from canvas.training.code_sources import is_code_text
from canvas.training.data import CorpusConfig, build_corpus, write_corpus
from canvas.training.fim import FIM, NONE, Corpus, FimDataConfig, editor_gap, sample_rows
from canvas.training.fim_gaps import code_gap, prose_gap
from canvas.training.fim_train import FimTrainConfig
from canvas.training.sources import Document
from canvas.training.tokens import KIND_CODE, KIND_PROSE, TokenArrays, tokenize_corpus
from tests.canvas.training.fakes import PY_MODULE

CODE = PY_MODULE.format(name="gaps") + "\n\ndef tabbed(x):\n\tif x:\n\t\treturn [\n\t\t    x,\n\t\t]\n\treturn None\n"
PROSE = ("It is a truth universally acknowledged. A single man wants a wife!\n\n"
         "\"Is it?\" she asked. The quick brown fox jumps over the lazy dog, again and again.\n\n"
         "In the beginning God created the heavens and the earth.\n\nThe end of the text")  # fmt: skip
SHELL = "#!/bin/sh\nfor x in a b; do\n    echo \"$x\"\ndone\n"
DATA = FimDataConfig(seq_len=256, max_middle=64, max_prefix=48, max_suffix=32, min_fim_piece=12)


def test_code_gaps_end_at_a_line_end_and_keep_the_text() -> None:
    shapes: dict[str, int] = {}
    for seed in range(600):
        gap = code_gap(CODE, np.random.default_rng(seed), first_whole=True, max_chars=400)
        if gap is None:
            continue
        shapes[gap.shape] = shapes.get(gap.shape, 0) + 1
        middle = CODE[gap.cut : gap.end]
        assert middle.strip() and CODE[gap.end] == "\n"  # the newline is the suffix's
        assert not middle.startswith("\n") and not middle.endswith("\n")
        assert CODE[gap.line_start : gap.cut].strip(" \t") == "" or gap.shape == "rest"
        assert gap.line_start == 0 or CODE[gap.line_start - 1] == "\n"
        if gap.shape in ("rest", "line"):
            assert "\n" not in middle
        if gap.mid_word:
            assert gap.shape == "rest" and all(ch.isalnum() or ch == "_" for ch in CODE[gap.cut - 1 : gap.cut + 1])
    assert set(shapes) == {"rest", "line", "block", "body"}


def test_a_window_cut_inside_a_line_never_gives_that_line() -> None:
    cut = CODE[10:]  # the window starts inside the docstring's line
    first_end = cut.index("\n")
    for seed in range(300):
        gap = code_gap(cut, np.random.default_rng(seed), first_whole=False, max_chars=400)
        assert gap is None or gap.cut > first_end


def test_prose_gaps_end_at_the_sentence_or_the_line() -> None:
    seen = set()
    for seed in range(400):
        gap = prose_gap(PROSE, np.random.default_rng(seed), max_chars=400)
        if gap is None:
            continue
        seen.add(gap.shape)
        middle = PROSE[gap.cut : gap.end]
        assert middle.startswith(" ") and middle.strip() and "\n" not in middle
        assert PROSE[gap.cut - 1] != " " and PROSE[gap.end] in " \n"
        if gap.shape == "rest":
            assert PROSE[gap.end] == "\n"
        else:
            assert middle.rstrip("\"')").endswith((".", "!", "?"))
        assert "The end of the text" not in middle  # the last line has no line end in the window
    assert seen == {"rest", "sentence"}


@pytest.fixture(scope="module")
def code_corpus(fim_base: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    """The FIM base's tokenizer over a corpus of two code files and a prose document."""
    root = tmp_path_factory.mktemp("code-corpus")
    docs = [{"id": "c/1", "source": "pystdlib", "kind": "code", "text": CODE},
            {"id": "c/2", "source": "shell", "kind": "code", "text": SHELL},
            {"id": "p/1", "source": "web", "kind": "prose", "text": PROSE}]  # fmt: skip
    for split in ("train", "valid"):
        (root / f"{split}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    tokenize_corpus(root, fim_base["base"], root / "tokens")
    arr = TokenArrays.open(root / "tokens", "train")
    assert arr.kinds is not None and arr.kinds.tolist() == [KIND_CODE, KIND_CODE, KIND_PROSE]
    tok = Tokenizer.from_file(str(fim_base["base"] / "tokenizer.json"))
    return Corpus(arr.tokens, arr.doc_starts, *word_boundaries(tok), fim_tokens(tok), arr.kinds, tok)


def test_editor_gaps_encode_the_text_exactly_and_rest_of_line_is_followed_by_a_line_end(code_corpus: Corpus) -> None:
    tok = code_corpus.codec
    rest = 0
    for seed in range(300):
        g = editor_gap(code_corpus, DATA, np.random.default_rng(seed), KIND_CODE)
        if g is None:
            continue
        parts = [tok.decode(p, skip_special_tokens=False) for p in (g.prefix, g.prompt, g.middle, g.suffix)]
        assert "".join(parts) == g.text  # nothing added, dropped or re-indented
        assert parts[2] == g.text[g.gap.cut : g.gap.end]  # the middle with its indentation, tabs and all
        if g.gap.shape == "rest":
            rest += 1
            assert "\n" not in parts[2] and parts[3].startswith("\n")
        if g.prompt:  # llama.cpp's layout: the cursor line before the cursor follows <mid>
            assert "\n" not in parts[1] and parts[0].endswith("\n") or not parts[0]
    assert rest > 20


def test_editor_pieces_end_each_middle_with_fim_end(code_corpus: Corpus) -> None:
    t = code_corpus.ids
    tok = code_corpus.codec
    layouts = {"llama": 0, "psm": 0, "spm": 0}
    line_middles = 0
    for step in range(30):
        rows = sample_rows(code_corpus, DATA, 2, seed=3, step=step)
        for r in range(2):
            ids, kind, seg = rows.ids[r].tolist(), rows.kind[r].tolist(), rows.segment[r].tolist()
            for s in sorted(set(seg) - {-1}):
                at = [i for i, x in enumerate(seg) if x == s]
                p_ids, p_kind = [ids[i] for i in at], [kind[i] for i in at]
                if FIM not in p_kind:
                    continue
                first = p_kind.index(FIM)
                middle = p_ids[first:-1]
                assert p_ids[-1] == t.end and all(k == FIM for k in p_kind[first:])
                assert all(k == NONE for k in p_kind[:first])
                mid_at = p_ids.index(t.middle)
                if p_ids[2] == t.suffix:
                    layouts["spm"] += 1
                else:
                    layouts["llama" if first > mid_at + 1 else "psm"] += 1
                    text = tok.decode(middle, skip_special_tokens=False)
                    after = tok.decode(p_ids[p_ids.index(t.suffix) + 1 : mid_at], skip_special_tokens=False)
                    if text.strip() and "\n" not in text and after.startswith("\n"):
                        line_middles += 1  # a middle that ends where its line ends, then <end>
    assert all(n > 0 for n in layouts.values()) and line_middles > 5


def test_the_code_share_draws_code_documents(code_corpus: Corpus) -> None:
    rng = np.random.default_rng(0)
    kinds = [code_corpus.pick(rng, code_corpus.draw_kind(rng, 0.3))[1] for _ in range(2000)]
    assert abs(np.mean(np.asarray(kinds) == KIND_CODE) - 0.3) < 0.04
    legacy = Corpus(code_corpus.tokens, code_corpus.doc_starts, code_corpus.starts_word, code_corpus.ends_word,
                    code_corpus.ids)  # no kinds: no draw, the rows before kinds existed
    assert legacy.draw_kind(np.random.default_rng(0), 0.3) is None and not legacy.has_code


def test_a_run_saved_before_editor_gaps_resumes_with_spans() -> None:
    saved = json.loads((Path(__file__).resolve().parents[3] / "runs" / "fim-96k" / "train_config.json").read_text())
    assert "gaps" not in saved["data"]
    cfg = FimTrainConfig.from_json(saved)
    assert cfg.data.gaps == "spans" and cfg.data.code_share is None
    assert FimTrainConfig(base="b").data.gaps == "editor"
    with pytest.raises(ValueError, match="gaps"):
        FimDataConfig(gaps="lines")


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("In <i>the name of God</i>, amen.", "In the name of God, amen."),
        ('<p class="span">He said so.</p>', "He said so."),
        ("Call :func:`os.path.join` and :meth:`~str.split` here.", "Call os.path.join and split here."),
        ("Tom &amp; Jerry &lt;b&gt;ran&lt;/b&gt; home.", "Tom & Jerry ran home."),
        ("Use the ``literal`` and see `the docs`_.", "Use the literal and see the docs."),
        ("If a < b and c > d, then stop.", "If a < b and c > d, then stop."),
    ],
)
def test_markup_is_stripped_from_prose(raw: str, clean: str) -> None:
    assert has_markup(raw) == (raw != clean)
    assert strip_markup(raw) == clean and not has_markup(strip_markup(raw))


def test_the_corpus_prose_has_no_markup_and_code_is_kept_as_is(tmp_path: Path) -> None:
    docs = [Document("web/1", "web", "In <i>the name of God</i>, amen, and so on and on.\n\n<br/>"),
            Document("pydoc/1", "pydoc", "See :class:`dict` for the mapping type and its methods."),
            Document("pystdlib/a.py", "pystdlib", CODE, kind="code"),
            Document("pystdlib/b.py", "pystdlib", CODE, kind="code")]  # fmt: skip
    write_corpus(docs, tmp_path, CorpusConfig(valid_fraction=0.01))
    files = [tmp_path / f"{s}.jsonl" for s in ("train", "valid")]
    records = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    prose = sorted(r["text"] for r in records if r["kind"] == "prose")
    assert prose == ["In the name of God, amen, and so on and on.", "See dict for the mapping type and its methods."]
    assert [r["text"] for r in records if r["kind"] == "code"] == [CODE]  # byte for byte; the repeat dropped


def test_held_out_packages_never_reach_a_split(fake_cache: Path, tmp_path: Path) -> None:
    manifest = build_corpus(tmp_path / "c", fake_cache, CorpusConfig(valid_fraction=0.3))
    held = manifest["heldout"]
    assert held["packages"] == ["more-itertools==11.2.1", "itsdangerous==2.2.0", "toolz==1.2.0"]
    held_records = [json.loads(line) for line in (tmp_path / "c" / "heldout.jsonl").read_text().splitlines()]
    assert held["files"] == [r["id"] for r in held_records] and len(held["files"]) == 9  # 2 modules + README each
    assert all(r["source"] == "pyheld" and r["kind"] == "code" for r in held_records)
    files = [tmp_path / "c" / f"{s}.jsonl" for s in ("train", "valid")]
    split = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert not {r["id"] for r in split} & set(held["files"])
    names = ("more-itertools", "more_itertools", "itsdangerous", "toolz")
    assert not [r["id"] for r in split if any(n in r["text"] for n in names)]
    trained = {r["id"].split("/")[1] for r in split if r["source"] == "pypkgs"}
    assert trained == {"requests", "attrs", "click", "six", "idna", "packaging", "jinja2", "pyparsing"}
    stdlib = {r["id"] for r in split if r["source"] == "pystdlib"}
    assert stdlib == {"pystdlib/python3.11/os2.py", "pystdlib/python3.11/fractions2.py",
                      "pystdlib/python3.11/json2/__init__.py"}  # no tests, no tables  # fmt: skip
    assert all(not has_markup(r["text"]) for r in split if r["kind"] == "prose")


def test_data_files_are_not_code() -> None:
    assert is_code_text(CODE)
    assert not is_code_text("x = [" + ", ".join(f"0x{i:04x}" for i in range(2000)) + "]\n")
    assert not is_code_text("\n".join(f"'\\x{i:02x}'  # {i}" for i in range(200)))
