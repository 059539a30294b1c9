"""The report page's inline style sheet and script (html_page.py puts both into the page: nothing is fetched).

The script only adds interaction to a page that is complete without it: the legend's boxes hide and show a kind
of mark, and a click on a mark shows its event (cause, stacks) under the timeline and marks its row in the table.
"""
from __future__ import annotations

from fabriclite.report.job_history import MARK_KINDS

#: the colour of each kind of mark, and of the rounds and goodput parts (also used by the legend)
COLOURS = {
    "failure": "#d62728", "restart": "#1f77b4", "preemption": "#ff7f0e", "requeue": "#9467bd",
    "checkpoint": "#8c564b", "restore": "#17becf", "hang": "#8c1c13", "straggler": "#bcbd22",
    "good": "#2ca02c", "startup": "#bcd3e6", "redone": "#e377c2", "other": "#c7c7c7",
}

CSS = """
:root { --ink: #1d232a; --muted: #5f6b76; --line: #d9dee3; --paper: #ffffff; --band: #f5f7f9; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: var(--ink); background: var(--band); }
main { max-width: 1280px; margin: 0 auto; padding: 18px 22px 40px; }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 26px 0 8px; }
code, pre { font: 12px/1.4 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
pre { background: #f0f2f4; padding: 8px 10px; border-radius: 4px; overflow: auto; max-height: 420px;
      white-space: pre-wrap; }
section, header { background: var(--paper); border: 1px solid var(--line); border-radius: 6px; padding: 12px 16px;
                  margin-top: 14px; }
header dl { display: grid; grid-template-columns: max-content 1fr; gap: 3px 14px; margin: 8px 0 0; }
header dt { color: var(--muted); }
header dd { margin: 0; word-break: break-all; }
.verdict { font-weight: 600; }
.verdict.bad { color: #b01c1c; }
.goodput-figure { font-size: 28px; font-weight: 700; }
.goodput-bar { display: flex; height: 22px; border-radius: 4px; overflow: hidden; margin: 8px 0 10px;
               border: 1px solid var(--line); }
.goodput-bar span { display: block; height: 100%; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { color: var(--muted); font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 6px;
          vertical-align: -1px; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 16px; margin: 4px 0 8px; user-select: none; }
.legend label { cursor: pointer; }
.timeline { width: 100%; height: auto; display: block; }
.timeline text { font-size: 11px; fill: var(--ink); }
.timeline .lane-label { font-weight: 600; }
.timeline .rank-label { fill: var(--muted); }
.timeline .axis line { stroke: var(--line); }
.timeline .axis text { fill: var(--muted); }
.timeline .lane-bg { fill: var(--band); }
.timeline .launch { fill: #7f8c99; }
.timeline .launch.unfinished { fill: none; stroke: #7f8c99; stroke-dasharray: 3 2; }
.timeline .round-startup { fill: #bcd3e6; }
.timeline .round-ok { fill: #a8d5a2; }
.timeline .round-failed { fill: #f4a6a6; }
.timeline .round-preempted { fill: #ffd08a; }
.timeline .round-running { fill: #d5d8dc; }
.timeline .round-stopping { fill: #e3e6e9; }
.timeline .round-label { font-size: 10px; }
.timeline .rate { fill: #dadaeb; stroke: #6a51a3; stroke-width: 0.8; }
.timeline .guide { stroke-width: 1; stroke-dasharray: 2 3; opacity: 0.7; }
.timeline .mark { cursor: pointer; }
.timeline .mark:focus { outline: none; }
.timeline .mark.selected path, .timeline .mark.selected rect { stroke: #000; stroke-width: 2; }
.info { min-height: 1.5em; margin-top: 8px; }
.info pre { max-height: 320px; }
tr.selected td { background: #fff3bf; }
.kind { font-weight: 600; }
.muted { color: var(--muted); }
@media print { body { background: #fff; } .legend input { display: none; } }
"""

#: the legend hides a kind with a class on the timeline: one rule per kind
HIDE_RULES = "".join(f".timeline.hide-{kind} .k-{kind} {{ display: none; }}\n" for kind in MARK_KINDS)

SCRIPT = """
(function () {
  "use strict";
  var svg = document.querySelector("svg.timeline");
  var info = document.getElementById("info");
  if (!svg || !info) { return; }
  document.querySelectorAll(".legend input[data-kind]").forEach(function (box) {
    box.addEventListener("change", function () {
      svg.classList.toggle("hide-" + box.getAttribute("data-kind"), !box.checked);
    });
  });
  function select(index) {
    document.querySelectorAll(".selected").forEach(function (el) { el.classList.remove("selected"); });
    var row = document.getElementById("event-" + index);
    svg.querySelectorAll('[data-event="' + index + '"]').forEach(function (el) { el.classList.add("selected"); });
    info.textContent = "";
    if (row) {
      row.classList.add("selected");
      var cells = row.querySelectorAll("td");
      var head = document.createElement("div");
      head.innerHTML = "<span class='kind'></span> <span class='muted'></span>";
      head.firstChild.textContent = cells[2].textContent;
      head.lastChild.textContent = cells[0].textContent + " \\u00b7 node " + cells[1].textContent;
      info.appendChild(head);
      var body = document.createElement("div");
      body.innerHTML = cells[3].innerHTML;
      body.querySelectorAll("details").forEach(function (d) { d.open = true; });
      info.appendChild(body);
    }
  }
  svg.addEventListener("click", function (ev) {
    var mark = ev.target.closest("[data-event]");
    if (mark) { select(mark.getAttribute("data-event")); }
  });
  svg.addEventListener("keydown", function (ev) {
    var mark = ev.target.closest("[data-event]");
    if (mark && (ev.key === "Enter" || ev.key === " ")) {
      ev.preventDefault();
      select(mark.getAttribute("data-event"));
    }
  });
  document.querySelectorAll("tr[data-row]").forEach(function (row) {
    row.addEventListener("click", function () { select(row.getAttribute("data-row")); });
  });
})();
"""
