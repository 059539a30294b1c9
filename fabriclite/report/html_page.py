"""One self-contained HTML page of a job's history (job_history.py): the run, its command and engine; the goodput
breakdown of each node; a timeline per node and rank (launches, rounds, steps per second, and a mark for every
failure, restart, preemption notice, requeue, checkpoint, restore, hang and straggler event); the hangs' stacks; and
the events in a table.

Offline by construction: the style, the script and the timeline (SVG) are inline, and the page's content security
policy lets it fetch nothing. Each timeline mark carries ``data-mark="<kind>"`` and ``data-event="<index>"`` (its
row in the table), one mark per event, so the marks can be counted against the record.
"""
from __future__ import annotations

import html
import math
import os
import shlex
import time
from typing import Any, Dict, List, Optional, Tuple

from fabriclite.report import page_style
from fabriclite.report.job_history import MARK_KINDS, JobHistory, Mark, Round
from fabriclite.supervision.watch.goodput import PARTS

#: the timeline's geometry (SVG user units)
WIDTH, GUTTER, RIGHT, AXIS_H, NODE_H, RANK_H = 1200, 150, 18, 30, 38, 24
#: a node with more ranks than this shows only the ranks that have a mark or a step rate
MAX_RANK_ROWS = 64
#: the timeline mark of each kind (centred on 0,0), drawn in its colour
SYMBOLS = {
    "failure": '<path d="M-5,-5L5,5M5,-5L-5,5" stroke="{c}" stroke-width="3" fill="none"/>',
    "restart": '<circle r="5" fill="#fff" stroke="{c}" stroke-width="2.5"/>',
    "preemption": '<path d="M-6,-5L6,-5L0,6Z" fill="{c}"/>',
    "requeue": '<path d="M-6,5L6,5L0,-6Z" fill="{c}"/>',
    "checkpoint": '<path d="M0,-6L6,0L0,6L-6,0Z" fill="{c}"/>',
    "restore": '<rect x="-4.5" y="-4.5" width="9" height="9" fill="{c}"/>',
    "hang": '<rect x="-6" y="-6" width="12" height="12" rx="2" fill="{c}"/><path d="M-2,-3V3M2,-3V3" '
            'stroke="#fff" stroke-width="1.6"/>',
    "straggler": '<path d="M0,-6L6,5L-6,5Z" fill="{c}" stroke="#6b6b00" stroke-width="0.8"/>',
}
#: marks about the node as a whole also draw a guide line across its ranks
GUIDED = ("restart", "preemption", "requeue", "hang")
_LABELS = {"good": "steps that counted", "startup": "start-up", "restart": "restart", "redone": "redone steps",
           "checkpoint": "checkpoint stalls", "preemption": "preemption", "other": "other"}
_KIND_NAMES = {"failure": "failures", "restart": "restarts", "preemption": "preemption notices",
               "requeue": "requeues", "checkpoint": "checkpoints", "restore": "restores", "hang": "hangs",
               "straggler": "stragglers"}


def render(history: JobHistory) -> str:
    """The page (a complete HTML document) of ``history``."""
    esc = html.escape
    body = [_header(history), _goodput(history), _timeline(history), _hangs(history), _table(history)]
    csp = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f'<link rel="icon" href="data:,">\n<title>fabriclite report: run {esc(history.run)}</title>\n'
            f'<style>{page_style.CSS}{page_style.HIDE_RULES}</style>\n</head>\n<body>\n<main>\n'
            + "\n".join(part for part in body if part)
            + f'\n</main>\n<script>{page_style.SCRIPT}</script>\n</body>\n</html>\n')


