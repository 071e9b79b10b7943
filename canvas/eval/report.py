"""Markdown for `dcanvas eval`: the tables of the model card and BENCHMARKS.md, from the eval's JSON result.

`markdown(result)` renders the per-task table (every variant: fill and seam ratios, repetition beside the human
text's, null share, seconds; degenerate runs flagged), the headline (the default modes), the quality-speed sweep
and the targets;
`card_metrics(result)` is the flat `{metric: value}` the exporter's model card takes; `card_section` and
`update_card` put a whole evaluation into a model card (`dcanvas eval --card`). `clients_markdown` and `code_markdown`
render the results of `--task clients` and `--task code`. All read only the JSON that
`canvas.eval.evaluate.evaluate` returns, so a saved `--out` file can be rendered again later.

`update_card` owns one block per key between marker comments and rewrites only that block, so the hand-written
reading of the numbers around it survives a re-evaluation.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from canvas.eval.metrics import AR_SETTINGS

PLACEHOLDER = "Not evaluated at export time; run `dcanvas eval` (its table belongs here)."


def fmt_num(value: float, digits: int = 2) -> str:
    """A table cell: `value` to `digits` decimals, "n/a" for a missing or NaN one."""
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def fmt_ci(value: float, ci: Any) -> str:
    """A ratio with its 90% bootstrap interval when the result has one (older results do not)."""
    if not ci or any(c is None or math.isnan(c) for c in ci):
        return fmt_num(value)
    return f"{fmt_num(value)} ({fmt_num(ci[0])}-{fmt_num(ci[1])})"


def fmt_pct(value: float) -> str:
    """A table cell: a share as a whole percentage, "n/a" for a missing or NaN one."""
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.0f}%"


def markdown(result: dict[str, Any]) -> str:
    from canvas.eval.metrics import FILL_RANGE, REPEAT_POINTS, SEAM_MAX, speed_bound

    cfg = result["config"]
    lo, hi = FILL_RANGE
    bounds = ", ".join(f"{t}: {b:g} s" for t in (f"infill-{g}" for g in cfg["gaps"])
                       if (b := speed_bound(t, cfg.get("speed_scale", 1.0))) is not None)  # fmt: skip
    lines = [
        f"## Evaluation of `{result['model']}`",
        "",
        f"Judge: {result['judge']}; judge perplexity pooled over samples, ratio = model / the human text it replaces "
        f"(1.0 is human-like): the fill in its context, and the seam, the first {cfg['seam_tokens']} judge tokens "
        f"after an infill; in brackets, 90% bootstrap intervals over the samples. Held-out text "
        f"{result.get('data', '')}, seed {cfg['seed']}, canvas {result['canvas_length']} tokens, batch 1, context "
        "encoding included in s/canvas.",
        "",
        f"Targets: fill ratio {lo:g}-{hi:g} (below {lo:g} with more repetition than the human text is degenerate, "
        f"flagged), seam ratio <= {SEAM_MAX:g}, repeated 4-grams within {100 * REPEAT_POINTS:.0f} points of the human "
        f"text's, seconds per infill ({bounds}).",
        "",
        "| task | variant | steps / bound | n | fill ratio | seam ratio | repeated 4-grams (human) "
        "| join faults (human) | null slots | s/canvas | tokens/forward | steps | exact length | fill+seam ratio "
        "| flag |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in result["results"]:
        settings = "" if p["mode"] == "ar" else f"{p['max_steps']} / {p['entropy_bound']:g}"
        flag = "**degenerate**" if p["degenerate"] else ""
        lines.append(
            f"| {p['task']} | {p['variant']} | {settings} | {p['samples']} | "
            f"{fmt_ci(p['fill_ratio'], p.get('fill_ratio_ci'))} | {fmt_ci(p['seam_ratio'], p.get('seam_ratio_ci'))} | "
            f"{fmt_pct(p['repeat_4gram'])} ({fmt_pct(p['repeat_4gram_human'])}) | "
            f"{fmt_pct(p['join_faults'])} ({fmt_pct(p['join_faults_human'])}) | "
            f"{fmt_pct(p['null_share'])} | {fmt_num(p['seconds_per_canvas'])} | {fmt_num(p['tokens_per_forward'])} | "
            f"{fmt_num(p['steps_per_canvas'], 1)} | {fmt_pct(p['exact_length'])} | {fmt_num(p['ratio'])} | {flag} |"
        )
    modes = result["headline_variants"]
    lines += ["", f"Headline (the model's default modes: infill {modes['infill']}, continuation "
              f"{modes['continuation']}): infill fill ratio {fmt_num(result['fill_ratio_infill'])}, seam ratio "
              f"{fmt_num(result['seam_ratio_infill'])}; continuation fill ratio "
              f"{fmt_num(result['fill_ratio_continuation'])}, {fmt_num(result['tokens_per_forward'])} tokens/forward, "
              f"{fmt_num(result['seconds_per_canvas'])} s/canvas."]
    sweep = result.get("sweep")
    if sweep:
        ref, best = sweep["reference"], sweep["best_within_10pct"]
        lines += [
            "",
            f"### Quality-speed sweep ({sweep['task']}, {sweep['samples']} samples)",
            "",
            "| max steps | entropy bound | judge ppl | ratio | vs reference | tokens/forward | s/canvas | steps |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in sweep["points"]:
            rel = p["judge_ppl"] / ref["judge_ppl"] if ref["judge_ppl"] else float("nan")
            lines.append(
                f"| {p['max_steps']} | {p['entropy_bound']:g} | {fmt_num(p['judge_ppl'], 1)} | {fmt_num(p['ratio'])} | "
                f"{fmt_num(rel)} | {fmt_num(p['tokens_per_forward'])} | {fmt_num(p['seconds_per_canvas'])} | "
                f"{fmt_num(p['steps_per_canvas'], 1)} |"
            )
        lines += ["", f"Reference: {ref['max_steps']} steps, bound {ref['entropy_bound']:g}. Fastest within 10% of "
                  f"its judge perplexity: {best['max_steps']} steps, bound {best['entropy_bound']:g}, "
                  f"{fmt_num(best['tokens_per_forward'])} tokens/forward."]  # fmt: skip
    choice = result.get("defaults_choice")
    if choice:
        kinds = ("infill", "continuation")
        picked = ", ".join(f"{k} {choice[k]['variant'] if choice[k] else 'unchanged'}" for k in kinds)
        slow = [k for k in kinds if choice[k] is not None and not choice[k]["within_speed"]]
        lines += ["", f"Defaults chosen ({picked}) and written: {result['defaults_written']}"
                  + (f"; no variant met the speed bounds for {', '.join(slow)}" if slow else "") + "."]
    lines += ["", "### Targets (the default modes)", "", "| task | variant | target | measured | met |",
              "|---|---|---|---:|---|"]  # fmt: skip
    for t in result["targets"]:
        where = f" ({t['at']})" if "at" in t else ""
        measured = fmt_pct(t["measured"]) if "4-grams" in t["target"] else fmt_ci(t["measured"], t.get("ci"))
        lines.append(f"| {t['task']} | {t['variant']} | {t['target']} | {measured}{where} | "
                     f"{'yes' if t['met'] else '**no**'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def card_metrics(result: dict[str, Any]) -> dict[str, str]:
    """Flat metric -> value (formatted) for the exporter's model card table."""
    keys = ("judge_ppl_ratio_infill", "fill_ratio_infill", "seam_ratio_infill", "judge_ppl_ratio_continuation",
            "fill_ratio_continuation", "judge_ppl_ratio_infill_ar", "judge_ppl_ratio_continuation_ar",
            "tokens_per_forward", "seconds_per_canvas")  # fmt: skip
    out: dict[str, str] = {k: fmt_num(result[k]) for k in keys if k in result}
    if "headline_variants" in result:
        out["default_modes"] = ", ".join(f"{k} {v}" for k, v in result["headline_variants"].items())
    sweep = result.get("sweep")
    if sweep:
        best = sweep["best_within_10pct"]
        out["tokens_per_forward_within_10pct"] = (
            f"{fmt_num(best['tokens_per_forward'])} (steps {best['max_steps']}, bound {best['entropy_bound']:g})"
        )
    out["judge"] = str(result["judge"])
    return out


