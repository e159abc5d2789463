#!/usr/bin/env python3
"""Checks every relative link (and #anchor) in README.md and docs/*.md: python3 scripts/check_doc_links.py [ROOT]."""
import re, os, sys, glob
root = sys.argv[1] if len(sys.argv) > 1 else '.'
os.chdir(root)
def slug(h):
    h = h.strip().lower()
    h = re.sub(r'[^\w\- ]', '', h)   # GitHub: drop punctuation except - and _
    return h.replace(' ', '-')
def anchors(path):
    out, fence = set(), False
    for line in open(path):
        if line.startswith('```'): fence = not fence
        if not fence and (m := re.match(r'#{1,6} (.*)', line)):
            out.add(slug(m.group(1)))
    return out
bad = 0; n = 0
for f in ['README.md'] + sorted(glob.glob('docs/*.md')):
    text = open(f).read()
    text = re.sub(r'```.*?```', '', text, flags=re.S)
    for m in re.finditer(r'\]\(([^)\s]+)\)', text):
        url = m.group(1)
        if re.match(r'[a-z]+:', url): continue
        n += 1
        p, _, frag = url.partition('#')
        target = os.path.normpath(os.path.join(os.path.dirname(f), p)) if p else f
        if not os.path.exists(target):
            print(f'{f}: missing file {url}'); bad += 1; continue
        if frag and target.endswith('.md') and frag not in anchors(target):
            print(f'{f}: missing anchor {url}'); bad += 1
print(f'{n} relative links checked, {bad} broken')
sys.exit(1 if bad else 0)