def write(history: JobHistory, path: str) -> str:
    """Write the page to ``path``; its absolute path."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(history))
    return path


# --------------------------------------------------------------------------------------------------- header
def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _span(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


def engine_text(history: JobHistory) -> str:
    """The engine line: SLURM (job id, restart count) or torchrun (restart count), node 0's host, and how many times
    the run was launched."""
    engine = history.engine
    parts = []
    if engine.get("slurm_job_id") is not None:
        parts.append(f"SLURM job {engine['slurm_job_id']}, restart count {engine.get('slurm_restart_count') or 0}")
    if engine.get("torchrun_restart_count") is not None:
        parts.append(f"torchrun, restart count {engine['torchrun_restart_count']}")
    if engine.get("launch"):  # schema 1: one restart count, of whichever engine launched it
        parts.append(f"SLURM / torchrun restart count {engine['launch']}")
    if not parts and engine.get("host"):
        parts.append("fabriclite alone (no SLURM job, no torchrun)")
    if engine.get("host"):
        parts.append(f"node 0 on {engine['host']}")
    launches = engine.get("launches", 0)
    parts.append(f"{launches} launch{'es' if launches != 1 else ''} of the run")
    return "; ".join(parts)


def _header(history: JobHistory) -> str:
    esc = html.escape
    command = history.command
    node0 = [l for l in history.launches if l.node == min(history.nodes, default=0)]
    last = node0[-1] if node0 else None
    if last is None:
        verdict, bad = "no supervisor events (the ranks' own events only)", False
    elif last.end is None:
        verdict, bad = "no job_end: the supervisor was killed, or the job is still running", True
    else:
        code = last.exit_code
        verdict = {0: "finished (exit code 0)", 75: "preempted, resumable (exit code 75)"}.get(
            code, f"failed (exit code {code})")
        bad = code not in (0, 75)
    ranks = sum(len(r) for r in history.ranks.values())
    rows = [
        ("run", f"<code>{esc(history.run)}</code>"),
        ("command", f"<code>{esc(shlex.join(command))}</code>" if command else
         '<span class="muted">not recorded (schema fabriclite.events/1)</span>'),
        ("engine", esc(engine_text(history))),
        ("outcome", f'<span class="verdict{" bad" if bad else ""}">{esc(verdict)}</span>'),
        ("job", f"{len(history.nodes)} node{'s' if len(history.nodes) != 1 else ''}, {ranks} rank"
                f"{'s' if ranks != 1 else ''}, {len(history.rounds)} round{'s' if len(history.rounds) != 1 else ''}"),
        ("time", f"{esc(_when(history.start))} to {esc(_when(history.end))} "
                 f"({esc(_span(history.end - history.start))})"),
        ("marks", esc(", ".join(f"{history.count(k)} {_KIND_NAMES[k]}" for k in MARK_KINDS))),
        ("record", "<br>".join(f"<code>{esc(p)}</code>" for p in history.sources)
         + f' <span class="muted">({esc(", ".join(history.schemas))})</span>'),
    ]
    if history.other_runs:
        rows.append(("other runs", esc(", ".join(f"{k} ({v} events)" for k, v in history.other_runs.items()))
                     + ' <span class="muted">(fabriclite report --run ID)</span>'))
    if history.unfinished:
        rows.append(("unfinished", esc(", ".join(f"node {l.node} launch {l.number} (from {_when(l.start)})"
                                                 for l in history.unfinished))
                     + ' <span class="muted">: no job_end; its time is counted to its last event</span>'))
    items = "\n".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    return f'<header>\n<h1>fabriclite job report</h1>\n<dl>\n{items}\n</dl>\n</header>'


# -------------------------------------------------------------------------------------------------- goodput
def _goodput(history: JobHistory) -> str:
    esc = html.escape
    nodes = sorted(history.goodput)
    if not nodes:
        return ""
    main = history.goodput[nodes[0]]
    share = 100.0 * main.good / main.wall if main.wall > 0 else 0.0
    keys = ["good", *PARTS, "other"]

    def seconds(g: Any, key: str) -> float:
        return g.good if key == "good" else g.other if key == "other" else g.badput[key]

    bar = "".join(
        f'<span style="width:{100.0 * seconds(main, k) / main.wall:.3f}%;background:'
        f'{page_style.COLOURS.get(k, "#999")}" title="{esc(_LABELS[k])}: {seconds(main, k):.1f} s"></span>'
        for k in keys if main.wall > 0 and seconds(main, k) > 0)
    head = "".join(f'<th class="num">node {n} (s)</th><th class="num">share</th>' for n in nodes)
    rows = []
    for k in keys:
        cells = "".join(f'<td class="num">{seconds(history.goodput[n], k):.1f}</td><td class="num">'
                        f'{_share(seconds(history.goodput[n], k), history.goodput[n].wall)}</td>' for n in nodes)
        extra = f" ({main.redone_steps} steps)" if k == "redone" else ""
        rows.append(f'<tr><td><span class="swatch" style="background:{page_style.COLOURS.get(k, "#999")}"></span>'
                    f'{esc(_LABELS[k])}{extra}</td>{cells}</tr>')
    walls = "".join(f'<td class="num">{history.goodput[n].wall:.1f}</td><td></td>' for n in nodes)
    return (f'<section id="goodput">\n<h2>Goodput</h2>\n<div><span class="goodput-figure">{share:.1f}%</span> '
            f'<span class="muted">of {main.wall:.1f} s of wall time (node {nodes[0]}, every launch of the run) in '
            f'optimizer steps that counted</span></div>\n<div class="goodput-bar">{bar}</div>\n'
            f'<table><tr><th>part</th>{head}</tr>\n' + "\n".join(rows)
            + f'\n<tr><th>wall</th>{walls}</tr></table>\n</section>')


def _share(part: float, wall: float) -> str:
    return f"{100.0 * part / wall:.1f}%" if wall > 0 else "-"


# ------------------------------------------------------------------------------------------------- timeline
class _Scale:
    def __init__(self, start: float, end: float) -> None:
        self.start, self.span = start, max(end - start, 1e-3)

    def __call__(self, t: float) -> float:
        return GUTTER + (t - self.start) / self.span * (WIDTH - GUTTER - RIGHT)


def _ticks(span: float) -> List[float]:
    """Round offsets (seconds) every 1, 2 or 5 x 10^k s, about eight across ``span``."""
    raw = max(span, 1e-3) / 8
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)
                if m * 10 ** math.floor(math.log10(raw)) >= raw))
    return [i * step for i in range(int(span / step) + 1)]


def _offset(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:g} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}h{minutes % 60:02d}" if minutes >= 60 else f"{minutes}m{secs:02d}"


def _rows(history: JobHistory) -> List[Tuple[int, Optional[int]]]:
    """The timeline's rows: each node, then its ranks (``(node, None)``, ``(node, rank)``)."""
    rows: List[Tuple[int, Optional[int]]] = []
    for node in history.nodes:
        rows.append((node, None))
        ranks = history.ranks.get(node, [])
        if len(ranks) > MAX_RANK_ROWS:
            busy = {m.rank for m in history.marks if m.node == node} | {r.rank for r in history.rates
                                                                       if r.node == node}
            ranks = [r for r in ranks if r in busy]
        rows.extend((node, rank) for rank in ranks)
    return rows


