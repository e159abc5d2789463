#!/usr/bin/env python3
"""scripts/chat_turns_figure.py: the cached share of each chat turn's prompt, with
the answers' ids kept and without, as an SVG (docs/chat-turns.svg) and a Markdown
table, from the CSV files tests/helpers/chat_turns.py --control --csv FILE writes
(one per model).

usage: chat_turns_figure.py OUT.svg LABEL=FILE.csv [LABEL=FILE.csv ...]"""
import csv
import sys

out, series = sys.argv[1], [a.split("=", 1) for a in sys.argv[2:]]
W, H, PAD, GAP = 360, 260, 44, 20
svg = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">' %
       (len(series) * (W + GAP), H + 40)]
table = []
for p, (label, path) in enumerate(series):
    rows = list(csv.DictReader(open(path)))
    x0 = p * (W + GAP)
    turns = len(rows)
    px = lambda t: x0 + PAD + (t - 1) * (W - PAD - 10) / max(1, turns - 1)
    py = lambda v: 20 + (H - PAD) * (1 - v)
    svg.append('<text x="%d" y="14" font-weight="bold">%s</text>' % (x0 + PAD, label))
    for v in (0, 0.25, 0.5, 0.75, 1.0):
        svg.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>' % (x0 + PAD, x0 + W - 10, py(v), py(v)))
        svg.append('<text x="%d" y="%.1f" text-anchor="end">%d%%</text>' % (x0 + PAD - 4, py(v) + 4, v * 100))
    for t in range(1, turns + 1):
        svg.append('<text x="%.1f" y="%d" text-anchor="middle">%d</text>' % (px(t), H - PAD + 36, t))
    svg.append('<text x="%d" y="%d" text-anchor="middle">turn</text>' % (x0 + (W + PAD) // 2, H + 34))
    for key, colour, dash, name in (("kept", "#2563eb", "", "answers' ids kept"),
                                    ("none", "#9ca3af", ' stroke-dasharray="5,3"', "re-tokenized (--answer-ids-mem 0)")):
        pts = [(px(int(r["turn"])), py(int(r["cached_" + key]) / int(r["prompt_" + key]))) for r in rows]
        svg.append('<polyline fill="none" stroke="%s" stroke-width="2"%s points="%s"/>' %
                   (colour, dash, " ".join("%.1f,%.1f" % q for q in pts)))
        svg += ['<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>' % (q[0], q[1], colour) for q in pts]
        ly = 34 if key == "kept" else 50
        svg.append('<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="2"%s/>' %
                   (x0 + W - 150, x0 + W - 130, H - 60 + ly - 34, H - 60 + ly - 34, colour, dash))
        svg.append('<text x="%d" y="%d">%s</text>' % (x0 + W - 126, H - 56 + ly - 34, name))
    table.append((label, rows))
svg.append("</svg>")
open(out, "w").write("\n".join(svg) + "\n")
print("| turn | " + " | ".join("%s: kept | %s: without" % (l, l) for l, _ in table) + " |")
print("| --- |" + " --- | --- |" * len(table))
for k in range(len(table[0][1])):
    cells = []
    for _, rows in table:
        r = rows[k]
        for key in ("kept", "none"):
            c, n = int(r["cached_" + key]), int(r["prompt_" + key])
            cells.append("%d of %d (%.1f%%)" % (c, n, 100.0 * c / n))
    print("| %d | %s |" % (k + 1, " | ".join(cells)))