def card_section(result: dict[str, Any], command: str) -> str:
    """The evaluation as a model-card block: the command, the tables, the defaults written, one output per task."""
    tables = markdown(result).split("\n", 2)[2].rstrip()  # without the "## Evaluation of" heading
    lines = [f"`{command}` ({result['wall_s']:.0f} s, {result.get('threads', '?')} threads):", "", tables, ""]
    written = result.get("defaults_written")
    if written:
        modes = f"infill **{written['default_mode_infill']}**, continuation **{written['default_mode_continuation']}**"
        ar = ", ".join(f"{k} {written[k]}" for k in AR_SETTINGS if k in written)
        lines += [f"Defaults written: modes {modes}{f' ({ar})' if ar else ''} (`dcanvas_sampler.json`: the best "
                  "quality within the speed bounds, by the rule of `canvas.eval.choice`)."]
        if "max_steps" in written:
            lines += [f"Sampler: **{written['max_steps']} steps, entropy bound {written['entropy_bound']:g}** "
                      "(`generation_config.json`: the fastest sweep point within 10% of the best judge perplexity)."]
        lines.append("")
    examples = result.get("examples") or []
    if examples:
        cfg = result["config"]
        lines += [f"Outputs on the first sample of each task ({cfg['max_steps']} steps, bound "
                  f"{cfg['entropy_bound']:g}; `[[...]]` is the model's text, `{{...}}` the human text it replaces):",
                  "", "```"]  # fmt: skip
        for ex in examples:
            for variant, output in ex["outputs"].items():
                text = f"...{ex['before'][-160:]}[[{output}]]{ex['after'][:80]}..."
                lines.append(f"{ex['task']} {variant}: {_one_line(text)}")
            lines.append(f"{ex['task']} human: {{{_one_line(ex['human'])}}}")
        lines.append("```")
    return "\n".join(lines) + "\n"