def _timeline(history: JobHistory) -> str:
    esc = html.escape
    x = _Scale(history.start, history.end)
    rows = _rows(history)
    top: Dict[Tuple[int, Optional[int]], float] = {}
    y = AXIS_H
    for row in rows:
        top[row] = y
        y += NODE_H if row[1] is None else RANK_H
    height = y + 6
    parts: List[str] = []
    for row, y0 in top.items():  # lane backgrounds and labels
        node, rank = row
        h = NODE_H if rank is None else RANK_H
        if rank is None:
            parts.append(f'<rect class="lane-bg" x="0" y="{y0:.1f}" width="{WIDTH}" height="{h}"/>')
            parts.append(f'<text class="lane-label" x="6" y="{y0 + h / 2 + 4:.1f}">node {node}</text>')
        else:
            parts.append(f'<line x1="{GUTTER}" x2="{WIDTH - RIGHT}" y1="{y0 + h:.1f}" y2="{y0 + h:.1f}" '
                         f'stroke="#eef0f2"/>')
            parts.append(f'<text class="rank-label" x="22" y="{y0 + h / 2 + 4:.1f}">rank {rank}</text>')
    span = history.end - history.start
    axis = ['<g class="axis">']
    for offset in _ticks(span):
        px = x(history.start + offset)
        axis.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{AXIS_H - 6}" y2="{height - 6:.1f}"/>'
                    f'<text x="{px:.1f}" y="{AXIS_H - 10}" text-anchor="middle">{esc(_offset(offset))}</text>')
    axis.append("</g>")
    parts.extend(axis)
    max_rate = max((r.per_second for r in history.rates if r.rank is not None), default=0.0)
    for rate in history.rates:  # steps per second: an area in the rank's row
        row = (rate.node, rate.rank)
        if rate.rank is None or row not in top or max_rate <= 0:
            continue
        h = (RANK_H - 6) * rate.per_second / max_rate
        x0, x1 = x(rate.start), x(rate.end)
        parts.append(f'<rect class="rate" x="{x0:.1f}" y="{top[row] + RANK_H - 3 - h:.1f}" '
                     f'width="{max(x1 - x0, 0.5):.1f}" height="{h:.1f}"><title>rank {rate.rank}: '
                     f'{rate.per_second:.2f} steps/s ({rate.steps} steps in round {rate.round})</title></rect>')
    for launch in history.launches:
        y0 = top[(launch.node, None)]
        end = launch.end if launch.end is not None else history.end
        cls = "launch" if launch.end is not None else "launch unfinished"
        parts.append(f'<rect class="{cls}" x="{x(launch.start):.1f}" y="{y0 + 3:.1f}" '
                     f'width="{max(x(end) - x(launch.start), 1):.1f}" height="4"><title>launch {launch.number} of '
                     f'node {launch.node} (pid {launch.pid}): exit code {launch.exit_code}</title></rect>')
    for r in history.rounds:
        parts.append(_round(history, r, x, top[(r.node, None)]))
    bottoms: Dict[int, float] = {}
    for (node, rank), y0 in top.items():
        bottoms[node] = max(bottoms.get(node, 0.0), y0 + (NODE_H if rank is None else RANK_H))
    for mark in history.marks:
        row = (mark.node, mark.rank) if (mark.node, mark.rank) in top else (mark.node, None)
        if row not in top:
            continue
        h = NODE_H if row[1] is None else RANK_H
        cy = top[row] + (h + 8) / 2 if row[1] is None else top[row] + h / 2
        parts.append(_mark(mark, x, cy, top[(mark.node, None)], bottoms[mark.node]))
    legend = "".join(
        f'<label><input type="checkbox" data-kind="{k}" checked> <svg width="14" height="14" viewBox="-7 -7 14 14">'
        f'{SYMBOLS[k].format(c=page_style.COLOURS[k])}</svg> {esc(_KIND_NAMES[k])} ({history.count(k)})</label>'
        for k in MARK_KINDS)
    rounds_legend = "".join(f'<span><span class="swatch" style="background:{c}"></span>{esc(n)}</span>' for n, c in (
        ("start-up", "#bcd3e6"), ("round stepping", "#a8d5a2"), ("failed round", "#f4a6a6"),
        ("preempted round", "#ffd08a"), ("after the last step", "#e3e6e9"), ("steps / s of a rank", "#dadaeb")))
    return (f'<section id="timeline">\n<h2>Timeline</h2>\n<div class="legend">{legend}</div>\n'
            f'<div class="legend muted">{rounds_legend} <span>time from the first event; '
            f'a thin bar above the rounds: each launch of the supervisor</span></div>\n'
            f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height:.0f}" '
            f'role="img" aria-label="timeline of run {esc(history.run)}">\n' + "\n".join(parts)
            + '\n</svg>\n<div id="info" class="info muted">Click a mark to see its event.</div>\n</section>')


def _round(history: JobHistory, r: Round, x: _Scale, y0: float) -> str:
    esc = html.escape
    end = r.end if r.end is not None else history.end
    up = r.up if r.up is not None and r.up <= end else None
    rate = next((s.per_second for s in history.rates if s.rank is None and s.node == r.node and s.round == r.number
                 and abs(s.start - (r.up or 0.0)) < 1e-6), None)
    what = (f"round {r.number} (launch {r.launch}) of node {r.node}: {r.outcome}, {r.steps} steps"
            + (f", first step {up - r.start:.1f} s after its start" if up is not None else ", no step finished")
            + (f", {rate:.2f} steps/s" if rate else "") + (f", exit code {r.exit_code}" if r.exit_code is not None
                                                            else ""))
    y, h = y0 + 10, NODE_H - 14
    out = [f'<g class="round"><title>{esc(what)}</title>']
    split = up if up is not None else end
    out.append(f'<rect class="round-startup" x="{x(r.start):.1f}" y="{y:.1f}" '
               f'width="{max(x(split) - x(r.start), 0.5):.1f}" height="{h}"/>')
    if up is not None:
        last = min(max(r.last_step or end, up), end)  # after the last step: the ranks' stop and exit
        out.append(f'<rect class="round-{r.outcome}" x="{x(up):.1f}" y="{y:.1f}" '
                   f'width="{max(x(last) - x(up), 0.5):.1f}" height="{h}"/>')
        if end > last:
            out.append(f'<rect class="round-stopping" x="{x(last):.1f}" y="{y:.1f}" width="{x(end) - x(last):.1f}" '
                       f'height="{h}"/>')
    label = f"round {r.number}" + (f" \u00b7 {rate:.1f} steps/s" if rate else "")
    if x(end) - x(r.start) > 7 * len(label):
        out.append(f'<text class="round-label" x="{x(r.start) + 4:.1f}" y="{y + h - 6:.1f}">{esc(label)}</text>')
    out.append("</g>")
    return "".join(out)