def _one_line(text: str) -> str:
    """Text for one line of a fenced block: newlines shown as a pilcrow, backticks that could close the fence cut."""
    return text.replace("\n", " ¶ ").replace("```", "'''")


def update_card(path: Path, key: str, section: str) -> None:
    """Write `section` into the model card at `path` as the block named `key`: in place of that block if the card has
    it, else at the end of its `## Evaluation` section (replacing the exporter's placeholder), else at the end."""
    begin, end = f"<!-- dcanvas eval {key}: begin -->", f"<!-- dcanvas eval {key}: end -->"
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    text = path.read_text(encoding="utf-8")
    if begin in text and end in text.split(begin, 1)[1]:
        head, rest = text.split(begin, 1)
        text = head + block.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.replace(PLACEHOLDER + "\n", "")
        lines = text.splitlines(keepends=True)
        heading = next((i for i, ln in enumerate(lines) if ln.strip() == "## Evaluation"), None)
        if heading is None:
            text = text.rstrip("\n") + "\n\n## Evaluation\n\n" + block
        else:
            nxt = next((i for i in range(heading + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
            after = "".join(lines[nxt:])
            text = "".join(lines[:nxt]).rstrip("\n") + "\n\n" + block + ("\n" + after if after else "")
    path.write_text(text, encoding="utf-8")


def clients_markdown(result: dict[str, Any]) -> str:
    """`dcanvas eval --task clients`: one row per server and request shape, then examples beside the human text."""
    servers = ", ".join(f"{k} {v}" for k, v in result["servers"].items())
    cfg = result["config"]
    lines = [
        f"## Client requests ({servers})",
        "",
        f"Judge: {result['judge']}; {result['samples']} half-typed lines of {result.get('data', 'held-out text')}, "
        f"seed {cfg['seed']}. Noise: tokens above {cfg['noise_nats']:g} nats under the judge; echo: word 4-grams "
        "also in the text after the cursor; first-line ratio: judge perplexity of the suggestion's first line over "
        "the human text's; length: median of characters / the human text's. In brackets, the human text's own.",
        "",
        "| server | shape | n | errors | empty | noise (human) | echo (human) | first-line ratio | length ratio "
        "| s median | s p95 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['server']} | {r['shape']} | {r['requests']} | {r['errors']} | {fmt_pct(r['empty_share'])} | "
            f"{fmt_pct(r['noise_share'])} ({fmt_pct(r['noise_share_human'])}) | "
            f"{fmt_pct(r['echo_share'])} ({fmt_pct(r['echo_share_human'])}) | {fmt_num(r['first_line_ratio'])} | "
            f"{fmt_num(r['length_ratio_median'])} | {fmt_num(r['seconds_median'])} | {fmt_num(r['seconds_p95'])} |"
        )
    errors = [(r["server"], r["shape"], e) for r in result["results"] for e in r["error_examples"]]
    if errors:
        lines += ["", "Errors: " + "; ".join(f"{s} {shape}: {e}" for s, shape, e in errors)]
    lines += _examples(result["examples"], "shape")
    return "\n".join(lines) + "\n"


def code_markdown(result: dict[str, Any]) -> str:
    """`dcanvas eval --task code`: one row per server and gap kind, then examples beside the human lines."""
    servers = ", ".join(f"{k} {v}" for k, v in result["servers"].items())
    lines = [
        f"## Code infill ({servers})",
        "",
        f"{result['tasks']} gaps in held-out Python ({'; '.join(result['sources'])}), `/infill` at an emptied line, "
        "greedy. Exact: the lines equal the human ones (whitespace at the ends aside); tests: the function's "
        "doctests pass with the suggestion in place (they fail with the gap empty).",
        "",
        "| server | kind | n | errors | empty | exact match | tests passed | s median | s p95 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['server']} | {r['kind']} | {r['tasks']} | {r['errors']} | {fmt_pct(r['empty_share'])} | "
            f"{fmt_pct(r['exact_match'])} | {fmt_pct(r['tests_passed'])} | {fmt_num(r['seconds_median'])} | "
            f"{fmt_num(r['seconds_p95'])} |"
        )
    lines += _examples(result["examples"], "task")
    return "\n".join(lines) + "\n"


def _examples(examples: list[dict[str, Any]], key: str) -> list[str]:
    if not examples:
        return []
    out = ["", "Examples (`[[...]]` the server's text, `{...}` the human text in its place):", "", "```"]
    for ex in examples:
        shown = f"[[{ex['output']}]]" if not ex.get("error") or ex["output"] else f"(error: {ex['error']})"
        out.append(f"{ex['server']} {ex[key]}: ...{_one_line(ex['before'][-120:])}{_one_line(shown)}")
        out.append(f"{ex['server']} {ex[key]} human: {{{_one_line(ex['human'])}}}")
    return [*out, "```"]