def _mark(mark: Mark, x: _Scale, cy: float, node_top: float, node_bottom: float) -> str:
    esc = html.escape
    colour = page_style.COLOURS[mark.kind]
    px = x(mark.time)
    tip = f"{mark.label}" + (f"\n{mark.detail.splitlines()[0][:300]}" if mark.detail and mark.kind == "failure"
                             else "")
    out = [f'<g class="mark k-{mark.kind}" data-mark="{mark.kind}" data-event="{mark.index}" tabindex="0">'
           f'<title>{esc(tip)}</title>']
    if mark.kind in GUIDED:
        out.append(f'<line class="guide" x1="{px:.1f}" x2="{px:.1f}" y1="{node_top:.1f}" y2="{node_bottom:.1f}" '
                   f'stroke="{colour}"/>')
    if mark.duration > 0:
        out.append(f'<rect x="{px:.1f}" y="{cy - 4:.1f}" width="{max(x(mark.time + mark.duration) - px, 2):.1f}" '
                   f'height="8" fill="{colour}" fill-opacity="0.35"/>')
    out.append(f'<g transform="translate({px:.1f},{cy:.1f})"><circle r="8" fill="transparent"/>'
               f'{SYMBOLS[mark.kind].format(c=colour)}</g></g>')
    return "".join(out)


# ------------------------------------------------------------------------------------------ hangs and table
def _hangs(history: JobHistory) -> str:
    esc = html.escape
    hangs = [m for m in history.marks if m.kind == "hang"]
    if not hangs:
        return ""
    items = "\n".join(f'<h3>{esc(_offset_of(history, m.time))}, node {m.node}, round {m.round}: '
                      f'{esc(m.label)}</h3>\n<pre>{esc(m.detail or "(no stacks recorded)")}</pre>' for m in hangs)
    return f'<section id="hangs">\n<h2>Hangs and their stacks</h2>\n{items}\n</section>'


def _offset_of(history: JobHistory, t: float) -> str:
    return f"+{t - history.start:.1f} s"


def _summary(e: Dict[str, Any]) -> str:
    """One line about an event that is not a mark (launches and rounds)."""
    kind = e["event"]
    if kind == "job_start":
        return f"supervisor started (pid {e.get('pid')}, {e.get('ranks')} ranks)"
    if kind == "round_start":
        return f"round {e.get('round')} started"
    if kind == "ranks_up":
        return f"round {e.get('round')}: every rank finished its first step, {e.get('seconds')} s after the start"
    if kind == "round_end":
        return f"round {e.get('round')} ended: exit code {e.get('exit_code')}, {e.get('steps')} steps"
    if kind == "job_end":
        return f"supervisor ended: exit code {e.get('exit_code')}"
    fields = {k: v for k, v in e.items() if k not in ("schema", "run", "time", "node", "event")}
    return ", ".join(f"{k} {v}" for k, v in fields.items())


def _table(history: JobHistory) -> str:
    esc = html.escape
    marks = {m.index: m for m in history.marks}
    rows = []
    skipped = 0
    for index, e in enumerate(history.events):
        if e["event"] == "steps":
            skipped += 1
            continue
        mark = marks.get(index)
        if mark is not None:
            what = esc(mark.label)
            if mark.detail and mark.kind == "hang":
                what += f"<details><summary>stacks</summary><pre>{esc(mark.detail)}</pre></details>"
            elif mark.detail:
                what += f"<br><code>{esc(mark.detail)}</code>"
            kind = mark.kind
        else:
            what, kind = esc(_summary(e)), e["event"]
        rows.append(f'<tr id="event-{index}" data-row="{index}"><td class="num">'
                    f'{esc(_offset_of(history, float(e["time"])))}</td><td class="num">{e.get("node", 0)}</td>'
                    f'<td class="kind">{esc(kind)}</td><td>{what}</td></tr>')
    note = (f'<p class="muted">{skipped} <code>steps</code> events (steps per second) are drawn on the timeline '
            f'only.</p>' if skipped else "")
    return (f'<section id="events">\n<h2>Events</h2>\n{note}<table>\n<tr><th class="num">time</th>'
            f'<th class="num">node</th><th>event</th><th>what</th></tr>\n' + "\n".join(rows)
            + "\n</table>\n</section>")
